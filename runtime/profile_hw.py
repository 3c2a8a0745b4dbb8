"""``meshplan profile``: time GEMMs, a memory copy and gloo collectives on this machine.

Only measures; ``costmodel/fitting.py`` turns the numbers into a calibration. Every timing is
taken after a warm-up (the first call of any configuration is several times slower,
shared/notes/torch-distributed-on-cpu.md) with one thread per process on the CPU, as the
runtime's ranks run (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``).

Collectives run in ``nproc`` processes started with ``torch.multiprocessing`` (spawn), meeting
over TCP on 127.0.0.1 with a process-group timeout; rank 0 times ``reps`` back-to-back calls
after a barrier. Point-to-point is a ping-pong between ranks 0 and 1 (half a round trip).

torch APIs: ``torch.matmul``, ``Tensor.copy_``, ``torch.distributed`` (gloo) ``all_reduce``,
``all_gather``, ``reduce_scatter``, ``send`` / ``recv``; ``torch.multiprocessing``.
"""

from __future__ import annotations

import datetime as dt
import os
import queue
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
CUDA_NAME_TO_KEY = (("H200", "h200"), ("H100", "h100-sxm"), ("B200", "b200"),
                    ("A100-SXM4-80GB", "a100-80gb"), ("A100 80GB", "a100-80gb"),
                    ("A100", "a100-40gb"))
"""Substring of ``torch.cuda.get_device_name()`` -> GPU catalog key (first match wins)."""


@dataclass(frozen=True, kw_only=True)
class ProfileSizes:
    """What to time: GEMM sides, copy bytes, collective bytes and repetitions."""

    gemm_sides: tuple[int, ...]
    copy_bytes: int
    collective_bytes: tuple[int, ...]
    reps: int


FULL = ProfileSizes(gemm_sides=(128, 256, 512, 768, 1024), copy_bytes=128 * 2**20,
                    collective_bytes=(4096, 65536, 2**20, 8 * 2**20), reps=10)
QUICK = ProfileSizes(gemm_sides=(64, 128, 256), copy_bytes=16 * 2**20,
                     collective_bytes=(4096, 2**20), reps=5)


@dataclass(frozen=True, kw_only=True)
class Measurements:
    """Raw timings (seconds per call) of one machine."""

    device_key: str
    """GPU catalog key: ``cpu``, a CUDA device's key, or ``default`` if unknown."""
    dtype: str
    gemm: tuple[tuple[float, float], ...]
    """(flop, seconds) per GEMM call."""
    copy: tuple[float, float]
    """(bytes moved: read + write, seconds) of one large tensor copy."""
    collectives: tuple[tuple[str, int, float, float], ...] = field(default=())
    """(op, ranks, size_bytes, seconds) per call; all_gather / reduce_scatter size is the
    full (gathered / input) buffer, all_reduce and send_recv the buffer each rank holds."""
    threads: int = 1


def device_key() -> str:
    """GPU catalog key of the device measured here."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name()
    return next((key for part, key in CUDA_NAME_TO_KEY if part in name), "default")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _seconds_per_call(fn: Callable[[], object], *, reps: int, device: torch.device) -> float:
    """Median of ``reps`` timings of ``fn`` after two warm-up calls."""
    fn(), fn()
    _sync(device)
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def time_gemms(sides: Sequence[int], *, dtype: torch.dtype, device: torch.device,
               reps: int) -> list[tuple[float, float]]:
    """(2 n^3 flop, seconds) of an n x n by n x n ``torch.matmul`` for each side n."""
    out = []
    for n in sides:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        out.append((2.0 * n ** 3, _seconds_per_call(lambda: torch.matmul(a, b), reps=reps,
                                                     device=device)))
    return out


def time_copy(nbytes: int, *, device: torch.device, reps: int) -> tuple[float, float]:
    """(2 * nbytes moved, seconds) of copying a ``nbytes`` float32 tensor into another."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2.0 * nbytes, _seconds_per_call(lambda: dst.copy_(src), reps=reps, device=device)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _one_collective(op: str, size_bytes: int, *, rank: int, world: int) -> Callable[[], None]:
    elems = max(world, size_bytes // 4) // world * world
    if op == "all_reduce":
        buf = torch.ones(elems)
        return lambda: dist.all_reduce(buf)
    if op == "all_gather":
        part = torch.ones(elems // world)
        outs = [torch.empty_like(part) for _ in range(world)]
        return lambda: dist.all_gather(outs, part)
    if op == "reduce_scatter":
        ins = [torch.ones(elems // world) for _ in range(world)]
        out = torch.empty(elems // world)
        return lambda: dist.reduce_scatter(out, ins)
    buf = torch.ones(elems)

    def ping_pong() -> None:  # two one-way transfers; ranks >= 2 sit out
        if rank == 0:
            dist.send(buf, 1), dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0), dist.send(buf, 0)
    return ping_pong


def _collective_rank(rank: int, world: int, port: int, sizes: ProfileSizes, timeout_s: float,
                     results: "mp.Queue") -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=dt.timedelta(seconds=timeout_s))
    try:
        for op in COLLECTIVES:
            for size in sizes.collective_bytes:
                fn = _one_collective(op, size, rank=rank, world=world)
                fn(), fn()
                dist.barrier()
                start = time.perf_counter()
                for _ in range(sizes.reps):
                    fn()
                seconds = (time.perf_counter() - start) / sizes.reps
                if op == "send_recv":
                    seconds /= 2
                if rank == 0:
                    results.put((op, world if op != "send_recv" else 2, float(size), seconds))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def time_collectives(nproc: int, sizes: ProfileSizes, *, timeout_s: float,
                     on_result: Callable[[int], None] = lambda done: None
                     ) -> list[tuple[str, int, float, float]]:
    """(op, ranks, size_bytes, seconds) of every collective over ``nproc`` gloo processes.

    RuntimeError if a process fails or the whole measurement exceeds ``timeout_s``.
    """
    if nproc < 2:
        raise ValueError(f"collectives need >= 2 processes, got --nproc-per-node {nproc}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    procs = [ctx.Process(target=_collective_rank, args=(r, nproc, port, sizes, timeout_s,
                                                        results), daemon=True)
             for r in range(nproc)]
    for proc in procs:
        proc.start()
    expected = len(COLLECTIVES) * len(sizes.collective_bytes)
    deadline = time.monotonic() + timeout_s
    out: list[tuple[str, int, float, float]] = []
    try:
        while len(out) < expected:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError(f"a collective-profiling process failed (exit codes "
                                   f"{[p.exitcode for p in procs]})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"collective profiling exceeded {timeout_s:.0f} s")
            try:
                out.append(results.get(timeout=0.5))
                on_result(len(out))
            except queue.Empty:
                continue
        for proc in procs:
            proc.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    return out


class Progress:
    """One self-overwriting line on stderr: ``profile [k/n] what``."""

    def __init__(self, total: int, *, stream=sys.stderr) -> None:
        self.total, self.done, self.stream = total, 0, stream

    def step(self, what: str) -> None:
        self.done += 1
        self.stream.write(f"\rprofile [{self.done}/{self.total}] {what:<40}")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def measure(*, dtype: str, sizes: ProfileSizes, nproc: int, timeout_s: float = 120.0,
            progress: Progress | None = None) -> Measurements:
    """Time GEMMs and a copy in this process and collectives over ``nproc`` processes."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    threads_before = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    step = progress.step if progress else (lambda what: None)
    try:
        gemm = []
        for n in sizes.gemm_sides:
            gemm += time_gemms((n,), dtype=DTYPES[dtype], device=device, reps=sizes.reps)
            step(f"matmul {n}x{n} {dtype}")
        copy = time_copy(sizes.copy_bytes, device=device, reps=sizes.reps)
        step(f"copy {sizes.copy_bytes / 2**20:.0f} MiB")
    finally:
        torch.set_num_threads(threads_before)
    total = len(COLLECTIVES) * len(sizes.collective_bytes)
    colls = time_collectives(nproc, sizes, timeout_s=timeout_s,
                             on_result=lambda done: step(f"gloo collectives {done}/{total}"))
    return Measurements(device_key=device_key(), dtype=dtype, gemm=tuple(gemm), copy=copy,
                        collectives=tuple(colls))


def steps_of(sizes: ProfileSizes) -> int:
    """Progress steps ``measure`` takes with ``sizes``."""
    return len(sizes.gemm_sides) + 1 + len(COLLECTIVES) * len(sizes.collective_bytes)
