"""The environment ``meshplan run`` gives torchrun and its workers."""

from __future__ import annotations

import pytest
import torch

from meshplan.runtime import launch
from meshplan.runtime.train import RunOptions


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU workers' allocator setting")
def test_cpu_workers_get_a_fixed_mmap_threshold_unless_the_user_set_one():
    env = launch.worker_environment(RunOptions(), launch.Launch(), base={"PATH": "/bin"})
    assert env["MALLOC_MMAP_THRESHOLD_"] == str(64 * 1024)
    assert env["OMP_NUM_THREADS"] == "1"
    mine = launch.worker_environment(RunOptions(), launch.Launch(),
                                     base={"MALLOC_MMAP_THRESHOLD_": "1048576"})
    assert mine["MALLOC_MMAP_THRESHOLD_"] == "1048576"
    assert not any(key.startswith("TORCH_NCCL") for key in env)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU workers' start method")
def test_cpu_workers_are_forked_unless_the_user_chose_spawn():
    from meshplan.runtime.agent import START_ENV

    env = launch.worker_environment(RunOptions(), launch.Launch(), base={"PATH": "/bin"})
    assert env[START_ENV] == "forkserver"
    mine = launch.worker_environment(RunOptions(), launch.Launch(), base={START_ENV: "spawn"})
    assert mine[START_ENV] == "spawn"


@pytest.mark.parametrize("argv", [
    ["--standalone", "--nproc-per-node", "1", "-m", "meshplan.runtime.worker", "{}"],
    ["--nproc-per-node", "1", "-m", "meshplan.runtime.worker", "{}"],  # static rendezvous
    ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", "x",
     "-m", "other.program"],
], ids=["standalone", "static", "other-program"])
def test_forked_agent_refuses_what_it_would_run_differently_from_torchrun(argv):
    """The forked path takes meshplan's own command line (``launch.torchrun_command``: its
    worker, an explicit c10d rendezvous); other command lines are refused before any worker
    starts instead of being launched with a different rendezvous than torchrun would use."""
    from meshplan.runtime import agent

    with pytest.raises(ValueError, match="forkserver"):
        agent._run_forked(argv)
