"""Is ``meshplan profile`` repeatable? Run it several times and compare the fitted values.

Each run is a fresh ``python -m meshplan profile`` (as a user runs it); the fitted values
come from its ``--measurements`` file. The table lists every fitted value of every run and the
spread (largest / smallest run); the acceptance is a spread of at most 1.2 (20 %) and a wall
time under 3 minutes per full run. Writes ``profile-repeat-<device>-<date>.{md,json}`` under
``benchmarks/results/``.

    python benchmarks/profile_repeat.py [--runs 2] [--quick] [--nproc-per-node 2]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1.2
"""Acceptance: largest / smallest run of each fitted value."""
WALL_LIMIT_S = 180.0
"""Acceptance: one full profile finishes within this."""


def fitted_values(fit: dict) -> dict[str, float]:
    """The fitted values of one ``--measurements`` file's ``fit``, with units in the names."""
    values = {"matmul_flop_per_s": fit["matmul_flop_per_s"],
              "matmul_overhead_s": fit["matmul_overhead_s"],
              "memory_bytes_per_s": fit["memory_bytes_per_s"]}
    for kind, link in sorted(fit["links"].items()):
        values[f"{kind}_latency_s (alpha)"] = link["latency_s"]
        values[f"{kind}_bytes_per_s (1/beta)"] = link["bytes_per_s"]
    values.update({f"{way}_bytes_per_s": rate
                   for way, rate in sorted(fit["host_copy_bytes_per_s"].items())})
    return values


def profile_once(*, quick: bool, nproc: int, workdir: Path, index: int,
                 timeout_s: float) -> dict:
    """One ``meshplan profile`` in a fresh interpreter: wall time and its measurements file."""
    out, raw = workdir / f"cal-{index}.json", workdir / f"raw-{index}.json"
    argv = [sys.executable, "-m", "meshplan", "profile", "--out", str(out),
            "--measurements", str(raw), "--nproc-per-node", str(nproc)]
    start = time.perf_counter()
    subprocess.run(argv + (["--quick"] if quick else []), cwd=ROOT, check=True,
                   timeout=timeout_s)
    wall_s = time.perf_counter() - start
    return {"wall_s": wall_s, **json.loads(raw.read_text())}


def table(runs: list[dict]) -> tuple[list[str], list[dict]]:
    """Markdown lines and JSON rows: each fitted value per run, and max / min over runs."""
    names = list(fitted_values(runs[0]["fit"]))
    header = ("| fitted value | " + " | ".join(f"run {i + 1}" for i in range(len(runs)))
              + " | max / min | within 20 % |")
    lines = [header, "|---" * (len(runs) + 3) + "|"]
    rows = []
    for name in names:
        values = [fitted_values(run["fit"])[name] for run in runs]
        spread = max(values) / min(values) if min(values) > 0 else float("inf")
        rows.append({"value": name, "runs": values, "max_over_min": spread,
                     "ok": spread <= TOLERANCE})
        lines.append(f"| {name} | " + " | ".join(f"{v:.4g}" for v in values)
                     + f" | {spread:.3f} | {'yes' if spread <= TOLERANCE else 'NO'} |")
    walls = [run["wall_s"] for run in runs]
    lines.append("| wall time of the command (s) | " + " | ".join(f"{w:.1f}" for w in walls)
                 + f" | {max(walls) / min(walls):.3f} | "
                 f"{'yes' if max(walls) < WALL_LIMIT_S else 'NO'} (< {WALL_LIMIT_S:.0f} s) |")
    return lines, rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="profile-repeat-") as tmp:
        runs = [profile_once(quick=args.quick, nproc=args.nproc_per_node, workdir=Path(tmp),
                             index=i, timeout_s=args.timeout) for i in range(args.runs)]
    lines, rows = table(runs)
    device = runs[0]["measurements"]["device_key"]
    mode = "quick" if args.quick else "full"
    title = (f"# meshplan profile ({mode}) run {args.runs} times on {device}: fitted values\n\n"
             f"{runs[0]['note']}; topology: {runs[0]['measurements']['topology']}\n\n")
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"profile-repeat{'-quick' if args.quick else ''}-{device}-{dt.date.today().isoformat()}"
    (args.out / f"{stem}.md").write_text(title + "\n".join(lines) + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps(
        {"mode": mode, "rows": rows, "wall_s": [r["wall_s"] for r in runs],
         "runs": runs}, indent=2))
    print(f"wrote {args.out / stem}.md and .json", file=sys.stderr)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
