"""Shared test helpers: the published reference numbers in ``tests/data/published.json``.

The file is the project's own copy of the published numbers (DESIGN.md, "Tests and CI"); tests
read this copy only. Two ways in:

* the ``published`` fixture: every case, keyed by its ``id``;
* ``@pytest.mark.published(kind=..., prefix=...)`` on a test that takes a ``published_case``
  argument: the test runs once per matching case, with the case ``id`` as the test id.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest

PUBLISHED_PATH = Path(__file__).parent / "data" / "published.json"


@functools.cache
def _published_cases() -> tuple[dict[str, Any], ...]:
    return tuple(json.loads(PUBLISHED_PATH.read_text(encoding="utf-8"))["cases"])


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "published(kind=None, prefix=None): parametrize ``published_case`` with the "
                   "cases of tests/data/published.json of that kind and id prefix")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "published_case" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("published")
    if marker is None:
        raise pytest.UsageError(f"{metafunc.function.__name__} takes published_case but has no "
                                f"@pytest.mark.published(kind=..., prefix=...)")
    kind, prefix = marker.kwargs.get("kind"), marker.kwargs.get("prefix", "")
    cases = [c for c in _published_cases()
             if (kind is None or c["kind"] == kind) and c["id"].startswith(prefix)]
    if not cases:
        raise pytest.UsageError(f"no published case of kind {kind!r} with id prefix {prefix!r}")
    metafunc.parametrize("published_case", cases, ids=[c["id"] for c in cases])


@pytest.fixture(scope="session")
def published() -> dict[str, dict[str, Any]]:
    """Every published case by id."""
    return {case["id"]: case for case in _published_cases()}


def benchmark_module(name: str):
    """``benchmarks/NAME.py`` loaded as a module (``benchmarks/`` is not a package)."""
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"meshplan_benchmark_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
