"""``meshplan export``: a plan as a DeepSpeed config, Megatron-LM arguments or torchtitan TOML.

The target's approximations are warnings: on stderr, or in the ``--json`` document."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tomllib
import warnings
from typing import Any

from meshplan.cli.errors import EXIT_OK, PROG
from meshplan.cli.output import print_json, refuse_overwrite, write_text
from meshplan.planner import export as export_formats
from meshplan.planner.plan import read_plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan_file", metavar="plan.json", help="a plan file (meshplan plan -o)")
    parser.add_argument("--to", dest="target", required=True, choices=export_formats.TARGETS,
                        help="DeepSpeed config JSON, Megatron-LM arguments or torchtitan TOML")
    parser.add_argument("-o", "--output", metavar="FILE",
                        help="write the export to FILE instead of stdout")
    parser.add_argument("--force", action="store_true", help="let -o overwrite an existing FILE")
    parser.add_argument("--json", action="store_true",
                        help='print {"target", "config", "text", "warnings"} as JSON')


def run(args: argparse.Namespace) -> int:
    plan = read_plan(args.plan_file)
    refuse_overwrite("-o", args.output, force=args.force)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", export_formats.ExportWarning)
        text = export_formats.render(plan, args.target)
    notes = [str(w.message) for w in caught
             if issubclass(w.category, export_formats.ExportWarning)]
    if args.output:
        write_text("-o", args.output, text)
    if args.json:
        print_json({"target": args.target, "config": _export_object(text, args.target),
                    "text": text, "warnings": notes})
        return EXIT_OK
    for note in notes:
        print(f"{PROG}: warning: {note}", file=sys.stderr)
    if not args.output:
        print(text, end="")
    return EXIT_OK


def _export_object(text: str, target: str) -> Any:
    """The export as JSON data: the DeepSpeed dict, the Megatron argument list, the TOML tables."""
    if target == "deepspeed":
        return json.loads(text)
    if target == "megatron":
        return shlex.split(text)
    return tomllib.loads(text)
