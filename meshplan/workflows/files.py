"""Files the workflows write: calibrations (with an ``about`` line) and JSON documents.

Messages name the ``meshplan`` flag behind each path (``--out``, ``--report``, ...), which is
also the workflow function's keyword."""

from __future__ import annotations

import json
import os
from typing import Any

from meshplan.costmodel.calibration import Calibration


def check_not_folder(flag: str, path: str | None) -> None:
    """ValueError when the file ``path`` a flag names is a folder."""
    if path and os.path.isdir(path):
        raise ValueError(f"{flag} {path!r}: is a folder; give a file name")


def check_folder(flag: str, path: str | None) -> None:
    """ValueError, before anything is measured, when the file ``path`` cannot be written:
    its folder does not exist, or ``path`` is itself a folder."""
    check_not_folder(flag, path)
    if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise ValueError(f"{flag} {path!r}: its folder does not exist")


def write_json(path: str, document: dict[str, Any]) -> None:
    with open(path, "w") as out:
        json.dump(document, out, indent=2)
        out.write("\n")


def write_calibration(calibration: Calibration, path: str, *, about: str) -> None:
    """``calibration`` as JSON, an ``about`` line first (``load_calibration`` reads it back)."""
    check_folder("--out", path)
    write_json(path, {"about": about, **calibration.to_dict()})
