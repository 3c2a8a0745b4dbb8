"""``validate``: run plans, compare measured with predicted step time and per-rank peak memory,
and optionally refit the calibration to the runs.

Each plan runs once through ``meshplan.runtime.launch`` (torchrun). On the CPU the live-tensor
tracker counts the per-rank peaks in the run's first ``RunOptions.memory_steps`` steps and the
``steps`` after them are timed without it (the median step is theirs). Refit on one plan: one
factor ``f`` slows every compute and communication cost (``fitting.scaled_calibration``, found
by ``fitting.refit_step_scale``). On several plans: ``fitting.refit_plans`` fits the compute
factor, the cost per GEMM call and the cost per collective call by least squares over them.
``meshplan validate`` is this function plus printing; a notebook calls it directly::

    from meshplan.workflows.validate import validate
    result = validate(["plan.json"], steps=5)
    result.plans[0].step_ratio
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from meshplan.costmodel import fitting
from meshplan.costmodel.calibration import Calibration, default_calibration
from meshplan.costmodel.estimate import Estimate, estimate
from meshplan.planner.plan import Plan, read_plan
from meshplan.runtime.report import RunReport
from meshplan.workflows.files import check_folder, write_calibration, write_json

FOREIGN_CORES_WARNING = 0.25
"""Above this many cores kept busy on average by other processes during a timed run, the ranks
wait for CPU time and for each other, and the step is not the plan's (on a 2-core machine one
foreign busy process doubled some steps): ``PlanMeasurement.loaded`` says so."""


class RunFailed(RuntimeError):
    """A plan's run ended with a failed worker (its traceback went to stderr)."""

    def __init__(self, plan: str, exit_code: int) -> None:
        super().__init__(f"plan {plan}: the run failed with exit code {exit_code}")
        self.plan, self.exit_code = plan, exit_code


@dataclass(frozen=True, kw_only=True)
class RankPeak:
    """One rank's peak allocated bytes, measured and as predicted for its stage."""

    rank: int
    stage: int
    measured_peak_bytes: int | None
    """None where the run could not measure it."""
    predicted_peak_bytes: int | None

    @property
    def peak_ratio(self) -> float | None:
        """measured / predicted, None where either is missing (or the prediction is 0)."""
        if self.measured_peak_bytes is None or not self.predicted_peak_bytes:
            return None
        return self.measured_peak_bytes / self.predicted_peak_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "stage": self.stage,
                "measured_peak_bytes": self.measured_peak_bytes,
                "predicted_peak_bytes": self.predicted_peak_bytes, "peak_ratio": self.peak_ratio}


@dataclass(frozen=True, kw_only=True)
class PlanMeasurement:
    """One plan's run next to its prediction."""

    plan: str
    """The plan file."""
    world_size: int
    measured_step_s: float
    """Median of the timed steps (``RunReport.step_s_median``: the warm-up left out)."""
    step_s: tuple[float, ...]
    """The timed steps: on the CPU those after the live-tensor tracker's, on CUDA all."""
    predicted_step_s: float
    per_rank: tuple[RankPeak, ...]
    foreign_cpu_cores: float | None
    timeshare: float = 1.0
    """Processes per CPU core the run shared (``RunReport.timeshare``; 1: a core each)."""
    """Cores other processes kept busy on average during the timed run (None: not Linux)."""

    @property
    def step_ratio(self) -> float:
        """measured / predicted step time, the prediction on the cores the run shared
        (times ``timeshare``)."""
        return self.measured_step_s / (self.predicted_step_s * self.timeshare)

    @property
    def one_core_step_s(self) -> float:
        """The measured step as on one core per process, what the plan predicts (and a
        refit fits): divided by ``timeshare``."""
        return self.measured_step_s / self.timeshare

    @property
    def loaded(self) -> bool:
        """Other processes kept more than ``FOREIGN_CORES_WARNING`` cores busy."""
        return self.foreign_cpu_cores is not None and \
            self.foreign_cpu_cores > FOREIGN_CORES_WARNING

    def to_dict(self) -> dict[str, Any]:
        """The plan's entry of the ``--report`` document."""
        return {"plan": self.plan, "world_size": self.world_size,
                "measured_step_s": self.measured_step_s, "step_s": list(self.step_s),
                "predicted_step_s": self.predicted_step_s, "step_ratio": self.step_ratio,
                "per_rank": [r.to_dict() for r in self.per_rank],
                "foreign_cpu_cores": self.foreign_cpu_cores, "timeshare": self.timeshare}


@dataclass(frozen=True, kw_only=True)
class RefitSummary:
    """The calibration fitted to the runs, where it was written, and its new predictions."""

    out: str
    fitted: str
    """What was fitted, in one line."""
    predicted_step_s: tuple[float, ...]
    """Each plan's step under the refitted calibration, in the order of the plans."""
    calibration: Calibration

    def to_dict(self) -> dict[str, Any]:
        return {"out": self.out, "fitted": self.fitted,
                "predicted_step_s": list(self.predicted_step_s)}


@dataclass(frozen=True, kw_only=True)
class ValidationResult:
    """Every plan's measurement and, with a refit, the refit."""

    calibration_name: str
    steps: int
    plans: tuple[PlanMeasurement, ...]
    refit: RefitSummary | None = None

    def to_dict(self) -> dict[str, Any]:
        """The ``--report`` document."""
        document = {"calibration": self.calibration_name, "steps": self.steps,
                    "plans": [p.to_dict() for p in self.plans]}
        if self.refit is not None:
            document["refit"] = self.refit.to_dict()
        return document


def validate(plan_files: Sequence[str], *, steps: int = 5, calibration: Calibration | None = None,
             calibration_name: str = "built-in", refit_out: str | None = None,
             report: str | None = None, timeout_s: float = 60.0,
             nproc_per_node: int | None = None,
             on_plan: Callable[[PlanMeasurement], None] | None = None) -> ValidationResult:
    """Run each plan for ``steps`` steps and compare with its prediction under
    ``calibration`` (default: the built-in one; ``calibration_name`` names it in the report).

    ``refit_out``: fit a calibration to the runs and write it there. ``report``: write the
    result's ``to_dict`` as JSON. ``on_plan`` is called with each plan's measurement as soon
    as it is there. ValueError before anything runs for a bad plan or a missing folder;
    RunFailed when a run fails.
    """
    plans = [(path, read_plan(path)) for path in plan_files]
    calibration = calibration or default_calibration()
    check_folder("--report", report)
    check_folder("--out", refit_out)
    measurements = []
    for path, plan in plans:
        measurement = measure_plan(path, plan, calibration=calibration, steps=steps,
                                   timeout_s=timeout_s, nproc_per_node=nproc_per_node)
        if on_plan is not None:
            on_plan(measurement)
        measurements.append(measurement)
    result = ValidationResult(calibration_name=calibration_name, steps=steps,
                              plans=tuple(measurements))
    if refit_out is not None:
        result = dataclasses.replace(result, refit=refit_calibration(
            [plan for _, plan in plans], result.plans, calibration, out=refit_out, steps=steps))
    if report:
        write_json(report, result.to_dict())
    return result


def plan_estimate(plan: Plan, calibration: Calibration) -> Estimate:
    """The cost model's estimate of ``plan`` under ``calibration``."""
    return estimate(plan.model, plan.cluster, plan.config, framework=plan.framework,
                    calibration=calibration)


def measure_plan(path: str, plan: Plan, *, calibration: Calibration, steps: int,
                 timeout_s: float, nproc_per_node: int | None) -> PlanMeasurement:
    """Run the plan in ``path`` and set its measurements next to ``plan_estimate``."""
    report, foreign = _run_plan(path, steps=steps, timeout_s=timeout_s,
                                nproc_per_node=nproc_per_node)
    est = plan_estimate(plan, calibration)
    stage_peak = {s.stage: s.peak_bytes for s in est.memory.per_stage}
    ranks = tuple(RankPeak(rank=r.rank, stage=r.stage, measured_peak_bytes=r.peak_bytes,
                           predicted_peak_bytes=stage_peak.get(r.stage))
                  for r in report.per_rank)
    tracked = set(report.tracked_steps)
    timed = tuple(s for i, s in enumerate(report.step_s) if i not in tracked)
    return PlanMeasurement(plan=path, world_size=report.world_size,
                           measured_step_s=report.step_s_median, step_s=timed,
                           predicted_step_s=est.time.step_s, per_rank=ranks,
                           foreign_cpu_cores=foreign, timeshare=report.timeshare)


def _run_plan(path: str, *, steps: int, timeout_s: float, nproc_per_node: int | None
              ) -> tuple[RunReport, float | None]:
    """(the run's report, cores other processes kept busy during it).

    One run gives both measurements. On CUDA it runs ``steps`` steps, every one counted by
    the allocator's counters, which cost nothing. On the CPU the live-tensor tracker costs
    dispatch time on every op (a tiny plan's step ran 2-4x slower with it): it counts the
    first ``RunOptions.memory_steps`` steps (the warm-up, then one with the optimizer states
    in place, where the peak is reached) and ``steps`` more run without it, timed."""
    import torch

    from meshplan.runtime import launch
    from meshplan.runtime.train import RunOptions

    where = launch.Launch(nproc_per_node=nproc_per_node, oversubscribe=True)  # as before the check
    options = RunOptions(steps=steps, timeout_s=timeout_s)
    if not torch.cuda.is_available():
        options = dataclasses.replace(options, steps=steps + options.memory_steps)
    before = cpu_counters()
    try:
        result = launch.run(path, options=options, launch=where)
    except launch.WorkerRefused as refused:  # a worker's one line (exit code 2)
        raise ValueError(str(refused)) from None
    if result.exit_code != 0 or result.report is None:
        raise RunFailed(path, result.exit_code or 1)
    return result.report, foreign_cores(before, cpu_counters())


def cpu_counters() -> tuple[float, float, float] | None:
    """(wall s, busy CPU s of the whole machine, CPU s of this process and its waited-for
    children); None where ``/proc/stat`` is missing (not Linux)."""
    import resource
    import time

    try:
        with open("/proc/stat") as stat:
            fields = [float(v) for v in stat.readline().split()[1:]]
    except OSError:
        return None
    hertz = os.sysconf("SC_CLK_TCK")
    mine = sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    busy_s = sum(fields[i] for i in (0, 1, 2, 5, 6)) / hertz  # user nice system irq softirq
    return time.monotonic(), busy_s, mine


def foreign_cores(before: tuple[float, float, float] | None,
                  after: tuple[float, float, float] | None) -> float | None:
    """Average number of cores other processes kept busy between two ``cpu_counters``."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    busy = after[1] - before[1]
    mine = after[2] - before[2]
    return max(0.0, (busy - mine) / (after[0] - before[0]))


# ----- refit -------------------------------------------------------------------------------------

def refit_calibration(plans: Sequence[Plan], measurements: Sequence[PlanMeasurement],
                      calibration: Calibration, *, out: str, steps: int) -> RefitSummary:
    """Fit ``calibration`` to the measured steps (``_refit_one`` / ``_refit_several``), write
    it to ``out`` and predict every plan again with it. ValueError when the plans mix devices
    or frameworks."""
    keys = {(plan.cluster.gpu.key, plan.framework) for plan in plans}
    if len(keys) > 1:
        raise ValueError(f"--refit over several plans needs one device and framework, got "
                         f"{sorted(keys)}")
    measured = [m.one_core_step_s for m in measurements]
    runs = "; ".join(f"{m.plan}: measured median step {m.measured_step_s:.4f} s"
                     for m in measurements)
    if len(plans) == 1:
        fitted_calibration, fitted = _refit_one(plans[0], calibration, measured[0])
    else:
        fitted_calibration, fitted = _refit_several(list(plans), calibration, measured)
    note = f"meshplan validate --refit over {steps} steps ({runs}); {fitted}"
    fitted_calibration = dataclasses.replace(
        fitted_calibration, source={**fitted_calibration.source, "refit": note})
    write_calibration(fitted_calibration, out, about=note)
    after = tuple(plan_estimate(plan, fitted_calibration).time.step_s for plan in plans)
    return RefitSummary(out=out, fitted=fitted, predicted_step_s=after,
                        calibration=fitted_calibration)


def _refit_one(plan: Plan, calibration: Calibration,
               measured_s: float) -> tuple[Calibration, str]:
    """One factor on every compute and communication cost, matching one plan's step."""
    key, cluster = plan.cluster.gpu.key, plan.cluster
    latency = dict(intra_latency_s=calibration.link_latency_s.get(
                       "intra", cluster.nvlink_latency_s),
                   inter_latency_s=calibration.link_latency_s.get(
                       "inter", cluster.nic_latency_s))

    def scaled(factor: float) -> Calibration:
        return fitting.scaled_calibration(calibration, gpu_key=key, factor=factor, **latency)

    factor = fitting.refit_step_scale(lambda f: plan_estimate(plan, scaled(f)).time.step_s,
                                      measured_step_s=measured_s)
    return scaled(factor), f"every compute and comm cost scaled by {factor:.3f}"


def _refit_several(plans: list[Plan], calibration: Calibration,
                   measured_s: list[float]) -> tuple[Calibration, str]:
    """Compute factor, seconds per GEMM call and per collective call, by least squares."""
    key, framework = plans[0].cluster.gpu.key, plans[0].framework

    def with_terms(terms: fitting.RefitTerms) -> Calibration:
        return fitting.with_refit_terms(calibration, terms, gpu_key=key, framework=framework)

    terms = fitting.refit_plans(
        lambda t: [plan_estimate(p, with_terms(t)).time.step_s for p in plans],
        measured_s=measured_s,
        start=fitting.refit_terms_of(calibration, gpu_key=key, framework=framework))
    fitted = (f"fitted over {len(plans)} plans: compute factor {terms.compute_factor:.3f}, "
              f"{terms.gemm_call_s * 1e6:.1f} us per GEMM call, "
              f"{terms.collective_call_s * 1e6:.0f} us per collective call")
    return with_terms(terms), fitted
