"""Accuracy of predicted peak memory against measured runs.

For every run in ``costmodel/data/memory_runs.json`` (torchtitan's published FSDP2 runs, the
runs torchtitan reports as fitting or out of memory on 80 GB A100s, torchtitan's own train step
on this CPU (``benchmarks/torchtitan_cpu_memory.py``) and meshplan's runtime on this CPU) print the measured and predicted peak and the error, then per framework the mean
and worst error and the fit checks that disagree. Acceptance (torchtitan, meshplan): within
10% of every measurement and never under-predicted by more than 5%.

    python benchmarks/memory_accuracy.py [--calibration FILE] [--markdown FILE]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from meshplan.costmodel import load_calibration
from meshplan.costmodel.memory_runs import compare, memory_runs
from common import print_table  # noqa: E402

GIB = 2**30


def _bytes_text(value: float) -> str:
    return f"{value / GIB:.4g} GiB" if value >= GIB else f"{value / 2**20:.4g} MiB"


def memory_table(calibration_path: str | None = None) -> pd.DataFrame:
    cal = load_calibration(calibration_path)
    rows = []
    for run in memory_runs():
        result = compare(run, cal)
        fits = run.measure == "fits"
        rows.append({"run": run.id, "framework": run.framework, "measure": run.measure,
                     "measured": str(run.measured) if fits else _bytes_text(run.measured),
                     "predicted": str(result.predicted) if fits
                     else _bytes_text(result.predicted),
                     "error": result.error if not fits else float("nan"),
                     "agrees": (result.predicted == run.measured) if fits
                     else -0.05 <= result.error <= 0.10})
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibration", help="calibration JSON (default: built-in)")
    parser.add_argument("--markdown", type=Path, help="also write the table as Markdown")
    args = parser.parse_args()
    table = memory_table(args.calibration)
    print_table(table, {"error": "{:+.3f}"})
    print()
    for framework, group in table.groupby("framework"):
        errors = group.error.dropna()
        mismatched = group[~group.agrees].run.tolist()
        summary = (f"mean |error| {errors.abs().mean():.3f}, max over {errors.max():+.3f}, "
                   f"max under {errors.min():+.3f}" if len(errors) else "no byte measurements")
        print(f"{framework}: {len(group)} runs; {summary}; outside acceptance or fit "
              f"disagreeing: {', '.join(mismatched) or 'none'}")
    if args.markdown:
        args.markdown.write_text(table.to_markdown(index=False, floatfmt="+.3f") + "\n")


if __name__ == "__main__":
    main()
