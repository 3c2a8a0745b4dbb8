"""benchmarks/gpu_profile_validate.py: its refusal without CUDA and, with ``--dry-run``, the
same four steps (profile, plan, validate --refit, validate --calibration) on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_profile_validate.py"


def _script(*argv: str, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout_s, check=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
@pytest.mark.timeout(60)
def test_without_cuda_it_stops_with_one_line(tmp_path):
    done = _script("--out", str(tmp_path), timeout_s=50)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "no CUDA device" in done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_dry_run_runs_every_step_on_the_cpu(tmp_path):
    done = _script("--dry-run", "--steps", "2", "--out", str(tmp_path), timeout_s=160)
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
