"""torchtitan's own FSDP x TP code path on this CPU, measured again and held to its memory rows.

``benchmarks/torchtitan_cpu_memory.py`` runs torchtitan 0.2.2's llama3 model with its
``apply_tp`` (SP, loss parallelism), ``apply_ac`` and ``apply_fsdp`` on four gloo ranks; the
peaks it measured are rows of ``costmodel/data/memory_runs.json``. Re-measured here, the peak
must match the row within 3 % (gloo's timing has moved one rank by 1.5 %); at 64 sequences per
rank (TP 4), within one whole-sequence activation above it (``WHOLE_SEQUENCE_BYTES``). The
FSDP x TP 2 row chosen peaks at the loss backward, so the match also needs loss parallelism's
local temporaries counted: without them its three extra vocabulary-shard copies go missing and
the peak reads 12-13 % lower (1,985,476 and 2,001,860 B in two runs, against 2,271,432).
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest

from meshplan.costmodel.memory_runs import memory_runs

ROOT = Path(__file__).resolve().parents[2]
ROW = "torchtitan-cpu-tiny-v1024-fsdp2-tp2-full-mb2"


@pytest.mark.timeout(300)
def test_the_2d_path_reproduces_its_row_and_counts_the_loss_temporaries(monkeypatch):
    if importlib.util.find_spec("torchtitan") is None:  # the export extra
        pytest.skip("torchtitan is not installed")
    # the spawned ranks import the script's worker by module name, from the parent's sys.path
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    benchmark = importlib.import_module("torchtitan_cpu_memory")
    (run,) = [r for r in memory_runs() if r.id == ROW]
    peaks = benchmark.measure("full", 2, dp=2, tp=2, vocab=1024)
    assert len(peaks) == 4
    assert max(peaks) == pytest.approx(run.measured, rel=0.03)


TP4_ROW = "torchtitan-cpu-tiny-h8-kv8-fsdp1-tp4-full-mb64"
WHOLE_SEQUENCE_BYTES = 4 * 64 * 64 * 64
"""One fp32 whole-sequence hidden state of the TP 4 row (64 x 64 tokens, width 64): what a
rank can hold beyond its row when gloo's worker thread still keeps a finished collective's
output at the peak. On a loaded machine (a concurrent test suite) the TP 8 row's ranks
measured up to 723,712 bytes above it (8,975,300 idle, every rank, every run)."""


@pytest.mark.timeout(300)
def test_the_tp4_path_reproduces_its_row(monkeypatch):
    """TP 4 with SP, 64 x 64 tokens, full AC (4 ranks, lighter than the TP 8 rows on a busy
    machine): a whole-sequence hidden state (1 MiB) outweighs the ffn-wide shards, so the
    peak is the MLP input gradient's reduce-scatter
    (``activations.sp_input_grad_scatter_bytes``); re-measured on torchtitan's own step, the
    row (and with it the model's -1.7 % against it; -9 % without that term) still holds: no
    rank below it, none above it by more than one whole-sequence activation gloo may still
    hold (``WHOLE_SEQUENCE_BYTES``)."""
    if importlib.util.find_spec("torchtitan") is None:  # the export extra
        pytest.skip("torchtitan is not installed")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    benchmark = importlib.import_module("torchtitan_cpu_memory")
    (run,) = [r for r in memory_runs() if r.id == TP4_ROW]
    peaks = benchmark.measure("full", 64, dp=1, tp=4, heads=(8, 8))
    assert len(peaks) == 4
    assert min(peaks) >= 0.99 * run.measured, peaks
    assert max(peaks) <= 1.01 * run.measured + WHOLE_SEQUENCE_BYTES, peaks


PP_ROWS = ("torchtitan-cpu-tiny-8l-pp2-dp1-interleaved-m8-full-stage0",
           "torchtitan-cpu-tiny-8l-pp2-dp1-interleaved-m8-full-stage1")


@pytest.mark.timeout(300)
def test_the_interleaved_pipeline_path_reproduces_its_rows(monkeypatch):
    """torchtitan's pipelined step (``benchmarks/torchtitan_cpu_pp_memory.py``: PP 2 with two
    model parts per rank, ``ScheduleInterleaved1F1B``, 8 micro-batches, full AC) measured
    again: each pipeline rank within 3 % of its row. Its peak holds every micro-batch's sent
    boundary tensors (the schedule waits on its sends when the step ends, and gloo's works
    keep their tensors until then), which is what the rows, and the model's
    ``pipeline_send_in_flight_bytes`` on the CPU, rest on."""
    if importlib.util.find_spec("torchtitan") is None:  # the export extra
        pytest.skip("torchtitan is not installed")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    benchmark = importlib.import_module("torchtitan_cpu_pp_memory")
    rows = {r.stage: r for r in memory_runs() if r.id in PP_ROWS}
    measured = benchmark.measure(pp=2, dp=1, schedule="Interleaved1F1B", microbatches=8,
                                 micro_batch=2, layers=8, policy="full", even=True)
    assert sorted(m["pp_rank"] for m in measured) == [0, 1]
    for m in measured:
        assert m["peak_bytes"] == pytest.approx(rows[m["pp_rank"]].measured, rel=0.03)


COMPILED_ROW = "torchtitan-cpu-tiny-fsdp1-op-compile-model-mb8"


@pytest.mark.timeout(400)
def test_the_compiled_path_reproduces_its_row(monkeypatch):
    """torchtitan's step with each block compiled after its per-op checkpoint wrapper (one
    rank), measured again through the CPU allocator's running total (``AllocatorPeak``: the
    live-tensor tracker cannot run under compile): within 1 % of its row, on which the
    model's compiled per-op set (the down projection's output not kept) rests."""
    if importlib.util.find_spec("torchtitan") is None:  # the export extra
        pytest.skip("torchtitan is not installed")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    benchmark = importlib.import_module("torchtitan_cpu_memory")
    (run,) = [r for r in memory_runs() if r.id == COMPILED_ROW]
    (peak,) = benchmark.measure("op", 8, dp=1, compile_mode="model")
    assert peak == pytest.approx(run.measured, rel=0.01)


@pytest.mark.timeout(400)
def test_one_rank_of_a_fake_group_reproduces_the_gloo_rows(tmp_path):
    """``benchmarks/gpu_torchtitan_memory.py --dry-run``: torchtitan's components wired as its
    trainer wires them (``parallelize_llama``, its loss, optimizers and train context), run
    as rank 0 of torch's fake process group in one process, hold what the same plans' gloo
    ranks measured: FSDP alone to within 0.1 %, FSDP x TP 2 within 2 % (the fake group's
    collectives leave no receive buffers behind). What lets that script stand one GPU in for
    a published run's rank."""
    import json
    import subprocess
    import sys

    if importlib.util.find_spec("torchtitan") is None:  # the export extra
        pytest.skip("torchtitan is not installed")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_torchtitan_memory.py"),
                           "--dry-run", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=380, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    (path,) = tmp_path.glob("torchtitan-memory-cpu-*.json")
    rows = {row["run"]: row for row in json.loads(path.read_text())["rows"]}
    assert len(rows) == 4
    for run_id, row in rows.items():
        tolerance = 0.02 if "-tp2-" in run_id else 0.001
        assert row["fake_rank_bytes"] == pytest.approx(row["gloo_ranks_bytes"],
                                                       rel=tolerance), run_id


MIXED_ROW = "torchtitan-cpu-tiny-float8-fsdp2-full-mb8"


@pytest.mark.timeout(300)
def test_the_float8_path_reproduces_its_row(tmp_path):
    """torchtitan's bf16 step with torchao's float8 linears (FSDP 2, full AC; one rank of a
    fake group, ``benchmarks/torchtitan_cpu_mixed_memory.py``) measured again: the live-tensor
    peak equals its row to within 0.1 % (one process, no gloo thread: two runs gave the same
    bytes). The row is where the eager float8 cast's fp32 copies
    (``activations.float8_cast_workspace_bytes``) and the CPU's composite RMSNorm were
    found."""
    import re
    import subprocess
    import sys

    if importlib.util.find_spec("torchtitan") is None or \
            importlib.util.find_spec("torchao") is None:  # the export extra
        pytest.skip("torchtitan or torchao is not installed")
    (run,) = [r for r in memory_runs() if r.id == MIXED_ROW]
    done = subprocess.run([sys.executable,
                           str(ROOT / "benchmarks" / "torchtitan_cpu_mixed_memory.py"),
                           "--plans", MIXED_ROW], capture_output=True, text=True, timeout=280,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    measured = int(re.search(r"measured (\d+) B", done.stdout).group(1))
    assert measured == pytest.approx(run.measured, rel=0.001)


def test_allocator_replay_names_what_is_alive_at_the_peak(monkeypatch):
    """``AllocatorPeak.live_at_peak`` (``torchtitan_cpu_mixed_memory.py --live``) replays the
    CPU allocator's events to the window's peak: the blocks alive there sum to the peak, and
    ``within`` finds the highest point inside one op instead."""
    import torch
    from torch.autograd.profiler import record_function

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    benchmark = importlib.import_module("torchtitan_cpu_memory")
    with benchmark.AllocatorPeak() as meter:
        kept = torch.empty(1 << 20, dtype=torch.uint8)  # before the window: alive throughout
        with meter.window():
            with record_function("first"):
                a = torch.empty(3 << 20, dtype=torch.uint8)
                del a
            with record_function("second"):
                b = torch.empty(2 << 20, dtype=torch.uint8)
                c = torch.empty(1 << 20, dtype=torch.uint8)
                del b, c
    del kept
    live = meter.live_at_peak()
    assert meter.peak_bytes == sum(size for size, _ in live)
    assert sorted(size for size, _ in live)[-2:] == [1 << 20, 3 << 20]
    assert any("first" in ops for size, ops in live if size == 3 << 20)
    inside = meter.live_at_peak(within="second")
    assert sorted(size for size, _ in inside)[-3:] == [1 << 20, 1 << 20, 2 << 20]


def test_cuda_trace_replay_finds_the_blocks_alive_at_the_peak(monkeypatch):
    """``gpu_torchtitan_memory.cuda_live_at_peak`` replays a CUDA allocator trace (the
    ``_snapshot()["device_traces"]`` entries: alloc, free_requested, free_completed): a block
    counts until its free completes, frees of blocks allocated before the recording are
    skipped, and the blocks alive at the highest point are grouped by size and the first frame
    outside torch."""
    if importlib.util.find_spec("torchtitan") is None:  # the benchmark imports its helpers
        pytest.skip("torchtitan is not installed")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    benchmark = importlib.import_module("gpu_torchtitan_memory")

    def frame(name):
        return [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
                {"filename": f"/tmp/{name}.py", "line": 7, "name": name}]

    trace = [
        {"action": "free_completed", "addr": 99, "size": 1000},  # allocated before recording
        {"action": "alloc", "addr": 1, "size": 300, "frames": frame("mlp")},
        {"action": "alloc", "addr": 2, "size": 300, "frames": frame("mlp")},
        {"action": "free_requested", "addr": 1, "size": 300},
        {"action": "alloc", "addr": 3, "size": 50, "frames": frame("norm")},  # peak: 650
        {"action": "free_completed", "addr": 1, "size": 300},
        {"action": "alloc", "addr": 4, "size": 200, "frames": frame("loss")},  # 550
    ]
    live = benchmark.cuda_live_at_peak(trace)
    assert live == [{"bytes": 300, "count": 2, "frame": "mlp (mlp.py:7)"},
                    {"bytes": 50, "count": 1, "frame": "norm (norm.py:7)"}]
