"""``meshplan launch --scheduler local``: N "nodes" on this machine, one ``meshplan run`` process
each, meeting at a c10d rendezvous on 127.0.0.1 -- a multi-node job without a cluster, for
trying a launch (or an elastic run) before queueing it.

Each node runs in a session of its own; its output goes to this process's stdout and stderr,
each line prefixed ``[node<i>] ``, or, with a log folder, to ``<folder>/node<i>.log``. SIGTERM
or SIGINT to this process is passed on as SIGTERM to every node (whose ``meshplan run`` then
ends its torchrun and workers); a node that does not end in time is killed with its process
tree (``runtime.launch.stop``, imported only then: torch is seconds of CPU, and this process
only starts and watches processes). The result says which signal ended the nodes. Without
elastic, the first node to fail ends the others (as ``srun --kill-on-bad-exit``), rather than
leaving them to wait for it until their process-group timeout.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

from meshplan.workflows.launch import Nodes, Rendezvous, node_command

LOOPBACK = "127.0.0.1"
POLL_S = 0.2
"""Seconds between looks at the nodes while they run."""
RUN_STOP_GRACE_S = 10.0
"""``runtime.launch.STOP_GRACE_S``: what a node's ``meshplan run`` gives its torchrun after
SIGTERM (a copy: importing it would import torch; tests/workflows/test_launch.py compares)."""
EXTRA_GRACE_S = 5.0
"""A node gets ``RUN_STOP_GRACE_S`` plus this after SIGTERM before it is killed."""
PUMP_JOIN_S = 10.0
"""How long the output threads may take to pass on a node's last lines after it ended."""
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
"""Dropped from the nodes' environment: with them a node's ``meshplan run`` would take itself
for a torchrun worker instead of starting torchrun."""


@dataclass(frozen=True)
class LocalResult:
    """Exit code of each node, which node failed first (None: none failed), and the signal
    that ended the nodes (None: they ended by themselves)."""

    exit_codes: tuple[int, ...]
    first_failure: int | None
    stopped_by: int | None = None

    @property
    def exit_code(self) -> int:
        """128 + the signal when stopped; else 0 when every node returned 0, else the exit
        code of the node that failed first."""
        if self.stopped_by is not None:
            return 128 + self.stopped_by
        return 0 if self.first_failure is None else self.exit_codes[self.first_failure]


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port on ``host`` that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def local_commands(plan_path: str, nodes: Nodes, run_flags: Sequence[str], *,
                   rdzv_conf: str | None = None) -> list[list[str]]:
    """The command of each of ``nodes.nodes`` local nodes: one rendezvous on 127.0.0.1 (a free
    port) under a fresh id."""
    rendezvous = Rendezvous(endpoint=f"{LOOPBACK}:{free_port()}", rdzv_id=uuid.uuid4().hex,
                            conf=rdzv_conf)
    command = node_command(os.path.abspath(plan_path), nodes, rendezvous, run_flags)
    return [list(command) for _ in range(nodes.nodes)]


def node_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without torchrun's variables, Python output unbuffered (lines pass
    through the prefixing as they come)."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k not in TORCHRUN_VARIABLES}
    return dict(env, PYTHONUNBUFFERED="1")


class _Output:
    """Passes a node's lines on to this process's stdout or stderr, prefixed, whole lines at a
    time (one lock for all nodes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def pump(self, pipe: IO[str], prefix: str, *, to_stderr: bool) -> None:
        def copy() -> None:
            for line in pipe:
                with self._lock:
                    stream = sys.stderr if to_stderr else sys.stdout
                    stream.write(prefix + line if line.endswith("\n") else f"{prefix}{line}\n")
                    stream.flush()
            pipe.close()

        thread = threading.Thread(target=copy, daemon=True)
        thread.start()
        self.threads.append(thread)


def _start(index: int, command: Sequence[str], *, env: dict[str, str], log_dir: str | None,
           output: _Output, quiet_stdout: bool) -> subprocess.Popen:
    if log_dir is not None:
        with open(os.path.join(log_dir, f"node{index}.log"), "w") as log:
            return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, errors="replace",
                            start_new_session=True)
    output.pump(proc.stdout, f"[node{index}] ", to_stderr=quiet_stdout)
    output.pump(proc.stderr, f"[node{index}] ", to_stderr=True)
    return proc


def _end(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM to every node still running; a node's ``meshplan run`` then ends its own
    torchrun and workers within ``STOP_GRACE_S`` and exits. A node still running after that
    (and ``EXTRA_GRACE_S``) is ended with its whole process tree by ``runtime.launch.stop``,
    imported only then (torch: seconds of CPU)."""
    alive = [proc for proc in procs if proc.poll() is None]
    for proc in alive:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + RUN_STOP_GRACE_S + EXTRA_GRACE_S
    while time.monotonic() < deadline and any(proc.poll() is None for proc in alive):
        time.sleep(POLL_S)
    stuck = [proc for proc in alive if proc.poll() is None]
    if stuck:
        from meshplan.runtime.launch import stop

        for proc in stuck:
            stop(proc, grace_s=EXTRA_GRACE_S)


def _wait(procs: Sequence[subprocess.Popen], *, stop_on_failure: bool) -> LocalResult:
    codes: list[int | None] = [None] * len(procs)
    first: int | None = None
    while any(code is None for code in codes):
        for index, proc in enumerate(procs):
            if codes[index] is None and (code := proc.poll()) is not None:
                codes[index] = code
                if code != 0 and first is None:
                    first = index
                    if stop_on_failure:
                        _end(procs)
        time.sleep(POLL_S)
    return LocalResult(tuple(int(code) for code in codes), first)


def _code(proc: subprocess.Popen) -> int:
    return proc.wait() if proc.returncode is None else proc.returncode


def run_nodes(commands: Sequence[Sequence[str]], *, log_dir: str | None = None,
              stop_on_failure: bool = True, quiet_stdout: bool = False,
              env: dict[str, str] | None = None) -> LocalResult:
    """Start every command as a node, wait for all; see the module docstring.

    ``log_dir``: write node i's stdout and stderr to ``log_dir/node<i>.log`` (the folder is
    created) instead of passing them on. ``quiet_stdout``: pass the nodes' stdout on to this
    process's stderr (``--json`` keeps stdout for the summary). ``env``: the nodes'
    environment (default ``node_environment()``). After SIGTERM or SIGINT every node is
    ended and the result says by which signal; must run in the main thread (it installs
    signal handlers).
    """
    if log_dir is not None:
        os.makedirs(log_dir, exist_ok=True)
    env = node_environment() if env is None else env
    output, procs = _Output(), []

    def on_signal(signum, frame):
        raise _Interrupted(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    stopped_by: int | None = None
    try:
        for index, command in enumerate(commands):
            procs.append(_start(index, command, env=env, log_dir=log_dir, output=output,
                                quiet_stdout=quiet_stdout))
        result = _wait(procs, stop_on_failure=stop_on_failure)
    except _Interrupted as interrupted:
        stopped_by = interrupted.signum
    finally:
        for sig in previous:  # a second signal must not cut the ending of the nodes short
            signal.signal(sig, signal.SIG_IGN)
        try:
            _end(procs)  # after a signal, or any other way out of the wait
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        for thread in output.threads:
            thread.join(PUMP_JOIN_S)
    if stopped_by is not None:
        return LocalResult(tuple(_code(proc) for proc in procs), None, stopped_by)
    return result
