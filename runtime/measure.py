"""Measure this machine for ``meshplan profile``: GEMMs, memory and host-device copies,
and collectives.

Only measures; ``costmodel/fitting.py`` turns the numbers into a calibration.

Timing. Each case (one GEMM side, the copy, one collective on one group and size) gets one
untimed call, then a few timed calls, in ``rounds`` passes that interleave all cases, so a
slow drift of a shared machine hits every size alike. A case's time is the median over the
rounds of each round's fastest call (``median_of_minima``): interference (another process
holding the core, a peer rank descheduled in the middle of a collective) only ever adds time,
so the fastest of a few back-to-back calls is what the hardware does when a rank has its core
(the reasoning of Python's ``timeit`` docs, which recommend the minimum), and the median over
rounds seconds apart keeps one lucky round from setting the value. On the raw samples of three
runs on this shared 2-core machine it spread the fitted alpha and beta by 1.01-1.09x, where the
5 % quantile of all calls spread them by 1.1-1.3x; the loopback bandwidth itself still moves
with other jobs' load (benchmarks/results/profile-repeat-*). Small collectives, cheap and the
noisiest relative to their time, get more calls (``calls_for``).

On the CPU every process runs one thread, as the runtime's ranks do, and a GEMM or copy is
timed by the thread's CPU time (``time.thread_time``, POSIX ``CLOCK_THREAD_CPUTIME_ID``, less
the clock's own cost): on a shared machine wall time also counts the time the thread waited
for a core, which on this 2-core machine halved the measured copy rate when other jobs ran;
on a dedicated core the two agree. Collectives are timed by wall time (waiting for the peer is
part of them); on CUDA every call by CUDA events.

Collectives. Outside torchrun, ``nproc`` processes started with ``torch.multiprocessing``
(spawn) meet over TCP on 127.0.0.1. Under torchrun (``RANK`` and ``WORLD_SIZE`` set, e.g.
``torchrun --nnodes 2 --nproc-per-node 8 ... -m meshplan profile``) every process takes
part and rank 0 returns the measurements. ``measured_groups`` picks the groups: the first g
ranks of rank 0's node (link ``intra``) and the first rank of each of the first m nodes (link
``inter``), g, m = 2, 4, 8, ... Every group times all-reduce, all-gather, reduce-scatter and
all-to-all (gloo has ``all_to_all_single`` on the CPU); each link's two-rank group also a
send/recv ping-pong (half a round trip per transfer). Backend gloo on the CPU, NCCL on CUDA.
Local gloo ranks are pinned to a core each (``_pin_to_own_core``); under torchrun placement is
left to the launcher.

Topology: ``topology.detect_topology`` (``nvidia-smi topo -m``, pynvml, or loopback).

Why one module of ~550 lines: the timing primitives (interleaved rounds, minima, CPU or CUDA
clocks), the compute cases and the collectives in both modes (spawned local processes and
torchrun) are one measurement pipeline that shares those primitives and ``ProfileSizes``;
split, each part would import the others' internals.

torch APIs: ``torch.matmul``, ``Tensor.copy_``, ``torch.cuda.Event``, ``torch.distributed``
(``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all_single``, ``send`` /
``recv``, ``new_group``, ``all_gather_object``), ``torch.multiprocessing``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import functools
import os
import queue
import socket
import sys
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from meshplan.runtime.topology import detect_topology

MIB = 2 ** 20
T = TypeVar("T")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
SMALL_MESSAGE_BYTES = 4 * MIB
"""Collectives below this size get proportionally more calls, up to ``MAX_CALL_FACTOR`` x."""
MAX_CALL_FACTOR = 8
MIN_SAMPLE_S = 1e-3
"""A GEMM or copy sample lasts at least this long (a batch of calls), up to ``MAX_BATCH``."""
MAX_BATCH = 1000
JOIN_TIMEOUT_S = 1.0
"""Wait this long for a collective process that sent its results to exit, then kill it
(tearing down an interpreter with torch loaded takes 1-3 s on this 2-core machine)."""
CLOCK_OVERHEAD_SAMPLES = 200
"""Back-to-back clock reads whose minimum difference is subtracted from every CPU sample."""
MAX_LOCAL_GPUS = 8
"""Default local processes on a CUDA machine: one per GPU, at most this many."""
CUDA_NAME_TO_KEY = (("H200", "h200"), ("H100", "h100-sxm"), ("B200", "b200"),
                    ("A100-SXM4-80GB", "a100-80gb"), ("A100 80GB", "a100-80gb"),
                    ("A100", "a100-40gb"))
"""Substring of ``torch.cuda.get_device_name()`` -> GPU catalog key (first match wins)."""


@dataclass(frozen=True, kw_only=True)
class ProfileSizes:
    """What to time and how often."""

    gemm_sides: tuple[int, ...]
    """n of the n x n by n x n GEMMs; small ones pin the per-call overhead, large the rate."""
    copy_bytes: int
    """Bytes of the device-memory copy (source; the same again is written)."""
    host_copy_bytes: int
    """Bytes of each pinned host-device copy (CUDA only)."""
    collective_bytes: tuple[int, ...]
    """Buffer sizes of the collectives (see ``Measurements.collectives``)."""
    host_adam_params: int = 64 * 2 ** 20
    """Parameters of the timed host AdamW step (``time_host_adam``). The full profiles step
    64 M parameters: 1 GiB of fp32 parameters, gradients and Adam moments, beyond any host's
    last-level cache, as the billions of parameters an offloaded optimizer steps are. On the
    H200 machine's host (16 threads) 8 M parameters stepped at 7.8 G parameters/s against 3.9
    at 64 M (benchmarks/README.md, 2026-12-04): the smaller size had priced the host step at
    half its time. On the 2-core test machine (32 MiB of L3) both sizes step at 2.2 G/s on one
    thread."""
    rounds: int
    """Interleaved passes over all cases."""
    calls: int
    """Timed calls of each case per pass (after one untimed call); ``calls_for`` gives small
    collectives more."""

    def __post_init__(self) -> None:
        values = (*self.gemm_sides, self.copy_bytes, self.host_copy_bytes,
                  *self.collective_bytes, self.rounds, self.calls, self.host_adam_params)
        if not self.gemm_sides or min(values) <= 0:
            raise ValueError(f"profile sizes must be positive and name GEMM sides, got {self}")


FULL = ProfileSizes(gemm_sides=(16, 32, 64, 128, 256, 512, 1024), copy_bytes=128 * MIB,
                    host_copy_bytes=64 * MIB,
                    collective_bytes=(4096, 65536, MIB, 4 * MIB, 16 * MIB), rounds=20,
                    calls=6)
QUICK = ProfileSizes(gemm_sides=(16, 64, 256), copy_bytes=64 * MIB, host_copy_bytes=16 * MIB,
                     collective_bytes=(4096, MIB, 4 * MIB), rounds=10, calls=3,
                     host_adam_params=4 * 2 ** 20)
FULL_CUDA = ProfileSizes(gemm_sides=(512, 1024, 2048, 4096, 8192), copy_bytes=1024 * MIB,
                         host_copy_bytes=256 * MIB,
                         collective_bytes=(65536, MIB, 16 * MIB, 128 * MIB), rounds=6, calls=5)
QUICK_CUDA = ProfileSizes(gemm_sides=(1024, 4096), copy_bytes=256 * MIB,
                          host_copy_bytes=64 * MIB, collective_bytes=(65536, 16 * MIB),
                          rounds=2, calls=3, host_adam_params=4 * 2 ** 20)


def sizes_for(*, quick: bool, cuda: bool) -> ProfileSizes:
    """The size set of ``meshplan profile`` (``--quick`` or not) for a CPU or CUDA device."""
    return {(False, False): FULL, (True, False): QUICK, (False, True): FULL_CUDA,
            (True, True): QUICK_CUDA}[(quick, cuda)]


@dataclass(frozen=True, kw_only=True)
class Measurements:
    """Timings (seconds per call, ``median_of_minima`` of the samples) of one machine."""

    device_key: str
    """GPU catalog key: ``cpu``, a CUDA device's key, or ``default`` if unknown."""
    dtype: str
    gemm: tuple[tuple[float, float], ...]
    """(flop, seconds) per GEMM call."""
    copy: tuple[float, float]
    """(bytes moved: read + write, seconds) of one large tensor copy."""
    collectives: tuple[tuple[str, str, int, float, float], ...] = ()
    """(link, op, ranks, size_bytes, seconds) per call; link ``intra`` or ``inter``;
    all_gather / reduce_scatter size is the full (gathered / input) buffer, all_reduce and
    send_recv the buffer each rank holds, all_to_all what each rank sends in total."""
    host_copy: tuple[tuple[str, float, float], ...] = ()
    """(``h2d`` or ``d2h``, bytes, seconds) of pinned host-device copies, and
    (``d2h_pageable``, bytes, seconds) of a blocking copy into fresh pageable memory
    (``time_host_copies``); empty without CUDA."""
    host_adam: tuple[tuple[int, int, float], ...] = ()
    """(threads, parameters, seconds) of one host AdamW step as the offloading runtime runs
    it (``time_host_adam``): on one thread and on every core of the node."""
    thin_gemm: tuple[tuple[float, float, float], ...] = ()
    """(rows, flop, seconds) of GEMMs with few rows (``time_compute``); empty on a GPU."""
    fresh_pages: tuple[float, ...] = ()
    """(bytes, seconds) of zeroing a freshly mapped tensor (``time_compute``); empty on a
    GPU."""
    backend: str = ""
    """Process-group backend of the collectives (``gloo``, ``nccl``); empty if none ran."""
    nodes: int = 1
    procs_per_node: int = 1
    topology: str = ""
    """One line on how the devices are linked (``detect_topology``)."""
    samples_per_case: int = 0
    """Timed calls behind each GEMM, copy and large-collective time (``calls_for`` gives
    small collectives up to ``MAX_CALL_FACTOR`` times more)."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def device_key() -> str:
    """GPU catalog key of the device measured here."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name()
    return next((key for part, key in CUDA_NAME_TO_KEY if part in name), "default")


def under_torchrun() -> bool:
    """True inside a torchrun worker (RANK and WORLD_SIZE are set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


# ----- timing ------------------------------------------------------------------------------------
def _call_timer(device: torch.device, *, cpu_time: bool = False
                ) -> Callable[[Callable[[], object]], float]:
    """Seconds of one call of ``fn``: CUDA events on a GPU; on the CPU ``perf_counter`` or,
    with ``cpu_time``, this thread's CPU time less the clock's own cost."""
    if device.type == "cuda":
        def time_cuda(fn: Callable[[], object]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return time_cuda
    if cpu_time and torch.get_num_threads() != 1:
        raise ValueError(f"CPU-time sampling counts this thread only; it needs "
                         f"torch.set_num_threads(1), not {torch.get_num_threads()}")
    clock = time.thread_time if cpu_time else time.perf_counter
    clock_s = min(-clock() + clock() for _ in range(CLOCK_OVERHEAD_SAMPLES))

    def time_cpu(fn: Callable[[], object]) -> float:
        start = clock()
        fn()
        return max(0.0, clock() - start - clock_s)
    return time_cpu


def median_of_minima(rounds: Sequence[Sequence[float]]) -> float:
    """Median over ``rounds`` of the fastest sample of each round (upper median if even)."""
    minima = sorted(min(samples) for samples in rounds if samples)
    if not minima:
        raise ValueError("no timing samples")
    return minima[len(minima) // 2]


def time_interleaved(cases: Mapping[Hashable, Callable[[], object]], *, rounds: int, calls: int,
                     device: torch.device, on_round: Callable[[int], None] = lambda k: None
                     ) -> dict[Hashable, float]:
    """Seconds per call of each case: ``rounds`` passes over all cases, each one untimed
    call and ``calls`` timed samples per case; ``median_of_minima`` of them. A sample
    times a batch of back-to-back calls lasting about ``MIN_SAMPLE_S`` (sized by the first
    untimed call), so the clock's cost and resolution vanish for microsecond GEMMs. On the
    CPU the thread's CPU time (see the module docstring)."""
    timer = _call_timer(device, cpu_time=True)
    samples: dict[Hashable, list[list[float]]] = {key: [] for key in cases}
    batch: dict[Hashable, int] = {}
    for fn in cases.values():  # a warm-up pass: first calls are several times slower
        fn()
    for done in range(1, rounds + 1):
        for key, fn in cases.items():
            first_s = timer(fn)
            size = batch.setdefault(key, max(1, min(MAX_BATCH, int(MIN_SAMPLE_S / max(
                first_s, 1e-9)))))

            def repeated(fn=fn, size=size) -> None:
                for _ in range(size):
                    fn()
            samples[key].append([timer(repeated) / size for _ in range(calls)])
        on_round(done)
    return {key: median_of_minima(values) for key, values in samples.items()}


THIN_GEMM_ROWS = (8, 32, 128)
"""Rows of the thin GEMMs ``time_compute`` times on the CPU (tokens of a small micro-batch)."""
THIN_GEMM_SHAPE = (1024, 4096)
"""(K, N) of the weight operand of those GEMMs: 16 MiB in fp32, a small model's MLP matrix."""
FRESH_PAGES_BYTES = 64 * MIB
"""Bytes of the fresh tensor ``time_compute`` zeroes on the CPU: above glibc's largest
dynamic mmap threshold (32 MiB), so every call maps, faults and zeroes new pages."""


def time_compute(*, dtype: torch.dtype, sizes: ProfileSizes, device: torch.device,
                 on_round: Callable[[int], None] = lambda k: None) -> dict:
    """Interleaved timings of this device: ``gemm``, (2 n^3 flop, s) per GEMM side n;
    ``copy``, (2 * copy_bytes, s) of the copy; on the CPU also ``thin_gemm``, (rows, flop, s)
    of a [rows, K] by [K, N] product per ``THIN_GEMM_ROWS``, and ``fresh_pages``, (bytes, s)
    of zeroing a freshly allocated ``FRESH_PAGES_BYTES`` tensor."""
    cases: dict[Hashable, Callable[[], object]] = {}
    for n in sizes.gemm_sides:
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        cases[n] = functools.partial(torch.matmul, a, b, out=torch.empty_like(a))
    src = torch.ones(sizes.copy_bytes // 4, device=device)
    cases["copy"] = functools.partial(torch.empty_like(src).copy_, src)
    cpu = device.type == "cpu"
    if cpu:
        k, n = THIN_GEMM_SHAPE
        weight = torch.randn(k, n).to(dtype)
        for rows in THIN_GEMM_ROWS:
            cases["thin", rows] = functools.partial(torch.matmul, torch.randn(rows, k).to(dtype),
                                                    weight)
        cases["fresh"] = functools.partial(torch.zeros, FRESH_PAGES_BYTES, dtype=torch.uint8)
    seconds = time_interleaved(cases, rounds=sizes.rounds, calls=sizes.calls, device=device,
                               on_round=on_round)
    out = {"gemm": tuple((2.0 * n ** 3, seconds[n]) for n in sizes.gemm_sides),
           "copy": (2.0 * sizes.copy_bytes, seconds["copy"])}
    if cpu:
        k, n = THIN_GEMM_SHAPE
        out["thin_gemm"] = tuple((rows, 2.0 * rows * k * n, seconds["thin", rows])
                                 for rows in THIN_GEMM_ROWS)
        out["fresh_pages"] = (float(FRESH_PAGES_BYTES), seconds["fresh"])
    return out


def time_host_copies(nbytes: int, *, rounds: int, calls: int
                     ) -> tuple[tuple[str, float, float], ...]:
    """(``h2d`` / ``d2h``, bytes, s) of ``nbytes`` between pinned host memory and the GPU,
    and (``d2h_pageable``, bytes, s) of ``Tensor.to("cpu")``: a blocking copy into a fresh
    pageable tensor, the copy FSDP2's CPU offload makes of each gradient shard while
    gradients accumulate (``timing._param_offload_per_microbatch_s``), page faults included;
    () without CUDA."""
    if not torch.cuda.is_available():
        return ()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    cases = {"h2d": lambda: gpu.copy_(host, non_blocking=True),
             "d2h": lambda: host.copy_(gpu, non_blocking=True),
             "d2h_pageable": lambda: gpu.to("cpu")}
    seconds = time_interleaved(cases, rounds=rounds, calls=calls, device=gpu.device)
    return tuple((way, float(nbytes), seconds[way]) for way in cases)


def time_host_adam(params: int, *, rounds: int, threads: Sequence[int] | None = None
                   ) -> tuple[tuple[int, int, float], ...]:
    """(threads, ``params``, s) of one fp32 AdamW step in host memory the way
    ``optim.HostOffloadAdamW`` runs it (torch's fused CPU kernel on 16 tensors), on 1 thread
    and on all cores (``threads`` overrides): the wall-clock median of ``rounds`` steps after
    two warm-up steps. The host step of optimizer offload, per node."""
    from meshplan.runtime.optim import _intra_op_threads

    counts = sorted(set(threads or (1, os.cpu_count() or 1)))
    size = max(1, params // 16)
    weights = [torch.zeros(size) for _ in range(16)]
    for weight in weights:
        weight.grad = torch.full_like(weight, 1e-3)
    adam = torch.optim.AdamW(weights, lr=1e-3, fused=True)
    out = []
    for count in counts:
        with _intra_op_threads(count):
            seconds = []
            for done in range(rounds + 2):
                start = time.perf_counter()
                adam.step()
                if done >= 2:
                    seconds.append(time.perf_counter() - start)
        out.append((count, size * 16, float(sorted(seconds)[len(seconds) // 2])))
    return tuple(out)


# ----- collectives -------------------------------------------------------------------------------
def _group_sizes(count: int) -> list[int]:
    powers = [2 ** k for k in range(1, count.bit_length()) if 2 ** k <= count]
    return powers + ([count] if count >= 2 and count not in powers else [])


def measured_groups(node_of: Sequence[int]) -> list[tuple[str, tuple[int, ...]]]:
    """(link, ranks) of every group ``profile`` times, given each rank's node index.

    ``intra``: the first g ranks of rank 0's node; ``inter``: the first rank of each of the
    first m nodes (rank 0's node first); g, m = 2, 4, 8, ... and the full count. Every group
    holds rank 0, which times them. Example: two nodes of two ranks, ``node_of = (0, 0, 1, 1)``
    gives ``[("intra", (0, 1)), ("inter", (0, 2))]``.
    """
    nodes = list(dict.fromkeys([node_of[0], *sorted(set(node_of))]))
    members = {node: [r for r, n in enumerate(node_of) if n == node] for node in nodes}
    leaders = [members[node][0] for node in nodes]
    return ([("intra", tuple(members[nodes[0]][:g])) for g in _group_sizes(len(members[nodes[0]]))]
            + [("inter", tuple(leaders[:m])) for m in _group_sizes(len(leaders))])


def calls_for(size_bytes: int, calls: int) -> int:
    """Timed calls per round of a collective on ``size_bytes``: ``calls``, times
    ``SMALL_MESSAGE_BYTES / size_bytes`` below that size, at most ``MAX_CALL_FACTOR`` x.
    A function of the size only, so every rank of a group makes the same calls."""
    return calls * min(MAX_CALL_FACTOR, max(1, SMALL_MESSAGE_BYTES // size_bytes))


def collective_cases(groups: Sequence[tuple[str, tuple[int, ...]]], sizes: Sequence[int]
                     ) -> list[tuple[str, str, tuple[int, ...], int]]:
    """(link, op, ranks, size_bytes) of every timed collective; send_recv on 2-rank groups."""
    return [(link, op, ranks, size) for link, ranks in groups for op in COLLECTIVES
            if op != "send_recv" or len(ranks) == 2 for size in sizes]


def _collective_call(op: str, size_bytes: int, *, ranks: tuple[int, ...], group: object,
                     device: torch.device) -> Callable[[], None]:
    """One call of ``op`` on ``size_bytes`` (see ``Measurements.collectives``) in ``group``."""
    world = len(ranks)
    elems = max(world, size_bytes // 4) // world * world
    buf = torch.ones(elems, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(buf, group=group)
    if op == "all_gather":
        outs = list(torch.empty_like(buf).chunk(world))
        return lambda: dist.all_gather(outs, buf[: elems // world], group=group)
    if op == "reduce_scatter":
        out = torch.empty(elems // world, device=device)
        return lambda: dist.reduce_scatter(out, list(buf.chunk(world)), group=group)
    if op == "all_to_all":
        out = torch.empty_like(buf)
        return lambda: dist.all_to_all_single(out, buf, group=group)
    first = dist.get_rank() == ranks[0]
    peer = ranks[1] if first else ranks[0]

    def ping_pong() -> None:  # two one-way transfers
        if first:
            dist.send(buf, peer, group=group), dist.recv(buf, peer, group=group)
        else:
            dist.recv(buf, peer, group=group), dist.send(buf, peer, group=group)
    return ping_pong


def time_collectives_here(node_of: Sequence[int], sizes: ProfileSizes, *, device: torch.device,
                          on_round: Callable[[int], None] = lambda k: None,
                          before_timing: Callable[[], object] = lambda: None
                          ) -> list[tuple[str, str, int, float, float]] | None:
    """This rank's part of every collective case; rank 0 gets ``Measurements.collectives``,
    the others None. Needs an initialised default process group on every rank;
    ``before_timing`` runs once the groups exist."""
    rank, timer = dist.get_rank(), _call_timer(device)
    groups = measured_groups(node_of)
    handles = {ranks: dist.new_group(list(ranks)) for _, ranks in groups}
    before_timing()
    cases = collective_cases(groups, sizes.collective_bytes)
    samples: dict[tuple, list[list[float]]] = {case: [] for case in cases}
    for done in range(1, sizes.rounds + 1):
        for case in cases:
            link, op, ranks, size = case
            if rank in ranks:
                fn = _collective_call(op, size, ranks=ranks, group=handles[ranks], device=device)
                fn()
                samples[case].append([timer(fn) / (2 if op == "send_recv" else 1)
                                      for _ in range(calls_for(size, sizes.calls))])
        on_round(done)
    dist.barrier()
    if rank != 0:
        return None
    return [(link, op, len(ranks), float(size),
             median_of_minima(samples[link, op, ranks, size]))
            for link, op, ranks, size in cases]


@contextlib.contextmanager
def _worker_malloc_env():
    """Spawn the collective processes with the allocator setting of the runtime's CPU workers
    (``launch.CPU_MALLOC_DEFAULTS``, unless the user set them): gloo's per-call buffers then
    come from fresh pages as they do in training, which slows its large transfers several
    times (an all-gather of 234 MiB over two processes here: 0.27 GB/s received with it,
    1.6 GB/s fitted on the default allocator); this process keeps its own."""
    from meshplan.runtime.launch import CPU_MALLOC_DEFAULTS

    added = {k: v for k, v in CPU_MALLOC_DEFAULTS.items()
             if k not in os.environ and not torch.cuda.is_available()}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _local_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def local_processes(requested: int | None) -> int:
    """Processes for the local collectives: ``requested``, else 2 on the CPU and one per GPU
    (at most ``MAX_LOCAL_GPUS``) on CUDA. ValueError when CUDA has fewer GPUs than
    requested: NCCL needs a GPU per process, and gloo on the host would measure the wrong
    link."""
    if not torch.cuda.is_available():
        return requested or 2
    gpus = torch.cuda.device_count()
    if requested is not None and requested > gpus:
        raise ValueError(f"--nproc-per-node {requested}: this machine has {gpus} GPU(s) and "
                         f"NCCL needs one per process; pass at most {gpus}")
    return requested or min(gpus, MAX_LOCAL_GPUS)


def _pin_to_own_core(rank: int, world: int) -> None:
    """Keep local gloo rank ``rank`` on one core of its own when there are enough.

    Left to the scheduler, the ranks and their gloo threads move between cores and a whole
    run settles into one of two speeds: on this 2-core machine all-to-all and send/recv of
    4 MiB took about 1.0 or 0.6-0.7 ms per run, pinned about 0.7 ms every time.
    """
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) >= world:
        os.sched_setaffinity(0, {cores[rank]})


def _spawned_rank(rank: int, world: int, port: int, sizes: ProfileSizes, timeout_s: float,
                  results: "mp.Queue", go: "mp.Event") -> None:
    backend = _local_backend()
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    else:
        _pin_to_own_core(rank, world)
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=dt.timedelta(seconds=timeout_s))
    try:
        def wait_for_go() -> None:
            if not go.wait(timeout_s):
                raise RuntimeError(f"no start signal within {timeout_s:.0f} s")

        out = time_collectives_here((0,) * world, sizes, device=device,
                                    on_round=lambda k: results.put(("round", k)) if rank == 0
                                    else None, before_timing=wait_for_go)
        if rank == 0:
            results.put(("done", out))
    finally:
        dist.destroy_process_group()


def time_collectives(nproc: int, sizes: ProfileSizes, *, timeout_s: float,
                     on_round: Callable[[int], None] = lambda k: None,
                     meanwhile: Callable[[], T] = lambda: None
                     ) -> tuple[list[tuple[str, str, int, float, float]], T]:
    """(``Measurements.collectives`` over ``nproc`` local processes (``intra`` only), what
    ``meanwhile`` returned). ``meanwhile`` runs here while the processes start (seconds of
    torch imports); they time nothing before it returns.

    RuntimeError if a process fails or the whole measurement exceeds ``timeout_s``.
    """
    if nproc < 2:
        raise ValueError(f"collectives need >= 2 processes, got --nproc-per-node {nproc}")
    ctx = mp.get_context("spawn")
    results, go = ctx.Queue(), ctx.Event()
    port = _free_port()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    procs = [ctx.Process(target=_spawned_rank, daemon=True,
                         args=(r, nproc, port, sizes, timeout_s, results, go))
             for r in range(nproc)]
    with _worker_malloc_env():
        for proc in procs:
            proc.start()
    deadline = time.monotonic() + timeout_s
    try:
        done_meanwhile = meanwhile()
        go.set()
        while True:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError(f"a collective-profiling process failed (exit codes "
                                   f"{[p.exitcode for p in procs]})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"collective profiling exceeded {timeout_s:.0f} s")
            try:
                kind, value = results.get(timeout=0.5)
            except queue.Empty:
                continue
            if kind == "done":
                break
            on_round(value)
        for proc in procs:
            proc.join(timeout=JOIN_TIMEOUT_S)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    return value, done_meanwhile


# ----- the whole measurement ---------------------------------------------------------------------
class Progress:
    """One self-overwriting line on stderr: ``profile [k/n] what``; silent if not ``shown``."""

    def __init__(self, total: int, *, stream=sys.stderr, shown: bool = True) -> None:
        self.total, self.done, self.stream, self.shown = total, 0, stream, shown

    def step(self, what: str) -> None:
        self.done += 1
        if self.shown:
            self.stream.write(f"\rprofile [{self.done}/{self.total}] {what:<40}")
            self.stream.flush()

    def close(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()


def steps_of(sizes: ProfileSizes, *, collectives: bool = True) -> int:
    """Progress steps ``measure`` takes: a compute and a collective step per round."""
    return sizes.rounds * (2 if collectives else 1)


def _time_this_device(dtype: str, sizes: ProfileSizes, device: torch.device,
                      step: Callable[[str], None]) -> dict:
    """GEMMs, the copy and (CUDA) host copies of this process, one thread on the CPU."""
    threads_before = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        compute = time_compute(dtype=DTYPES[dtype], sizes=sizes, device=device,
                               on_round=lambda k: step(f"compute round {k}/{sizes.rounds}"))
        host = time_host_copies(sizes.host_copy_bytes, rounds=sizes.rounds, calls=sizes.calls)
    finally:
        torch.set_num_threads(threads_before)
    return dict(**compute, host_copy=host)


def measure(*, dtype: str, sizes: ProfileSizes, nproc: int, timeout_s: float = 120.0,
            progress: Progress | None = None) -> Measurements:
    """Time this device in this process (while the collective processes start) and
    collectives over ``nproc`` local processes (none with ``nproc`` 1)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    step = progress.step if progress else (lambda what: None)
    this_device = functools.partial(_time_this_device, dtype, sizes, device, step)
    if nproc > 1:
        colls, compute = time_collectives(
            nproc, sizes, timeout_s=timeout_s, meanwhile=this_device,
            on_round=lambda k: step(f"collectives round {k}/{sizes.rounds}"))
    else:
        colls, compute = [], this_device()
    # on all cores: after the collective processes ended, which would compete for them
    adam = time_host_adam(sizes.host_adam_params, rounds=sizes.rounds)
    return Measurements(device_key=device_key(), dtype=dtype, **compute, host_adam=adam,
                        collectives=tuple(colls),
                        backend=_local_backend() if nproc > 1 else "",
                        procs_per_node=nproc, topology=detect_topology(),
                        samples_per_case=sizes.rounds * sizes.calls)


def measure_distributed(*, dtype: str, sizes: ProfileSizes, timeout_s: float = 120.0,
                        progress: Progress | None = None) -> Measurements | None:
    """Under torchrun: rank 0 times its device while the others wait, then every process
    times the collectives; rank 0 returns the measurements, the others None."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else \
        torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=dt.timedelta(seconds=timeout_s))
    step = progress.step if progress and rank == 0 else (lambda what: None)
    try:
        node_of: list[int] = [0] * world
        dist.all_gather_object(node_of, int(os.environ.get("GROUP_RANK", 0)))
        compute = _time_this_device(dtype, sizes, device, step) if rank == 0 else {}
        if rank == 0:  # the node's cores, while the other ranks wait in the barrier
            compute["host_adam"] = time_host_adam(sizes.host_adam_params, rounds=sizes.rounds)
        dist.barrier()
        colls = time_collectives_here(node_of, sizes, device=device, on_round=lambda k: step(
            f"collectives round {k}/{sizes.rounds}"))
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return None
    nodes = len(set(node_of))
    return Measurements(device_key=device_key(), dtype=dtype, **compute,
                        collectives=tuple(colls), backend="nccl" if cuda else "gloo",
                        nodes=nodes, procs_per_node=world // nodes,
                        topology=detect_topology(nodes=nodes),
                        samples_per_case=sizes.rounds * sizes.calls)
