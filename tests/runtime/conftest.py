"""Helpers of the runtime tests, as fixtures: plan files from the cost model, and torchrun.

Multi-process tests run on CPU with gloo under torchrun on 127.0.0.1 (a c10d rendezvous on a
free port), fp32, with ``OMP_NUM_THREADS=1``. ``runtime.worker`` can run several plans of one
world size in one launch (each on a fresh DeviceMesh), which keeps process start-up -- seconds
per rank on a 2-core machine -- to one launch per world size.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from meshplan.costmodel import ModelSpec, ParallelConfig, estimate, load_cluster
from meshplan.planner.plan import Plan, write_plan
from meshplan.runtime.strict import ENV as STRICT_ENV

LAUNCH_TIMEOUT_S = 110
"""A torchrun launch of the tests must finish within this (tests time out at 120 s)."""


def plan_config(**values: Any) -> ParallelConfig:
    """A test configuration: global batch 8, sequence 64, fp32 unless given."""
    return ParallelConfig(**{"global_batch_size": 8, "seq_len": 64, "dtype": "fp32", **values})


def write_plan_file(model: ModelSpec, config: ParallelConfig, path: Path) -> Path:
    """A plan file for ``config``: the cost model's estimate on the ``cpu`` cluster."""
    cluster = load_cluster("cpu", gpus_per_node=config.world_size)
    plan = Plan.from_estimate(estimate(model, cluster, config),
                              provenance={"source": "tests/runtime"})
    write_plan(plan, path)
    return path


def worker_env() -> dict[str, str]:
    """This environment without torchrun's variables, one thread per process, and
    device-only collectives (``runtime/strict.py``: a host tensor handed to a collective fails,
    as under NCCL)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return dict(env, OMP_NUM_THREADS="1", **{STRICT_ENV: "1"})


def run_torchrun(plans: Sequence[Path], reports: Sequence[Path], *, nproc: int, steps: int,
                 timeout_s: float = LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``runtime.worker`` on ``nproc`` local processes for ``plans``, one report each; on the
    CPU forked from one preloaded server, as ``meshplan run`` starts them there."""
    import torch

    from meshplan.runtime.agent import START_ENV
    from meshplan.runtime.launch import Launch, torchrun_command
    from meshplan.runtime.train import RunOptions
    from meshplan.runtime.worker import Job

    job = Job(plans=tuple(map(str, plans)), reports=tuple(map(str, reports)),
              options=RunOptions(steps=steps, timeout_s=60.0))
    return subprocess.run(torchrun_command(job, Launch(), nproc_per_node=nproc),
                          capture_output=True, text=True, timeout=timeout_s,
                          env=dict(worker_env(), **({} if torch.cuda.is_available()
                                                    else {START_ENV: "forkserver"})))


@pytest.fixture(scope="session")
def plan_file() -> Callable[..., Path]:
    return write_plan_file


@pytest.fixture(scope="session")
def torchrun() -> Callable[..., subprocess.CompletedProcess]:
    return run_torchrun


@pytest.fixture(scope="session")
def make_config() -> Callable[..., ParallelConfig]:
    return plan_config


def run_meshplan(*argv: str, timeout_s: float = LAUNCH_TIMEOUT_S,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``meshplan ARGV`` in a fresh interpreter (``python -m meshplan``), with ``env``
    added to ``worker_env()``."""
    return subprocess.run([sys.executable, "-m", "meshplan", *argv], capture_output=True,
                          text=True, timeout=timeout_s, env={**worker_env(), **(env or {})})


def run_benchmark(name: str, *argv: str, timeout_s: float) -> subprocess.CompletedProcess:
    """``python benchmarks/NAME ARGV`` from the repository root, as a user runs the script."""
    root = Path(__file__).resolve().parents[2]
    return subprocess.run([sys.executable, str(root / "benchmarks" / name), *argv], cwd=root,
                          capture_output=True, text=True, timeout=timeout_s, check=False)


@pytest.fixture(scope="session")
def meshplan_env() -> dict[str, str]:
    """The environment ``meshplan`` runs in (``worker_env``), for tests that start it."""
    return worker_env()


@pytest.fixture(scope="session")
def meshplan() -> Callable[..., subprocess.CompletedProcess]:
    return run_meshplan


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a rendezvous endpoint)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
