"""DeepSpeed ZeRO-3's traffic: fetch batches, the one-module-ahead prefetch, the framework's
own gather path against the library's ring, and the linearity in layers the planner needs."""

from __future__ import annotations

import dataclasses

import pytest

from meshplan.costmodel import ParallelConfig, default_calibration, load_cluster, load_model
from meshplan.costmodel.calls import collective_calls_per_microbatch, zero3_fetch_batches
from meshplan.costmodel.estimate import stage_micro
from meshplan.costmodel.memory import StageParams
from meshplan.costmodel.timing import deepspeed_zero3_traffic, stage_links

GPT3 = load_model("gpt3-175b")
H = 12288


def config(**overrides) -> ParallelConfig:
    base = dict(tp=1, pp=1, dp=8, micro_batch_size=1, global_batch_size=8, seq_len=2048,
                recompute="none", zero_stage=3)
    return ParallelConfig(**(base | overrides))


def test_gpt3_fetches_four_matrices_a_layer_its_small_tensors_persist():
    """h = 12,288: the QKV, attention-output and MLP matrices are gathered; the biases (3h and
    4h elements) and the norms are under DeepSpeed's 100,000-element persistence threshold."""
    assert zero3_fetch_batches(GPT3, config()) == (
        (3 * H * H, 1), (H * H, 1), (4 * H * H, 1), (4 * H * H, 1))
    calls = collective_calls_per_microbatch(GPT3, config(recompute="full"), 0,
                                            framework="deepspeed", recompute="full")
    # 96 layers x 4 tensors, and one tensor for each end of the model (this one stage is both
    # ends: word and position embeddings), gathered in forward, recompute and backward
    assert calls.zero_all_gather == 3 * (96 * 4 + 2)
    assert calls.zero_reduce_scatter == 96 * 4 + 2


def test_swiglu_layers_fetch_five_matrices_and_large_biases_are_gathered():
    llama = load_model("llama3-8b")
    assert [k for _, k in zero3_fetch_batches(llama, config())] == [1] * 5
    wide = dataclasses.replace(GPT3, hidden_size=32768, num_heads=128,
                               ffn_hidden_size=4 * 32768)
    # its MLP input bias holds 4h = 131,072 elements: gathered with its matrix
    batches = zero3_fetch_batches(wide, config())
    assert [k for _, k in batches] == [1, 1, 2, 1]
    assert batches[2][0] == 4 * 32768 * 32768 + 4 * 32768


def _slow_path_calibration(rate: float = 1e9, rank_s: float = 0.0):
    """A gather path far slower than NVLink, so that every batch takes the path's time."""
    return dataclasses.replace(default_calibration(),
                               zero3_path_bytes_per_s={"deepspeed": rate},
                               zero3_path_rank_s={"deepspeed": rank_s})


def test_compute_equal_to_each_gather_exposes_half_a_pass():
    """Worked by hand for GPT-3's batch shares 3:1:4:4 when each module's forward compute
    equals its own gather time g_k (G = one pass's gathers): forward takes
    max(3,1) + max(1,4) + max(4,4) + max(4,3) = 15 twelfths of G for 12 of compute; backward
    (twice the compute, each module's reduce-scatter as long as its gather) pairs each
    module's compute with the next module's gather plus its own reduce-scatter,
    max(6, 4+3) + max(2, 3+1) + max(8, 1+4) + max(8, 4+4) = 27 twelfths for 24. Exposed:
    3 + 3 twelfths = G / 2, of 3 G of traffic."""
    layers = 4
    cal = _slow_path_calibration()
    link = stage_links(load_cluster("dgx-a100-80gb", nodes=1), config(), 0).dp
    per_layer = 12 * H * H
    gather_pass = per_layer * 2 / 1e9  # bf16 parameters, and DeepSpeed's bf16 gradients
    params = StageParams(dense=layers * per_layer, expert=0.0, largest_layer=per_layer,
                         layers=layers)
    raw, exposed = deepspeed_zero3_traffic(GPT3, config(), cal, params=params, link=link,
                                           layers=layers, recompute="none",
                                           layers_compute=layers * 3 * gather_pass)
    assert raw == pytest.approx(layers * 3 * gather_pass, rel=1e-9)
    assert exposed == pytest.approx(layers * gather_pass / 2, rel=1e-9)


def test_no_compute_hides_nothing_and_ample_compute_hides_all():
    layers = 2
    cal = _slow_path_calibration()
    link = stage_links(load_cluster("dgx-a100-80gb", nodes=1), config(), 0).dp
    params = StageParams(dense=layers * 12 * H * H, expert=0.0, largest_layer=1.0,
                         layers=layers)
    for mode in ("none", "full"):
        raw, exposed = deepspeed_zero3_traffic(GPT3, config(recompute=mode), cal,
                                               params=params, link=link, layers=layers,
                                               recompute=mode, layers_compute=0.0)
        assert exposed == pytest.approx(raw)
        raw, exposed = deepspeed_zero3_traffic(GPT3, config(recompute=mode), cal,
                                               params=params, link=link, layers=layers,
                                               recompute=mode, layers_compute=1e6)
        assert exposed == pytest.approx(0.0, abs=1e-9)


def test_per_rank_cost_grows_with_the_group_and_the_slower_of_ring_and_path_is_taken():
    """The path's per-rank term makes the same bytes cost more over more ranks; without a
    path the ring's own time stands, and the path never makes a batch faster than the ring."""
    model, layers = GPT3, 1
    params = StageParams(dense=12 * H * H, expert=0.0, largest_layer=1.0, layers=layers)
    cluster = load_cluster("dgx-a100-80gb", nodes=96)
    ring_only = dataclasses.replace(default_calibration(), zero3_path_bytes_per_s={},
                                    zero3_path_rank_s={})
    with_path = _slow_path_calibration(rate=25e9, rank_s=5e-6)
    raws = {}
    for dp in (96, 384, 768):
        link = stage_links(cluster, config(dp=dp, global_batch_size=dp), 0).dp
        kwargs = dict(params=params, link=link, layers=layers, recompute="none",
                      layers_compute=0.0)
        ring, _ = deepspeed_zero3_traffic(model, config(dp=dp, global_batch_size=dp), ring_only,
                                          **kwargs)
        both, _ = deepspeed_zero3_traffic(model, config(dp=dp, global_batch_size=dp), with_path,
                                          **kwargs)
        assert both >= ring
        raws[dp] = both
    # 4 tensors a layer, each gathered in forward and backward and reduce-scattered once: 12
    # calls, each 5 us more per rank
    assert raws[768] - raws[384] == pytest.approx(12 * (768 - 384) * 5e-6, rel=1e-6)
    assert raws[384] > raws[96]


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_terms_are_linear_in_the_stage_layers(recompute):
    """The planner's tables read every term as base + slope * layers: the ZeRO-3 traffic and
    the part of it compute hides must have no curvature in the layer count."""
    model = load_model("gpt3-175b")
    cluster = load_cluster("dgx-a100-80gb", nodes=8)
    cal = default_calibration()

    def terms(first: int, stage: int) -> tuple[float, float]:
        cfg = config(pp=2, dp=32, global_batch_size=64, recompute=recompute,
                     layers_per_stage=(first, 96 - first))
        t = stage_micro(model, cluster, cfg, stage, framework="deepspeed", calibration=cal)
        return t.zero_comm_s, t.zero_hidden_s

    for stage in (0, 1):  # the last stage also computes the LM head, which hides nothing
        a, b, c = (terms(first, stage) for first in (40, 41, 42))
        for i in range(2):
            assert c[i] - 2 * b[i] + a[i] == pytest.approx(0.0, abs=1e-9 * abs(c[i]))
            assert abs(b[i] - a[i]) > 0
