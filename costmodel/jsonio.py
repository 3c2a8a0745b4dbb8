"""Reading the JSON files users give and the package's own data files."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any


def read_json_object(path: str | Path, *, what: str) -> dict[str, Any]:
    """The JSON object in the file ``path``; ValueError naming ``what`` and the file otherwise."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{what} file {str(path)!r} does not exist")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{what} file {str(path)!r} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} file {str(path)!r} must hold a JSON object")
    return data


def read_package_json(name: str) -> dict[str, Any]:
    """A data file shipped in ``costmodel/data``."""
    return json.loads(resources.files("meshplan.costmodel.data").joinpath(name).read_text())
