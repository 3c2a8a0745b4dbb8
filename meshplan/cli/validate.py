"""``meshplan validate``: run plans, compare measured with predicted, optionally refit
(``meshplan.workflows.validate``); this prints each plan's ratios as its run ends."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from meshplan.cli.args import positive_float, positive_int
from meshplan.cli.errors import EXIT_OK
from meshplan.cli.inputs import load_calibration_flag
from meshplan.cli.output import refuse_overwrite

if TYPE_CHECKING:
    from meshplan.workflows.validate import PlanMeasurement, RefitSummary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan_files", nargs="+", metavar="plan.json",
                        help="plan file(s) (meshplan plan -o); --refit over several plans fits "
                             "compute, per-GEMM and per-collective costs together")
    parser.add_argument("--steps", type=positive_int, default=5, metavar="N",
                        help="optimizer steps (default 5; the first is a warm-up)")
    parser.add_argument("--calibration", metavar="FILE",
                        help="calibration of the prediction (default: the built-in one)")
    parser.add_argument("--refit", action="store_true",
                        help="write a calibration fitted so the predictions match these runs")
    parser.add_argument("--out", metavar="FILE", default="calibration-refit.json",
                        help="where --refit writes (default calibration-refit.json)")
    parser.add_argument("--report", metavar="FILE",
                        help="write measured and predicted values of every plan as JSON")
    parser.add_argument("--force", action="store_true",
                        help="let --out and --report overwrite existing files")
    parser.add_argument("--timeout", type=positive_float, default=60.0, metavar="S",
                        help="process-group timeout in seconds (default 60)")
    parser.add_argument("--nproc-per-node", type=positive_int, metavar="K",
                        help="processes (default: each plan's world size)")


def run(args: argparse.Namespace) -> int:
    """0, or the exit code of a failed run (its traceback is above)."""
    from meshplan.workflows.validate import RunFailed, validate

    several = len(args.plan_files) > 1
    if args.refit:
        refuse_overwrite("--out", args.out, force=args.force)
    refuse_overwrite("--report", args.report, force=args.force)

    def show(measurement: PlanMeasurement) -> None:
        if several:
            print(f"plan {measurement.plan}")
        print(validate_summary(measurement))

    try:
        result = validate(args.plan_files, steps=args.steps,
                          calibration=load_calibration_flag(args.calibration),
                          calibration_name=args.calibration or "built-in",
                          refit_out=args.out if args.refit else None, report=args.report,
                          timeout_s=args.timeout, nproc_per_node=args.nproc_per_node,
                          on_plan=show)
    except RunFailed as failed:
        return failed.exit_code
    if result.refit is not None:
        print(refit_lines(result.refit, result.plans))
    return EXIT_OK


def validate_summary(measurement: PlanMeasurement) -> str:
    """Measured against predicted step time and per-rank peak memory, with ratios."""
    m = measurement
    shared = (f" x{m.timeshare:.2g} for {m.timeshare:.2g} processes per CPU core here = "
              f"{m.predicted_step_s * m.timeshare:.4f} s" if m.timeshare > 1 else "")
    lines = [f"step time  measured {m.measured_step_s:.4f} s   predicted "
             f"{m.predicted_step_s:.4f} s{shared}   ratio {m.step_ratio:.2f}x"]
    if m.loaded:
        lines.append(f"warning: other processes kept {m.foreign_cpu_cores:.2f} cores busy "
                     f"during the timed run; its step time is not this plan's alone")
    for rank in m.per_rank:
        if rank.peak_ratio is None:
            continue
        lines.append(f"rank {rank.rank} (stage {rank.stage})  peak measured "
                     f"{rank.measured_peak_bytes / 1e6:.2f} MB   predicted "
                     f"{rank.predicted_peak_bytes / 1e6:.2f} MB   ratio {rank.peak_ratio:.2f}x")
    return "\n".join(lines)


def refit_lines(refit: RefitSummary, plans: tuple[PlanMeasurement, ...]) -> str:
    """What the refit fitted, where it went, and each plan's step predicted with it."""
    lines = [f"refit      {refit.fitted}; wrote {refit.out}"]
    for plan, predicted_s in zip(plans, refit.predicted_step_s):
        lines.append(f"           {plan.plan}: measured {plan.measured_step_s:.4f} s   "
                     f"predicted now {predicted_s:.4f} s   ratio "
                     f"{plan.one_core_step_s / predicted_s:.2f}x")
    return "\n".join(lines)
