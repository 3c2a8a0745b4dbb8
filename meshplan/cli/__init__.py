"""``meshplan``: the command line (DESIGN.md, "Command line (the contract)").

One module per subcommand (``models``, ``clusters``, ``estimate``, ``plan``, ``explain``,
``export``, ``run``, ``launch``, ``profile``, ``validate``), each with ``add_arguments(parser)``
and ``run(args) -> exit code``; shared flags in ``args``, loading what they name in ``inputs``.
argparse lives in this package and nowhere else: a handler turns its ``Namespace`` into
cost-model objects (``ModelSpec``, ``ClusterSpec``, ``ParallelConfig``, ``Calibration``) and
hands only those on. A subcommand's module is imported only when that subcommand is parsed,
so ``meshplan --help`` imports none of them and ``meshplan models`` only its own.

Exit codes: 0 success (``estimate`` also when the plan does not fit), 2 user error (one line
``meshplan: error: <message>`` on stderr, never a traceback), 3 "no plan fits", 1 ``run`` or
``validate`` failed in a worker (its traceback is above); ``launch --scheduler local`` returns
the exit code of the node that failed first.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NoReturn

from meshplan.cli.errors import (EXIT_NO_PLAN, EXIT_OK, EXIT_RUN_FAILED, EXIT_USAGE, PROG,
                                 UsageError, one_line)

__all__ = ["COMMANDS", "EXIT_NO_PLAN", "EXIT_OK", "EXIT_RUN_FAILED", "EXIT_USAGE", "PROG",
           "UsageError", "build_parser", "main"]


@dataclass(frozen=True)
class Command:
    """One subcommand: its one-line help and the module ``meshplan.cli.<module>`` with its
    ``add_arguments(parser)`` and ``run(args) -> int``."""

    help: str
    module: str


COMMANDS: dict[str, Command] = {
    "models": Command("list the model catalog, or one model's layers", "models"),
    "clusters": Command("list the cluster templates", "clusters"),
    "estimate": Command("memory per GPU and time per step of one plan", "estimate"),
    "plan": Command("search the fastest (or cheapest) plans that fit", "plan"),
    "explain": Command("why a plan: what binds, runners-up, what-ifs", "explain"),
    "export": Command("write a plan as a DeepSpeed / Megatron / torchtitan config", "export"),
    "run": Command("run a plan with torchrun and report measurements", "run"),
    "launch": Command("run a plan on several nodes: a SLURM batch script, or local processes",
                      "launch"),
    "profile": Command("measure this machine's compute and links into a calibration",
                       "profile"),
    "validate": Command("run a plan, compare measured vs predicted, refit", "validate"),
}


def _command_module(name: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{COMMANDS[name].module}")


class _Parser(argparse.ArgumentParser):
    """ArgumentParser that raises ``UsageError`` instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


class _CommandParser(_Parser):
    """A subcommand's parser: its flags are added when it first parses (argparse hands a
    subcommand's arguments to its parser's ``parse_known_args``), importing its module then."""

    def __init__(self, *args: Any, command: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._command: str | None = command

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self._command is not None:
            command, self._command = self._command, None
            _command_module(command).add_arguments(self)
        return super().parse_known_args(args, namespace)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, allow_abbrev=False,
                     description="Plan and estimate parallel training of large models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                parser_class=_CommandParser)
    for name, command in COMMANDS.items():
        sub.add_parser(name, help=command.help, description=command.help, allow_abbrev=False,
                       command=name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``meshplan`` with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:
            raise UsageError(f"unrecognized arguments: {' '.join(extra)}")
        return _command_module(args.command).run(args)
    except SystemExit as done:  # --help
        return done.code if isinstance(done.code, int) else EXIT_USAGE
    except (UsageError, ValueError) as err:
        print(f"{PROG}: error: {one_line(str(err))}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `meshplan models | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
