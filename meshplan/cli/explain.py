"""``meshplan explain``: why a plan: what binds, the runners-up, what-ifs."""

from __future__ import annotations

import argparse

from meshplan.cli.args import positive_float
from meshplan.cli.errors import EXIT_OK
from meshplan.cli.inputs import load_calibration_flag
from meshplan.cli.output import print_json
from meshplan.planner.plan import read_plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan_file", metavar="plan.json", help="a plan file (meshplan plan -o)")
    parser.add_argument("--calibration", metavar="FILE",
                        help="calibration JSON (default: the built-in one)")
    parser.add_argument("--time-limit", type=positive_float, default=30.0, metavar="S",
                        help="time limit of each search behind the explanation (default 30)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    from meshplan.planner import explain  # the search behind it imports the solver (ortools)

    plan = read_plan(args.plan_file)
    calibration = load_calibration_flag(args.calibration)
    explanation = explain.explain(plan, calibration=calibration, time_limit_s=args.time_limit)
    if args.json:
        print_json(explanation.to_dict())
    else:
        print(explain.render(explanation))
    return EXIT_OK
