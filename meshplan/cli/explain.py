"""``meshplan explain``: why a plan: what binds, the runners-up, what-ifs; with
``--node-mtbf-hours``, what node failures cost and the best checkpoint interval."""

from __future__ import annotations

import argparse

from meshplan.cli.args import nonnegative_float, positive_float, positive_int
from meshplan.cli.errors import EXIT_OK, UsageError
from meshplan.cli.inputs import load_calibration_flag
from meshplan.cli.output import print_json
from meshplan.planner.elasticity import (DEFAULT_REPLAN_S, DEFAULT_RESTART_S,
                                         DEFAULT_STORAGE_BYTES_PER_S, FailureModel)
from meshplan.planner.plan import read_plan

SECONDS_PER_HOUR = 3600.0
BYTES_PER_GB = 1e9
"""GB in the bandwidth flags is 10^9 bytes."""
_FAILURE_FLAGS = {"restart_s": "--restart-s", "replan_s": "--replan-s",
                  "checkpoint_read_gb_per_s": "--checkpoint-read-gb-per-s",
                  "checkpoint_write_gb_per_s": "--checkpoint-write-gb-per-s",
                  "checkpoint_every": "--checkpoint-every"}
"""The flags that refine ``--node-mtbf-hours`` (dest: flag)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan_file", metavar="plan.json", help="a plan file (meshplan plan -o)")
    parser.add_argument("--calibration", metavar="FILE",
                        help="calibration JSON (default: the built-in one)")
    parser.add_argument("--time-limit", type=positive_float, default=30.0, metavar="S",
                        help="time limit of each search behind the explanation (default 30)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    group = parser.add_argument_group(
        "elasticity (what node failures cost; the other flags need --node-mtbf-hours)")
    group.add_argument("--node-mtbf-hours", type=positive_float, metavar="H",
                       help="mean time between failures of one node, hours; adds the section")
    group.add_argument("--restart-s", type=nonnegative_float, metavar="S",
                       help="failure detection, restart, rendezvous and worker start per "
                            f"failure (default {DEFAULT_RESTART_S:g})")
    group.add_argument("--replan-s", type=nonnegative_float, metavar="S",
                       help=f"the planner's time per failure (default {DEFAULT_REPLAN_S:g})")
    for way in ("read", "write"):
        group.add_argument(f"--checkpoint-{way}-gb-per-s", type=positive_float, metavar="GB",
                           help=f"checkpoint storage {way} bandwidth of one node, GB/s "
                                f"(default {DEFAULT_STORAGE_BYTES_PER_S / BYTES_PER_GB:g})")
    group.add_argument("--checkpoint-every", type=positive_int, metavar="N",
                       help="also show the time lost when saving every N steps")


def failure_model(args: argparse.Namespace) -> FailureModel | None:
    """The failure model the flags ask for; None without ``--node-mtbf-hours``."""
    given = [flag for dest, flag in _FAILURE_FLAGS.items() if getattr(args, dest) is not None]
    if args.node_mtbf_hours is None:
        if given:
            raise UsageError(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} "
                             "--node-mtbf-hours H (the elasticity section they refine)")
        return None
    chosen = {"restart_s": args.restart_s, "replan_s": args.replan_s,
              "checkpoint_every": args.checkpoint_every}
    for way in ("read", "write"):
        rate = getattr(args, f"checkpoint_{way}_gb_per_s")
        chosen[f"{way}_bytes_per_s"] = None if rate is None else rate * BYTES_PER_GB
    return FailureModel(node_mtbf_s=args.node_mtbf_hours * SECONDS_PER_HOUR,
                        **{k: v for k, v in chosen.items() if v is not None})


def run(args: argparse.Namespace) -> int:
    from meshplan.planner import explain  # the search behind it imports the solver (ortools)

    failures = failure_model(args)
    plan = read_plan(args.plan_file)
    calibration = load_calibration_flag(args.calibration)
    explanation = explain.explain(plan, calibration=calibration, time_limit_s=args.time_limit,
                                  failures=failures)
    if args.json:
        print_json(explanation.to_dict())
    else:
        print(explain.render(explanation))
    return EXIT_OK
