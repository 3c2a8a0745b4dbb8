"""Replan time of an elastic job after it loses a node: the catalog's MT-NLG 530B scenario.

Plans 530B on 280 DGX A100-80GB nodes (batch 1920, Megatron) with ``--elastic 279:280`` (the
table of replans searched ahead of the run), then times what rank 0 of a restarted attempt does
on 279 nodes: the table lookup (``runtime.elastic._decide`` path: ``from_table``), and, for
comparison, a live replan (``planner.replan.replan``) under wall-clock limits of 1 and 30 s.

    python benchmarks/elastic_replan.py [--plan FILE]   # FILE: reuse a plan made with --elastic
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from meshplan.planner.plan import read_plan
from meshplan.planner.replan import from_table, replan

SCENARIO = ["--model", "mt-nlg-530b", "--cluster", "dgx-a100-80gb", "--nodes", "280",
            "--global-batch", "1920", "--framework", "megatron", "--deterministic"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", help="a plan file made with --elastic 279:280")
    args = parser.parse_args()
    path = args.plan
    if path is None:
        path = str(Path(tempfile.mkdtemp()) / "530b.json")
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "meshplan", "plan", *SCENARIO, "--elastic",
                        "279:280", "-o", path], check=True, stdout=subprocess.DEVNULL)
        print(f"plan + table for 279..280 nodes: {time.perf_counter() - started:.1f} s")
    plan = read_plan(path)
    started = time.perf_counter()
    looked_up = from_table(plan, nodes=279, gpus_per_node=8)
    lookup_s = time.perf_counter() - started
    assert looked_up is not None, "the plan has no table entry for 279 nodes"
    print(f"280 nodes: {plan.step_s:.2f} s/step ({_layout(plan)})")
    print(f"279 nodes, table lookup: {lookup_s * 1e3:.1f} ms -> {looked_up.step_s:.2f} s/step "
          f"({_layout(looked_up)})")
    for limit in (1.0, 30.0):
        done = replan(plan, nodes=279, time_limit_s=limit)
        print(f"279 nodes, live replan (--replan-time-limit {limit:g}): {done.wall_s:.2f} s, "
              f"{done.status} -> {done.plan.step_s:.2f} s/step ({_layout(done.plan)})")
    return 0


def _layout(plan) -> str:
    c = plan.config
    return f"tp {c.tp} pp {c.pp} dp {c.dp} cp {c.cp} mb {c.micro_batch_size} vpp {c.vpp}"


if __name__ == "__main__":
    raise SystemExit(main())
