"""DeepSpeed's context parallelism is DeepSpeed-Ulysses (``timing.ulysses_per_layer_s``): four
all-to-alls a layer forward and four backward over the cp group, each carrying the rank's
tokens times the query width of its tensor-parallel shard, all exposed; the other frameworks
keep the ring exchange. Expected values are worked by hand from the cluster's link numbers."""

from __future__ import annotations

import pytest

from meshplan.costmodel import ParallelConfig, default_calibration, estimate, load_cluster
from meshplan.costmodel import load_model
from meshplan.costmodel.estimate import stage_terms
from meshplan.costmodel.layout import framework_layout_error
from meshplan.costmodel.timing import calibrated_links, stage_links, ulysses_per_layer_s

CAL = default_calibration()


def _config(**over) -> ParallelConfig:
    values = dict(tp=1, cp=4, dp=2, pp=1, zero_stage=1, micro_batch_size=1,
                  global_batch_size=8, seq_len=32768)
    values.update(over)
    return ParallelConfig(**values)


@pytest.mark.parametrize("recompute,passes", [("none", 2), ("selective", 2), ("full", 3)])
def test_four_all_to_alls_a_pass_of_the_query_width(recompute, passes):
    """Llama-2-7B, cp 4 inside one DGX-H100 node, 32K tokens: each all-to-all moves
    8,192 tokens x 4,096 x 2 bytes = 64 MiB per rank, three quarters of it to the other three
    GPUs over NVLink; forward and backward make 8 of them, full recomputation 12."""
    model, cluster = load_model("llama2-7b"), load_cluster("dgx-h100", nodes=1)
    config = _config(recompute=recompute)
    link = calibrated_links(stage_links(cluster, config, 0), CAL, cluster.gpu.key).cp
    assert (link.size, link.nodes) == (4, 1)
    size = 32768 // 4 * 4096 * 2
    # a pairwise exchange: 3 rounds, each one hop's latency
    one = 3 / 4 * size / (link.intra_bytes_per_s * CAL.nvlink_efficiency) + 3 * link.latency_s
    got = ulysses_per_layer_s(model, config, link, CAL, recompute=recompute)
    assert got == pytest.approx(passes * 4 * one, rel=1e-9)


def test_deepspeed_prices_ulysses_exposed_and_the_others_the_ring():
    """The same plan's per-micro-batch context-parallel time: under DeepSpeed every layer's
    all-to-alls, in full (32 layers x the per-layer time); under Megatron-LM the ring's K/V
    exchange, which the attention hides almost entirely at 32K tokens."""
    model, cluster = load_model("llama2-7b"), load_cluster("dgx-h100", nodes=1)
    config = _config()
    link = calibrated_links(stage_links(cluster, config, 0), CAL, cluster.gpu.key).cp
    per_layer = ulysses_per_layer_s(model, config, link, CAL)
    deepspeed = stage_terms(model, cluster, config, 0, framework="deepspeed", calibration=CAL)
    megatron = stage_terms(model, cluster, config, 0, framework="megatron", calibration=CAL)
    assert deepspeed.micro.cp_comm_s == pytest.approx(model.num_layers * per_layer, rel=1e-9)
    assert megatron.micro.cp_comm_s < 0.1 * deepspeed.micro.cp_comm_s
    step = estimate(model, cluster, config, framework="deepspeed", calibration=CAL)
    assert step.time.cp_comm_s == pytest.approx(
        config.grad_accum_steps * deepspeed.micro.cp_comm_s, rel=1e-9)


def test_ulysses_needs_cp_to_divide_each_tensor_parallel_ranks_heads():
    """32 heads: tp 2 leaves 16 a rank, which cp 4 and 8 divide and cp 3 or 32 do not (tp 8:
    4 a rank, cp 8 refused); the ring frameworks take any cp."""
    model = load_model("llama2-7b")
    ok = _config(tp=2, cp=8, dp=1, global_batch_size=4)
    assert framework_layout_error("deepspeed", ok, model) is None
    bad = _config(tp=8, cp=8, dp=1, global_batch_size=4, seq_len=65536)
    why = framework_layout_error("deepspeed", bad, model)
    assert why is not None and "cp 8 must divide the 4 heads" in why
    assert framework_layout_error("megatron", bad, model) is None
    assert framework_layout_error("torchtitan", bad.replace(zero_stage=3), model) is None
