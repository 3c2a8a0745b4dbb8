"""Fixtures of the launch tests: a tiny dp2 plan file, and a real SLURM cluster on this machine.

``slurm_cluster`` (once per session) runs Debian's slurm-wlm (22.05 on bookworm) as two SLURM
nodes on this one host: Debian builds slurmd with multiple-slurmd support, so two slurmd, each
with its own ``NodeName``, port, spool and log (``slurmd -N NAME``), register with one
slurmctld, and a ``--nodes=2`` job really is two nodes with one task each -- the script
``meshplan launch`` writes runs unchanged. The nodes are named ``127.0.0.1`` and ``127.0.0.2``:
both loopback addresses, so slurmctld reaches each slurmd at its name and the job's first node
(the rendezvous host, ``scontrol show hostnames``) resolves without DNS or /etc/hosts entries.
Each node gets half of the CPUs and memory ``slurmd -C`` reports.

Nothing of the machine's own SLURM or munge is used or changed: the cluster has its own munged
(own key and socket, ``AuthInfo=socket=...``), free ports, and its state, spool and logs in a
temporary folder; ``SLURM_CONF`` points the clients (sbatch, srun, scontrol, sinfo) at it. No
accounting (no slurmdbd, so no sacct): jobs are followed with ``scontrol show job``, which keeps
a finished job for ``MinJobAge`` (300 s by default). Plugins: ``proctrack/linuxproc`` and
``task/none`` (no cgroups needed), ``select/cons_tres``.

The fixture skips, saying why, when a daemon is not installed (``.ci/run`` installs
slurm-wlm and munge as root where apt works), this is not root (slurmd starts job steps as
their user), or a daemon does not come up within ``DAEMONS_UP_S``. Teardown cancels any job
left and stops every daemon (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from meshplan.costmodel import ParallelConfig, estimate, load_cluster, load_model
from meshplan.planner.plan import Plan, write_plan
from meshplan.workflows.local import free_port

SLURM_PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo",
                  "scancel")
NODE_NAMES = ("127.0.0.1", "127.0.0.2")
DAEMONS_UP_S = 30.0
"""How long munged, slurmctld and the slurmds get to be up (nodes idle in sinfo)."""
CLIENT_TIMEOUT_S = 30.0
"""Bound on each sinfo / scontrol / scancel call."""
STOP_S = 10.0
"""How long a daemon gets after SIGTERM before SIGKILL."""
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                          "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"})
MUNGE_KEY_BYTES = 1024


@pytest.fixture
def dp2_plan(tmp_path) -> Path:
    """A plan of the ``tiny`` model, dp=2 (ZeRO-3), on the ``cpu`` cluster of 2 "GPUs" per
    node: 2 processes in all (batch 8, sequence 64, fp32)."""
    config = ParallelConfig(dp=2, zero_stage=3, global_batch_size=8, seq_len=64, dtype="fp32")
    est = estimate(load_model("tiny"), load_cluster("cpu", gpus_per_node=2), config)
    path = tmp_path / "dp2.json"
    write_plan(Plan.from_estimate(est, provenance={"source": "tests/workflows"}), path)
    return path


@dataclass(frozen=True)
class SlurmCluster:
    """The running test cluster: its ``slurm.conf`` and its log folder."""

    conf: Path
    root: Path

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def client(self, *argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(argv, capture_output=True, text=True, env=self.env,
                              timeout=CLIENT_TIMEOUT_S)

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o ID`` as a dict (``JobState``, ``NodeList``, ``ExitCode``)."""
        done = self.client("scontrol", "show", "job", "-o", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", done.stdout))

    def wait(self, job_id: str, *, timeout_s: float) -> dict[str, str]:
        """The job once it is in a final state; cancelled (and its state then) after
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.job(job_id)
            if state.get("JobState") in FINAL_STATES:
                return state
            time.sleep(1.0)
        self.client("scancel", job_id)
        return self.job(job_id)

    def logs(self) -> str:
        """The tails of the daemons' logs, for a failure message."""
        tails = [f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace")
                                                  .splitlines()[-15:])
                 for log in sorted([*self.root.glob("*.log"), *self.root.glob("*.out")])]
        return "\n".join(tails)


def _short_hostname() -> str:
    """This host's name as slurmctld compares it with ``SlurmctldHost``."""
    return socket.gethostname().split(".")[0]


def _hardware() -> tuple[int, int]:
    """CPUs and RealMemory (MiB) of this machine, as ``slurmd -C`` reports them."""
    text = subprocess.run(["slurmd", "-C"], capture_output=True, text=True,
                          timeout=CLIENT_TIMEOUT_S).stdout
    values = dict(re.findall(r"(CPUs|RealMemory)=(\d+)", text))
    return int(values.get("CPUs", 1)), int(values.get("RealMemory", 1024))


def _slurm_conf(root: Path, munge_socket: Path) -> str:
    cpus, memory_mib = _hardware()
    nodes = [f"NodeName={name} NodeHostname={_short_hostname()} Port={free_port()} "
             f"CPUs={max(1, cpus // len(NODE_NAMES))} "
             f"RealMemory={max(1, memory_mib // len(NODE_NAMES))} State=UNKNOWN"
             for name in NODE_NAMES]
    return "\n".join([
        "ClusterName=meshplan-test",
        f"SlurmctldHost={_short_hostname()}(127.0.0.1)",
        f"SlurmctldPort={free_port()}",
        "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", f"AuthInfo=socket={munge_socket}", "CredType=cred/munge",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool-%n",
        f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/builtin", "MpiDefault=none", "ReturnToService=2",
        "MailProg=/bin/true", "KillWait=5",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none", "SwitchType=switch/none",
        *nodes,
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ""])


def _daemon(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _stop(daemons: list[subprocess.Popen]) -> None:
    for proc in daemons:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in daemons:
        try:
            proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=STOP_S)


def _wait_until(ready, daemons: list[subprocess.Popen]) -> bool:
    deadline = time.monotonic() + DAEMONS_UP_S
    while time.monotonic() < deadline:
        if any(proc.poll() is not None for proc in daemons):
            return False
        if ready():
            return True
        time.sleep(0.5)
    return False


def _start_cluster(root: Path, daemons: list[subprocess.Popen]) -> SlurmCluster:
    """Start munged, slurmctld and the slurmds into ``daemons``; the cluster once every node
    is idle, else ``pytest.skip`` (the caller stops what started)."""
    munge = root / "munge"
    munge.mkdir(mode=0o755)
    key = munge / "munge.key"
    key.write_bytes(os.urandom(MUNGE_KEY_BYTES))
    key.chmod(0o400)
    munge_socket = munge / "munge.socket"
    daemons.append(_daemon(["munged", "--foreground", "--force", f"--key-file={key}",
                            f"--socket={munge_socket}", f"--pid-file={munge}/munged.pid",
                            f"--seed-file={munge}/munged.seed",
                            f"--log-file={root}/munged.log"], root / "munged.out"))
    cluster = SlurmCluster(conf=root / "slurm.conf", root=root)
    if not _wait_until(munge_socket.exists, daemons):
        pytest.skip(f"SLURM test cluster: munged did not start\n{cluster.logs()}")
    cluster.conf.write_text(_slurm_conf(root, munge_socket))
    (root / "state").mkdir()
    daemons.append(_daemon(["slurmctld", "-D", "-f", str(cluster.conf)],
                           root / "slurmctld.out"))
    for name in NODE_NAMES:
        (root / f"spool-{name}").mkdir()
        daemons.append(_daemon(["slurmd", "-D", "-N", name, "-f", str(cluster.conf)],
                               root / f"slurmd-{name}.out"))

    def idle() -> bool:
        done = cluster.client("sinfo", "-h", "-N", "-o", "%N %T")
        states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
        return all(states.get(name) == "idle" for name in NODE_NAMES)

    if not _wait_until(idle, daemons):
        pytest.skip(f"SLURM test cluster: slurmctld and {len(NODE_NAMES)} slurmd did not come "
                    f"up (a daemon exited, or the nodes were not idle within "
                    f"{DAEMONS_UP_S:.0f} s)\n{cluster.logs()}")
    return cluster


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory) -> Iterator[SlurmCluster]:
    missing = [name for name in SLURM_PROGRAMS if shutil.which(name) is None]
    if missing:
        pytest.skip(f"SLURM test cluster: {', '.join(missing)} not installed (apt-get install "
                    f"slurm-wlm munge; .ci/run does it as root)")
    if os.geteuid() != 0:
        pytest.skip("SLURM test cluster: slurmd must run as root (it starts job steps as "
                    "their user)")
    root = tmp_path_factory.mktemp("slurm")
    daemons: list[subprocess.Popen] = []
    try:
        cluster = _start_cluster(root, daemons)
        yield cluster
        cluster.client("scancel", "--full", f"--user={os.getuid()}")
    finally:
        _stop(daemons)
