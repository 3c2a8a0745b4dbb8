"""``meshplan estimate``: memory per GPU and time per step of one plan (also when it does not
fit: the report says why)."""

from __future__ import annotations

import argparse

from meshplan.cli.args import add_config_arguments, add_target_arguments, config_kwargs_from_args
from meshplan.cli.errors import EXIT_OK
from meshplan.cli.inputs import fill_config_defaults, load_inputs
from meshplan.cli.output import print_json
from meshplan.costmodel.estimate import estimate, estimate_to_dict
from meshplan.planner import report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_arguments(parser)
    add_config_arguments(parser)
    parser.add_argument("--json", action="store_true",
                        help="print the estimate JSON (schema_version 1) and nothing else")


def run(args: argparse.Namespace) -> int:
    model, cluster, calibration = load_inputs(args)
    config = fill_config_defaults(config_kwargs_from_args(args), model=model, cluster=cluster)
    est = estimate(model, cluster, config, framework=args.framework, calibration=calibration)
    if args.json:
        print_json(estimate_to_dict(est))
    else:
        print(report.estimate_report(est))
    return EXIT_OK  # also when it does not fit: the report says why
