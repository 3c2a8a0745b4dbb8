"""Elastic training on this machine: local "nodes" (one ``meshplan run`` each) meet at one c10d
rendezvous with ``--nnodes MIN:MAX``; a node is killed (or joins) at a known step; the job must
finish every step under a replanned layout with the losses of an uninterrupted run.

The membership change happens while every rank waits after step ``HOLD_AT`` (``fault.py``'s
hold: the checkpoint of step ``CHECKPOINT_EVERY`` is committed, step ``HOLD_AT`` is past it, so
``HOLD_AT - CHECKPOINT_EVERY`` steps are redone). The rendezvous settings are shortened so a
dead node is noticed in seconds (``RDZV_CONF``); every process has a bounded timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from meshplan.runtime.launch import _descendants
from meshplan.testing import run_cli

STEPS = 6
GLOBAL_BATCH = 12
"""Divides over 1 to 4 data-parallel replicas."""
CHECKPOINT_EVERY = 3
HOLD_AT = 4
LOSS_TOL = 1e-4
RDZV_CONF = ("join_timeout=90,last_call_timeout=4,close_timeout=10,keep_alive_interval=1,"
             "keep_alive_max_attempt=3")
PROCESS_TIMEOUT_S = 200
COMMON = ("--steps", str(STEPS), "--checkpoint-every", str(CHECKPOINT_EVERY), "--timeout", "30",
          "--oversubscribe")


def _plan(path: Path, *, nodes: int, gpus_per_node: int) -> Path:
    done = run_cli("plan", "--model", "tiny", "--cluster", "cpu", "--nodes", str(nodes),
                   "--gpus-per-node", str(gpus_per_node), "--global-batch", str(GLOBAL_BATCH), "--seq-len",
                   "64", "--dtype", "fp32", "--deterministic", "-o", str(path))
    assert done.code == 0, done.err
    return path


class Job:
    """Local nodes of one elastic job; each node is a ``meshplan run`` of its own."""

    started: list["Job"] = []
    """Every job of the module, ended after each test (``_end_jobs``)."""

    def __init__(self, root: Path, plan: Path, port: int, *, nnodes: str, nproc: int,
                 env: dict[str, str], rdzv_conf: str = RDZV_CONF) -> None:
        Job.started.append(self)
        self.root, self.plan, self.nnodes, self.nproc = root, plan, nnodes, nproc
        self.rdzv_conf = rdzv_conf
        self.checkpoints, self.report = root / "ckpt", root / "report.json"
        self.endpoint, self.run_id = f"127.0.0.1:{port}", uuid.uuid4().hex[:8]
        self.env, self.nodes = env, []

    def start_node(self) -> subprocess.Popen:
        """Start the next node; node 0 hosts the rendezvous store (``is_host``), so it is the
        one that must survive (as the node at ``--rdzv-endpoint`` on a cluster)."""
        index = len(self.nodes)
        log = open(self.root / f"node{index}.log", "w")
        argv = [sys.executable, "-m", "meshplan", "run", str(self.plan), *COMMON,
                "--nnodes", self.nnodes, "--nproc-per-node", str(self.nproc),
                "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.run_id,
                "--rdzv-conf", f"{self.rdzv_conf},is_host={int(index == 0)}",
                "--checkpoint-dir", str(self.checkpoints), "--report", str(self.report)]
        node = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                start_new_session=True)
        self.nodes.append(node)
        return node

    def kill_node(self, index: int) -> None:
        """SIGKILL node ``index``: its ``meshplan run``, torchrun agent and workers."""
        node = self.nodes[index]
        for pid in [node.pid, *_descendants(node.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        node.wait(timeout=30)

    def wait(self, index: int) -> int:
        """Node ``index``'s exit code (every node is ended if it does not exit in time; the
        others keep running: a node that joined may still be closing its torchrun)."""
        try:
            return self.nodes[index].wait(timeout=PROCESS_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.stop()
            raise

    def stop(self) -> None:
        for index, node in enumerate(self.nodes):
            if node.poll() is None:
                self.kill_node(index)

    def log(self, index: int) -> str:
        return (self.root / f"node{index}.log").read_text()[-6000:]


@pytest.fixture(autouse=True)
def _end_jobs():
    yield
    while Job.started:
        Job.started.pop().stop()


def _wait_for(path: Path, job: Job, *, timeout_s: float = PROCESS_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline or any(n.poll() is not None for n in job.nodes):
            job.stop()
            pytest.fail(f"{path.name} never appeared; node 0 log:\n{job.log(0)}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def elastic_env(meshplan_env, tmp_path_factory):
    marker = tmp_path_factory.mktemp("marker") / "go"
    return marker, dict(meshplan_env, MESHPLAN_FAULT_AT_STEP=str(HOLD_AT),
                        MESHPLAN_FAULT_MARKER=str(marker), MESHPLAN_FAULT_HOLD="1")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, meshplan):
    """Losses of an uninterrupted single-node run (2 processes) of the same global batch."""
    root = tmp_path_factory.mktemp("reference")
    plan = _plan(root / "one-node.json", nodes=1, gpus_per_node=2)
    assert json.loads(plan.read_text())["global_batch_size"] == GLOBAL_BATCH
    done = meshplan("run", str(plan), "--steps", str(STEPS), "--json", "--oversubscribe",
                    timeout_s=PROCESS_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)["losses"]


def _reset(marker: Path) -> None:
    """Before a test: no marker (ranks will hold) and no hold file of an earlier test."""
    marker.unlink(missing_ok=True)
    Path(str(marker) + ".held").unlink(missing_ok=True)


def _metrics_steps(job: Job) -> list[int]:
    lines = (job.checkpoints / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


def _check_finished(job: Job, reference: list[float], *, world_sizes: tuple[int, int]) -> dict:
    report = json.loads(job.report.read_text())
    assert len(report["losses"]) == STEPS
    errors = [abs(a - b) for a, b in zip(report["losses"], reference)]
    assert max(errors) <= LOSS_TOL, (report["losses"], reference)
    assert _metrics_steps(job) == list(range(1, STEPS + 1))  # none missing, none twice
    changes = report["membership_changes"]
    # a node that started late may add a first change (it joins a running job); the last
    # is the one the test made
    assert all(c["reason"] == "membership" for c in changes), changes
    change = changes[-1]
    assert (change["old_world_size"], change["world_size"]) == world_sizes
    assert change["reason"] == "membership" and change["step"] == CHECKPOINT_EVERY
    assert change["plan"]["dp"] * change["plan"]["tp"] * change["plan"]["pp"] == world_sizes[1]
    assert change["replan_s"] > 0 and change["reshard_s"] > 0
    assert change["measured_step_s"] > 0 and change["predicted_step_s"] > 0
    assert report["world_size"] == world_sizes[1]
    return change


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_losing_a_node_replans_reshards_and_matches_an_uninterrupted_run(
        tmp_path, free_port, elastic_env, reference):
    marker, env = elastic_env
    _reset(marker)
    plan = _plan(tmp_path / "two-nodes.json", nodes=2, gpus_per_node=2)
    job = Job(tmp_path, plan, free_port, nnodes="1:2", nproc=2, env=env)
    job.start_node()
    job.start_node()
    _wait_for(Path(str(marker) + ".held"), job)
    job.kill_node(1)
    marker.touch()
    code = job.wait(0)
    assert code == 0, job.log(0)
    change = _check_finished(job, reference, world_sizes=(4, 2))
    assert change["steps_redone"] == HOLD_AT - CHECKPOINT_EVERY
    assert "membership at step 3: 4 -> 2 processes" in job.log(0)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_node_joining_grows_the_job_and_matches_an_uninterrupted_run(
        tmp_path, free_port, elastic_env, reference):
    marker, env = elastic_env
    _reset(marker)
    plan = _plan(tmp_path / "one-node.json", nodes=1, gpus_per_node=2)
    job = Job(tmp_path, plan, free_port, nnodes="1:2", nproc=2, env=env)
    job.start_node()
    _wait_for(Path(str(marker) + ".held"), job)
    job.start_node()  # torchrun restarts node 0's waiting workers into a 2-node rendezvous
    _wait_for(job.checkpoints / "membership.jsonl", job)  # the new attempt holds at step 4
    marker.touch()
    code = job.wait(0)
    assert code == 0, job.log(0)
    assert job.wait(1) == 0, job.log(1)
    change = _check_finished(job, reference, world_sizes=(2, 4))
    assert change["steps_redone"] == HOLD_AT - CHECKPOINT_EVERY


def _records(job: Job) -> list[dict]:
    path = job.checkpoints / "membership.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_node_lost_twice_in_a_row_still_matches(tmp_path, free_port, elastic_env, reference):
    """3 nodes of 1 process: one is killed at the hold, a second as soon as the job has
    replanned for 2 (before its next checkpoint); it finishes on the first node alone."""
    marker, env = elastic_env
    _reset(marker)
    plan = _plan(tmp_path / "three-nodes.json", nodes=3, gpus_per_node=1)
    job = Job(tmp_path, plan, free_port, nnodes="1:3", nproc=1, env=env)
    for _ in range(3):
        job.start_node()
    _wait_for(Path(str(marker) + ".held"), job)
    job.kill_node(2)
    marker.touch()
    deadline = time.monotonic() + PROCESS_TIMEOUT_S
    while not any(r["world_size"] == 2 for r in _records(job)):
        assert time.monotonic() < deadline and job.nodes[0].poll() is None, job.log(0)
        time.sleep(0.2)
    job.kill_node(1)
    code = job.wait(0)
    assert code == 0, job.log(0)
    report = json.loads(job.report.read_text())
    assert max(abs(a - b) for a, b in zip(report["losses"], reference)) <= LOSS_TOL
    assert len(report["losses"]) == STEPS and _metrics_steps(job) == list(range(1, STEPS + 1))
    sizes = [(c["old_world_size"], c["world_size"]) for c in report["membership_changes"]]
    assert sizes[-2:] == [(3, 2), (2, 1)], sizes
    assert report["world_size"] == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_falling_below_the_minimum_stops_clearly_and_keeps_the_checkpoint(
        tmp_path, free_port, elastic_env):
    """--nnodes 2:3 and one of two nodes killed: the survivor waits out the join timeout and
    exits 4 with one line naming the intact checkpoint."""
    from meshplan.runtime import checkpoint

    marker, env = elastic_env
    _reset(marker)
    plan = _plan(tmp_path / "two-nodes.json", nodes=2, gpus_per_node=1)
    # long enough for both nodes to import torch and meet at the first rendezvous on a busy
    # machine (8 s was not); the survivor waits it out once more after the kill
    conf = RDZV_CONF.replace("join_timeout=90", "join_timeout=20")
    job = Job(tmp_path, plan, free_port, nnodes="2:3", nproc=1, env=env, rdzv_conf=conf)
    job.start_node()
    job.start_node()
    _wait_for(Path(str(marker) + ".held"), job)
    job.kill_node(1)
    marker.touch()
    code = job.wait(0)
    log = job.log(0)
    assert code == 4, log
    line = [x for x in log.splitlines() if x.startswith("meshplan: error:")]
    assert line == [f"meshplan: error: fewer than 2 nodes (--nnodes 2:3) met at the rendezvous "
                    f"within its join timeout; the job stopped, its last checkpoint "
                    f"{job.checkpoints / 'step-3'} is intact; start the job again with "
                    f"--resume"], line
    assert checkpoint.latest_step(str(job.checkpoints)) == CHECKPOINT_EVERY
    from meshplan.runtime import integrity
    assert integrity.verify_files(str(job.checkpoints / "step-3"), rank=0, world_size=1) is None
