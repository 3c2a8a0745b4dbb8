"""``meshplan models``: the model catalog, or one model (a traced module layer by layer)."""

from __future__ import annotations

import argparse

from meshplan.cli.args import add_json_argument, positive_int
from meshplan.cli.errors import EXIT_OK
from meshplan.cli.inputs import load_flagged
from meshplan.cli.output import print_json
from meshplan.costmodel.config import DTYPES
from meshplan.costmodel.models import is_traced_ref, load_model, model_catalog
from meshplan.planner import report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_json_argument(parser)
    parser.add_argument("--model", metavar="NAME|FILE|PKG.MOD:FN",
                        help="show one model; a traced module (package.module:callable) is "
                             "listed layer by layer")
    parser.add_argument("--seq-len", type=positive_int, metavar="S",
                        help="sequence length to trace a module at")
    parser.add_argument("--dtype", choices=DTYPES,
                        help="dtype to trace a module in (default bf16)")


def run(args: argparse.Namespace) -> int:
    if args.model:
        traced = is_traced_ref(args.model)
        model = load_flagged("--model", args.model, lambda: load_model(
            args.model, seq_len=args.seq_len if traced else None,
            dtype=args.dtype if traced else None))
        if args.json:
            print_json({**model.to_dict(), "num_params": model.num_params})
        else:
            print(report.layers_table(model) if model.is_traced
                  else report.models_table([model]))
        return EXIT_OK
    models = list(model_catalog().values())
    if args.json:
        print_json([{**m.to_dict(), "num_params": m.num_params} for m in models])
    else:
        print(report.models_table(models))
    return EXIT_OK
