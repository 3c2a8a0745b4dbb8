"""Checks ``meshplan run`` makes before it starts any worker; each refusal is one ValueError line.

* Devices (``check_devices``): with CUDA, the processes of this node must not exceed its GPUs
  (one GPU per rank). Without CUDA (the ``cpu`` cluster: one process is one device) the
  processes must not exceed the CPU cores this process may use (``os.sched_getaffinity``),
  unless ``oversubscribe`` (``--oversubscribe``: tests and debugging on a small machine run
  several ranks per core, slowly but correctly); and the plan's predicted bytes of all ranks of
  this node (each rank's stage peak, ``plan.prediction.memory``) plus a fixed
  ``RANK_OVERHEAD_BYTES`` per process must fit the memory available now (``MemAvailable`` of
  ``/proc/meminfo``). The memory check has no override: a run past it would be killed by the
  kernel's OOM killer, possibly with other processes of the machine.
* Data (``check_data``): the ``--data`` file must hold whole tokens of its dtype, at least one
  sequence of s + 1 tokens, and no id >= the vocabulary (the whole file is scanned once, in
  chunks).
* Checkpoint folder (``check_checkpoint_dir``): it, or the nearest existing parent it would be
  created in, must be a writable folder when the run saves checkpoints or metrics into it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from meshplan.costmodel import layout
from meshplan.planner.plan import Plan
from meshplan.runtime.data import DataSpec, token_dtype

RANK_OVERHEAD_BYTES = 600 * 2 ** 20
"""Resident memory of one worker beyond its tensors: the Python interpreter with torch
imported and gloo/NCCL buffers (measured here: about 450-550 MiB RSS per CPU worker of the
``tiny`` model; rounded up)."""
_SCAN_TOKENS = 1 << 24
"""Tokens per chunk of the vocabulary scan (32-64 MiB)."""


def available_memory_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """``MemAvailable`` in bytes, or None where the file does not say (not Linux)."""
    try:
        text = Path(meminfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def usable_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def node_ranks_bytes(plan: Plan, nproc_per_node: int) -> float:
    """Predicted bytes of the first ``nproc_per_node`` ranks (global ranks 0..k-1, this node
    when it is node 0; every node of a uniform layout holds as many stages of each kind)."""
    names, sizes = layout.mesh_dims(plan.config)  # row-major rank grid (layout.rank_of)
    stage_peak = {s.stage: s.peak_bytes for s in plan.prediction.memory.per_stage}
    total = 0.0
    for rank in range(nproc_per_node):
        coords = dict(zip(names, np.unravel_index(rank, sizes)))
        total += stage_peak.get(int(coords["pp"]), plan.peak_bytes)
    return total


def check_devices(plan: Plan, *, nproc_per_node: int, cuda_devices: int,
                  oversubscribe: bool, cores: int | None = None,
                  memory_bytes: int | None = None) -> None:
    """ValueError when this node cannot hold ``nproc_per_node`` ranks of ``plan``."""
    if cuda_devices:
        if nproc_per_node > cuda_devices:
            raise ValueError(f"the plan runs {nproc_per_node} processes on this node but it "
                             f"has {cuda_devices} GPUs (one GPU per process)")
        return
    cores = usable_cores() if cores is None else cores
    if nproc_per_node > cores and not oversubscribe:
        raise ValueError(f"the plan runs {nproc_per_node} processes on this node but only "
                         f"{cores} CPU cores are available (one core per process on the cpu "
                         "cluster); pass --oversubscribe to run them anyway")
    memory_bytes = available_memory_bytes() if memory_bytes is None else memory_bytes
    if memory_bytes is None:
        return
    need = node_ranks_bytes(plan, nproc_per_node) + nproc_per_node * RANK_OVERHEAD_BYTES
    if need > memory_bytes:
        raise ValueError(f"the plan's {nproc_per_node} processes on this node need about "
                         f"{need / 2 ** 30:.1f} GiB (predicted per-rank bytes + "
                         f"{RANK_OVERHEAD_BYTES / 2 ** 20:.0f} MiB each) but "
                         f"{memory_bytes / 2 ** 30:.1f} GiB of memory is available")


def check_data(spec: DataSpec) -> None:
    """ValueError naming what is wrong with ``spec.token_file`` (nothing when synthetic)."""
    if spec.token_file is None:
        return
    path = Path(spec.token_file)
    if not path.is_file():
        raise ValueError(f"--data {path}: no such file")
    dtype = np.dtype(token_dtype(spec))
    size_bytes = path.stat().st_size
    if size_bytes % dtype.itemsize:
        raise ValueError(f"--data {path}: {size_bytes} bytes is not a whole number of "
                         f"{dtype.name} tokens")
    tokens = size_bytes // dtype.itemsize
    row = spec.seq_len + 1
    if tokens < row:
        raise ValueError(f"--data {path}: {tokens} tokens, fewer than one sequence of {row} "
                         f"(seq_len {spec.seq_len} + 1)")
    array = np.memmap(path, dtype=dtype, mode="r")
    for start in range(0, tokens, _SCAN_TOKENS):
        chunk = array[start:start + _SCAN_TOKENS]
        top = int(chunk.max())
        if top >= spec.vocab_size:
            where = start + int(np.argmax(chunk >= spec.vocab_size))
            raise ValueError(f"--data {path}: token id {int(array[where])} at position "
                             f"{where} is >= the model's vocabulary size {spec.vocab_size}")


def check_checkpoint_dir(directory: str | None) -> None:
    """ValueError unless ``directory`` is (or can be created as) a writable folder."""
    if directory is None:
        return
    path = Path(directory).absolute()
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"--checkpoint-dir {directory}: {probe} is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"--checkpoint-dir {directory}: {probe} is not writable")
