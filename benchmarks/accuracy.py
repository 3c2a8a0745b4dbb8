"""Accuracy of predicted step time against published training runs.

For every run in ``costmodel/data/reference_runs.json`` (the golden published configurations,
the other runs the calibration was fitted on, and held-out runs it never saw), print the
predicted and published step time and the error, then per group the mean absolute error, the
maximum absolute error and the bias (mean signed error): golden, fit, held-out, every source
family (fit and held-out runs; held-out runs alone), and the data-parallel-heavy runs
(ZeRO-3 / FSDP without model parallelism: DeepSpeed ZeRO-3 at scale, MosaicML's FSDP runs).
Writes ``accuracy-<hardware>-<date>.{md,json,png}`` under ``benchmarks/results/``.

    python benchmarks/accuracy.py [--calibration FILE] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from meshplan.costmodel import load_calibration  # noqa: E402
from meshplan.costmodel.reference import predict, reference_runs  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def accuracy_table(calibration_path: str | None = None) -> pd.DataFrame:
    """One row per published run: configuration, predicted and published step seconds."""
    calibration = load_calibration(calibration_path)
    rows = []
    for run in reference_runs():
        est = predict(run, calibration)
        c = est.config
        group = "golden" if run.golden else ("fit" if run.set == "fit" else "holdout")
        rows.append({
            "run": run.id, "group": group, "family": run.family, "dp_heavy": run.dp_heavy,
            "model": run.model.name,
            "gpu": run.cluster.gpu.key, "gpus": run.cluster.num_gpus,
            "framework": run.framework,
            "plan": (f"tp{c.tp} pp{c.pp} dp{c.dp} cp{c.cp} mb{c.micro_batch_size} v{c.vpp} "
                     f"{'sp ' if c.sp else ''}{c.stage_recompute(0)}"),
            "predicted_s": est.time.step_s, "published_s": run.measured_step_s,
            "error": est.time.step_s / run.measured_step_s - 1,
            "predicted_mfu": est.throughput.mfu,
        })
    return pd.DataFrame(rows)


def groups(table: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """The groups the benchmark reports, by name: golden, fit, held-out, each family (all its
    runs, then its held-out runs), the data-parallel-heavy runs, all."""
    out = {"golden": table[table.group == "golden"],
           "fit (all)": table[table.group != "holdout"],
           "holdout": table[table.group == "holdout"]}
    for family in sorted(set(table.family)):
        part = table[table.family == family]
        out[f"family {family}"] = part
        out[f"family {family} (holdout)"] = part[part.group == "holdout"]
    out["dp-heavy (ZeRO-3/FSDP, no TP/PP)"] = table[table.dp_heavy]
    out["all"] = table
    return out


def summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per group: runs, mean and maximum absolute error, bias (mean signed error)."""
    return pd.DataFrame([{"group": name, "runs": len(part),
                          "mean_abs_error": part.error.abs().mean(),
                          "max_abs_error": part.error.abs().max(),
                          "bias": part.error.mean()}
                         for name, part in groups(table).items() if len(part)])


def plot(table: pd.DataFrame, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 6))
    for group, marker in (("golden", "o"), ("fit", "s"), ("holdout", "^")):
        part = table[table.group == group]
        ax.scatter(part.published_s, part.predicted_s, marker=marker, label=group)
    low, high = table.published_s.min() * 0.7, table.published_s.max() * 1.4
    ax.plot([low, high], [low, high], "k-", lw=1, label="identity")
    ax.fill_between([low, high], [low * 0.8, high * 0.8], [low * 1.2, high * 1.2],
                    color="grey", alpha=0.15, label="±20%")
    ax.set(xscale="log", yscale="log", xlabel="published step time (s)",
           ylabel="predicted step time (s)",
           title="meshplan step-time prediction vs published runs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibration", help="calibration JSON (default: built-in)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="output folder")
    args = parser.parse_args()
    table = accuracy_table(args.calibration)
    stats = summary(table)
    pd.set_option("display.width", 200)
    print(table.to_string(index=False, formatters={"error": "{:+.1%}".format,
                                                   "predicted_mfu": "{:.1%}".format}))
    print()
    print(stats.to_string(index=False, formatters={"mean_abs_error": "{:.1%}".format,
                                                   "max_abs_error": "{:.1%}".format,
                                                   "bias": "{:+.1%}".format}))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"accuracy-a100-h100-{dt.date.today().isoformat()}"
    (args.out / f"{stem}.md").write_text(
        "# Step-time accuracy against published runs\n\n"
        + table.to_markdown(index=False, floatfmt=".3f") + "\n\n"
        + stats.to_markdown(index=False, floatfmt=".3f") + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps(
        {"runs": table.to_dict(orient="records"), "summary": stats.to_dict(orient="records")},
        indent=2))
    plot(table, args.out / f"{stem}.png")
    print(f"\nwrote {args.out / stem}.{{md,json,png}}")


if __name__ == "__main__":
    main()
