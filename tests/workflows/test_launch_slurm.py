"""``meshplan launch --scheduler slurm --submit`` against a real SLURM (the ``slurm_cluster``
fixture of conftest.py: slurmctld and two slurmd on this host, SLURM nodes 127.0.0.1 and
127.0.0.2; skipped, with the reason, where SLURM is not installed or cannot start).

The job is the script as users get it: ``--nodes=2``, one task per node, so srun starts one
``meshplan run`` on each SLURM node; the two meet at the first node's rendezvous and train the
dp2 plan (one process per node). Only the executable's path and the cluster are this machine's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshplan.testing import run_cli

JOB_TIMEOUT_S = 240.0
"""How long the job may take from submission to its end (it is cancelled then)."""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_two_node_job_trains(slurm_cluster, dp2_plan, tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))
    monkeypatch.chdir(tmp_path)
    report = tmp_path / "report.json"
    result = run_cli("launch", dp2_plan, "--scheduler", "slurm", "--nodes", "2",
                     "--nproc-per-node", "1", "--time", "00:04:00", "--submit", "--json",
                     "--steps", "2", "--report", report.name, "--init-timeout", "120")
    launched = result.json()
    job_id = launched["job_id"]
    state = slurm_cluster.wait(job_id, timeout_s=JOB_TIMEOUT_S)
    output_file = Path(launched["output"].replace("%j", job_id))
    output = output_file.read_text() if output_file.exists() else "(no output file)"
    assert state.get("JobState") == "COMPLETED", \
        f"{state}\n{output[-4000:]}\n{slurm_cluster.logs()}"
    assert state["NodeList"] == "127.0.0.[1-2]" and state["ExitCode"] == "0:0"
    assert "ran 2 steps on 2 processes (gloo)" in output, output[-4000:]
    data = json.loads(report.read_text())  # relative to the job's --chdir, this folder
    assert data["world_size"] == 2 and len(data["losses"]) == 2
