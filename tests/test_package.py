"""One ``meshplan`` package: what is installed, what a user's working directory cannot shadow,
and what the light commands import.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "networkx", "pandas")
"""Modules the plan-file type, ``meshplan models`` and ``meshplan --help`` must not import."""


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "PYTHONPATH", "PYTHONSAFEPATH")}
    return dict(env, OMP_NUM_THREADS="1")


def test_the_installed_distribution_has_one_top_level_package():
    top = metadata.distribution("meshplan").read_text("top_level.txt").split()
    assert top == ["meshplan"]
    scripts = [e for e in metadata.distribution("meshplan").entry_points
               if e.group == "console_scripts"]
    assert [(e.name, e.value) for e in scripts] == [("meshplan", "meshplan.cli:main")]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_built_wheel_holds_only_the_meshplan_package(tmp_path):
    source = tmp_path / "src"  # a copy, so that setuptools' build/ folder stays out of the tree
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".venv", ".git", "build", "*.egg-info", "__pycache__", ".hypothesis", ".pytest_cache"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(tmp_path), str(source)],
                          capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("meshplan-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"meshplan"}
    for module in ("meshplan/costmodel/estimate.py", "meshplan/planner/plan.py",
                   "meshplan/runtime/worker.py", "meshplan/cli/__init__.py",
                   "meshplan/workflows/__init__.py", "meshplan/costmodel/data/models.json"):
        assert module in names


def test_the_old_top_level_names_are_not_importable_from_elsewhere(tmp_path):
    code = ("import importlib.util, json; print(json.dumps([importlib.util.find_spec(n) is None "
            "for n in ('costmodel', 'planner', 'runtime')]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, env=_clean_env())
    assert json.loads(done.stdout) == [True, True, True], done.stderr


@pytest.mark.parametrize("argv", [["-m", "meshplan", "models"], ["-m", "meshplan", "--help"],
                                  ["-m", "meshplan", "clusters"]], ids=" ".join)
def test_light_commands_import_no_torch_networkx_or_pandas(argv, tmp_path):
    """The command runs in-process after a hook that records sys.modules at exit."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import atexit, json, sys, runpy\n"
        f"atexit.register(lambda: print('MODULES=' + json.dumps(sorted(m for m in {HEAVY!r} "
        "if m in sys.modules)), file=sys.stderr))\n"
        f"sys.argv = ['meshplan', *{argv[2:]!r}]\n"
        "runpy.run_module('meshplan', run_name='__main__')\n")
    done = subprocess.run([sys.executable, str(probe)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, env=_clean_env())
    assert done.returncode == 0, done.stderr[-2000:]
    line = [x for x in done.stderr.splitlines() if x.startswith("MODULES=")][-1]
    assert json.loads(line.removeprefix("MODULES=")) == []
    assert done.stdout.strip()


def test_the_plan_file_type_imports_no_torch_networkx_or_pandas(tmp_path):
    code = ("import json, sys; import meshplan.planner.plan as p; "
            "p.read_plan, p.write_plan, p.Plan; "
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, env=_clean_env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == []
