"""Ring context parallelism's merges (``timing.ring_attention_merge_s``): the fp32 accumulators
each ring step adds its block's result into, priced by their HBM bytes, and what they do to the
planner's choice of context parallelism at short sequences."""

from __future__ import annotations

import pytest

from meshplan.costmodel import ParallelConfig, default_calibration, load_cluster, load_model
from meshplan.costmodel import timing
from meshplan.planner.search import search
from meshplan.planner.space import SearchSpace

CAL = default_calibration()
MODEL = load_model("llama3-8b")  # q width 4096, k / v width 1024
CLUSTER = load_cluster("dgx-h100", nodes=1)


def _config(**kw) -> ParallelConfig:
    base = dict(dp=2, cp=4, micro_batch_size=1, global_batch_size=2, seq_len=8192,
                recompute="none", zero_stage=3)
    return ParallelConfig(**{**base, **kw})


def _bytes(config: ParallelConfig, framework: str = "torchtitan") -> float:
    bandwidth = CLUSTER.gpu.hbm_bytes_per_s * CAL.device(CLUSTER.gpu.key).memory_efficiency
    return timing.ring_attention_merge_s(MODEL, CLUSTER, config, CAL, framework=framework,
                                         recompute=config.recompute) * bandwidth


def test_merge_bytes_by_hand():
    # 8192 tokens over cp 4: 2048 a rank; output 2048 x 4096 = 8,388,608 elements, k and v
    # 2048 x 1024 = 2,097,152 each; 3 ring steps after the first, 3/4 of the elements each.
    # forward: 2.25 x 10 B x 8,388,608 + the cast 6 B x 8,388,608 = 239,075,328
    # backward: 2.25 x (10 B x 12,582,912 + 8 B x 4,194,304) + 6 B x 12,582,912 = 434,110,464
    assert _bytes(_config()) == pytest.approx(239_075_328 + 434_110_464)
    # full recomputation runs the forward's merges again
    assert _bytes(_config(recompute="full")) == pytest.approx(2 * 239_075_328 + 434_110_464)


@pytest.mark.parametrize("change", [dict(cp=1, dp=8, global_batch_size=8),
                                    dict(flash_attention=False)])
def test_no_merges_without_a_ring(change):
    assert _bytes(_config(**change)) == 0.0


def test_ulysses_has_no_merges():
    # DeepSpeed's context parallelism all-to-alls to a full-sequence attention
    assert _bytes(_config(), framework="deepspeed") == 0.0


def test_merges_grow_with_the_ring_and_fade_with_the_sequence():
    """At a fixed number of tokens a rank, the merges grow with cp - 1 while the attention's
    FLOPs grow with the whole sequence: a visible share of a layer at 8K tokens over 8 ranks,
    a small one at 256K."""
    def share(seq_len: int, cp: int) -> float:
        config = _config(seq_len=seq_len, cp=cp, dp=8 // cp, global_batch_size=8 // cp)
        parts = timing.layer_forward(MODEL, CLUSTER, config, CAL, moe=False,
                                     framework="torchtitan")
        layer = (1 + timing.BACKWARD_FACTOR) * parts.total_s
        return timing.ring_attention_merge_s(MODEL, CLUSTER, config, CAL, recompute="none",
                                             framework="torchtitan") / layer

    by_cp = [_bytes(_config(seq_len=1024 * cp, cp=cp, dp=8 // cp, global_batch_size=8 // cp))
             for cp in (2, 4, 8)]
    assert by_cp[0] < by_cp[1] < by_cp[2]
    assert share(8192, 8) > 0.04
    assert share(262144, 8) < 0.01


def test_planner_ranks_rings_below_data_parallelism_at_short_sequences():
    """Llama 3 8B on one node of 8 H100s, global batch 64 x 8K tokens, torchtitan: without the
    merges, dp 8 and cp 2, 4 and 8 (the same tokens a rank, the ring hidden behind attention)
    tied at the top; with them every ring is slower than dp 8, the more so the longer the
    ring."""
    space = SearchSpace(global_batch_size=64, seq_len=8192)
    result = search(MODEL, CLUSTER, space, framework="torchtitan", calibration=CAL, top_k=4,
                    deterministic=True)
    best = result.ranked[0]
    assert best.estimate.config.cp == 1
    rings = [(s.estimate.config.cp, s.step_s) for s in result.ranked if s.estimate.config.cp > 1]
    assert rings, "no ring among the runners-up"
    assert all(step > 1.01 * best.step_s for _, step in rings)
    assert [step for _, step in sorted(rings)] == sorted(step for _, step in rings)


def test_ring_calls_run_at_the_chunks_kernel_efficiency():
    """On a device with a measured length curve (the H200's SDPA flash kernel, efficiency
    a s / (s + h)), each ring step's kernel call covers one chunk, s / cp: the attention of
    8K tokens over cp 8 runs at the 1K-token point of the curve, the same call shape Ulysses
    (DeepSpeed) avoids."""
    cluster = load_cluster("dgx-h200", nodes=1)
    half = CAL.device("h200").eager_flash_attention_half_seq
    assert half, "the H200's calibration lost its measured length curve"

    def core_per_token(cp: int, framework: str = "torchtitan") -> float:
        config = _config(seq_len=8192, cp=cp, dp=8 // cp, global_batch_size=8 // cp)
        parts = timing.layer_forward(MODEL, cluster, config, CAL, moe=False, framework=framework)
        fixed = 2 * CAL.device("h200").matmul_overhead_s  # the two score / value GEMM calls
        return (parts.core_s - fixed) / (config.micro_batch_size * config.seq_len / cp)

    curve = lambda s: s / (s + half)  # noqa: E731
    # same attention FLOPs per token at every cp (8K keys a query, causal): the time per token
    # follows the curve at the chunk's length
    assert core_per_token(8) / core_per_token(1) == pytest.approx(curve(8192) / curve(1024),
                                                                  rel=1e-6)
    assert core_per_token(8, "deepspeed") == pytest.approx(core_per_token(1, "deepspeed"),
                                                           rel=1e-6)
