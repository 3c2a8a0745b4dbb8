"""Tensor-parallel traffic per framework (``timing.tp_comm_parts_s``).

The counts are derived here from the frameworks' code paths, not read from the code under
test: DTensor's SP (torchtitan's ``parallelize_llama``: an all-gather before each of the
attention and MLP blocks, a reduce-scatter after each, and the conjugates in backward, all
waited for), torchao's float8 TP (the all-gathers carry float8 elements), and the count the
Megatron-LM path keeps (the one its calibration was fitted with).
"""

from __future__ import annotations

import pytest

from meshplan.costmodel import collectives as coll
from meshplan.costmodel import default_calibration
from meshplan.costmodel.config import ParallelConfig
from meshplan.costmodel.estimate import estimate
from meshplan.costmodel.hardware import load_cluster
from meshplan.costmodel.models import load_model
from meshplan.costmodel.timing import calibrated_links, stage_links

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


@pytest.mark.parametrize("recompute, forwards", [("none", 1), ("selective", 1), ("full", 2)])
def test_torchtitan_sp_waits_for_four_collectives_per_block_pass(recompute, forwards):
    """Per layer: 2 all-gathers + 2 reduce-scatters in each forward (twice under full
    recomputation) and as many in backward; 32 layers, one micro-batch."""
    model, cluster, config, cal, link, effs, hidden = _setup(recompute=recompute)
    pair = coll.all_gather_s(link, hidden, **effs) + coll.reduce_scatter_s(link, hidden, **effs)
    got = estimate(model, cluster, config, framework="torchtitan", calibration=cal)
    assert got.time.tp_comm_s == pytest.approx(32 * (forwards + 1) * 2 * pair, rel=1e-9)


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
