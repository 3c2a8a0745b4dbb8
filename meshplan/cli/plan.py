"""``meshplan plan``: search the fastest (or cheapest) plans that fit; every plan flag given
pins that choice. Exit 3 when no plan fits."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from meshplan.cli.args import (add_config_arguments, add_target_arguments,
                               config_kwargs_from_args, node_range, nonnegative_float,
                               positive_float, positive_int)
from meshplan.cli.errors import EXIT_NO_PLAN, EXIT_OK, PROG, one_line
from meshplan.cli.inputs import load_inputs
from meshplan.cli.output import print_json, refuse_overwrite
from meshplan.costmodel import schema
from meshplan.costmodel.config import default_dtype
from meshplan.costmodel.hardware import ClusterSpec
from meshplan.costmodel.model import ModelSpec
from meshplan.planner import report
from meshplan.planner.plan import write_plan
from meshplan.planner.space import SETTING_FIELDS, SearchSpace

DEFAULT_TIME_LIMIT_S = 10.0
DEFAULT_MEMORY_MARGIN = 0.05
"""Kept free by default: the cost model's reserved bytes already count the allocator's
fragmentation and the NCCL communicators it knows of; the CUDA context (about 0.5 GiB per
process with lazy module loading, outside PyTorch's allocator), the extra process groups a
framework creates and the estimate's own error (issue-level target: within 10%, never under by
more than 5%) are not, so 5% (4 GiB of an 80 GB GPU) is held back."""

_PINNABLE = ("tp", "pp", "dp", "cp", "ep", "zero_stage", "offload", "offload_device",
             "micro_batch_size", "vpp", "mesh_order", "sp")
"""Plan flags that pin one value of the search space as given."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_arguments(parser)
    add_config_arguments(parser)
    group = parser.add_argument_group("search")
    group.add_argument("--objective", choices=("time", "cost"), default="time",
                       help="fastest step (default) or cheapest run for --train-tokens")
    group.add_argument("--top", type=positive_int, default=5, metavar="K",
                       help="plans to report (default 5)")
    group.add_argument("--time-limit", type=positive_float, default=DEFAULT_TIME_LIMIT_S,
                       metavar="S",
                       help=f"search time limit in seconds (default {DEFAULT_TIME_LIMIT_S:g}); "
                            "a search cut short reports FEASIBLE and its proven gap")
    group.add_argument("--deterministic", action="store_true",
                       help="limit the search by work (CP-SAT deterministic time, node count) "
                            "instead of wall-clock time: the same answer on a busy machine")
    group.add_argument("--global-batch-tolerance", type=nonnegative_float, default=0.0,
                       metavar="F",
                       help="when no configuration divides --global-batch, plan the nearest "
                            "global batch within F of it (e.g. 0.01), best tokens/s")
    group.add_argument("--allow-fewer-gpus", action="store_true",
                       help="when no configuration divides the GPUs, plan on the nearest "
                            "smaller node count (leaving GPUs idle)")
    group.add_argument("--elastic", type=node_range, metavar="MIN:MAX",
                       help="also plan every node count from MIN to MAX and keep the table in "
                            "the plan file: an elastic run (run --nnodes MIN:MAX) then replans "
                            "by lookup when nodes leave or join")
    group.add_argument("--seed", type=int, default=0, help="solver seed (default 0)")
    group.add_argument("--workers", type=positive_int, default=1,
                       help="CP-SAT worker threads (default 1)")
    group.add_argument("--memory-margin", type=nonnegative_float,
                       default=DEFAULT_MEMORY_MARGIN, metavar="F",
                       help="fraction of GPU memory to keep free for the CUDA context, NCCL "
                            f"and estimate error (default {DEFAULT_MEMORY_MARGIN:g})")
    group.add_argument("--train-tokens", type=positive_float, metavar="T",
                       help="tokens to train on: report days (and cost) per plan")
    group.add_argument("--gpu-hour-price", type=positive_float, metavar="P",
                       help="price of one GPU-hour, for the cost objective and report")
    group.add_argument("--deadline-days", type=positive_float, metavar="D",
                       help="with --objective cost: finish within D days")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the best plan to FILE")
    parser.add_argument("--force", action="store_true", help="let -o overwrite FILE")
    parser.add_argument("--json", action="store_true",
                        help="print the search result JSON (schema_version 1: ranked plans, "
                             "solver status, Pareto front) and nothing else; write a plan "
                             "file for run/explain/export with -o")


def _stage_pins(pins: dict[str, Any], given: dict[str, Any], *, model: ModelSpec) -> None:
    """Pin ``pp`` from --layers-per-stage or a per-stage --recompute; ValueError when they and
    --pp disagree on the number of stages."""
    layers = given.get("layers_per_stage")
    if layers is not None:
        if sum(layers) != model.num_layers:
            raise ValueError(f"--layers-per-stage sums to {sum(layers)}, but {model.name} has "
                             f"{model.num_layers} layers")
        pins["layers_per_stage"] = tuple(layers)
    source = "--pp" if "pp" in pins else None
    for name, value in (("--layers-per-stage", layers), ("--recompute", pins.get(
            "recompute_pinned"))):
        if value is None:
            continue
        if source is not None and pins["pp"] != (len(value),):
            raise ValueError(f"{name} lists {len(value)} stages but {source} gives "
                             f"{pins['pp'][0]}")
        pins["pp"], source = (len(value),), source or name
    if "pp" in pins and "layers_per_stage" in pins and "recompute_pinned" in pins and \
            len(pins["layers_per_stage"]) != len(pins["recompute_pinned"]):
        raise ValueError("--layers-per-stage and --recompute list different stage counts")


def search_space_from_args(given: dict[str, Any], *, model: ModelSpec,
                           cluster: ClusterSpec, memory_margin: float) -> SearchSpace:
    """The search space with every plan flag the user gave pinned, and the run settings
    (``SETTING_FIELDS``: --selective-ac, --recompute-early-stop, --compile, --float8) given to
    every configuration."""
    pins: dict[str, Any] = {name: (given[name],) for name in _PINNABLE if name in given}
    recompute = given.get("recompute")
    if isinstance(recompute, str):
        pins["recompute_modes"] = (recompute,)
    elif recompute is not None:
        pins["recompute_pinned"] = tuple(recompute)
    _stage_pins(pins, given, model=model)
    if given.get("offload") == "optimizer+params" and given.get("zero_stage", 3) != 3:
        raise ValueError("--offload optimizer+params needs --zero 3 (parameters are only "
                         f"sharded under ZeRO-3), got --zero {given['zero_stage']}")
    dtype = given.get("dtype", default_dtype(cluster.gpu.key))
    return SearchSpace(global_batch_size=given["global_batch_size"],
                       seq_len=given.get("seq_len", model.seq_len), dtype=dtype,
                       flash_attention=given.get("flash_attention", True),
                       memory_margin=memory_margin, **pins,
                       **{name: given[name] for name in SETTING_FIELDS if name in given})


def run(args: argparse.Namespace) -> int:
    from meshplan.planner import planning
    from meshplan.planner.search import NoPlanFits, SearchTimeout

    model, cluster, calibration = load_inputs(args)
    refuse_overwrite("-o", args.output, force=args.force)
    if args.memory_margin >= 1:
        raise ValueError(f"--memory-margin must be below 1, got {args.memory_margin}")
    space = search_space_from_args(config_kwargs_from_args(args), model=model, cluster=cluster,
                                   memory_margin=args.memory_margin)
    budget = planning.Budget(train_tokens=args.train_tokens, gpu_hour_price=args.gpu_hour_price,
                             deadline_days=args.deadline_days)
    try:
        result = planning.plan(model, cluster, space, framework=args.framework,
                               calibration=calibration,
                               calibration_name=args.calibration or "built-in",
                               objective=args.objective, budget=budget, top_k=args.top,
                               time_limit_s=args.time_limit, seed=args.seed,
                               workers=args.workers, deterministic=args.deterministic,
                               batch_tolerance=args.global_batch_tolerance,
                               allow_fewer_gpus=args.allow_fewer_gpus)
    except NoPlanFits as err:
        print(f"{PROG}: {one_line(str(err))}", file=sys.stderr)
        return EXIT_NO_PLAN
    except SearchTimeout as err:
        raise ValueError(str(err)) from None
    if args.framework == "meshplan":
        from meshplan.runtime.support import model_refusal

        refusal = model_refusal(model)
        if refusal is not None:  # planned all the same: its memory layout is meshplan's
            print(f"{PROG}: warning: meshplan run will refuse this plan: {refusal}",
                  file=sys.stderr)
    if args.elastic:
        from meshplan.planner.replan import with_table

        low, high = args.elastic[0], args.elastic[1] or args.elastic[0]
        best, missing = with_table(result.plans[0], range(low, high + 1),
                                   time_limit_s=args.time_limit)
        result = dataclasses.replace(result, plans=(best, *result.plans[1:]))
        for nodes, why in missing.items():
            print(f"{PROG}: warning: --elastic: no plan for {nodes} nodes: {one_line(why)}",
                  file=sys.stderr)
    if args.output:
        try:
            write_plan(result.plans[0], args.output)
        except OSError as err:
            raise ValueError(f"-o {args.output!r}: cannot write: {err.strerror or err}") from None
    if args.json:
        print_json({"schema_version": schema.PLAN_SEARCH,
                    "plans": [p.to_dict() for p in result.plans],
                    "solver": {"status": result.status, "wall_s": result.wall_s,
                               "candidates": result.candidates, "gap": result.gap},
                    "pareto": list(result.pareto)})
    else:
        given = config_kwargs_from_args(args)
        source = ("--seq-len" if "seq_len" in given else
                  "the model's default: set --seq-len to plan another length")
        print(report.plans_report(result, model=model, cluster=cluster,
                                  objective=args.objective, memory_margin=args.memory_margin,
                                  seq_source=source))
        if args.output:
            print(f"wrote the best plan to {args.output}")
    return EXIT_OK
