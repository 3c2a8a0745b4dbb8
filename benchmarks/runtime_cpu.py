"""Runtime on this CPU machine: measured against predicted per-rank peak memory and step time.

Runs a set of small plans of the ``tiny`` model on the ``cpu`` cluster (gloo, fp32) through
``meshplan run`` and compares each rank's measured peak (live tensor bytes) with the cost
model's prediction for its stage (framework ``meshplan``), and the median step time with the
predicted step. The first two steps run under the live-tensor tracker, which counts the peak;
the median is of the steps after them, which run without its dispatch overhead
(``RunOptions.memory_steps``). Plans of more processes than this machine has cores share them:
their step ratio is against the prediction times the processes per core (``timeshare``,
``RunReport.timeshared_step_s``).
Writes ``runtime-cpu-tiny-<date>.{md,json,png}`` under ``benchmarks/results/``.

    python benchmarks/runtime_cpu.py [--steps 12] [--calibration FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from meshplan.costmodel import ParallelConfig, estimate, load_calibration, load_cluster, load_model  # noqa: E402
from meshplan.planner.plan import Plan, write_plan  # noqa: E402
from common import print_table, save_png  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

PLANS = {  # name: (ranks, ParallelConfig fields beyond the common ones)
    "single": (1, dict()),
    "dp2 zero0": (2, dict(dp=2, zero_stage=0)),
    "dp2 zero1": (2, dict(dp=2, zero_stage=1)),
    "dp2 zero2": (2, dict(dp=2, zero_stage=2)),
    "dp2 zero3": (2, dict(dp=2, zero_stage=3)),
    "dp2 zero3 full": (2, dict(dp=2, zero_stage=3, recompute="full")),
    "tp2": (2, dict(tp=2)),
    "tp2 sp selective": (2, dict(tp=2, sp=True, recompute="selective")),
    "pp2 1f1b": (2, dict(pp=2)),
    "pp2 interleaved": (2, dict(pp=2, vpp=2)),
    "pp2 interleaved m8": (2, dict(pp=2, vpp=2, global_batch_size=16)),
    "tp2 dp2 zero3": (4, dict(tp=2, dp=2, zero_stage=3)),
    "pp2 dp2 zero3": (4, dict(pp=2, dp=2, zero_stage=3)),
    "pp2 dp2 tp2 zero3": (8, dict(pp=2, dp=2, tp=2, zero_stage=3)),
    "pp2 dp2 zero3 interleaved": (4, dict(pp=2, dp=2, zero_stage=3, vpp=2,
                                          global_batch_size=16)),
    # 16 blocks (``LAYERS``): every rank's forwards before its first backward, then a steady
    # phase
    "pp4 zero3 16l": (4, dict(pp=4, zero_stage=3, layers=16)),
    "pp4 zero3 interleaved 16l": (4, dict(pp=4, zero_stage=3, vpp=2, layers=16)),
    "pp4 zero3 interleaved m8 16l": (4, dict(pp=4, zero_stage=3, vpp=2, layers=16,
                                             global_batch_size=16)),
    # Qwen3's query and key norms: kept tensors (none), rebuilt (selective, their weights on
    # each rank's heads under TP), under FSDP2 in a pipeline
    "qk-norm single": (1, dict(qk_norm=True)),
    "qk-norm tp2 sp selective": (2, dict(qk_norm=True, tp=2, sp=True, recompute="selective")),
    "qk-norm pp2 dp2 zero3": (4, dict(qk_norm=True, pp=2, dp=2, zero_stage=3)),
}
"""Plans by name; ``layers`` (not a ParallelConfig field) gives the tiny model more blocks,
``qk_norm`` (not one either) Qwen3's query and key norms."""
COMMON = dict(global_batch_size=8, micro_batch_size=2, seq_len=64, dtype="fp32")


def make_plan(ranks: int, fields: dict, calibration_path: str | None) -> Plan:
    fields = dict(fields)
    model = load_model("tiny")
    if "layers" in fields:
        layers = fields.pop("layers")
        model = dataclasses.replace(model, num_layers=layers, name=f"tiny-{layers}l")
    if fields.pop("qk_norm", False):
        model = dataclasses.replace(model, qk_norm=True, name=f"{model.name}-qk-norm")
    cluster = load_cluster("cpu", nodes=1, gpus_per_node=ranks)
    config = ParallelConfig(**{**COMMON, **fields})
    est = estimate(model, cluster, config, framework="meshplan",
                   calibration=load_calibration(calibration_path))
    return Plan.from_estimate(est, provenance={"calibration": calibration_path or "built-in",
                                               "source": "benchmarks/runtime_cpu.py"})


def run(plan: Plan, steps: int, folder: Path) -> dict:
    plan_file, report_file = folder / "plan.json", folder / "report.json"
    write_plan(plan, plan_file)
    subprocess.run([sys.executable, "-m", "meshplan", "run", str(plan_file), "--steps",
                    str(steps), "--report", str(report_file), "--oversubscribe"],
                   check=True, timeout=600,
                   stdout=subprocess.DEVNULL)
    return json.loads(report_file.read_text())


def rows(steps: int, calibration_path: str | None) -> list[dict]:
    out = []
    for name, (ranks, fields) in PLANS.items():
        plan = make_plan(ranks, fields, calibration_path)
        with tempfile.TemporaryDirectory() as tmp:
            report = run(plan, steps, Path(tmp))
        for rank in report["per_rank"]:
            out.append({"plan": name, "rank": rank["rank"], "stage": rank["stage"],
                        "measured_peak_bytes": rank["peak_bytes"],
                        "predicted_peak_bytes": rank["predicted_peak_bytes"],
                        "peak_ratio": rank["peak_bytes"] / rank["predicted_peak_bytes"],
                        "measured_step_s": report["step_s_median"],
                        "predicted_step_s": report["predicted"]["step_s"],
                        "timeshare": report["timeshare"],
                        "step_ratio": report["ratio"]["timeshared_step_s"]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12,
                        help="steps per plan (default 12: two counted by the memory tracker, "
                             "the median of the last ten)")
    parser.add_argument("--calibration", help="calibration JSON (default: built-in)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    table = pd.DataFrame(rows(args.steps, args.calibration))
    print_table(table, {"peak_ratio": "{:.3f}", "step_ratio": "{:.2f}",
                        "measured_step_s": "{:.4f}", "predicted_step_s": "{:.4f}"})
    within = table.groupby("plan").peak_ratio.apply(lambda r: (abs(r - 1) <= 0.10).all())
    print(f"\nplans whose every rank is within 10% of the predicted peak: "
          f"{int(within.sum())} of {len(within)} ({', '.join(within[within].index)})")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"runtime-cpu-tiny-{dt.date.today().isoformat()}"
    (args.out / f"{stem}.md").write_text(
        "# Runtime on CPU (gloo, fp32, tiny): measured vs predicted\n\n"
        + table.to_markdown(index=False, floatfmt=".4g") + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps(table.to_dict(orient="records"),
                                                      indent=2))
    fig, ax = plt.subplots(figsize=(6, 5))
    ax.scatter(table.predicted_peak_bytes / 1e6, table.measured_peak_bytes / 1e6)
    low = min(table.predicted_peak_bytes.min(), table.measured_peak_bytes.min()) / 1e6 * 0.8
    high = max(table.predicted_peak_bytes.max(), table.measured_peak_bytes.max()) / 1e6 * 1.2
    ax.plot([low, high], [low, high], "k-", lw=1, label="identity")
    ax.fill_between([low, high], [low * 0.9, high * 0.9], [low * 1.1, high * 1.1],
                    color="grey", alpha=0.2, label="±10%")
    ax.set(xlabel="predicted peak per rank (MB)", ylabel="measured peak per rank (MB)",
           title="meshplan runtime on CPU: per-rank peak memory")
    ax.legend()
    save_png(fig, args.out / f"{stem}.png")


if __name__ == "__main__":
    main()
