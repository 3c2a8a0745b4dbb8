"""The GPU scripts where no GPU is lent: each refuses in one line without CUDA, and each
``--dry-run`` runs its whole path on the CPU.

``benchmarks/gpu_profile_validate.py``: the same four steps (profile, plan, validate --refit,
validate --calibration). ``benchmarks/gpu_runtime.py``: every plan through ``meshplan run`` and
the results files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str, *argv: str, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s, check=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["gpu_profile_validate.py", "gpu_runtime.py"])
def test_without_cuda_it_stops_with_one_line(tmp_path, name):
    done = _script(name, "--out", str(tmp_path), timeout_s=50)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "no CUDA device" in done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_profile_validate_dry_run_runs_every_step_on_the_cpu(tmp_path):
    done = _script("gpu_profile_validate.py", "--dry-run", "--steps", "2", "--out",
                   str(tmp_path), timeout_s=160)
    assert done.returncode == 0, done.stderr[-3000:]
    (result_file,) = tmp_path.glob("gpu-profile-validate-dryrun-cpu-*.json")
    result = json.loads(result_file.read_text())
    assert result_file.with_suffix(".md").exists()
    assert result["device"] == "cpu" and result["model"] == "tiny"
    assert result["profile_fit"]["matmul_flop_per_s"] > 0
    assert result["plans"]["A"] != result["plans"]["B"]
    refit, check = result["validate"]
    assert refit["refit_factor"] > 0 and check["refit_factor"] is None
    assert check["calibration"] == "refit.json"
    assert all(c["measured_step_s"] > 0 and c["predicted_step_s"] > 0 for c in (refit, check))
    assert result["total_s"] > 0  # wall-clock: its budget is the GPU run's, not asserted here


@pytest.mark.timeout(60)
def test_runtime_unknown_plan_is_one_line(tmp_path):
    done = _script("gpu_runtime.py", "--dry-run", "--plans", "none,zero9", "--out",
                   str(tmp_path), timeout_s=50)
    assert done.returncode == 2 and "unknown plan 'zero9'" in done.stderr
    assert "Traceback" not in done.stderr and list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_runtime_dry_run_runs_every_plan_on_the_cpu(tmp_path):
    done = _script("gpu_runtime.py", "--dry-run", "--steps", "2", "--out", str(tmp_path),
                   timeout_s=380)
    assert done.returncode == 0, done.stderr[-3000:]
    (result_file,) = tmp_path.glob("gpu-dryrun-cpu-*.json")
    assert result_file.with_suffix(".md").exists()
    rows = json.loads(result_file.read_text())
    assert [r["plan"] for r in rows] == ["none", "zero1", "selective", "full",
                                        "offload-optimizer", "zero3-offload-params"]
    for row in rows:
        assert row["measured_peak_bytes"] > 0 and row["predicted_peak_bytes"] > 0, row
        assert row["measured_step_s"] > 0 and row["predicted_step_s"] > 0, row
