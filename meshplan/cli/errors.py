"""Exit codes and the user-error type of ``meshplan`` (DESIGN.md, "Command line").

A leaf module, so that every subcommand module can use them without importing the package's
``__init__`` (which imports the subcommands: that would close an import cycle). ``meshplan.cli``
re-exports all of them.
"""

from __future__ import annotations

PROG = "meshplan"
EXIT_OK = 0
EXIT_RUN_FAILED = 1
"""``run`` or ``validate``: a worker failed (its traceback is above)."""
EXIT_USAGE = 2
"""User error: bad flag, unknown name, malformed file, degrees that do not fit together."""
EXIT_NO_PLAN = 3
"""``plan`` found no configuration that fits (DESIGN.md)."""


class UsageError(Exception):
    """A command-line mistake; ``main`` prints it as one line and exits with ``EXIT_USAGE``."""


def one_line(message: str) -> str:
    """``message`` with its lines joined by single spaces (errors are one line on stderr)."""
    return " ".join(line.strip() for line in str(message).splitlines() if line.strip())
