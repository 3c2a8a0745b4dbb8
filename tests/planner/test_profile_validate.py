"""``meshplan profile`` and ``meshplan validate``: a calibration measured here, a plan run and
refitted; plus the pure fits (costmodel/fitting.py) and the ``link_latency_s`` override."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshplan.costmodel import ParallelConfig, estimate, load_calibration, load_cluster, load_model
from meshplan.costmodel import fitting
from meshplan.costmodel.calibration import default_calibration
from meshplan.planner.plan import Plan, write_plan

ROOT = Path(__file__).resolve().parents[2]
CONFIG = dict(dp=2, global_batch_size=8, micro_batch_size=2, seq_len=64, dtype="fp32")


def meshplan(*argv: str, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshplan", *argv], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout_s, check=False)


def _tiny_estimate(calibration=None):
    return estimate(load_model("tiny"), load_cluster("cpu", nodes=1, gpus_per_node=2),
                    ParallelConfig(**CONFIG), framework="meshplan", calibration=calibration)


# ----- pure fits ---------------------------------------------------------------------------------
def test_fit_gemm_recovers_efficiency_and_overhead():
    peak, eff, overhead = 1e11, 0.5, 2e-5
    flop = [1e6, 1e8, 1e9]
    eff_fit, overhead_fit = fitting.fit_gemm(flop, [f / (peak * eff) + overhead for f in flop],
                                             peak_flop_per_s=peak)
    assert eff_fit == pytest.approx(eff) and overhead_fit == pytest.approx(overhead)


H200_GEMMS = ((2 * 512 ** 3, 1.6097e-05), (2 * 1024 ** 3, 1.6616e-05), (2 * 2048 ** 3, 2.5803e-05),
              (2 * 4096 ** 3, 1.79112e-04), (2 * 8192 ** 3, 1.398112e-03))
"""(flop, s) per call of bf16 n-cubes, ``meshplan profile`` on one H200 on 2026-12-04
(``benchmarks/results/profile-h200-2026-12-04-measurements.json``): up to 2048 the calls are
launch-bound (16-26 us, near-flat in FLOPs)."""


def test_gpu_gemm_fit_reads_the_rate_off_the_sizes_that_are_not_launch_bound():
    flop, seconds = zip(*H200_GEMMS)
    (f1, t1), (f2, t2) = H200_GEMMS[-2:]
    secant = (f2 - f1) / (t2 - t1)  # the two largest: 789 TFLOP/s
    rate, overhead = fitting.fit_gemm_rate(flop, seconds, asynchronous=True)
    assert rate == pytest.approx(secant, rel=1e-9)
    assert overhead == pytest.approx(t1 - f1 / secant, rel=1e-6)
    # the launch-bound sizes pull the same fit to ~915 TFLOP/s, above what any size reached
    cpu_rate, _ = fitting.fit_gemm_rate(flop, seconds)
    assert cpu_rate > 1.1 * max(f / t for f, t in H200_GEMMS)


def test_fit_alpha_beta_recovers_the_collectives_model():
    bandwidth, alpha = 3e9, 1e-4
    samples = []
    for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv"):
        factor, steps = fitting.collective_coefficients(op, 2)
        samples += [(op, 2, s, factor * s / bandwidth + steps * alpha) for s in (4e3, 1e6, 8e6)]
    assert fitting.fit_alpha_beta(samples) == pytest.approx((bandwidth, alpha))


def test_refit_scale_reaches_the_measurement():
    factor = fitting.refit_step_scale(lambda f: 0.01 * f + 0.002 * min(f, 2.0),
                                      measured_step_s=0.05)
    assert 0.01 * factor + 0.002 * min(factor, 2.0) == pytest.approx(0.05, rel=1e-3)


# ----- link_latency_s ----------------------------------------------------------------------------
def test_link_latency_absent_changes_nothing_and_present_slows_comm():
    base = default_calibration()
    assert base.link_latency_s == {}
    same = dataclasses.replace(base, link_latency_s={"inter": 1.0})  # no cross-node group here
    slow = dataclasses.replace(base, link_latency_s={"intra": 1e-2})
    assert _tiny_estimate(same).time.step_s == _tiny_estimate(base).time.step_s
    assert _tiny_estimate(slow).time.dp_comm_s > _tiny_estimate(base).time.dp_comm_s


def test_link_latency_is_validated():
    with pytest.raises(ValueError, match="link_latency_s"):
        dataclasses.replace(default_calibration(), link_latency_s={"nvlink": 1e-6})


# ----- the commands ------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_profile_quick_writes_a_loadable_calibration(tmp_path):
    out = tmp_path / "f.json"
    done = meshplan("profile", "--quick", "--out", str(out), timeout_s=100)
    assert done.returncode == 0, done.stderr
    assert "profile [" in done.stderr  # progress line
    cal = load_calibration(str(out))
    cpu = cal.device("cpu")
    assert 0 < cpu.matmul_efficiency <= 1 and cpu.matmul_overhead_s >= 0
    assert 0 < cpu.memory_efficiency <= 1 and 0 < cal.nvlink_efficiency <= 1
    assert cal.link_latency_s["intra"] > 0
    assert "profile" in cal.source
    assert json.loads(out.read_text())["devices"]["cpu"] == dataclasses.asdict(cpu)
    done = meshplan("estimate", "--model", "tiny", "--cluster", "cpu", "--dp", "2",
                    "--global-batch", "8", "--seq-len", "64", "--calibration", str(out),
                    "--json", timeout_s=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["time"]["step_s"] > 0


@pytest.mark.timeout(180)
def test_validate_prints_ratios_and_refit_matches_the_run(tmp_path):
    plan_file, out = tmp_path / "plan.json", tmp_path / "refit.json"
    write_plan(Plan.from_estimate(_tiny_estimate(), provenance={"source": "test"}), plan_file)
    done = meshplan("validate", str(plan_file), "--steps", "4", "--refit", "--out", str(out),
                    timeout_s=170)
    assert done.returncode == 0, done.stderr
    step_line = next(line for line in done.stdout.splitlines() if line.startswith("step time"))
    measured_s = float(step_line.split()[3])
    assert "ratio" in step_line
    assert sum("peak measured" in line and "ratio" in line
               for line in done.stdout.splitlines()) == 2
    refit = load_calibration(str(out))
    assert _tiny_estimate(refit).time.step_s == pytest.approx(measured_s, rel=0.25)
