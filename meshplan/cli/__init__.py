"""``meshplan``: the command line (DESIGN.md, "Command line (the contract)").

argparse lives here and nowhere else: each handler turns its ``Namespace`` into cost-model objects
(``ModelSpec``, ``ClusterSpec``, ``ParallelConfig``, ``Calibration``) and hands only those on.

Exit codes: 0 success (``estimate`` also when the plan does not fit), 2 user error (one line
``meshplan: error: <message>`` on stderr, never a traceback), 3 reserved for "no plan fits",
1 ``run`` failed in a worker (its traceback is above).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import tomllib
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from meshplan.costmodel import (FRAMEWORKS, Calibration, ClusterSpec, ModelSpec, ParallelConfig,
                       cluster_names, estimate, estimate_to_dict, load_calibration, load_cluster,
                       load_model, model_catalog)
from meshplan.costmodel.config import MESH_AXES, OFFLOAD_DEVICES, OFFLOAD_MODES, RECOMPUTE_MODES
from meshplan.costmodel import schema
from meshplan.costmodel.config import CPU_DEVICE_KEY, DTYPES, default_dtype
from meshplan.costmodel.refs import is_factory_ref
from meshplan.planner import report
from meshplan.planner import export as export_formats
from meshplan.planner import explain as explain_mod
from meshplan.planner import planning
from meshplan.planner.plan import read_plan, write_plan
from meshplan.planner.search import NoPlanFits, SearchTimeout
from meshplan.planner.space import SearchSpace

PROG = "meshplan"
EXIT_OK = 0
EXIT_USAGE = 2
"""User error: bad flag, unknown name, malformed file, degrees that do not fit together."""
EXIT_NO_PLAN = 3
"""``plan`` found no configuration that fits (DESIGN.md)."""


class UsageError(Exception):
    """A command-line mistake; ``main`` prints it as one line and exits with ``EXIT_USAGE``."""


class _Parser(argparse.ArgumentParser):
    """ArgumentParser that raises ``UsageError`` instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


# ----- flag value types (argparse turns ArgumentTypeError into "argument --x: <message>") -------

def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _split_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",")]


def _recompute(text: str) -> str | tuple[str, ...]:
    """One recompute mode, or a comma-separated list with one mode per pipeline stage."""
    modes = _split_list(text)
    bad = [m for m in modes if m not in RECOMPUTE_MODES]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown mode {bad[0]!r} in {text!r}; use one of {', '.join(RECOMPUTE_MODES)} "
            f"or a comma-separated list with one per stage (e.g. full,full,selective,none)")
    return modes[0] if len(modes) == 1 else tuple(modes)


def _layers_per_stage(text: str) -> tuple[int, ...]:
    try:
        return tuple(_positive_int(part) for part in _split_list(text))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be a comma-separated list of positive layer counts, got {text!r}") from None


def _mesh_order(text: str) -> tuple[str, ...]:
    axes = tuple(_split_list(text))
    if sorted(axes) != sorted(MESH_AXES):
        raise argparse.ArgumentTypeError(
            f"must list each of {','.join(MESH_AXES)} once, fastest-varying first; got {text!r}")
    return axes


# ----- shared flag groups ------------------------------------------------------------------------

def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """What to train on what: model, cluster, framework, calibration."""
    group = parser.add_argument_group("model and cluster")
    group.add_argument("--model", required=True, metavar="M",
                       help="catalog name (see 'meshplan models'), ModelSpec JSON or HF config.json")
    group.add_argument("--cluster", required=True, metavar="C",
                       help="catalog name (see 'meshplan clusters') or cluster JSON")
    group.add_argument("--nodes", type=_positive_int, metavar="N",
                       help="nodes of a catalog cluster (default 1, or the JSON's)")
    group.add_argument("--gpus-per-node", type=_positive_int, metavar="K",
                       help="override the cluster's GPUs per node")
    group.add_argument("--framework", choices=FRAMEWORKS, default="meshplan",
                       help="runtime whose memory layout to assume (default meshplan)")
    group.add_argument("--calibration", metavar="FILE",
                       help="calibration JSON (default: the built-in one)")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The plan flags; ``dest`` is the ParallelConfig field. Unset flags stay None."""
    group = parser.add_argument_group("plan (unset flags take defaults)")
    group.add_argument("--tp", type=_positive_int, metavar="T", help="tensor parallel (default 1)")
    group.add_argument("--pp", type=_positive_int, metavar="P",
                       help="pipeline stages (default 1)")
    group.add_argument("--dp", type=_positive_int, metavar="D",
                       help="data parallel (default: GPUs / (tp*pp*cp))")
    group.add_argument("--cp", type=_positive_int, metavar="C", help="context parallel (default 1)")
    group.add_argument("--ep", type=_positive_int, metavar="E",
                       help="expert parallel, MoE only (default 1)")
    group.add_argument("--sp", action="store_true", default=None,
                       help="sequence parallelism over the TP group")
    group.add_argument("--zero", dest="zero_stage", type=int, choices=(0, 1, 2, 3),
                       metavar="{0-3}", help="ZeRO stage (default 0)")
    group.add_argument("--offload", choices=OFFLOAD_MODES, help="offload (default none)")
    group.add_argument("--offload-device", choices=OFFLOAD_DEVICES,
                       help="where offloaded states live (default cpu)")
    group.add_argument("--recompute", type=_recompute, metavar="{none,selective,full}[,...]",
                       help="activation recomputation, or one mode per stage (default none)")
    group.add_argument("--micro-batch", dest="micro_batch_size", type=_positive_int,
                       metavar="B", help="sequences per micro-batch per replica (default 1)")
    group.add_argument("--global-batch", dest="global_batch_size", type=_positive_int,
                       metavar="G", required=True, help="sequences per optimizer step")
    group.add_argument("--seq-len", type=_positive_int, metavar="S",
                       help="sequence length (default: the model's)")
    group.add_argument("--vpp", type=_positive_int, metavar="V",
                       help="virtual stages per pipeline stage (interleaved 1F1B; default 1)")
    group.add_argument("--layers-per-stage", type=_layers_per_stage, metavar="L0,L1,...",
                       help="layers on each stage (default: even split)")
    group.add_argument("--mesh-order", type=_mesh_order, metavar="tp,cp,dp,pp",
                       help="rank layout, fastest-varying axis first (default tp,cp,dp,pp)")
    group.add_argument("--no-flash-attention", dest="flash_attention", action="store_const",
                       const=False, default=None,
                       help="count the s x s attention scores (eager attention)")
    group.add_argument("--dtype", choices=DTYPES,
                       help="compute dtype (default bf16; fp32 on the cpu cluster)")


_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(ParallelConfig))


def config_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The ParallelConfig fields the user set on the command line (unset flags are left out)."""
    return {name: getattr(args, name) for name in _CONFIG_FIELDS
            if getattr(args, name, None) is not None}


def default_dp(*, num_gpus: int, tp: int, pp: int, cp: int) -> int:
    """Data-parallel degree that uses every GPU: num_gpus / (tp * pp * cp)."""
    used = tp * pp * cp
    if num_gpus % used:
        raise ValueError(f"tp*pp*cp = {tp}*{pp}*{cp} = {used} does not divide the cluster's "
                         f"{num_gpus} GPUs, so --dp cannot fill it; pick degrees whose product "
                         f"divides {num_gpus}")
    return num_gpus // used


def fill_config_defaults(given: dict[str, Any], *, model: ModelSpec,
                         cluster: ClusterSpec) -> ParallelConfig:
    """A ParallelConfig from the flags in ``given`` plus the CLI's defaults.

    Defaults: degrees 1, ``dp`` the GPUs left over, ``seq_len`` the model's, dtype bf16 (fp32 on
    the CPU pseudo-device); the rest are ParallelConfig's own defaults. Raises ValueError.
    """
    values = dict(given)
    for axis in ("tp", "pp", "cp"):
        values.setdefault(axis, 1)
    if "dp" not in values:
        values["dp"] = default_dp(num_gpus=cluster.num_gpus, tp=values["tp"], pp=values["pp"],
                                  cp=values["cp"])
    values.setdefault("seq_len", model.seq_len)
    values.setdefault("dtype", default_dtype(cluster.gpu.key))
    return ParallelConfig(**values)


# ----- loading inputs ----------------------------------------------------------------------------

def load_inputs(args: argparse.Namespace) -> tuple[ModelSpec, ClusterSpec, Calibration]:
    """Model, cluster and calibration named by the flags; ValueError for anything unreadable.

    The loaders report bad content as ValueError already; an unreadable file (OSError) and a
    value of the wrong JSON type in a calibration or GPU entry (TypeError, which the loaders do
    not translate yet) are turned into ValueError here, naming the flag.
    """
    cluster = _load("--cluster", args.cluster,
                    lambda: load_cluster(args.cluster, nodes=args.nodes,
                                         gpus_per_node=args.gpus_per_node))
    # a user's module (package.module:callable) is traced at the sequence length and in the
    # dtype the plans will use
    seq_len = dtype = None
    if is_factory_ref(args.model):
        seq_len = getattr(args, "seq_len", None)
        dtype = getattr(args, "dtype", None) or default_dtype(cluster.gpu.key)
    model = _load("--model", args.model,
                  lambda: load_model(args.model, seq_len=seq_len, dtype=dtype))
    calibration = _load("--calibration", args.calibration,
                        lambda: load_calibration(args.calibration))
    return model, cluster, calibration


def _load(flag: str, ref: str | None, loader: Callable[[], Any]) -> Any:
    try:
        return loader()
    except OSError as err:
        raise ValueError(f"{flag} {ref!r}: cannot read {err.filename or ref!r}: "
                         f"{err.strerror or err}") from None
    except TypeError as err:  # wrong JSON value types the loader does not check
        raise ValueError(f"{flag} {ref!r}: {err}") from None


# ----- subcommands -------------------------------------------------------------------------------

def _dump_json(data: Any) -> None:
    print(json.dumps(data, indent=2))


def _add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _add_models_arguments(parser: argparse.ArgumentParser) -> None:
    _add_json_argument(parser)
    parser.add_argument("--model", metavar="NAME|FILE|PKG.MOD:FN",
                        help="show one model; a traced module (package.module:callable) is "
                             "listed layer by layer")
    parser.add_argument("--seq-len", type=_positive_int, metavar="S",
                        help="sequence length to trace a module at")
    parser.add_argument("--dtype", choices=DTYPES,
                        help="dtype to trace a module in (default bf16)")


def _run_models(args: argparse.Namespace) -> int:
    if args.model:
        factory = is_factory_ref(args.model)
        model = _load("--model", args.model, lambda: load_model(
            args.model, seq_len=args.seq_len if factory else None,
            dtype=args.dtype if factory else None))
        if args.json:
            _dump_json({**model.to_dict(), "num_params": model.num_params})
        else:
            print(report.layers_table(model) if model.is_traced
                  else report.models_table([model]))
        return EXIT_OK
    models = list(model_catalog().values())
    if args.json:
        _dump_json([{**m.to_dict(), "num_params": m.num_params} for m in models])
    else:
        print(report.models_table(models))
    return EXIT_OK


def _run_clusters(args: argparse.Namespace) -> int:
    clusters = [load_cluster(name) for name in cluster_names()]
    if args.json:
        _dump_json([{**dataclasses.asdict(c), "num_gpus": c.num_gpus} for c in clusters])
    else:
        print(report.clusters_table(clusters))
    return EXIT_OK


def _add_estimate_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_arguments(parser)
    add_config_arguments(parser)
    parser.add_argument("--json", action="store_true",
                        help="print the estimate JSON (schema_version 1) and nothing else")


def _run_estimate(args: argparse.Namespace) -> int:
    model, cluster, calibration = load_inputs(args)
    config = fill_config_defaults(config_kwargs_from_args(args), model=model, cluster=cluster)
    est = estimate(model, cluster, config, framework=args.framework, calibration=calibration)
    if args.json:
        _dump_json(estimate_to_dict(est))
    else:
        print(report.estimate_report(est))
    return EXIT_OK  # also when it does not fit: the report says why


def _add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan_file", metavar="plan.json", help="a plan file (meshplan plan -o)")
    parser.add_argument("--to", dest="target", required=True, choices=export_formats.TARGETS,
                        help="DeepSpeed config JSON, Megatron-LM arguments or torchtitan TOML")
    parser.add_argument("-o", "--output", metavar="FILE",
                        help="write the export to FILE instead of stdout")
    parser.add_argument("--force", action="store_true", help="let -o overwrite an existing FILE")
    parser.add_argument("--json", action="store_true",
                        help='print {"target", "config", "text", "warnings"} as JSON')


def _run_export(args: argparse.Namespace) -> int:
    """Export a plan; the target's approximations are warnings on stderr (or in --json)."""
    plan = read_plan(args.plan_file)
    if args.output and not args.force and os.path.exists(args.output):
        raise ValueError(f"-o {args.output!r} exists; pass --force to overwrite it")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", export_formats.ExportWarning)
        text = export_formats.render(plan, args.target)
    notes = [str(w.message) for w in caught
             if issubclass(w.category, export_formats.ExportWarning)]
    if args.output:
        try:
            with open(args.output, "w") as out:
                out.write(text)
        except OSError as err:
            raise ValueError(f"-o {args.output!r}: cannot write: {err.strerror or err}") from None
    if args.json:
        _dump_json({"target": args.target, "config": _export_object(text, args.target),
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


def _nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def _add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_arguments(parser)
    add_config_arguments(parser)
    group = parser.add_argument_group("search")
    group.add_argument("--objective", choices=("time", "cost"), default="time",
                       help="fastest step (default) or cheapest run for --train-tokens")
    group.add_argument("--top", type=_positive_int, default=5, metavar="K",
                       help="plans to report (default 5)")
    group.add_argument("--time-limit", type=_positive_float, default=60.0, metavar="S",
                       help="search time limit in seconds (default 60)")
    group.add_argument("--seed", type=int, default=0, help="solver seed (default 0)")
    group.add_argument("--workers", type=_positive_int, default=1,
                       help="CP-SAT worker threads (default 1)")
    group.add_argument("--memory-margin", type=_nonnegative_float, default=0.0, metavar="F",
                       help="fraction of GPU memory to keep free (default 0)")
    group.add_argument("--train-tokens", type=_positive_float, metavar="T",
                       help="tokens to train on: report days (and cost) per plan")
    group.add_argument("--gpu-hour-price", type=_positive_float, metavar="P",
                       help="price of one GPU-hour, for the cost objective and report")
    group.add_argument("--deadline-days", type=_positive_float, metavar="D",
                       help="with --objective cost: finish within D days")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the best plan to FILE")
    parser.add_argument("--force", action="store_true", help="let -o overwrite FILE")
    parser.add_argument("--json", action="store_true",
                        help="print the plan JSON (schema_version 1) and nothing else")


def search_space_from_args(given: dict[str, Any], *, model: ModelSpec,
                           cluster: ClusterSpec, memory_margin: float) -> SearchSpace:
    """The search space with every plan flag the user gave pinned."""
    pins: dict[str, Any] = {}
    for name in ("tp", "pp", "dp", "cp", "ep", "zero_stage", "offload", "offload_device",
                 "micro_batch_size", "vpp", "mesh_order", "sp"):
        if name in given:
            pins[name] = (given[name],)
    recompute = given.get("recompute")
    if isinstance(recompute, str):
        pins["recompute_modes"] = (recompute,)
    elif recompute is not None:
        pins["recompute_pinned"] = tuple(recompute)
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
    if given.get("offload") == "optimizer+params" and given.get("zero_stage", 3) != 3:
        raise ValueError("--offload optimizer+params needs --zero 3 (parameters are only "
                         f"sharded under ZeRO-3), got --zero {given['zero_stage']}")
    dtype = given.get("dtype", default_dtype(cluster.gpu.key))
    return SearchSpace(global_batch_size=given["global_batch_size"],
                       seq_len=given.get("seq_len", model.seq_len), dtype=dtype,
                       flash_attention=given.get("flash_attention", True),
                       memory_margin=memory_margin, **pins)


def _run_plan(args: argparse.Namespace) -> int:
    model, cluster, calibration = load_inputs(args)
    if args.output and not args.force and os.path.exists(args.output):
        raise ValueError(f"-o {args.output!r} exists; pass --force to overwrite it")
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
                               workers=args.workers)
    except NoPlanFits as err:
        print(f"{PROG}: {_one_line(str(err))}", file=sys.stderr)
        return EXIT_NO_PLAN
    except SearchTimeout as err:
        raise ValueError(str(err)) from None
    if args.output:
        try:
            write_plan(result.plans[0], args.output)
        except OSError as err:
            raise ValueError(f"-o {args.output!r}: cannot write: {err.strerror or err}") from None
    if args.json:
        _dump_json({"schema_version": schema.PLAN_SEARCH, "plans": [p.to_dict() for p in result.plans],
                    "solver": {"status": result.status, "wall_s": result.wall_s,
                               "candidates": result.candidates},
                    "pareto": list(result.pareto)})
    else:
        print(report.plans_report(result, model=model, cluster=cluster,
                                  objective=args.objective))
        if args.output:
            print(f"wrote the best plan to {args.output}")
    return EXIT_OK


def _add_explain_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan_file", metavar="plan.json", help="a plan file (meshplan plan -o)")
    parser.add_argument("--calibration", metavar="FILE",
                        help="calibration JSON (default: the built-in one)")
    parser.add_argument("--time-limit", type=_positive_float, default=30.0, metavar="S",
                        help="time limit of each search behind the explanation (default 30)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _run_explain(args: argparse.Namespace) -> int:
    plan = read_plan(args.plan_file)
    calibration = _load("--calibration", args.calibration,
                        lambda: load_calibration(args.calibration))
    explanation = explain_mod.explain(plan, calibration=calibration,
                                      time_limit_s=args.time_limit)
    if args.json:
        _dump_json(explanation.to_dict())
    else:
        print(explain_mod.render(explanation))
    return EXIT_OK


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan_file", metavar="plan.json", help="a plan file (meshplan plan -o)")
    parser.add_argument("--steps", type=_positive_int, default=10, metavar="N",
                        help="optimizer steps (default 10; the first is a warm-up)")
    parser.add_argument("--seed", type=int, default=0, help="weights and data seed (default 0)")
    parser.add_argument("--data", metavar="FILE",
                        help="token file (flat uint16/int32 array) instead of synthetic tokens")
    parser.add_argument("--report", metavar="FILE",
                        help="write the run report JSON (schema_version 1) to FILE")
    parser.add_argument("--timeout", type=_positive_float, default=60.0, metavar="S",
                        help="process-group timeout in seconds (default 60)")
    saving = parser.add_argument_group("checkpoints (torch.distributed.checkpoint)")
    saving.add_argument("--checkpoint-dir", metavar="DIR",
                        help="checkpoint folder, shared by all nodes (layout: "
                             "runtime/checkpoint.py)")
    saving.add_argument("--checkpoint-every", type=_positive_int, metavar="N",
                        help="save after every N steps (default: never; DIR is then only read)")
    saving.add_argument("--resume", action="store_true",
                        help="continue from the latest complete checkpoint in DIR, under this "
                             "plan (it may differ from the one that saved it)")
    group = parser.add_argument_group("torchrun (ignored when already under torchrun)")
    group.add_argument("--nproc-per-node", type=_positive_int, metavar="K",
                       help="processes per node (default: the plan's world size / nodes)")
    group.add_argument("--nnodes", type=_positive_int, default=1, metavar="N",
                       help="nodes (default 1)")
    group.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                       help="c10d rendezvous (default on one node: 127.0.0.1, a free port)")
    group.add_argument("--rdzv-id", metavar="ID", help="rendezvous job id, the same on all nodes")
    group.add_argument("--max-restarts", type=int, default=0, metavar="K",
                       help="restart the workers up to K times after a failure; they resume "
                            "from the latest checkpoint in DIR (default 0)")
    parser.add_argument("--json", action="store_true",
                        help="print the run report JSON on stdout (progress goes to stderr)")


def _run_run(args: argparse.Namespace) -> int:
    """Execute a plan with torch.distributed; the runtime is imported only here (DESIGN.md)."""
    from meshplan.runtime import launch
    from meshplan.runtime.train import RunOptions

    if args.data and not os.path.isfile(args.data):
        raise ValueError(f"--data {args.data!r}: no such file")
    if args.report and not os.path.isdir(os.path.dirname(os.path.abspath(args.report))):
        raise ValueError(f"--report {args.report!r}: its folder does not exist")
    options = RunOptions(steps=args.steps, seed=args.seed, data=args.data,
                         timeout_s=args.timeout, checkpoint_dir=args.checkpoint_dir,
                         checkpoint_every=args.checkpoint_every or 0, resume=args.resume)
    where = launch.Launch(nproc_per_node=args.nproc_per_node, nnodes=args.nnodes,
                          rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
                          max_restarts=args.max_restarts)
    result = launch.run(args.plan_file, options=options, launch=where, report=args.report,
                        json_output=args.json)
    if result.report is not None:
        if args.json:
            _dump_json(result.report)
        else:
            print(_run_summary(result.report))
    return result.exit_code


def _run_summary(report: dict[str, Any]) -> str:
    """Measured against predicted, for people: step time and the largest per-rank peak."""
    def ratio(value: float | None) -> str:
        return f"{value:.2f}x" if value is not None else "n/a"

    predicted = report["predicted"]
    lines = [f"ran {len(report['losses'])} steps on {report['world_size']} processes "
             f"({report['backend']}); final loss {report['losses'][-1]:.4f}",
             f"step time  measured {report['step_s_median']:.4f} s   predicted "
             f"{predicted['step_s']:.4f} s   ratio {ratio(report['ratio']['step_s'])}"]
    if report.get("resumed_from_step") is not None:
        lines.append(f"resumed from checkpoint step-{report['resumed_from_step']} "
                     f"({report['restarts']} torchrun restarts)")
    if report["peak_bytes"] is not None:
        lines.append(f"peak/rank  measured {report['peak_bytes'] / 1e6:.2f} MB   predicted "
                     f"{predicted['peak_bytes'] / 1e6:.2f} MB   ratio "
                     f"{ratio(report['ratio']['peak_bytes'])}")
    return "\n".join(lines)


# ----- profile / validate ------------------------------------------------------------------------
PROFILE_TIMEOUT_S = 150.0
"""Limit on the collective measurement of ``profile`` (the whole command stays under 3 min)."""


def _add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", metavar="FILE", default="calibration.json",
                        help="calibration JSON to write (default calibration.json)")
    parser.add_argument("--measurements", metavar="FILE",
                        help="raw timings and fitted values as JSON (default: --out with "
                             "'-measurements' before '.json')")
    parser.add_argument("--nproc-per-node", type=_positive_int, metavar="K",
                        help="local processes for the collectives, groups of 2, 4, ... K "
                             "(default 2 on the CPU, one per GPU up to 8; 1 skips them). Under "
                             "torchrun every process of the job takes part instead, and "
                             "cross-node links are measured too")
    parser.add_argument("--quick", action="store_true",
                        help="fewer and smaller sizes (seconds; for tests)")
    parser.add_argument("--dtype", choices=DTYPES,
                        help="GEMM dtype (default fp32 on the CPU, bf16 on a GPU)")
    parser.add_argument("--calibration", metavar="FILE",
                        help="calibration the measured values are written over (default: "
                             "built-in)")
    parser.add_argument("--cluster", metavar="NAME",
                        help="catalog cluster whose NIC bandwidth the cross-node fit is "
                             "expressed against (default: the first with this device)")


def _write_calibration(calibration: Calibration, path: str, *, about: str) -> None:
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise ValueError(f"--out {path!r}: its folder does not exist")
    with open(path, "w") as out:
        json.dump({"about": about, **calibration.to_dict()}, out, indent=2)
        out.write("\n")


def _run_profile(args: argparse.Namespace) -> int:
    """Measure this machine (runtime/profile_hw.py) and fit a calibration (costmodel/fitting).

    Under torchrun every process joins the collectives; rank 0 fits and writes, the other
    ranks return 0 without output.
    """
    import time

    from meshplan.costmodel import fitting, gpu_catalog
    from meshplan.runtime import profile_hw

    start = time.perf_counter()
    base = _load("--calibration", args.calibration, lambda: load_calibration(args.calibration))
    key = profile_hw.device_key()
    gpu = gpu_catalog()["a100-80gb" if key == "default" else key]
    cluster = _load("--cluster", args.cluster, lambda: load_cluster(
        args.cluster or next((name for name in cluster_names()
                              if load_cluster(name).gpu.key == gpu.key), "dgx-a100-80gb")))
    raw_path = _profile_paths(args)
    dtype = args.dtype or default_dtype(key)
    if key == CPU_DEVICE_KEY and dtype == "fp16":
        raise ValueError("--dtype fp16 on the CPU: torch has no fast fp16 GEMM there (about "
                         "1 GFLOP/s here), the profile would take many minutes; use fp32 or bf16")
    sizes = profile_hw.sizes_for(quick=args.quick, cuda=key != CPU_DEVICE_KEY)
    distributed = profile_hw.under_torchrun()
    nproc = 1 if distributed else profile_hw.local_processes(args.nproc_per_node)
    progress = profile_hw.Progress(
        profile_hw.steps_of(sizes, collectives=distributed or nproc > 1),
        shown=not distributed or os.environ["RANK"] == "0")
    try:
        if distributed:
            measured = profile_hw.measure_distributed(dtype=dtype, sizes=sizes,
                                                      timeout_s=PROFILE_TIMEOUT_S,
                                                      progress=progress)
        else:
            measured = profile_hw.measure(dtype=dtype, sizes=sizes, nproc=nproc,
                                          timeout_s=PROFILE_TIMEOUT_S, progress=progress)
    finally:
        progress.close()
    if measured is None:  # a torchrun rank other than 0
        return EXIT_OK
    fit = fitting.fit_profile(gemm=measured.gemm, copy=measured.copy,
                              collectives=measured.collectives, host_copy=measured.host_copy)
    wall_s = time.perf_counter() - start
    where = (f"{measured.nodes} nodes x {measured.procs_per_node}" if measured.nodes > 1
             else f"{measured.procs_per_node}")
    note = (f"{'quick, ' if args.quick else ''}{key}, {dtype}, {where} "
            f"{measured.backend or 'no collective'} processes, {measured.samples_per_case} "
            f"samples per case, {wall_s:.0f} s")
    catalog = fitting.CatalogRates(peak_flop_per_s=gpu.peak(dtype),
                                   hbm_bytes_per_s=gpu.hbm_bytes_per_s,
                                   link_bytes_per_s=gpu.nvlink_bytes_per_s,
                                   nic_bytes_per_s=cluster.nic_bytes_per_s)
    calibration = fitting.profiled_calibration(base, fit, gpu_key=key, catalog=catalog,
                                               note=note)
    calibration = dataclasses.replace(calibration, source={**calibration.source,
                                                           "topology": measured.topology})
    _write_calibration(calibration, args.out, about=f"meshplan profile of this machine "
                       f"({note}; topology: {measured.topology}); use with --calibration "
                       f"{args.out}")
    with open(raw_path, "w") as out:
        json.dump({"about": f"raw timings and fits of {args.out}", "note": note,
                   "wall_s": wall_s, "measurements": measured.to_dict(),
                   "fit": fit.to_dict(), "catalog": dataclasses.asdict(catalog),
                   "reference_cluster": cluster.name}, out, indent=2)
        out.write("\n")
    print(_profile_lines(measured, fit, catalog, dtype=dtype))
    print(f"wrote {args.out} (device {key!r}) and {raw_path} in {wall_s:.1f} s")
    return EXIT_OK


def _profile_paths(args: argparse.Namespace) -> str:
    """The ``--measurements`` path (default: next to ``--out``); ValueError, before anything is
    measured, when the folder of either file does not exist."""
    raw_path = args.measurements or f"{os.path.splitext(args.out)[0]}-measurements.json"
    for flag, path in (("--out", args.out), ("--measurements", raw_path)):
        if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise ValueError(f"{flag} {path!r}: its folder does not exist")
    return raw_path


def _profile_lines(measured: Any, fit: Any, catalog: Any, *, dtype: str) -> str:
    """What ``profile`` measured, one line per kind, next to the catalog figures."""
    lines = [f"topology   {measured.topology}",
             f"matmul     {fit.matmul_flop_per_s / 1e12:.4g} TFLOP/s + "
             f"{fit.matmul_overhead_s * 1e6:.2f} us/call  ({dtype}; catalog peak "
             f"{catalog.peak_flop_per_s / 1e12:.4g})",
             f"memory     {fit.memory_bytes_per_s / 1e9:.1f} GB/s  (catalog "
             f"{catalog.hbm_bytes_per_s / 1e9:.1f})"]
    lines.append("host-dev   " + (", ".join(f"{way} {rate / 1e9:.1f} GB/s" for way, rate in
                                            fit.host_copy_bytes_per_s.items())
                                  or "skipped: no CUDA device (pinned H2D/D2H need one)"))
    reference = {"intra": ("link", catalog.link_bytes_per_s),
                 "inter": ("NIC", catalog.nic_bytes_per_s)}
    for kind in ("intra", "inter"):
        link = fit.links.get(kind)
        if link is None:
            why = ("one process" if kind == "intra" else
                   "one node; run under torchrun --nnodes N to measure it")
            lines.append(f"{kind:<10} not measured ({why})")
            continue
        lines.append(f"{kind:<10} alpha {link.latency_s * 1e6:.1f} us, beta "
                     f"{link.bytes_per_s / 1e9:.2f} GB/s over groups of "
                     f"{', '.join(map(str, link.group_sizes))} ({measured.backend}; catalog "
                     f"{reference[kind][0]} {reference[kind][1] / 1e9:.2f} GB/s)")
    return "\n".join(lines)


VALIDATE_MEMORY_STEPS = 3
"""Steps of ``validate``'s memory run. The CPU's live-tensor tracker costs dispatch time on every
op (a tiny plan's step ran 3-4x slower with it), so step times come from a run without it and
per-rank peaks from a short second run with it; the peak is reached within the first steps."""
FOREIGN_CORES_WARNING = 0.25
"""``validate`` warns when other processes kept more than this many cores busy on average during
a timed run: the ranks then wait for CPU time and for each other, and the step is not the
plan's (on a 2-core machine one foreign busy process doubled some steps)."""


def _add_validate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan_files", nargs="+", metavar="plan.json",
                        help="plan file(s) (meshplan plan -o); --refit over several plans fits "
                             "compute, per-GEMM and per-collective costs together")
    parser.add_argument("--steps", type=_positive_int, default=5, metavar="N",
                        help="optimizer steps (default 5; the first is a warm-up)")
    parser.add_argument("--calibration", metavar="FILE",
                        help="calibration of the prediction (default: the built-in one)")
    parser.add_argument("--refit", action="store_true",
                        help="write a calibration fitted so the predictions match these runs")
    parser.add_argument("--out", metavar="FILE", default="calibration-refit.json",
                        help="where --refit writes (default calibration-refit.json)")
    parser.add_argument("--report", metavar="FILE",
                        help="write measured and predicted values of every plan as JSON")
    parser.add_argument("--timeout", type=_positive_float, default=60.0, metavar="S",
                        help="process-group timeout in seconds (default 60)")
    parser.add_argument("--nproc-per-node", type=_positive_int, metavar="K",
                        help="processes (default: each plan's world size)")


def _run_validate(args: argparse.Namespace) -> int:
    """Run each plan, compare with the prediction under ``--calibration``, optionally refit.

    On the CPU each plan runs twice (``_measure_plan``): its median step without the memory
    tracker, its per-rank peaks with it. Refit on one plan: one factor ``f`` slows every compute and
    communication cost (``fitting.scaled_calibration``, found by ``fitting.
    refit_step_scale``). On several plans: ``fitting.refit_plans`` fits the compute factor,
    the cost per GEMM call and the cost per collective call by least squares over them.
    """
    plans = [(path, read_plan(path)) for path in args.plan_files]
    calibration = _load("--calibration", args.calibration,
                        lambda: load_calibration(args.calibration))
    for flag, path in (("--report", args.report), ("--out", args.out if args.refit else None)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise ValueError(f"{flag} {path!r}: its folder does not exist")
    entries = []
    for path, plan in plans:
        code, measured = _measure_plan(path, args)
        if measured is None:
            return code
        if len(plans) > 1:
            print(f"plan {path}")
        est = _plan_estimate(plan, calibration)
        print(_validate_summary(measured, est))
        entries.append(_validate_entry(path, measured, est))
    document = {"calibration": args.calibration or "built-in", "steps": args.steps,
                "plans": entries}
    if args.refit:
        document["refit"] = _refit_and_write(plans, entries, calibration, args)
    if args.report:
        with open(args.report, "w") as out:
            json.dump(document, out, indent=2)
            out.write("\n")
    return EXIT_OK


def _measure_plan(path: str, args: argparse.Namespace) -> tuple[int, dict[str, Any] | None]:
    """(exit code, report): the timed run's report with the memory run's per-rank peaks.

    On CUDA one run gives both (the allocator's counters cost nothing); on the CPU the timed
    run goes without the live-tensor tracker and a short second run measures the peaks."""
    import torch

    from meshplan.runtime import launch
    from meshplan.runtime.train import RunOptions

    where = launch.Launch(nproc_per_node=args.nproc_per_node)
    runs = ((args.steps, True),) if torch.cuda.is_available() else \
        ((args.steps, False), (min(args.steps, VALIDATE_MEMORY_STEPS), True))
    reports, foreign = [], None
    for steps, track in runs:
        before = _cpu_counters()
        result = launch.run(path, options=RunOptions(steps=steps, timeout_s=args.timeout,
                                                     track_memory=track), launch=where)
        if result.exit_code != 0 or result.report is None:
            return result.exit_code or 1, None
        foreign = _foreign_cores(before, _cpu_counters()) if foreign is None else foreign
        reports.append(result.report)
    timed, tracked = reports[0], reports[-1]
    return EXIT_OK, {**timed, "per_rank": tracked["per_rank"],
                     "peak_bytes": tracked["peak_bytes"], "foreign_cpu_cores": foreign}


def _cpu_counters() -> tuple[float, float, float] | None:
    """(wall s, busy CPU s of the whole machine, CPU s of this process and its waited-for
    children); None where ``/proc/stat`` is missing (not Linux)."""
    import resource
    import time

    try:
        with open("/proc/stat") as stat:
            fields = [float(v) for v in stat.readline().split()[1:]]
    except OSError:
        return None
    hertz = os.sysconf("SC_CLK_TCK")
    mine = sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    busy_s = sum(fields[i] for i in (0, 1, 2, 5, 6)) / hertz  # user nice system irq softirq
    return time.monotonic(), busy_s, mine


def _foreign_cores(before: tuple[float, float, float] | None,
                   after: tuple[float, float, float] | None) -> float | None:
    """Average number of cores other processes kept busy between two ``_cpu_counters``."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    busy = after[1] - before[1]
    mine = after[2] - before[2]
    return max(0.0, (busy - mine) / (after[0] - before[0]))


def _plan_estimate(plan: Any, calibration: Calibration) -> Any:
    return estimate(plan.model, plan.cluster, plan.config, framework=plan.framework,
                    calibration=calibration)


def _validate_entry(path: str, report: dict[str, Any], est: Any) -> dict[str, Any]:
    """One plan's measured and predicted values for ``--report``."""
    stage_peak = {s.stage: s.peak_bytes for s in est.memory.per_stage}
    ranks = [{"rank": r["rank"], "stage": r["stage"], "measured_peak_bytes": r["peak_bytes"],
              "predicted_peak_bytes": stage_peak.get(r["stage"]),
              "peak_ratio": (r["peak_bytes"] / stage_peak[r["stage"]]
                             if r["peak_bytes"] is not None and stage_peak.get(r["stage"])
                             else None)}
             for r in report["per_rank"]]
    measured_s = report["step_s_median"]
    return {"plan": path, "world_size": report["world_size"], "measured_step_s": measured_s,
            "step_s": report["step_s"], "predicted_step_s": est.time.step_s,
            "step_ratio": measured_s / est.time.step_s, "per_rank": ranks,
            "foreign_cpu_cores": report.get("foreign_cpu_cores")}


def _refit_and_write(plans: list[tuple[str, Any]], entries: list[dict[str, Any]],
                     calibration: Calibration, args: argparse.Namespace) -> dict[str, Any]:
    """Fit (``_refit_one`` / ``_refit_several``), write ``--out``, print and return a summary."""
    keys = {(plan.cluster.gpu.key, plan.framework) for _, plan in plans}
    if len(keys) > 1:
        raise ValueError(f"--refit over several plans needs one device and framework, got "
                         f"{sorted(keys)}")
    measured = [e["measured_step_s"] for e in entries]
    runs = "; ".join(f"{path}: measured median step {m:.4f} s"
                     for (path, _), m in zip(plans, measured))
    if len(plans) == 1:
        refit, fitted = _refit_one(plans[0][1], calibration, measured[0])
    else:
        refit, fitted = _refit_several([p for _, p in plans], calibration, measured)
    note = f"meshplan validate --refit over {args.steps} steps ({runs}); {fitted}"
    refit = dataclasses.replace(refit, source={**refit.source, "refit": note})
    _write_calibration(refit, args.out, about=note)
    after = [_plan_estimate(plan, refit).time.step_s for _, plan in plans]
    print(f"refit      {fitted}; wrote {args.out}")
    for (path, _), m, p in zip(plans, measured, after):
        print(f"           {path}: measured {m:.4f} s   predicted now {p:.4f} s   "
              f"ratio {m / p:.2f}x")
    return {"out": args.out, "fitted": fitted, "predicted_step_s": after}


def _refit_one(plan: Any, calibration: Calibration,
               measured_s: float) -> tuple[Calibration, str]:
    """One factor on every compute and communication cost, matching one plan's step."""
    from meshplan.costmodel import fitting

    key, cluster = plan.cluster.gpu.key, plan.cluster
    latency = dict(intra_latency_s=calibration.link_latency_s.get(
                       "intra", cluster.nvlink_latency_s),
                   inter_latency_s=calibration.link_latency_s.get(
                       "inter", cluster.nic_latency_s))

    def scaled(factor: float) -> Calibration:
        return fitting.scaled_calibration(calibration, gpu_key=key, factor=factor, **latency)

    factor = fitting.refit_step_scale(lambda f: _plan_estimate(plan, scaled(f)).time.step_s,
                                      measured_step_s=measured_s)
    return scaled(factor), f"every compute and comm cost scaled by {factor:.3f}"


def _refit_several(plans: list[Any], calibration: Calibration,
                   measured_s: list[float]) -> tuple[Calibration, str]:
    """Compute factor, seconds per GEMM call and per collective call, by least squares."""
    from meshplan.costmodel import fitting

    key, framework = plans[0].cluster.gpu.key, plans[0].framework

    def with_terms(terms: Any) -> Calibration:
        return fitting.with_refit_terms(calibration, terms, gpu_key=key, framework=framework)

    terms = fitting.refit_plans(
        lambda t: [_plan_estimate(p, with_terms(t)).time.step_s for p in plans],
        measured_s=measured_s,
        start=fitting.refit_terms_of(calibration, gpu_key=key, framework=framework))
    fitted = (f"fitted over {len(plans)} plans: compute factor {terms.compute_factor:.3f}, "
              f"{terms.gemm_call_s * 1e6:.1f} us per GEMM call, "
              f"{terms.collective_call_s * 1e6:.0f} us per collective call")
    return with_terms(terms), fitted


def _validate_summary(report: dict[str, Any], est: Any) -> str:
    """Measured against predicted step time and per-rank peak memory, with ratios."""
    measured_s, predicted_s = report["step_s_median"], est.time.step_s
    lines = [f"step time  measured {measured_s:.4f} s   predicted {predicted_s:.4f} s   "
             f"ratio {measured_s / predicted_s:.2f}x"]
    foreign = report.get("foreign_cpu_cores")
    if foreign is not None and foreign > FOREIGN_CORES_WARNING:
        lines.append(f"warning: other processes kept {foreign:.2f} cores busy during the timed "
                     f"run; its step time is not this plan's alone")
    stage_peak = {s.stage: s.peak_bytes for s in est.memory.per_stage}
    for rank in report["per_rank"]:
        predicted = stage_peak.get(rank["stage"])
        if rank["peak_bytes"] is None or not predicted:
            continue
        lines.append(f"rank {rank['rank']} (stage {rank['stage']})  peak measured "
                     f"{rank['peak_bytes'] / 1e6:.2f} MB   predicted {predicted / 1e6:.2f} MB"
                     f"   ratio {rank['peak_bytes'] / predicted:.2f}x")
    return "\n".join(lines)


@dataclass(frozen=True)
class Command:
    """One subcommand: its one-line help, its flags and its handler (returns the exit code)."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {
    "models": Command("list the model catalog, or one model's layers",
                      _add_models_arguments, _run_models),
    "clusters": Command("list the cluster templates", _add_json_argument, _run_clusters),
    "estimate": Command("memory per GPU and time per step of one plan", _add_estimate_arguments,
                        _run_estimate),
    "plan": Command("search the fastest (or cheapest) plans that fit", _add_plan_arguments,
                    _run_plan),
    "explain": Command("why a plan: what binds, runners-up, what-ifs", _add_explain_arguments,
                       _run_explain),
    "export": Command("write a plan as a DeepSpeed / Megatron / torchtitan config",
                      _add_export_arguments, _run_export),
    "run": Command("run a plan with torchrun and report measurements", _add_run_arguments,
                   _run_run),
    "profile": Command("measure this machine's compute and links into a calibration",
                       _add_profile_arguments, _run_profile),
    "validate": Command("run a plan, compare measured vs predicted, refit",
                        _add_validate_arguments, _run_validate),
}

def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, allow_abbrev=False,
                     description="Plan and estimate parallel training of large models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        child = sub.add_parser(name, help=command.help, description=command.help,
                               allow_abbrev=False)
        command.add_arguments(child)
    return parser


def _one_line(message: str) -> str:
    return " ".join(line.strip() for line in str(message).splitlines() if line.strip())


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``meshplan`` with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:
            raise UsageError(f"unrecognized arguments: {' '.join(extra)}")
        return COMMANDS[args.command].run(args)
    except SystemExit as done:  # --help
        return done.code if isinstance(done.code, int) else EXIT_USAGE
    except (UsageError, ValueError) as err:
        print(f"{PROG}: error: {_one_line(str(err))}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `meshplan models | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
