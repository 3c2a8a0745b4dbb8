"""What the subcommands write: JSON on stdout, files named by flags."""

from __future__ import annotations

import json
import os
from typing import Any


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2))


def refuse_overwrite(flag: str, path: str | None, *, force: bool) -> None:
    """ValueError when ``path`` exists and ``--force`` was not given (a folder: always,
    ``workflows.files.check_not_folder``)."""
    from meshplan.workflows.files import check_not_folder

    check_not_folder(flag, path)
    if path and not force and os.path.exists(path):
        raise ValueError(f"{flag} {path!r} exists; pass --force to overwrite it")


def check_folder(flag: str, path: str | None) -> None:
    """ValueError, before any work starts, when the folder ``path`` would be written in is
    missing (the workflows' rule, ``workflows.files.check_folder``; imported here, not at
    module level, as the CLI takes workflows only inside functions)."""
    from meshplan.workflows.files import check_folder as check

    check(flag, path)


def write_text(flag: str, path: str, text: str) -> None:
    """``text`` into ``path``; an OSError becomes a ValueError naming ``flag``."""
    try:
        with open(path, "w") as out:
            out.write(text)
    except OSError as err:
        raise ValueError(f"{flag} {path!r}: cannot write: {err.strerror or err}") from None
