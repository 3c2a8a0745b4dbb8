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
