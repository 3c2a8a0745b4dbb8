"""CPU step-time predictions of the tiny model against this machine's measured steps.

The measurements are the median steps of ``meshplan validate`` on the 2-core CI machine,
quiet (benchmarks/results/validate-refit-cpu-2026-11-30.md, mean of rounds 0 and 1). The CPU
device's per-op and per-collective-call host costs in the built-in calibration were solved
from the first two plans; the others were not used.
"""

from __future__ import annotations

import pytest

from meshplan.costmodel import ParallelConfig, default_calibration, estimate, load_cluster, load_model

COMMON = dict(global_batch_size=8, micro_batch_size=2, seq_len=64, dtype="fp32")
MEASURED_S = {  # plan: (ranks, ParallelConfig fields, measured median step, rounds 0 and 1)
    "single": (1, {}, (0.02096, 0.02500)),
    "tp2": (2, dict(tp=2), (0.2144, 0.2324)),
    "dp2z3": (2, dict(dp=2, zero_stage=3), (0.06011, 0.05854)),
    "pp2": (2, dict(pp=2), (0.01769, 0.01968)),
    "dp2z0": (2, dict(dp=2, zero_stage=0), (0.01862, 0.01570)),
    "single_full": (1, dict(recompute="full"), (0.03422, 0.03552)),
    "tp2sp": (2, dict(tp=2, sp=True, recompute="selective"), (0.3635, 0.3748)),
    "dp2z1": (2, dict(dp=2, zero_stage=1), (0.02808, 0.03099)),
}
HELD_OUT = ("dp2z3", "pp2", "dp2z0", "single_full", "tp2sp", "dp2z1")


def _ratio(plan: str) -> float:
    ranks, fields, measured = MEASURED_S[plan]
    cluster = load_cluster("cpu", nodes=1, gpus_per_node=ranks)
    est = estimate(load_model("tiny"), cluster, ParallelConfig(**{**COMMON, **fields}),
                   framework="meshplan", calibration=default_calibration())
    return sum(measured) / len(measured) / est.time.step_s


@pytest.mark.parametrize("plan", HELD_OUT)
def test_held_out_cpu_plans_within_2x(plan):
    assert 0.5 <= _ratio(plan) <= 2.0


def test_gpu_devices_have_no_host_overheads():
    """On GPUs kernels are queued ahead of the device: no per-op or per-call host cost."""
    cal = default_calibration()
    for key in ("a100-80gb", "h100-sxm", "default"):
        assert cal.device(key).op_overhead_s == 0 and cal.call_s(key) == 0
    assert cal.device("cpu").op_overhead_s > 0 and cal.call_s("cpu") > 0
