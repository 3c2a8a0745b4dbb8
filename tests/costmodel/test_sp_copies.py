"""The copies DTensor's sequence-parallel collectives make on the compute stream
(``timing.sp_reorder_copies_s``).

The worker counts, on torch's own code path (2 gloo ranks), the elements ``aten.cat`` writes
around an all-gather and a reduce-scatter of a ``[b, s, h]`` hidden state sharded on the
sequence; the cost model's per-layer copy seconds are then rebuilt here from those counts per
collective and the layer's collectives (forward, backward, recomputation)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshplan.costmodel import ParallelConfig, default_calibration, load_cluster, load_model
from meshplan.costmodel.timing import sp_reorder_copies_s

WORKER = Path(__file__).with_name("sp_copies_worker.py")
SEQ, HIDDEN = 16, 8  # as in the worker


@pytest.mark.timeout(120)
def test_sequence_parallel_collectives_copy_the_gathered_state():
    """Four sequences per micro-batch: both collectives copy the whole gathered state once;
    one sequence: the all-gather's re-concatenation is a view, the reduce-scatter still copies."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--standalone", str(WORKER)],
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {(int(rank), int(batch)): (int(gather), int(scatter)) for rank, batch, gather, scatter
            in re.findall(r"copies (\d+) (\d+) (\d+) (\d+)", out.stdout)}
    for rank in (0, 1):
        assert rows[(rank, 4)] == (4 * SEQ * HIDDEN, 4 * SEQ * HIDDEN)
        assert rows[(rank, 1)] == (0, SEQ * HIDDEN)


MODEL = load_model("llama3-8b")
CLUSTER = load_cluster("grand-teton-h100", nodes=8)


def _copies_s(mode: str = "op", **fields) -> float:
    """The model's copy seconds of one layer recomputing under ``mode`` (per-layer modes:
    ``op`` is torchtitan's per-op policy)."""
    base = dict(tp=8, dp=8, sp=True, zero_stage=3, micro_batch_size=12, global_batch_size=96,
                seq_len=8192, recompute="selective", selective_ac="op", dtype="bf16")
    config = ParallelConfig(**{**base, **fields})
    return sp_reorder_copies_s(MODEL, CLUSTER, config, default_calibration(), recompute=mode,
                               framework="torchtitan")


def _copy_s(elements: float, element_bytes: int) -> float:
    """One copy: the elements read and written once through HBM at the achieved rate."""
    device = default_calibration().device(CLUSTER.gpu.key)
    return 2 * elements * element_bytes / (CLUSTER.gpu.hbm_bytes_per_s * device.memory_efficiency)


def test_per_op_policy_layer_pays_ten_copies():
    """Llama 3 8B at TP 8 with SP, 12 x 8,192 tokens per micro-batch, torchtitan's per-op
    policy: forward 2 all-gathers + 2 reduce-scatters, backward their 4 mirror images, and the
    2 all-gathers the recomputation runs again; each copies 12 x 8192 x 4096 bf16 elements."""
    hidden = 12 * 8192 * 4096
    assert _copies_s() == pytest.approx(10 * _copy_s(hidden, 2), rel=1e-12)


def test_one_sequence_per_micro_batch_copies_only_around_reduce_scatters():
    """One sequence: the forward's 2 reduce-scatters and the backward's 2 (of the all-gathers'
    gradients) copy; the all-gathers' re-concatenations are views."""
    hidden = 8192 * 4096
    assert _copies_s(micro_batch_size=1, global_batch_size=8) == pytest.approx(
        4 * _copy_s(hidden, 2), rel=1e-12)


def test_float8_gathers_copy_one_byte_elements():
    hidden = 12 * 8192 * 4096
    expected = 4 * _copy_s(hidden, 1) + 6 * _copy_s(hidden, 2)  # 2 + 2 recomputed all-gathers
    assert _copies_s(float8=True) == pytest.approx(expected, rel=1e-12)


def test_full_recompute_stopping_early_skips_the_last_reduce_scatter():
    hidden = 12 * 8192 * 4096
    stops = _copies_s("full", recompute="full", recompute_early_stop=True)
    runs_all = _copies_s("full", recompute="full", recompute_early_stop=False)
    assert stops == pytest.approx(11 * _copy_s(hidden, 2), rel=1e-12)
    assert runs_all == pytest.approx(12 * _copy_s(hidden, 2), rel=1e-12)


def test_no_copies_without_dtensor_sequence_parallelism():
    config = ParallelConfig(tp=8, dp=8, sp=True, zero_stage=1, micro_batch_size=12,
                            global_batch_size=96, seq_len=8192)
    cal = default_calibration()
    assert sp_reorder_copies_s(MODEL, CLUSTER, config, cal, recompute="none",
                               framework="megatron") == 0.0
    for changed in (dict(sp=False), dict(tp=1, dp=8, sp=False)):
        other = dataclasses.replace(config, **changed)
        assert sp_reorder_copies_s(MODEL, CLUSTER, other, cal, recompute="none",
                                   framework="torchtitan") == 0.0
