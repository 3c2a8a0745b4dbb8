"""FSDP's gradient reduction in the compute dtype (``ParallelConfig.grad_reduce_dtype``):
what it changes under --framework torchtitan, and where it is refused.

Expected values are written from what FSDP2 holds and moves (the reduce-scatter input and the
unsharded gradients in the reduce dtype, the ring carrying that dtype), not read from the code
under test."""

from __future__ import annotations

import json

import pytest

from meshplan.costmodel import ParallelConfig, collectives as coll
from meshplan.costmodel.estimate import estimate
from meshplan.costmodel.frameworks import torchtitan_fsdp_buffer_bytes
from meshplan.costmodel.hardware import load_cluster
from meshplan.costmodel.models import load_model
from meshplan.costmodel.timing import grad_comm_bytes
from meshplan.testing import run_cli, usage_error

BLOCK, STAGE, HEAD = 200e6, 6.4e9, 0.5e9


def test_a_bf16_reduction_halves_the_reduce_scatter_input_and_the_pipelined_accumulators():
    """At a block's backward FSDP2 holds the block's unsharded gradients (compute dtype) and
    their copy in the reduce dtype; under a pipeline the stage's gradients accumulate in the
    reduce dtype. Going from fp32 to bf16 frees 2 bytes per element of each."""
    kwargs = dict(stage_params=STAGE, largest_block_params=BLOCK, kept_gathered_params=HEAD,
                  compute_bytes=2)
    for reshard in (True, False):
        fp32 = torchtitan_fsdp_buffer_bytes(reshard_after_forward=reshard, **kwargs)
        bf16 = torchtitan_fsdp_buffer_bytes(reshard_after_forward=reshard, reduce_bytes=2,
                                            **kwargs)
        assert fp32 - bf16 == pytest.approx(2 * BLOCK)
    fp32 = torchtitan_fsdp_buffer_bytes(reshard_after_forward=False, pipelined=True, **kwargs)
    bf16 = torchtitan_fsdp_buffer_bytes(reshard_after_forward=False, pipelined=True,
                                        reduce_bytes=2, **kwargs)
    assert fp32 - bf16 == pytest.approx(2 * STAGE)


def test_only_torchtitan_sharded_gradients_follow_the_setting():
    assert grad_comm_bytes("torchtitan", "bf16") == 4
    assert grad_comm_bytes("torchtitan", "bf16", reduce_bytes=2) == 2
    assert grad_comm_bytes("megatron", "bf16", reduce_bytes=2) == 4
    assert grad_comm_bytes("meshplan", "bf16", reduce_bytes=2) == 4


def _plan(**changes) -> ParallelConfig:
    base = dict(dp=64, zero_stage=3, micro_batch_size=2, global_batch_size=128, seq_len=4096,
                recompute="full")
    return ParallelConfig(**{**base, **changes})


def test_a_network_bound_fsdp_step_gets_faster_and_smaller():
    """Llama 2 13B on 64 A100s behind 400 Gb/s per node: the per-micro-batch reduce-scatter
    crosses the network; in bf16 it moves half the bytes, so the step is shorter by at least
    the difference of the two rings' bandwidth time when nothing hides it, and no longer than
    without it; the peak holds less."""
    model = load_model("llama2-13b")
    cluster = load_cluster("a100-80gb-400gbps", nodes=8)
    fp32 = estimate(model, cluster, _plan(), framework="torchtitan")
    bf16 = estimate(model, cluster, _plan(grad_reduce_dtype="bf16"), framework="torchtitan")
    assert bf16.time.step_s < fp32.time.step_s
    assert bf16.time.dp_comm_total_s < fp32.time.dp_comm_total_s
    assert bf16.memory.peak_bytes < fp32.memory.peak_bytes
    # the setting is recorded with the plan, and only when it is not the default
    assert json.loads(run_cli("estimate", "--model", "llama2-13b", "--cluster",
                              "a100-80gb-400gbps", "--nodes", "8", "--framework", "torchtitan",
                              "--zero", "3", "--global-batch", "128", "--grad-reduce-dtype",
                              "bf16", "--json").out)["plan"]["grad_reduce_dtype"] == "bf16"
    assert "grad_reduce_dtype" not in json.loads(run_cli(
        "estimate", "--model", "llama2-13b", "--cluster", "a100-80gb-400gbps", "--nodes", "8",
        "--framework", "torchtitan", "--zero", "3", "--global-batch", "128",
        "--json").out)["plan"]


def test_ring_bytes_set_the_difference_when_nothing_hides_the_reduce_scatter():
    """With no data parallelism to overlap (one micro-batch whose compute is far shorter than
    its traffic), the difference is the reduce-scatter of 2 bytes per parameter on the ring."""
    model = load_model("llama2-13b")
    cluster = load_cluster("a100-80gb-400gbps", nodes=8)
    plan = _plan(micro_batch_size=1, global_batch_size=64, seq_len=128, recompute="none")
    fp32 = estimate(model, cluster, plan, framework="torchtitan")
    bf16 = estimate(model, cluster, plan.replace(grad_reduce_dtype="bf16"),
                    framework="torchtitan")
    from meshplan.costmodel.calibration import default_calibration
    from meshplan.costmodel.timing import stage_links
    cal = default_calibration()
    link = stage_links(cluster, plan, 0).dp
    effs = dict(intra_eff=cal.nvlink_efficiency, inter_eff=cal.network_efficiency)
    params = model.num_params
    ring = (coll.reduce_scatter_s(link, 4 * params, **effs)
            - coll.reduce_scatter_s(link, 2 * params, **effs))
    assert fp32.time.step_s - bf16.time.step_s == pytest.approx(ring, rel=0.05)


def test_bad_settings_get_one_line():
    args = ["estimate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--global-batch", "16",
            "--zero", "3"]
    assert "modelled for --framework torchtitan only" in usage_error(
        *args, "--framework", "megatron", "--grad-reduce-dtype", "bf16")
    assert "must be fp32 or the compute dtype" in usage_error(
        *args, "--framework", "torchtitan", "--grad-reduce-dtype", "fp16")
    assert "invalid choice" in usage_error(*args, "--grad-reduce-dtype", "int8")


def test_the_torchtitan_export_refuses_a_bf16_reduction(tmp_path):
    plan = tmp_path / "plan.json"
    done = run_cli("plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "2",
                   "--framework", "torchtitan", "--global-batch", "64", "--zero", "3",
                   "--grad-reduce-dtype", "bf16", "-o", str(plan))
    assert done.code == 0, done.err
    message = usage_error("export", str(plan), "--to", "torchtitan")
    assert "reduces gradients in float32 only" in message


def test_a_bf16_reduction_never_costs_time_or_memory():
    """Over random torchtitan plans with ZeRO-2/3 (layouts, micro-batches, recomputation,
    pipelines, offload), reducing in bf16 never predicts a longer step or a larger peak."""
    import random

    from meshplan.costmodel.config import RECOMPUTE_MODES
    rng = random.Random(13)
    model = load_model("llama3-8b")
    checked = 0
    for _ in range(160):
        nodes = rng.choice((1, 2, 4))
        cluster = load_cluster(rng.choice(("dgx-h100", "a100-80gb-400gbps")), nodes=nodes)
        tp, pp = rng.choice((1, 2, 4, 8)), rng.choice((1, 2, 4))
        dp = cluster.num_gpus // (tp * pp)
        if dp < 2:
            continue
        micro = rng.choice((1, 2))
        try:
            plan = ParallelConfig(tp=tp, pp=pp, dp=dp, sp=tp > 1, zero_stage=rng.choice((2, 3)),
                                  micro_batch_size=micro,
                                  global_batch_size=dp * micro * rng.choice((1, 4, 8)),
                                  seq_len=rng.choice((2048, 8192)),
                                  recompute=rng.choice(RECOMPUTE_MODES),
                                  offload=rng.choice(("none", "none", "optimizer")))
        except ValueError:
            continue
        fp32 = estimate(model, cluster, plan, framework="torchtitan")
        bf16 = estimate(model, cluster, plan.replace(grad_reduce_dtype="bf16"),
                        framework="torchtitan")
        assert bf16.time.step_s <= fp32.time.step_s * (1 + 1e-12), plan
        assert bf16.memory.peak_reserved_bytes <= fp32.memory.peak_reserved_bytes, plan
        checked += 1
    assert checked >= 60
