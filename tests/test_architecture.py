"""Dependency direction (DESIGN.md): costmodel <- planner <- runtime, and where heavy imports live.

Parses every module's imports with ``ast`` (nothing is imported), so the rules hold for code
paths tests never execute.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _module_imports(package: str) -> dict[Path, set[str]]:
    return {p: _imports(p) for p in sorted((ROOT / package).rglob("*.py"))}


def _top_level_imports(path: Path) -> set[str]:
    """Imports at module level (not inside functions): what importing the module pulls in."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _hits(names: set[str], prefix: str) -> set[str]:
    return {n for n in names if n == prefix or n.startswith(prefix + ".")}


@pytest.mark.parametrize("path", sorted((ROOT / "costmodel").rglob("*.py")), ids=str)
def test_costmodel_imports_neither_planner_nor_runtime(path):
    names = _imports(path)
    assert not _hits(names, "planner") and not _hits(names, "runtime"), names


@pytest.mark.parametrize("path", sorted((ROOT / "costmodel").rglob("*.py")), ids=str)
def test_costmodel_uses_torch_only_for_profiling(path):
    if path.name.startswith("profil") or path.name == "hf.py":
        return
    assert not _hits(_imports(path), "torch"), path


@pytest.mark.parametrize("path", sorted((ROOT / "planner").rglob("*.py")), ids=str)
def test_planner_imports_runtime_only_lazily_in_the_cli(path):
    top = _top_level_imports(path)
    assert not _hits(top, "runtime"), f"{path} imports runtime at module level"
    if path.name != "cli.py":
        assert not _hits(_imports(path), "runtime"), path


def test_ortools_only_in_the_solver_module():
    users = [p for pkg in ("costmodel", "planner", "runtime")
             for p, names in _module_imports(pkg).items() if _hits(names, "ortools")]
    assert all(p.name == "solver.py" and p.parent.name == "planner" for p in users), users


def test_transformers_only_in_costmodel_hf_and_only_lazily():
    users = [p for pkg in ("costmodel", "planner", "runtime")
             for p, names in _module_imports(pkg).items() if _hits(names, "transformers")]
    assert users == [ROOT / "costmodel" / "hf.py"], users
    assert not _hits(_top_level_imports(users[0]), "transformers")


def test_torch_distributed_only_under_runtime():
    users = [p for pkg in ("costmodel", "planner")
             for p, names in _module_imports(pkg).items() if _hits(names, "torch.distributed")]
    assert users == []
