"""The GPU scripts where no GPU is lent: each refuses in one line without CUDA, and
``benchmarks/gpu_runtime.py --dry-run`` runs its whole path on the CPU: plans through
``meshplan run`` and the results files (``SCRIPT_PLANS``), and every plan of the script on one
CPU process. ``gpu_profile_validate.py``'s dry run is in
``test_gpu_profile_validate.py`` (a file of its own, so the two long dry runs can go to two
pytest-xdist workers)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from meshplan.planner.plan import write_plan
from tests.runtime.conftest import run_benchmark

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["gpu_profile_validate.py", "gpu_runtime.py", "gpu_kernels.py",
                                  "gpu_memory_breakdown.py", "gpu_torchtitan_memory.py"])
def test_without_cuda_it_stops_with_one_line(tmp_path, name):
    done = run_benchmark(name, "--out", str(tmp_path), timeout_s=50)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "no CUDA device" in done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_runtime_unknown_plan_is_one_line(tmp_path):
    done = run_benchmark("gpu_runtime.py", "--dry-run", "--plans", "none,zero9", "--out",
                         str(tmp_path), timeout_s=50)
    assert done.returncode == 2 and "unknown plan 'zero9'" in done.stderr
    assert "Traceback" not in done.stderr and list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_runtime_bad_calibration_is_one_line(tmp_path):
    bad = tmp_path / "calibration.json"
    bad.write_text('{"nvlink_efficiency": 7}')
    done = run_benchmark("gpu_runtime.py", "--dry-run", "--calibration", str(bad), "--out",
                         str(tmp_path / "out"), timeout_s=50)
    assert done.returncode == 2 and done.stderr.startswith("gpu_runtime.py: --calibration:")
    assert done.stderr.strip().count("\n") == 0 and not (tmp_path / "out").exists()


def test_runtime_plans_predict_with_the_given_calibration():
    """A profile of a machine whose host memory is half as fast (a slice of a node) slows
    the predicted host work of the parameter-offload plan, and the plan records which
    calibration it was made with."""
    import dataclasses

    from meshplan.costmodel.calibration import default_calibration

    script = _runtime_script()
    base = default_calibration()
    slow = dataclasses.replace(base, host_memory_bytes_per_s={
        key: rate / 2 for key, rate in base.host_memory_bytes_per_s.items()})
    fields = script.PLANS["zero3-offload-params"]
    built_in = script.make_plan("dgx-h200", fields)
    profiled = script.make_plan("dgx-h200", fields, calibration=slow,
                                calibration_name="profile.json")
    assert profiled.prediction.time.offload_s > built_in.prediction.time.offload_s
    assert profiled.provenance["calibration"] == "profile.json"
    assert built_in.provenance["calibration"] == "built-in"


LONG_TESTS = "MESHPLAN_LONG_TESTS"
ALL_PLANS = ["none", "zero1", "selective", "full", "offload-optimizer", "zero3-offload-params",
             "zero3-full"]
SCRIPT_PLANS = ALL_PLANS if os.environ.get(LONG_TESTS) else ["none", "zero3-offload-params"]
"""The plans the script's dry run takes through ``meshplan run``, one launch each (about 30 s
on a busy 2-core machine): two by default, the first and the last (ZeRO-3 with parameters
offloaded), which take the script's whole path; all six with ``MESHPLAN_LONG_TESTS=1``. Every
plan still runs by default, in ``test_every_runtime_plan_runs_on_one_cpu_process``."""


def _runtime_script():
    """``benchmarks/gpu_runtime.py`` as a module (its ``PLANS`` and ``make_plan``)."""
    spec = importlib.util.spec_from_file_location("gpu_runtime", ROOT / "benchmarks" /
                                                  "gpu_runtime.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_runtime_dry_run_runs_the_plans_on_the_cpu(tmp_path):
    done = run_benchmark("gpu_runtime.py", "--dry-run", "--steps", "2", "--plans",
                         ",".join(SCRIPT_PLANS), "--out", str(tmp_path), timeout_s=380)
    assert done.returncode == 0, done.stderr[-3000:]
    (result_file,) = tmp_path.glob("gpu-dryrun-cpu-*.json")
    assert result_file.with_suffix(".md").exists()
    rows = json.loads(result_file.read_text())
    assert [r["plan"] for r in rows] == SCRIPT_PLANS
    for row in rows:
        assert row["measured_peak_bytes"] > 0 and row["predicted_peak_bytes"] > 0, row
        assert row["measured_step_s"] > 0 and row["predicted_step_s"] > 0, row
        assert 0 < row["measured_optimizer_s"] < row["measured_step_s"], row
        assert row["predicted_optimizer_s"] >= 0 and row["predicted_offload_s"] >= 0, row


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_runtime_plan_runs_on_one_cpu_process(tmp_path, torchrun):
    """Each of the script's dry-run plans (its ``make_plan``), all in one one-process launch
    (``runtime.worker`` runs them one after another): the report values the script reads."""
    script = _runtime_script()
    assert list(script.PLANS) == ALL_PLANS
    plans = []
    for name, fields in script.PLANS.items():
        plans.append(tmp_path / f"{name}.json")
        write_plan(script.make_plan("cpu", fields, dry_run=True), plans[-1])
    reports = [path.with_suffix(".report.json") for path in plans]
    done = torchrun(plans, reports, nproc=1, steps=2)
    assert done.returncode == 0, done.stderr[-3000:]
    for name, path in zip(script.PLANS, reports):
        report = json.loads(path.read_text())
        rank = report["per_rank"][0]
        assert report["world_size"] == 1, name
        assert rank["peak_bytes"] > 0 and rank["predicted_peak_bytes"] > 0, name
        assert report["step_s_median"] > 0 and report["predicted"]["step_s"] > 0, name


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_kernels_dry_run_writes_every_group(tmp_path):
    """``gpu_kernels.py --dry-run``: every group on the CPU at tiny sizes, each row beside the
    calibration's value, in both results files."""
    done = run_benchmark("gpu_kernels.py", "--dry-run", "--out", str(tmp_path), timeout_s=110)
    assert done.returncode == 0, done.stderr[-2000:]
    [result] = tmp_path.glob("gpu-kernels-dryrun-cpu-*.json")
    rows = json.loads(result.read_text())["rows"]
    assert {row["group"] for row in rows} == {"gemm", "narrow_gemm", "tp_gemm", "attention",
                                              "ring", "launch", "float8", "loss",
                                              "elementwise", "host"}
    assert not [row for row in rows if "error" in row]
    assert all(row["seconds"] > 0 for row in rows)
    assert (tmp_path / result.name.replace(".json", ".md")).exists()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_memory_breakdown_on_the_cpu_adds_up_to_its_peak(tmp_path):
    """``gpu_memory_breakdown.py --device cpu``: the composition of each peak sums to the
    tracked peak (the tensor whose release reveals the peak included)."""
    done = run_benchmark("gpu_memory_breakdown.py", "--device", "cpu", "--model", "tiny",
                         "--seq-len", "64", "--out", str(tmp_path), timeout_s=110)
    assert done.returncode == 0, done.stderr[-2000:]
    [result] = tmp_path.glob("memory-breakdown-cpu-tiny-*.json")
    rows = json.loads(result.read_text())["rows"]
    assert [row["mode"] for row in rows] == ["none", "selective", "full"]
    for row in rows:
        assert sum(row["composition"].values()) == row["tracked_peak_bytes"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_emulation_computes_causal_attention(cp):
    """``gpu_kernels.py``'s ring group times one rank's ring attention; its chunk choices and
    merges are checked here against plain causal attention over the whole sequence: with each
    rank holding the round-robin pair of chunks (r, 2 cp - 1 - r) and the arriving key/value
    pairs of ranks r - 1, r - 2, ..., every rank's merged output and query gradient equal the
    full causal attention's rows (CPU flash kernels, fp32)."""
    from tests.conftest import benchmark_module

    kernels = benchmark_module("gpu_kernels")
    forward, backward = kernels._flash_ops(torch.device("cpu"))
    torch.manual_seed(0)
    chunk, heads, head = 8, 2, 16
    q, k, v, dout = (torch.randn(1, heads, 2 * cp * chunk, head) for _ in range(4))
    q.requires_grad_(True)
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    [full_dq] = torch.autograd.grad(full, [q], dout)

    def local(t, rank):
        parts = t.chunk(2 * cp, dim=2)
        return torch.cat([parts[rank], parts[2 * cp - 1 - rank]], dim=2)

    for rank in range(cp):
        steps = [(local(k, (rank - i) % cp), local(v, (rank - i) % cp)) for i in range(cp)]
        q_r = local(q.detach(), rank)
        out, lse, saved = kernels.ring_forward(q_r, steps, rank=rank, forward=forward)
        torch.testing.assert_close(out, local(full.detach(), rank), rtol=1e-4, atol=1e-5)
        dq = kernels.ring_backward(local(dout, rank), q_r, steps, out, lse, saved,
                                   backward=backward)
        torch.testing.assert_close(dq, local(full_dq, rank), rtol=1e-4, atol=1e-5)
