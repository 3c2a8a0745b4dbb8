"""``meshplan launch``: run a plan on several nodes, one ``meshplan run`` per node -- an sbatch
script for SLURM (``--submit`` queues it), or N processes on this machine
(``meshplan.workflows.slurm`` and ``meshplan.workflows.local``).

Run flags: every flag of ``meshplan run`` (``cli.run.add_arguments``) is also a flag of launch,
except the ones launch sets itself (``--nnodes``, ``--rdzv-endpoint``, ``--rdzv-id``: refused,
saying what to give instead) or has its own of (``--nproc-per-node``, ``--json``). argparse
knows their arity from run's parser, so they may come before or after the plan; they are
recorded as typed, checked with run's own parser before anything is written or started, and
handed to every node verbatim.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn

from meshplan.cli import run as run_command
from meshplan.cli.args import positive_int, rdzv_conf
from meshplan.cli.errors import EXIT_OK, UsageError
from meshplan.cli.output import check_folder, print_json, refuse_overwrite, write_text

SCHEDULERS = ("slurm", "local")
SET_BY_LAUNCH = {
    "--nnodes": "give --nodes N, or --elastic MIN:MAX",
    "--rdzv-endpoint": "the first node of the allocation (slurm) or 127.0.0.1 (local)",
    "--rdzv-id": "the job id (slurm) or a fresh one (local)",
}
"""Run flags launch sets on every node itself, and what stands for them."""
SLURM_ONLY = ("time", "partition", "job_name", "script", "rdzv_port", "cpus_per_task",
              "submit")
LOCAL_ONLY = ("log_dir",)
SLURM_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d+(:\d{1,2}){0,2}")
"""sbatch --time: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
MAX_PORT = 65535


def elastic_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition(":")
    try:
        bounds = (positive_int(low), positive_int(high)) if sep else None
    except argparse.ArgumentTypeError:
        bounds = None
    if bounds is None or bounds[0] > bounds[1]:
        raise argparse.ArgumentTypeError(f"must be MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return bounds


def slurm_time(text: str) -> str:
    if not SLURM_TIME.fullmatch(text):
        raise argparse.ArgumentTypeError(f"must be a SLURM time limit such as HH:MM:SS, "
                                         f"D-HH:MM:SS or minutes, got {text!r}")
    return text


def port(text: str) -> int:
    value = positive_int(text)
    if value > MAX_PORT:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 1 to {MAX_PORT}, got {text!r}")
    return value


class _Forward(argparse.Action):
    """A run flag: appends its words, as typed, to ``run_flags``."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None):
        words = list(getattr(namespace, self.dest) or [])
        words.append(option_string)
        words.extend([values] if isinstance(values, str) else values)
        setattr(namespace, self.dest, words)


class _SetByLaunch(argparse.Action):
    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None):
        raise UsageError(f"{option_string} is set by launch on every node: "
                         f"{SET_BY_LAUNCH[option_string]}")


class _RunParser(argparse.ArgumentParser):
    """``meshplan run``'s parser, checking the forwarded flags; errors are UsageErrors."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (a flag of meshplan run)")


def _run_parser() -> argparse.ArgumentParser:
    parser = _RunParser(prog="meshplan run", add_help=False, allow_abbrev=False)
    run_command.add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan_file", metavar="plan.json", help="a plan file (meshplan plan -o)")
    parser.add_argument("--scheduler", choices=SCHEDULERS, required=True,
                        help="slurm: write (and --submit) an sbatch script; local: start the "
                             "nodes as processes on this machine")
    parser.add_argument("--nodes", type=positive_int, metavar="N",
                        help="nodes (slurm: default 1; local: required)")
    parser.add_argument("--nproc-per-node", type=positive_int, metavar="K",
                        help="processes per node (default: the plan's GPUs per node)")
    parser.add_argument("--elastic", type=elastic_range, metavar="MIN:MAX",
                        help="elastic: meshplan run --nnodes MIN:MAX; slurm asks for "
                             "--nodes=MIN-MAX (then give no --nodes)")
    parser.add_argument("--rdzv-conf", type=rdzv_conf, metavar="K=V,...",
                        help="torchrun's rendezvous options, passed to meshplan run")
    parser.add_argument("--json", action="store_true",
                        help="print what was written / how the nodes ended as JSON")
    parser.add_argument("--force", action="store_true",
                        help="overwrite an existing --script (slurm), and pass --force to "
                             "meshplan run (its --report)")
    slurm = parser.add_argument_group("slurm")
    slurm.add_argument("--script", metavar="FILE",
                       help="the batch script (default: <plan folder>/<plan stem>.sbatch); its "
                            "job writes <script stem>-<job id>.out next to it")
    slurm.add_argument("--submit", action="store_true", help="sbatch the script; print the id")
    slurm.add_argument("--time", type=slurm_time, metavar="HH:MM:SS",
                       help="time limit (default: the partition's)")
    slurm.add_argument("--partition", metavar="P", help="partition (default: SLURM's)")
    slurm.add_argument("--job-name", metavar="NAME", help="job name (default: the plan stem)")
    slurm.add_argument("--cpus-per-task", type=positive_int, metavar="C",
                       help="CPUs of each node's task: torchrun and all its workers (default: "
                            "SLURM's, often 1; set it where tasks are bound to their CPUs)")
    slurm.add_argument("--rdzv-port", type=port, metavar="PORT",
                       help="rendezvous port on the first node (default: 29500 + job id "
                            "modulo 1000)")
    local = parser.add_argument_group("local")
    local.add_argument("--log-dir", metavar="DIR",
                       help="write node i's output to DIR/node<i>.log (default: to this "
                            "terminal, each line prefixed [node<i>])")
    _add_run_flags(parser)


def _add_run_flags(parser: argparse.ArgumentParser) -> None:
    """``meshplan run``'s flags as forwarded ones (``_Forward``), less launch's own. Read from
    the parsers' ``_actions`` (argparse has no public list of a parser's arguments), so a flag
    added to ``meshplan run`` is a flag of launch at once."""
    for flag in SET_BY_LAUNCH:
        parser.add_argument(flag, action=_SetByLaunch, help=argparse.SUPPRESS)
    taken = {flag for action in parser._actions for flag in action.option_strings}
    group = parser.add_argument_group("run flags (passed to meshplan run on every node; see "
                                      "meshplan run --help)")
    for action in _run_parser()._actions:
        if not action.option_strings or taken.intersection(action.option_strings):
            continue
        metavar = action.metavar or (None if action.nargs == 0 else
                                     "{%s}" % ",".join(map(str, action.choices))
                                     if action.choices else action.dest.upper())
        group.add_argument(*action.option_strings, action=_Forward, dest="run_flags",
                           nargs=action.nargs, default=None, metavar=metavar,
                           help=action.help)


def run(args: argparse.Namespace) -> int:
    """0; ValueError when refused; local: the nodes' exit code (``LocalResult.exit_code``)."""
    run_flags = list(args.run_flags or []) + (["--force"] if args.force else [])
    _check_flags(args)
    _run_parser().parse_args([args.plan_file, *run_flags])
    if args.scheduler == "slurm":
        return _slurm(args, run_flags)
    return _local(args, run_flags)


def _check_flags(args: argparse.Namespace) -> None:
    other = LOCAL_ONLY if args.scheduler == "slurm" else SLURM_ONLY
    given = [name for name in other if getattr(args, name) not in (None, False)]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise UsageError(f"{flag} is not a flag of --scheduler {args.scheduler}")
    if args.scheduler == "slurm" and args.elastic and args.nodes:
        raise UsageError("--nodes with --elastic: under SLURM the allocation decides how many "
                         "nodes between MIN and MAX; give one of them")
    if args.scheduler == "local" and not args.nodes:
        raise UsageError("--scheduler local needs --nodes N (the local nodes to start)")


def _slurm(args: argparse.Namespace, run_flags: list[str]) -> int:
    from meshplan.planner.plan import meshplan_version
    from meshplan.workflows import slurm
    from meshplan.workflows.launch import plan_nodes, uses_gpus

    nodes_given = args.nodes or (args.elastic[1] if args.elastic else 1)
    plan, nodes = plan_nodes(args.plan_file, nodes=nodes_given,
                             nproc_per_node=args.nproc_per_node, elastic=args.elastic)
    script = args.script or slurm.default_script_path(args.plan_file)
    refuse_overwrite("--script", script, force=args.force)
    check_folder("--script", script)
    if args.submit:
        slurm.check_sbatch()
    job = slurm.SlurmJob(job_name=args.job_name or Path(args.plan_file).stem,
                         output=slurm.default_output(script), workdir=os.getcwd(),
                         gpus_per_node=nodes.nproc_per_node if uses_gpus(plan) else None,
                         time_limit=args.time, partition=args.partition,
                         cpus_per_task=args.cpus_per_task, rdzv_port=args.rdzv_port)
    count = slurm.sbatch_nodes(nodes)
    shape = f"nodes {count}, processes per node {nodes.nproc_per_node}"
    about = f"meshplan launch (meshplan {meshplan_version()}): {args.plan_file}; {shape}"
    write_text("--script", script, slurm.sbatch_script(
        os.path.abspath(args.plan_file), nodes, job, run_flags, rdzv_conf=args.rdzv_conf,
        about=about))
    job_id = slurm.submit(script) if args.submit else None
    if args.json:
        print_json({"schema_version": 1, "scheduler": "slurm", "script": os.path.abspath(script),
                    "output": job.output, "nodes": count,
                    "nproc_per_node": nodes.nproc_per_node, "job_id": job_id})
        return EXIT_OK
    print(f"wrote {script} ({shape}); the job writes {job.output}")
    print(f"submitted batch job {job_id}" if job_id
          else f"submit it with: sbatch {shlex.quote(script)}")
    return EXIT_OK


def _local(args: argparse.Namespace, run_flags: list[str]) -> int:
    from meshplan.workflows.launch import plan_nodes
    from meshplan.workflows.local import local_commands, run_nodes

    _, nodes = plan_nodes(args.plan_file, nodes=args.nodes, nproc_per_node=args.nproc_per_node,
                          elastic=args.elastic)
    if args.log_dir:
        try:
            os.makedirs(args.log_dir, exist_ok=True)
        except OSError as err:
            raise ValueError(f"--log-dir {args.log_dir!r}: {err.strerror or err}") from None
    commands = local_commands(args.plan_file, nodes, run_flags, rdzv_conf=args.rdzv_conf)
    result = run_nodes(commands, log_dir=args.log_dir, quiet_stdout=args.json,
                       stop_on_failure=nodes.elastic is None)
    if result.stopped_by is not None:
        print(f"meshplan: stopped by {signal.Signals(result.stopped_by).name}: the "
              f"{nodes.nodes} local nodes were ended", file=sys.stderr)
    elif result.first_failure is not None:
        print(f"meshplan: node {result.first_failure} failed first, with exit code "
              f"{result.exit_code}", file=sys.stderr)
    if args.json:
        print_json({"schema_version": 1, "scheduler": "local", "nodes": nodes.nodes,
                    "nproc_per_node": nodes.nproc_per_node,
                    "exit_codes": list(result.exit_codes), "exit_code": result.exit_code,
                    "log_dir": args.log_dir})
    return result.exit_code
