"""How long do the light commands take to start? ``python -c pass`` against ``meshplan --help``,
``meshplan models`` and ``meshplan clusters``, each in a fresh interpreter.

Each command runs ``--runs`` times (default 7) as ``python -m meshplan ...`` (what the console
script runs, less its two-line wrapper); the table gives the median and the fastest wall time,
the median less the bare interpreter's, and which of torch, networkx and pandas the command
imported (DESIGN.md: none). Writes ``cli-startup-<device>-<date>.{md,json}`` under
``benchmarks/results/``.

    python benchmarks/cli_startup.py [--runs 7]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
HEAVY = ("torch", "networkx", "pandas")
COMMANDS = {"python -c pass": ["-c", "pass"], "meshplan --help": ["-m", "meshplan", "--help"],
            "meshplan models": ["-m", "meshplan", "models"],
            "meshplan clusters": ["-m", "meshplan", "clusters"]}
"""Label and interpreter arguments of each measured command."""
PROBE = ("import atexit, json, runpy, sys\n"
         f"atexit.register(lambda: print('HEAVY=' + json.dumps([m for m in {HEAVY!r} "
         "if m in sys.modules]), file=sys.stderr))\n"
         "sys.argv = ['meshplan', *sys.argv[1:]]\n"
         "runpy.run_module('meshplan', run_name='__main__')\n")
"""Runs ``meshplan ARGV`` and reports on stderr which heavy modules were imported at exit."""


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE")}


def wall_times_s(argv: list[str], *, runs: int) -> list[float]:
    """Wall seconds of ``runs`` fresh ``python ARGV`` processes (output discarded)."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, *argv], check=True, env=_env(),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
        times.append(time.perf_counter() - start)
    return times


def heavy_imports(argv: list[str]) -> list[str] | None:
    """Which of ``HEAVY`` a ``meshplan`` command imported; None for a non-meshplan command."""
    if argv[:2] != ["-m", "meshplan"]:
        return None
    done = subprocess.run([sys.executable, "-c", PROBE, *argv[2:]], capture_output=True,
                          text=True, check=True, env=_env(), timeout=120)
    line = [x for x in done.stderr.splitlines() if x.startswith("HEAVY=")][-1]
    return json.loads(line.removeprefix("HEAVY="))


def measure(*, runs: int) -> list[dict]:
    rows = []
    for label, argv in COMMANDS.items():
        times = wall_times_s(argv, runs=runs)
        rows.append({"command": label, "median_s": statistics.median(times),
                     "min_s": min(times), "runs": runs, "heavy_imports": heavy_imports(argv)})
    bare_s = rows[0]["median_s"]
    for row in rows:
        row["over_python_s"] = row["median_s"] - bare_s
    return rows


def markdown(rows: list[dict], *, when: str) -> list[str]:
    lines = [f"# CLI start-up on this CPU ({when})", "",
             f"Fresh interpreter per run, {rows[0]['runs']} runs each, {sys.executable} "
             f"(Python {sys.version.split()[0]}), {os.cpu_count()} cores (shared).", "",
             "| command | median ms | fastest ms | median over `python -c pass` ms | "
             "imports torch / networkx / pandas |", "|---|---|---|---|---|"]
    for r in rows:
        heavy = "-" if r["heavy_imports"] is None else (", ".join(r["heavy_imports"]) or "none")
        lines.append(f"| `{r['command']}` | {r['median_s'] * 1e3:.0f} | {r['min_s'] * 1e3:.0f} "
                     f"| {r['over_python_s'] * 1e3:.0f} | {heavy} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="runs per command (default 7)")
    args = parser.parse_args()
    rows = measure(runs=args.runs)
    when = dt.date.today().isoformat()
    lines = markdown(rows, when=when)
    print("\n".join(lines))
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"cli-startup-cpu-{when}"
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps({"date": when, "rows": rows}, indent=2)
                                         + "\n")
    print(f"wrote {stem}.md and .json")


if __name__ == "__main__":
    main()
