"""Does ``meshplan validate --refit`` transfer to a plan it was not fitted on? (CPU, gloo, tiny)

The acceptance of the profiling issue: after a refit on some plans, the predicted step of a
*different* plan is within 25 % of its measured step, and every rank's predicted peak within
10 %. Each round, only through the ``meshplan`` commands:

1. ``meshplan profile --quick`` measures this machine (GEMM, copy, gloo alpha-beta);
2. ``meshplan validate A1 A2 ... --refit --calibration profile.json`` runs the refit plans and
   fits compute factor, seconds per GEMM call and per collective call over them;
3. ``meshplan validate A1 --refit`` alone gives the old one-factor refit, for comparison;
4. ``meshplan validate B --calibration refit.json`` runs each held-out plan B.

The table puts each plan's measured median step (``--steps`` steps, the first a warm-up, run
without the memory tracker) next to its prediction under the built-in calibration, the profile,
the one-factor refit and the several-plan refit, and each rank's measured / predicted peak.
Other processes on this 2-core machine are the main noise (a rank waits for CPU time, then its
peer waits for it in the next collective): ``validate`` reports how many cores others kept busy
during each timed run, and rows above ``LOADED_CORES`` are marked ``loaded`` and left out of the
summary; ``--quiet-cores`` waits for a quiet machine before each run.

    python benchmarks/validate_refit.py [--steps 20] [--rounds 1] [--refit single,tp2]
                                        [--predict dp2z3,pp2,dp2z0,single_full,tp2sp,dp2z1]
                                        [--quiet-cores 0.3]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from meshplan.costmodel import ParallelConfig, estimate, load_calibration, load_cluster, load_model
from meshplan.planner.plan import Plan, read_plan, write_plan

RESULTS = Path(__file__).resolve().parent / "results"
COMMON = dict(global_batch_size=8, micro_batch_size=2, seq_len=64, dtype="fp32")
PLANS = {  # name: (ranks, ParallelConfig fields beyond COMMON)
    "single": (1, dict()),
    "single_full": (1, dict(recompute="full")),
    "dp2z0": (2, dict(dp=2, zero_stage=0)),
    "dp2z1": (2, dict(dp=2, zero_stage=1)),
    "dp2z3": (2, dict(dp=2, zero_stage=3)),
    "tp2": (2, dict(tp=2)),
    "tp2sp": (2, dict(tp=2, sp=True, recompute="selective")),
    "pp2": (2, dict(pp=2)),
}
STEP_TOLERANCE = 0.25
MEMORY_TOLERANCE = 0.10
RUN_TIMEOUT_S = 600
LOADED_CORES = 0.5
"""A run during which other processes kept more cores than this busy is marked ``loaded``."""
QUIET_WAIT_S = 900
"""Longest wait for a quiet machine before each ``validate`` (``--quiet-cores``)."""


def write_plans(folder: Path) -> dict[str, Path]:
    out = {}
    for name, (ranks, fields) in PLANS.items():
        est = estimate(load_model("tiny"), load_cluster("cpu", nodes=1, gpus_per_node=ranks),
                       ParallelConfig(**{**COMMON, **fields}), framework="meshplan")
        out[name] = folder / f"{name}.json"
        write_plan(Plan.from_estimate(est, provenance={"source": "benchmarks/validate_refit.py"}),
                   out[name])
    return out


def meshplan(*argv: str) -> str:
    done = subprocess.run([sys.executable, "-m", "meshplan", *argv], text=True,
                          capture_output=True, timeout=RUN_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"meshplan {' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def busy_cores(window_s: float = 2.0) -> float:
    """Cores the whole machine keeps busy over ``window_s`` (``/proc/stat``)."""
    def sample() -> tuple[float, float]:
        with open("/proc/stat") as stat:
            fields = [float(v) for v in stat.readline().split()[1:]]
        busy = sum(fields[i] for i in (0, 1, 2, 5, 6))  # user nice system irq softirq
        return time.monotonic(), busy / os.sysconf("SC_CLK_TCK")
    (t0, b0), _ = sample(), time.sleep(window_s)
    t1, b1 = sample()
    return (b1 - b0) / (t1 - t0)


def wait_quiet(max_cores: float | None) -> float:
    """Wait (up to ``QUIET_WAIT_S``) until others keep at most ``max_cores`` busy; return it."""
    start, busy = time.monotonic(), busy_cores()
    while max_cores is not None and busy > max_cores and time.monotonic() - start < QUIET_WAIT_S:
        busy = busy_cores()
    return busy


def validate(plans: list[Path], *, steps: int, calibration: Path | None, report: Path,
             quiet_cores: float | None, refit_out: Path | None = None) -> dict:
    argv = ["validate", *map(str, plans), "--steps", str(steps), "--report", str(report)]
    if calibration is not None:
        argv += ["--calibration", str(calibration)]
    if refit_out is not None:
        argv += ["--refit", "--out", str(refit_out)]
    busy_before = wait_quiet(quiet_cores)
    print(meshplan(*argv), flush=True)
    document = json.loads(report.read_text())
    for entry in document["plans"]:
        entry["busy_cores_before"] = busy_before
    return document


def predicted_step_s(plan_file: Path, calibration: Path | None) -> float:
    plan = read_plan(plan_file)
    return estimate(plan.model, plan.cluster, plan.config, framework=plan.framework,
                    calibration=load_calibration(str(calibration) if calibration else None)
                    ).time.step_s


def one_round(files: dict[str, Path], folder: Path, *, refit: list[str], predict: list[str],
              steps: int, quiet_cores: float | None) -> tuple[list[dict], str]:
    profile, multi, one = folder / "profile.json", folder / "refit.json", folder / "one.json"
    wait_quiet(quiet_cores)
    meshplan("profile", "--quick", "--out", str(profile))
    fitted = validate([files[n] for n in refit], steps=steps, calibration=profile,
                      report=folder / "refit-report.json", refit_out=multi,
                      quiet_cores=quiet_cores)
    validate([files[refit[0]]], steps=steps, calibration=profile,
             report=folder / "one-report.json", refit_out=one, quiet_cores=quiet_cores)
    entries = {n: (e, "refit") for n, e in zip(refit, fitted["plans"])}
    for name in predict:
        held = validate([files[name]], steps=steps, calibration=multi,
                        report=folder / f"{name}-report.json", quiet_cores=quiet_cores)
        entries[name] = (held["plans"][0], "held out")
    calibrations = {"built-in": None, "profile": profile, "one-factor refit": one,
                    "refit": multi}
    rows = []
    for name, (entry, role) in entries.items():
        row = {"plan": name, "role": role,
               "foreign_cores": entry["foreign_cpu_cores"],
               "loaded": (entry["foreign_cpu_cores"] or 0.0) > LOADED_CORES,
               "measured_step_s": entry["measured_step_s"],
               "step_q1_s": statistics.quantiles(entry["step_s"][1:], n=4)[0]
               if len(entry["step_s"]) > 2 else entry["measured_step_s"]}
        for label, path in calibrations.items():
            row[f"predicted {label}"] = predicted_step_s(files[name], path)
            row[f"ratio {label}"] = entry["measured_step_s"] / row[f"predicted {label}"]
        peaks = [r["peak_ratio"] for r in entry["per_rank"] if r["peak_ratio"] is not None]
        row["peak_ratios"] = " ".join(f"{r:.3f}" for r in peaks)
        row["step_ok"] = abs(1 / row["ratio refit"] - 1) <= STEP_TOLERANCE
        row["memory_ok"] = all(abs(1 / r - 1) <= MEMORY_TOLERANCE for r in peaks)
        rows.append(row)
    return rows, json.loads(multi.read_text())["source"]["refit"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--refit", default="single,tp2",
                        help="plans the refit is fitted on (default single,tp2)")
    parser.add_argument("--predict", default="dp2z3,pp2,dp2z0,single_full,tp2sp,dp2z1",
                        help="held-out plans (default: all others)")
    parser.add_argument("--quiet-cores", type=float, default=None,
                        help="before each validate, wait until the machine keeps at most this "
                             "many cores busy (default: do not wait)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    refit, predict = args.refit.split(","), args.predict.split(",")
    unknown = sorted(set(refit + predict) - set(PLANS))
    if unknown or set(refit) & set(predict):
        parser.error(f"plans must be distinct names of {sorted(PLANS)}; got {unknown or refit}")
    rows, notes = [], []
    with tempfile.TemporaryDirectory(prefix="validate-refit-") as tmp:
        files = write_plans(Path(tmp))
        for index in range(args.rounds):
            folder = Path(tmp) / f"round{index}"
            folder.mkdir()
            got, note = one_round(files, folder, refit=refit, predict=predict,
                                  steps=args.steps, quiet_cores=args.quiet_cores)
            rows += [{"round": index, **row} for row in got]
            notes.append(note)
    table = pd.DataFrame(rows)
    pd.set_option("display.width", 250)
    print(table.to_string(index=False, float_format="{:.4g}".format))
    held = table[(table.role == "held out") & ~table.loaded]
    summary = (f"held-out runs (not loaded: {len(held)} of {int((table.role == 'held out').sum())})"
               f" within {STEP_TOLERANCE:.0%} (step) and {MEMORY_TOLERANCE:.0%} (every rank's "
               f"peak): {int((held.step_ok & held.memory_ok).sum())}; step only: "
               f"{int(held.step_ok.sum())}; by plan: "
               + ", ".join(f"{p} {int(g.step_ok.sum())}/{len(g)}"
                           for p, g in held.groupby("plan", sort=False)))
    print(summary)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"validate-refit-cpu-{dt.date.today().isoformat()}"
    (args.out / f"{stem}.md").write_text(
        "# validate --refit on CPU (gloo, fp32, tiny): refit plans vs held-out plans\n\n"
        f"{args.steps} steps per run (median of the last {args.steps - 1}); ratios are "
        "measured / predicted.\n\n" + table.to_markdown(index=False, floatfmt=".4g")
        + f"\n\n{summary}\n\nRefits:\n\n" + "\n".join(f"- {n}" for n in notes) + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps(
        {"steps": args.steps, "refit": refit, "predict": predict, "refits": notes,
         "rows": table.to_dict(orient="records")}, indent=2, default=str))


if __name__ == "__main__":
    main()
