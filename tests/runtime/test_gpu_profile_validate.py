"""``benchmarks/gpu_profile_validate.py --dry-run`` where no GPU is lent: the same four steps
as on a GPU (profile, plan, validate --refit, validate --calibration) on the CPU. Its refusal
without CUDA is tested with ``gpu_runtime.py``'s in ``test_gpu_scripts.py``."""

from __future__ import annotations

import json

import pytest

from tests.runtime.conftest import run_benchmark


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_profile_validate_dry_run_runs_every_step_on_the_cpu(tmp_path):
    done = run_benchmark("gpu_profile_validate.py", "--dry-run", "--steps", "2", "--out",
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
