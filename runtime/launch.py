"""``meshplan run``: start torchrun for a plan, or be the worker when already under torchrun.

Outside torchrun (no RANK / WORLD_SIZE in the environment) ``run`` checks the plan against the
launch (world size = nproc-per-node x nnodes must equal tp*cp*dp*pp, else ValueError before
anything starts) and runs ``python -m torch.distributed.run`` with ``python -m meshplan.runtime.worker``
as the program: one node uses a c10d rendezvous on 127.0.0.1 with a free port (torchrun's
``--standalone``, without its ``localhost`` lookup); several nodes pass ``--nnodes``,
``--rdzv-endpoint`` and ``--rdzv-id`` through. ``OMP_NUM_THREADS=1`` is set for the workers
(each also calls ``torch.set_num_threads(1)`` on the CPU). Under torchrun (e.g.
``torchrun --nproc-per-node 8 $(which meshplan) run plan.json``) ``run`` is the worker itself.

Fault tolerance: ``--max-restarts K`` (default 0: one failing rank ends the job) lets torchrun
restart all workers up to K times after a failure; the restarted workers resume from the latest
checkpoint in ``--checkpoint-dir`` (train.py, checkpoint.py). Each attempt then gets its own
rendezvous store (``FRESH_STORE_PER_ATTEMPT``; set it yourself when starting torchrun by hand).
Checkpoint flags are checked here, before torchrun starts (``checkpoint.check_start``):
``--resume`` without a checkpoint, or with one of another data stream or model, is refused.

torch APIs: ``torch.distributed.run`` (torchrun) with ``--max-restarts``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import dataclasses
from dataclasses import dataclass

import torch

from meshplan.planner.plan import Plan, read_plan
from meshplan.runtime import agent, checkpoint
from meshplan.runtime import hf
from meshplan.runtime import recipe as recipe_mod
from meshplan.runtime import mesh as mesh_mod
from meshplan.runtime import preflight
from meshplan.runtime.report import RunReport, read_report
from meshplan.runtime.train import RunOptions, plan_data
from meshplan.runtime.worker import Job, run_job_or_exit, under_torchrun

STOP_GRACE_S = 10.0
"""Seconds torchrun and its workers get after SIGTERM before they are killed."""
NCCL_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",  # a failed or timed-out collective ends the rank
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",  # flight recorder: the last 2000 collectives
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",       # ... dumped by every rank on a timeout
}
"""NCCL error handling and flight recorder, as torchtitan sets them (torch 2.13 names)."""
CPU_MALLOC_DEFAULTS = {"MALLOC_MMAP_THRESHOLD_": str(64 * 2 ** 10)}
"""glibc allocator setting of CPU workers (a value the user set wins). By default glibc raises
its mmap threshold to the size of each mmapped block it frees (up to 32 MiB), so the
repeated multi-MB buffers of a training step (FSDP2's gathered parameters, gradients, gloo
staging) then come from the heap, and freed heap memory stays resident: measured on the
8-process 0.32 B run of ``benchmarks/large_cpu_rss.py``, peak RSS sat 350-550 MiB above
live tensors plus the fixed launch overhead. A fixed 64 KiB threshold returns every
larger block to the system when it is freed: RSS then tracks live tensors to within a few MiB
(same benchmark). On CUDA the device allocator holds the big buffers and pinned host memory
does not go through malloc, so GPU workers keep glibc's default."""
FLIGHT_RECORDER_FILE = "TORCH_FR_DUMP_TEMP_FILE"
LOCAL_ENDPOINT = "127.0.0.1:0"
"""Single-node rendezvous: loopback, port chosen by the agent."""
FRESH_STORE_PER_ATTEMPT = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""Set to 1 when restarts are allowed: by default the workers of every attempt share the
rendezvous' TCPStore, where the first attempt's process-group keys remain; the restarted
workers then read dead peers' addresses and fail to build the mesh's sub-groups (torch 2.13,
gloo: "connectFullMesh failed ... Connection refused"). With it, each attempt gets a new store."""


@dataclass(frozen=True, kw_only=True)
class Launch:
    """How many processes, on how many nodes, meeting where."""

    nproc_per_node: int | None = None
    """Processes on this node; None: the plan's world size divided by ``nnodes``."""
    nnodes: int = 1
    """Nodes; with ``max_nnodes`` the fewest an elastic job runs on."""
    max_nnodes: int | None = None
    """The most nodes of an elastic job (``--nnodes MIN:MAX``); None: exactly ``nnodes``."""
    rdzv_conf: str | None = None
    """torchrun's ``--rdzv-conf`` (e.g. ``join_timeout=600,last_call_timeout=30``)."""
    rdzv_endpoint: str | None = None
    """host:port of the c10d rendezvous; None on one node means 127.0.0.1 and a free port."""
    rdzv_id: str | None = None
    """Job id shared by all nodes; None picks a fresh one (single node only)."""
    max_restarts: int = 0
    """Times torchrun restarts the workers after a failure (they resume from a checkpoint)."""
    oversubscribe: bool = False
    """Allow more processes than CPU cores on the cpu cluster (``preflight.check_devices``)."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.nnodes < 1 or (self.max_nnodes is not None and self.max_nnodes < self.nnodes):
            raise ValueError(f"--nnodes {self.nodes_arg}: need 1 <= MIN <= MAX")
        if self.most_nodes > 1 and (self.rdzv_endpoint is None or self.rdzv_id is None):
            raise ValueError(f"--nnodes {self.nodes_arg} needs --rdzv-endpoint HOST:PORT and "
                             "--rdzv-id ID (the same on every node)")

    @property
    def elastic(self) -> bool:
        """``--nnodes MIN:MAX`` with MIN < MAX: membership may change (elastic.py)."""
        return self.max_nnodes is not None and self.max_nnodes > self.nnodes

    @property
    def most_nodes(self) -> int:
        return self.max_nnodes if self.max_nnodes is not None else self.nnodes

    @property
    def nodes_arg(self) -> str:
        """torchrun's ``--nnodes`` value: N or MIN:MAX."""
        return f"{self.nnodes}:{self.max_nnodes}" if self.max_nnodes is not None else str(
            self.nnodes)


def processes_per_node(launch: Launch, world_size: int) -> int:
    """``nproc_per_node``, or the plan's world size spread over ``nnodes``."""
    if launch.nproc_per_node is not None:
        return launch.nproc_per_node
    if world_size % launch.nnodes:
        raise ValueError(f"the plan's {world_size} processes do not divide over "
                         f"{launch.nnodes} nodes; give --nproc-per-node")
    return world_size // launch.nnodes


def torchrun_command(job: Job, launch: Launch, *, nproc_per_node: int) -> list[str]:
    """The ``python -m meshplan.runtime ... -m meshplan.runtime.worker <job>`` command line
    (``runtime/__main__.py`` runs ``agent``: torchrun that ends quietly on an error a worker
    recorded)."""
    conf = ["--rdzv-conf", launch.rdzv_conf] if launch.rdzv_conf else []
    return [sys.executable, "-m", "meshplan.runtime",
            "--nnodes", launch.nodes_arg, "--nproc-per-node", str(nproc_per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", launch.rdzv_endpoint or LOCAL_ENDPOINT,
            "--rdzv-id", launch.rdzv_id or uuid.uuid4().hex, *conf,
            "--max-restarts", str(launch.max_restarts),
            "-m", "meshplan.runtime.worker", job.to_json()]


def worker_environment(options: RunOptions, launch: Launch,
                       base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of torchrun and its workers.

    PYTHONSAFEPATH: torchrun and its workers do not put the working directory first on
    sys.path, so a user's own `meshplan/` (or any) package there cannot replace meshplan's
    code inside the workers; a user's model factory is still found (load_factory appends it).
    On CUDA, NCCL's asynchronous error handling and flight recorder are on (``NCCL_DEFAULTS``;
    a value the user set wins): a collective that times out ends its process instead of
    hanging, and every rank dumps its last collectives to ``flight_recorder_prefix``. On the
    CPU, glibc returns large freed blocks at once (``CPU_MALLOC_DEFAULTS``) and the workers
    are forks of one preloaded interpreter (``agent.START_ENV``, ``prefork.py``).
    """
    env = dict(os.environ if base is None else base, OMP_NUM_THREADS="1", PYTHONSAFEPATH="1")
    if launch.max_restarts or launch.elastic:
        env[FRESH_STORE_PER_ATTEMPT] = "1"
    if torch.cuda.is_available():
        for key, value in NCCL_DEFAULTS.items():
            env.setdefault(key, value)
        env.setdefault(FLIGHT_RECORDER_FILE, flight_recorder_prefix(options))
    else:
        for key, value in CPU_MALLOC_DEFAULTS.items():
            env.setdefault(key, value)
        env.setdefault(agent.START_ENV, "forkserver")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def flight_recorder_prefix(options: RunOptions) -> str:
    """Where NCCL's flight recorder dumps (``<prefix><rank>``): the checkpoint folder's
    ``flight_recorder/``, else the temporary folder's ``meshplan-flight-recorder/``."""
    root = options.checkpoint_dir or tempfile.gettempdir()
    name = "flight_recorder" if options.checkpoint_dir else "meshplan-flight-recorder"
    folder = os.path.join(os.path.abspath(root), name)
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, "rank_")


def _descendants(pid: int) -> list[int]:
    """Process ids below ``pid`` (children first), read from /proc (Linux; [] elsewhere)."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found


def _kill(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def stop(proc: subprocess.Popen, *, grace_s: float = STOP_GRACE_S) -> None:
    """End torchrun ``proc`` and every process below it: SIGTERM to torchrun's process group
    and to each worker (torchrun starts each in a session of its own), then, after
    ``grace_s``, SIGKILL to any still alive. The workers' pids are taken first, while they are
    still torchrun's children."""
    tree = _descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    _kill(tree, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and (proc.poll() is None or _alive(tree)):
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    _kill([pid for pid in tree if _alive([pid])], signal.SIGKILL)
    proc.wait()


def _alive(pids: list[int]) -> bool:
    """True when one of ``pids`` is still running (not a zombie)."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as handle:
                if handle.read().rsplit(")", 1)[1].split()[0] != "Z":
                    return True
        except OSError:
            continue
    return False


RENDEZVOUS_ENDED = ("RendezvousTimeoutError", "RendezvousClosedError")
"""What torchrun's agent raises when too few nodes joined within ``join_timeout`` (or the
rendezvous was closed): seen on its stderr, the job ended for want of nodes."""


def _forward(stream, seen: list[str]) -> None:
    for line in stream:
        sys.stderr.write(line)
        if any(name in line for name in RENDEZVOUS_ENDED):
            seen.append(line)
    sys.stderr.flush()


class TooFewNodes(Exception):
    """An elastic job stopped because fewer than its minimum of nodes met at the rendezvous."""

    def __init__(self, launch: Launch, options: RunOptions) -> None:
        directory = options.checkpoint_dir
        step = checkpoint.latest_step(directory) if directory and os.path.isdir(
            directory) else None
        kept = (f"its last checkpoint {checkpoint.step_dir(directory, step)} is intact; start "
                f"the job again with --resume" if step is not None else "no checkpoint was "
                "saved")
        super().__init__(f"fewer than {launch.nnodes} nodes (--nnodes {launch.nodes_arg}) met "
                         f"at the rendezvous within its join timeout; the job stopped, {kept}")


class WorkerRefused(Exception):
    """A worker ended the job on an error it recorded (``agent.report_error``): one line for
    the user and the worker's exit code (2 refused input, 3 training diverged)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class Stopped(Exception):
    """``meshplan run`` got SIGTERM or SIGINT; torchrun and its workers were ended."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def start(job: Job, launch: Launch, *, nproc_per_node: int) -> int:
    """Run torchrun for ``job`` and wait; output goes to this process's stdout and stderr.

    Returns torchrun's exit code; ``WorkerRefused`` when a worker recorded why it ended the
    job, ``TooFewNodes`` when an elastic rendezvous ended for want of nodes. SIGTERM or SIGINT to this process (or its process group)
    ends torchrun and every worker within ``STOP_GRACE_S`` seconds (``stop``) and raises
    ``Stopped``; a checkpoint being written then stays uncommitted, ``latest`` keeps naming
    the last complete one (checkpoint.py).
    """
    with tempfile.TemporaryDirectory(prefix="meshplan-agent-") as scratch:
        error_file = os.path.join(scratch, "error.json")
        env = dict(worker_environment(job.options, launch), **{agent.ERROR_FILE: error_file})
        code = _start(job, launch, nproc_per_node=nproc_per_node, env=env)
        recorded = agent.read_error(error_file) if code else None
    if recorded is not None and recorded.get("kind") == agent.TOO_FEW_NODES:
        raise TooFewNodes(launch, job.options)
    if recorded is not None:
        raise WorkerRefused(int(recorded["code"]), str(recorded["message"]))
    return code


def _start(job: Job, launch: Launch, *, nproc_per_node: int, env: dict[str, str]) -> int:
    watch = launch.elastic
    proc = subprocess.Popen(torchrun_command(job, launch, nproc_per_node=nproc_per_node),
                            env=env, start_new_session=True,
                            stderr=subprocess.PIPE if watch else None,
                            text=True if watch else None, errors="replace" if watch else None)
    seen: list[str] = []
    forwarder = None
    if watch:  # copy torchrun's stderr through, noting how a rendezvous ended
        forwarder = threading.Thread(target=_forward, args=(proc.stderr, seen), daemon=True)
        forwarder.start()
    received: list[int] = []

    def on_signal(signum, frame):
        received.append(signum)
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = proc.wait()
        if forwarder is not None:
            forwarder.join(timeout=10)
        if code and seen:
            raise TooFewNodes(launch, job.options)
        return code
    except Stopped:
        stop(proc)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:  # any other way out of the wait
            stop(proc)


@dataclass(frozen=True)
class RunResult:
    """Exit code of ``run`` and the report, where this process can read it (rank 0's node)."""

    exit_code: int
    report: RunReport | None


def run(plan_path: str, *, options: RunOptions, launch: Launch, report: str | None = None,
        json_output: bool = False) -> RunResult:
    """``meshplan run``: exit code 0 (ok), 1 (a worker failed); ValueError when refused.

    Every process reads the plan file once: this one (which checks it before anything starts)
    and, when it starts torchrun, each worker (which cannot share this process's objects).

    The report is returned where this process can read it (the launching process, or rank 0
    under torchrun), also without a ``report`` path (a temporary file carries it). With
    ``json_output`` progress lines go to stderr.
    """
    plan = read_plan(plan_path)
    mesh_mod.check_supported(plan.config, plan.model)
    recipe_mod.check_dtype(plan.config.dtype)
    preflight.check_data(plan_data(plan, options))
    preflight.check_checkpoint_dir(options.checkpoint_dir)
    if options.init_from:
        hf.check_directory(options.init_from, plan.model)
    if options.save_hf:
        hf.check_savable(plan.model)
    _check_checkpoint_flags(plan, options)
    if not under_torchrun():
        if launch.elastic:  # each attempt replans for the nodes present (elastic.py)
            nproc = launch.nproc_per_node or plan.cluster.gpus_per_node
        else:
            nproc = processes_per_node(launch, plan.config.world_size)
            mesh_mod.check_world_size(plan.config, nproc * launch.nnodes)
        preflight.check_devices(plan, nproc_per_node=nproc,
                                cuda_devices=torch.cuda.device_count(),
                                oversubscribe=launch.oversubscribe)
    elif not options.elastic:
        mesh_mod.check_world_size(plan.config, int(os.environ["WORLD_SIZE"]))
    with tempfile.TemporaryDirectory(prefix="meshplan-run-") as scratch:
        path = os.path.abspath(report) if report else os.path.join(scratch, "report.json")
        job = Job(plans=(os.path.abspath(plan_path),), reports=(path,), options=options,
                  progress_to_stderr=json_output)
        if under_torchrun():  # this process is a worker: the plan it read is the job's
            code = run_job_or_exit(job, plans=[plan])
            rank0 = os.environ["RANK"] == "0"
            return RunResult(code, _read_report(path) if code == 0 and rank0 else None)
        code = start(job, launch, nproc_per_node=nproc)
        return RunResult(code, _read_report(path) if code == 0 else None)


def _check_checkpoint_flags(plan: Plan, options: RunOptions) -> None:
    """ValueError when the checkpoint flags cannot work for this plan (``check_start``)."""
    checkpoint.check_start(options.checkpoint_dir, resume=options.resume,
                           saving=options.checkpoint_every > 0,
                           restarted=checkpoint.torchrun_restarts() > 0,
                           data=checkpoint.data_stream(plan_data(plan, options)),
                           model=checkpoint.architecture(plan.model),
                           recipe=dataclasses.asdict(options.recipe), steps=options.steps,
                           run_id=options.run_id if options.elastic else None)


def _read_report(path: str | None) -> RunReport | None:
    if path is None or not os.path.exists(path):
        return None
    return read_report(path)
