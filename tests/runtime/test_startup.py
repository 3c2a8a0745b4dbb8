"""What ``meshplan run``'s processes import at start-up (``worker.import_training``).

The launching process only checks the plan and starts torchrun: it must not load the parts of
torch.distributed that training uses (seconds of CPU per launch). A worker loads all of them
before it joins the process group, so nothing the training code imports inside a function is
imported later, under strict mode's wrapped collectives or inside a measured window.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshplan.costmodel import load_model

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch.distributed.tensor", "torch.distributed.checkpoint",
         "torch.distributed.pipelining", "torch.distributed.optim", "torch.distributed.fsdp",
         "torch._dynamo", "sympy", "networkx")
"""What the launching process must not import (DTensor, DCP, pipelining with torch._dynamo,
ZeRO, FSDP2; the cost model's tracing)."""
LAZY_MODULES = ("checkpoint", "materialize", "pipeline", "recipe", "train")
"""The runtime modules that import training's parts inside their functions."""
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def startup(tmp_path_factory, plan_file, make_config) -> dict:
    """In one fresh interpreter: ``meshplan run`` with checkpoints up to where it would start
    torchrun (its exit code, the processes per node it would start, the heavy modules then
    loaded), then ``worker.import_training`` (every module loaded after it)."""
    root = tmp_path_factory.mktemp("startup")
    plan = plan_file(load_model("tiny"), make_config(tp=2, dp=2, zero_stage=1),
                     root / "plan.json")
    argv = ["run", str(plan), "--steps", "2", "--checkpoint-dir", str(root / "ckpt"),
            "--checkpoint-every", "1", "--oversubscribe"]
    code = f"""
import json, sys
from meshplan import cli
from meshplan.runtime import launch, worker
started = []
launch.start = lambda job, where, nproc_per_node: started.append(nproc_per_node) or 0
code = cli.main({argv!r})
heavy = [name for name in {HEAVY!r} if name in sys.modules]
worker.import_training()
print(json.dumps({{"launch": [code, started, heavy], "worker": sorted(sys.modules)}}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_the_launching_process_imports_none_of_training(startup):
    assert startup["launch"] == [0, [4], []]


def _function_imports(path: Path) -> set[str]:
    """Modules that the functions of ``path`` import (``from X import Y``: X.Y where that
    is a module, else X)."""
    found = set()
    for function in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                found.update(_module_of(node.module, alias.name) for alias in node.names)
    return found


def _module_of(module: str, name: str) -> str:
    try:
        return f"{module}.{name}" if importlib.util.find_spec(f"{module}.{name}") else module
    except ModuleNotFoundError:  # ``module`` is not a package
        return module


def test_a_worker_imports_everything_training_imports_late_before_it_starts(startup):
    lazy = set().union(*(_function_imports(ROOT / "runtime" / f"{name}.py")
                         for name in LAZY_MODULES))
    assert {"torch.distributed.pipelining", "meshplan.runtime.optim"} <= lazy
    assert sorted(lazy - set(startup["worker"])) == []
