"""Tensor-parallel traffic per framework (``timing.tp_comm_parts_s``).

The counts are derived here from the frameworks' code paths, not read from the code under
test: DTensor's SP (torchtitan's ``parallelize_llama``: an all-gather before each of the
attention and MLP blocks, a reduce-scatter after each, and the conjugates in backward, all
waited for), what torchtitan's per-op policy gathers again, torchao's float8 TP (the
all-gathers carry float8 elements), async TP (torch's micro-pipeline pass), and the count the
Megatron-LM path keeps (the one its calibration was fitted with).
"""

from __future__ import annotations

import dataclasses

import pytest

from meshplan.costmodel import collectives as coll
from meshplan.costmodel import default_calibration
from meshplan.costmodel.config import ParallelConfig
from meshplan.costmodel.estimate import estimate
from meshplan.costmodel.hardware import load_cluster
from meshplan.costmodel.models import load_model
from meshplan.costmodel.timing import calibrated_links, layer_forward, stage_links

CLUSTER = "grand-teton-h100"


def _setup(**changes):
    model = load_model("llama3-8b")
    cluster = load_cluster(CLUSTER, nodes=1)
    base = dict(tp=8, dp=1, sp=True, zero_stage=3, micro_batch_size=2, global_batch_size=2,
                seq_len=8192, recompute="none")
    config = ParallelConfig(**{**base, **changes})
    cal = default_calibration()
    link = calibrated_links(stage_links(cluster, config, 0), cal, cluster.gpu.key).tp
    effs = dict(intra_eff=cal.nvlink_efficiency, inter_eff=cal.network_efficiency)
    hidden = 2 * 2 * 8192 * 4096  # bf16 bytes of one micro-batch's hidden state
    return model, cluster, config, cal, link, effs, hidden


@pytest.mark.parametrize("recompute, forwards", [("none", 1), ("full", 2)])
def test_torchtitan_sp_waits_for_four_collectives_per_block_pass(recompute, forwards):
    """Per layer: 2 all-gathers + 2 reduce-scatters in each forward (twice under full
    recomputation) and as many in backward; 32 layers, one micro-batch."""
    model, cluster, config, cal, link, effs, hidden = _setup(recompute=recompute)
    pair = coll.all_gather_s(link, hidden, **effs) + coll.reduce_scatter_s(link, hidden, **effs)
    got = estimate(model, cluster, config, framework="torchtitan", calibration=cal)
    assert got.time.tp_comm_s == pytest.approx(32 * (forwards + 1) * 2 * pair, rel=1e-9)


def test_full_recomputation_that_stops_early_skips_the_last_reduce_scatter():
    """Stopping early (torch's non-reentrant checkpoint default; meshplan's runtime always),
    the recomputed forward ends at w2's input: its reduce-scatter is not run again."""
    model, cluster, config, cal, link, effs, hidden = _setup(recompute="full",
                                                             recompute_early_stop=True)
    scatter = coll.reduce_scatter_s(link, hidden, **effs)
    pair = coll.all_gather_s(link, hidden, **effs) + scatter
    for framework in ("torchtitan", "meshplan"):
        got = estimate(model, cluster, config, framework=framework, calibration=cal)
        assert got.time.tp_comm_s == pytest.approx(32 * (3 * 2 * pair - scatter), rel=1e-9)


def test_torchtitan_op_policy_gathers_again_what_it_does_not_save():
    """torchtitan's per-op policy saves the reduce-scatters' outputs, not the all-gathers':
    its recomputation gathers both block inputs again (2 more all-gathers per layer)."""
    model, cluster, config, cal, link, effs, hidden = _setup(recompute="selective")
    gather = coll.all_gather_s(link, hidden, **effs)
    pair = gather + coll.reduce_scatter_s(link, hidden, **effs)
    got = estimate(model, cluster, config, framework="torchtitan", calibration=cal)
    assert got.time.tp_comm_s == pytest.approx(32 * (2 * 2 * pair + 2 * gather), rel=1e-9)
    # meshplan's runtime saves every TP collective's output: nothing again
    own = estimate(model, cluster, config, framework="meshplan", calibration=cal)
    assert own.time.tp_comm_s == pytest.approx(32 * 2 * 2 * pair, rel=1e-9)


def test_torchtitan_layer_policy_repeats_the_forward_of_the_recomputed_blocks():
    """selective_ac 2: every second block fully recomputed (3 passes of 4 collectives), the
    others kept whole (2 passes)."""
    model, cluster, config, cal, link, effs, hidden = _setup(recompute="selective",
                                                             selective_ac="2")
    pair = coll.all_gather_s(link, hidden, **effs) + coll.reduce_scatter_s(link, hidden, **effs)
    got = estimate(model, cluster, config, framework="torchtitan", calibration=cal)
    assert got.time.tp_comm_s == pytest.approx(16 * 3 * 2 * pair + 16 * 2 * 2 * pair, rel=1e-9)


def test_torchtitan_op_policy_without_sp_reduces_the_attention_output_again():
    model, cluster, config, cal, link, effs, hidden = _setup(sp=False, recompute="selective")
    got = estimate(model, cluster, config, framework="torchtitan", calibration=cal)
    assert got.time.tp_comm_s == pytest.approx(
        32 * 5 * coll.all_reduce_s(link, hidden, **effs), rel=1e-9)


def test_torchtitan_float8_gathers_one_byte_elements():
    """Float8ColwiseParallel / Float8RowwiseParallel: the all-gathers move half the bytes, the
    reduce-scatters stay bf16."""
    model, cluster, config, cal, link, effs, hidden = _setup(float8=True, compile="model")
    pair = (coll.all_gather_s(link, hidden / 2, **effs)
            + coll.reduce_scatter_s(link, hidden, **effs))
    got = estimate(model, cluster, config, framework="torchtitan", calibration=cal)
    assert got.time.tp_comm_s == pytest.approx(32 * 2 * 2 * pair, rel=1e-9)
    bf16 = estimate(model, cluster, config.replace(float8=False), framework="torchtitan",
                    calibration=cal)
    assert 0.7 < got.time.tp_comm_s / bf16.time.tp_comm_s < 0.8  # bandwidth-bound: ~3/4


def test_torchtitan_without_sp_waits_for_four_all_reduces():
    model, cluster, config, cal, link, effs, hidden = _setup(sp=False)
    got = estimate(model, cluster, config, framework="torchtitan", calibration=cal)
    assert got.time.tp_comm_s == pytest.approx(
        32 * 4 * coll.all_reduce_s(link, hidden, **effs), rel=1e-9)


@pytest.mark.parametrize("recompute, pairs", [("none", 2), ("full", 3)])
def test_megatron_sp_keeps_its_fitted_count(recompute, pairs):
    """One all-gather + reduce-scatter per direction per layer (plus one for the rerun forward
    under full recomputation): half the DTensor count, the part Megatron-LM does not overlap
    as this project's calibration was fitted."""
    model, cluster, config, cal, link, effs, hidden = _setup(recompute=recompute)
    pair = coll.all_gather_s(link, hidden, **effs) + coll.reduce_scatter_s(link, hidden, **effs)
    got = estimate(model, cluster, config, framework="megatron", calibration=cal)
    assert got.time.tp_comm_s == pytest.approx(32 * pairs * pair, rel=1e-9)
    titan = estimate(model, cluster, config, framework="torchtitan", calibration=cal)
    assert titan.time.tp_comm_s == pytest.approx(2 * got.time.tp_comm_s, rel=1e-9)


# ----- async TP (torchtitan's enable_async_tensor_parallel) --------------------------------------

def _slow_link(cal):
    """``cal`` with NVLink 200x slower, so that every TP transfer outlasts its matmuls."""
    return dataclasses.replace(cal, nvlink_efficiency=cal.nvlink_efficiency / 200)


def _vanilla_and_fused(model, cluster, config, cal):
    """torchtitan's estimates of ``config`` without and with async TP."""
    return tuple(estimate(model, cluster, config.replace(async_tp=fused), framework="torchtitan",
                          calibration=cal) for fused in (False, True))

def _shares(model):
    """Each projection group's share of a Llama layer's GEMM FLOPs, from its dimensions."""
    h, q, kv, ffn = model.hidden_size, model.q_size, model.kv_size, model.ffn_hidden_size
    total = h * (2 * q + 2 * kv) + 3 * h * ffn
    return {"qkv": h * (q + 2 * kv) / total, "o": h * q / total, "up": 2 * h * ffn / total,
            "down": h * ffn / total}


def test_async_tp_on_a_slow_link_hides_seven_eighths_of_each_fused_matmul():
    """When every transfer outlasts its matmuls, each fused pair waits for the transfer less
    the (tp-1)/tp of the matmuls that run under it: in forward all four (wq/wk/wv, wo, w1/w3,
    w2), in backward the input-gradient matmuls of wo and w2; the backward's two
    reduce-scatters (of summed gradients) stay whole."""
    model, cluster, config, cal, _, effs, hidden = _setup(compile="model", async_tp=True)
    slow = _slow_link(cal)
    link = calibrated_links(stage_links(cluster, config, 0), slow, cluster.gpu.key).tp
    effs = dict(intra_eff=slow.nvlink_efficiency, inter_eff=slow.network_efficiency)
    gather = coll.all_gather_s(link, hidden, **effs)
    scatter = coll.reduce_scatter_s(link, hidden, **effs)
    gemm = layer_forward(model, cluster, config, slow, moe=False, framework="torchtitan").gemm_s
    share = _shares(model)
    assert gather > gemm and scatter > gemm  # every pair is transfer-bound
    forward = 2 * (gather + scatter) - 7 / 8 * gemm
    backward = 2 * (gather + scatter) - 7 / 8 * gemm * (share["o"] + share["down"])
    got = estimate(model, cluster, config, framework="torchtitan", calibration=slow)
    assert got.time.tp_comm_s == pytest.approx(32 * (forward + backward), rel=1e-9)


def test_async_tp_on_h100_hides_part_of_the_traffic_and_never_the_backward_scatters():
    model = load_model("llama3-70b")
    cluster = load_cluster(CLUSTER, nodes=4)
    config = ParallelConfig(tp=8, dp=4, sp=True, zero_stage=3, micro_batch_size=4,
                            global_batch_size=16, seq_len=8192, recompute="full",
                            compile="model")
    cal = default_calibration()
    vanilla, fused = _vanilla_and_fused(model, cluster, config, cal)
    link = calibrated_links(stage_links(cluster, config, 0), cal, cluster.gpu.key).tp
    scatter = coll.reduce_scatter_s(link, 2 * 4 * 8192 * 8192, intra_eff=cal.nvlink_efficiency,
                                    inter_eff=cal.network_efficiency)
    assert 80 * 2 * scatter <= fused.time.tp_comm_s < vanilla.time.tp_comm_s
    assert fused.time.step_s < vanilla.time.step_s
    assert fused.time.compute_s == vanilla.time.compute_s


@pytest.mark.parametrize("changes", [dict(sp=False), dict(tp=1, dp=8, global_batch_size=16)])
def test_async_tp_changes_nothing_without_sp_collectives(changes):
    model, cluster, config, cal, *_ = _setup(compile="model", **changes)
    vanilla, fused = _vanilla_and_fused(model, cluster, config, cal)
    assert fused.time.step_s == vanilla.time.step_s


def test_async_tp_needs_compile_and_torchtitan():
    with pytest.raises(ValueError, match="needs torch.compile"):
        _setup(async_tp=True)
    model, cluster, config, cal, *_ = _setup(async_tp=True, compile="model")
    with pytest.raises(ValueError, match="torchtitan only"):
        estimate(model, cluster, config, framework="megatron", calibration=cal)


def test_async_tp_fuses_only_the_attention_projections_of_an_moe_model():
    """Mixtral's experts are not tensor-parallel linears the pass fuses: on a slow link async
    TP saves 7/8 of wq/wk/wv and wo in forward and of wo's input gradient in backward."""
    model = load_model("mixtral-8x7b")
    cluster = load_cluster(CLUSTER, nodes=1)
    config = ParallelConfig(tp=8, dp=1, sp=True, zero_stage=3, micro_batch_size=1,
                            global_batch_size=1, seq_len=4096, recompute="none",
                            compile="model")
    cal = default_calibration()
    slow = _slow_link(cal)
    vanilla, fused = _vanilla_and_fused(model, cluster, config, slow)
    h, q, kv, f = model.hidden_size, model.q_size, model.kv_size, model.ffn_hidden_size
    dense_gemm = layer_forward(model, cluster, config, slow, moe=False,
                               framework="torchtitan").gemm_s
    total = h * (2 * q + 2 * kv) + 3 * h * f
    hidden = 7 / 8 * dense_gemm * (h * (q + 2 * kv) + 2 * h * q) / total
    assert vanilla.time.tp_comm_s - fused.time.tp_comm_s == pytest.approx(
        model.num_layers * hidden, rel=1e-9)
