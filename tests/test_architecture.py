"""The architecture of DESIGN.md, checked from the source: parts, allowed edges, heavy imports.

Parses every module's imports with ``ast`` (nothing is imported), so the rules hold for code
paths tests never execute. The parts are the installed sub-packages of ``meshplan``; their
folders in the repository are given by ``PART_FOLDERS`` (the package-dir mapping of
pyproject.toml).
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]

PART_FOLDERS = {
    "costmodel": ROOT / "costmodel",
    "planner": ROOT / "planner",
    "runtime": ROOT / "runtime",
    "workflows": ROOT / "meshplan" / "workflows",
    "cli": ROOT / "meshplan" / "cli",
}
"""Each part of the package and the folder it lives in."""

ALLOWED_EDGES = {
    # part:      the parts it may import (DESIGN.md: costmodel <- planner <- runtime <-
    #            workflows <- cli; nothing points back)
    "costmodel": set(),
    "planner": {"costmodel"},
    "runtime": {"costmodel", "planner"},
    "workflows": {"costmodel", "planner", "runtime"},
    "cli": {"costmodel", "planner", "runtime", "workflows"},
}
"""The one table of allowed edges between the parts."""

LAZY_ONLY = {("cli", "runtime"), ("cli", "workflows")}
"""Edges that only function bodies may take: ``meshplan --help`` must not import torch."""

TORCH_IN_COSTMODEL = {"tracing.py", "factory.py", "hf.py"}
"""The cost model's tracing code, the only part of it that imports torch."""


def _module_name(path: Path) -> str:
    """Installed dotted name of the module at ``path``: ``costmodel/x.py`` is
    ``meshplan.costmodel.x`` (package-dir), ``meshplan/cli/x.py`` is ``meshplan.cli.x``."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] in ("costmodel", "planner", "runtime"):
        parts = ("meshplan", *parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _package_files() -> list[Path]:
    files = [p for folder in PART_FOLDERS.values() for p in folder.rglob("*.py")]
    files += [p for p in (ROOT / "meshplan").glob("*.py")]
    return sorted(set(files))


def _imports(path: Path, *, top_level_only: bool = False) -> set[str]:
    """Absolute dotted names ``path`` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    own = _module_name(path)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` imports the submodule pkg.sub where there is one, else a
            # name of pkg itself (parents a module import always runs are not edges)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                names.add(sub if sub in _MODULES else base)
    return names


_MODULES = {_module_name(p) for p in _package_files()}


def _part_of(name: str) -> str | None:
    for part in PART_FOLDERS:
        if name == f"meshplan.{part}" or name.startswith(f"meshplan.{part}."):
            return part
    return None


def _hits(names: set[str], prefix: str) -> set[str]:
    return {n for n in names if n == prefix or n.startswith(prefix + ".")}


def test_pyproject_installs_one_top_level_package_mapped_to_the_part_folders():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = config["packages"]
    assert {p.split(".")[0] for p in packages} == {"meshplan"}
    mapping = config["package-dir"]
    for part in ("costmodel", "planner", "runtime"):
        assert (ROOT / mapping[f"meshplan.{part}"]).resolve() == PART_FOLDERS[part]
    # every folder with an __init__.py under a part is listed, so nothing is left uninstalled
    for part, folder in PART_FOLDERS.items():
        for init in folder.rglob("__init__.py"):
            assert _module_name(init) in packages, init
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"meshplan": "meshplan.cli:main"}


@pytest.mark.parametrize("path", _package_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_follow_the_table_of_allowed_edges(path):
    me = _part_of(_module_name(path))
    if me is None:  # meshplan/__init__.py, __main__.py, testing.py sit above every part
        return
    every, top = _imports(path), _imports(path, top_level_only=True)
    for name in every:
        other = _part_of(name)
        if other is None or other == me:
            continue
        assert other in ALLOWED_EDGES[me], f"{path.relative_to(ROOT)} imports {name}"
        if (me, other) in LAZY_ONLY:
            assert name not in top, f"{path.relative_to(ROOT)} imports {name} at module level"
    # no module imports the 0.1 top-level names any more
    for old in ("costmodel", "planner", "runtime"):
        assert not _hits(every, old), f"{path.relative_to(ROOT)} imports {_hits(every, old)}"


def test_no_import_cycle_inside_the_package():
    """Every import counts, also the ones inside functions: a lazy import that closes a cycle
    is still a cycle of the design."""
    files = _package_files()
    modules = {_module_name(p): p for p in files}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        for target in _imports(path):
            if target in modules and target != name:
                graph.add_edge(name, target)
    # a package's __init__ re-exporting its submodules is the usual direction; a submodule
    # importing its own package's __init__ back would close a cycle and is counted
    cycles = list(nx.simple_cycles(graph))
    assert cycles == [], cycles[:5]


@pytest.mark.parametrize("path", sorted(PART_FOLDERS["costmodel"].rglob("*.py")),
                         ids=lambda p: p.name)
def test_costmodel_uses_torch_only_for_profiling(path):
    if path.name in TORCH_IN_COSTMODEL:
        return
    assert not _hits(_imports(path), "torch"), path


def test_ortools_only_in_the_solver_module():
    users = [p for p in _package_files() if _hits(_imports(p), "ortools")]
    assert users == [PART_FOLDERS["planner"] / "solver.py"], users


def test_transformers_only_in_costmodel_hf_and_only_lazily():
    users = [p for p in _package_files() if _hits(_imports(p), "transformers")]
    assert users == [PART_FOLDERS["costmodel"] / "hf.py"], users
    assert not _hits(_imports(users[0], top_level_only=True), "transformers")


def test_torch_distributed_only_under_runtime_and_workflows():
    users = [p for p in _package_files() if _hits(_imports(p), "torch.distributed")
             and _part_of(_module_name(p)) not in ("runtime",)]
    assert users == []
