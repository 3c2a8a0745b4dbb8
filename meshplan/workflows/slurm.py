"""``meshplan launch --scheduler slurm``: an sbatch script that starts one ``meshplan run`` per
node, and ``sbatch`` to submit it.

The script asks for the nodes (``--nodes=N``, or ``--nodes=MIN-MAX`` when elastic: SLURM then
allocates between MIN and MAX), one task per node and, on a GPU cluster, the plan's GPUs per
node; then ``srun --ntasks-per-node=1`` runs the node command of ``workflows.launch`` on every
node of the allocation. The rendezvous endpoint is the allocation's first node
(``scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1``) and a port taken from the job
id (``RDZV_PORT_BASE + SLURM_JOB_ID % RDZV_PORT_SPAN``, so that two jobs sharing a first node
rarely pick the same port) unless one is given; the rendezvous id is ``$SLURM_JOB_ID``. Without
elastic, ``srun --kill-on-bad-exit=1`` ends the job when one node's run fails; elastic jobs
keep the other nodes (torchrun carries on with fewer).

Every word the user or the plan gave is quoted with ``shlex.quote``, also in ``#SBATCH`` lines
(sbatch removes the quotes there as a shell would). The nodes run the same interpreter and
plan path as the process writing the script (a shared filesystem, as on any SLURM cluster); the
job's working folder (``--chdir``) is the folder ``meshplan launch`` ran in, so relative paths
in the run flags mean the same.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from meshplan.workflows.launch import Nodes, Rendezvous, node_command

RDZV_PORT_BASE = 29500
"""torchrun's default rendezvous port: the first of the ports a job may pick."""
RDZV_PORT_SPAN = 1000
"""Ports from ``RDZV_PORT_BASE`` a job's id is spread over."""
SBATCH_TIMEOUT_S = 60.0
"""How long ``sbatch`` may take to answer."""


class _Shell(str):
    """A word the batch script's shell expands (``"$SLURM_JOB_ID"``): written as is."""


@dataclass(frozen=True, kw_only=True)
class SlurmJob:
    """What the batch script asks of SLURM besides the nodes."""

    job_name: str
    output: str
    """``#SBATCH --output``: the job's stdout and stderr (``%j``: the job id)."""
    workdir: str
    """``#SBATCH --chdir``: where the job runs."""
    gpus_per_node: int | None = None
    """``#SBATCH --gpus-per-node``; None on the ``cpu`` cluster."""
    time_limit: str | None = None
    """``#SBATCH --time`` (SLURM's formats, e.g. ``HH:MM:SS``); None: the partition's default."""
    partition: str | None = None
    cpus_per_task: int | None = None
    """CPUs of each node's task (torchrun and all its workers); also given to srun, which in
    SLURM 22.05 does not inherit it. None: SLURM's default (often one CPU)."""
    rdzv_port: int | None = None
    """None: ``RDZV_PORT_BASE + SLURM_JOB_ID % RDZV_PORT_SPAN``."""


def sbatch_nodes(nodes: Nodes) -> str:
    """``#SBATCH --nodes``: ``N``, or ``MIN-MAX`` when elastic."""
    return f"{nodes.elastic[0]}-{nodes.elastic[1]}" if nodes.elastic else str(nodes.nodes)


def _sbatch_lines(nodes: Nodes, job: SlurmJob) -> list[str]:
    options = [("job-name", job.job_name), ("nodes", sbatch_nodes(nodes)), ("ntasks-per-node", "1"),
               ("gpus-per-node", job.gpus_per_node), ("cpus-per-task", job.cpus_per_task),
               ("time", job.time_limit), ("partition", job.partition), ("output", job.output),
               ("chdir", job.workdir)]
    return [f"#SBATCH {shlex.quote(f'--{name}={value}')}" for name, value in options
            if value is not None]


def _shell_words(words: Sequence[str]) -> str:
    """``words`` as shell text: quoted, except ``_Shell`` words."""
    return " ".join(word if isinstance(word, _Shell) else shlex.quote(word) for word in words)


def _flag_lines(words: Sequence[str]) -> list[str]:
    """``words`` as shell text, a new line at each ``--flag``."""
    lines: list[list[str]] = [[]]
    for word in words:
        if word.startswith("--") and lines[-1]:
            lines.append([])
        lines[-1].append(word)
    return [_shell_words(line) for line in lines]


def _processes(count: int) -> str:
    return f"{count} process{'' if count == 1 else 'es'}"


def sbatch_script(plan_path: str, nodes: Nodes, job: SlurmJob, run_flags: Sequence[str], *,
                  rdzv_conf: str | None = None, about: str = "") -> str:
    """The batch script's text (bash). ``plan_path`` should be absolute (the job's working
    folder is ``job.workdir``); ``about`` is a comment line under the shebang."""
    port = (str(job.rdzv_port) if job.rdzv_port
            else f"$(({RDZV_PORT_BASE} + SLURM_JOB_ID % {RDZV_PORT_SPAN}))")
    rendezvous = Rendezvous(endpoint=_Shell('"$head_node:$rdzv_port"'),
                            rdzv_id=_Shell('"$SLURM_JOB_ID"'), conf=rdzv_conf)
    srun = ["srun", _Shell('--nodes="$SLURM_JOB_NUM_NODES"'), "--ntasks-per-node=1"]
    if job.cpus_per_task:
        srun.append(f"--cpus-per-task={job.cpus_per_task}")
    srun.append(f"--kill-on-bad-exit={0 if nodes.elastic else 1}")
    command = node_command(plan_path, nodes, rendezvous, run_flags)
    return "\n".join([
        "#!/bin/bash",
        *([f"# {' '.join(about.splitlines())}"] if about else []),
        *_sbatch_lines(nodes, job),
        "set -eu",
        "# the rendezvous: the allocation's first node",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"rdzv_port={port}",
        f"# one meshplan run (torchrun agent) per node, {_processes(nodes.nproc_per_node)} each",
        " \\\n    ".join([f"exec {_shell_words(srun)}", *_flag_lines(command)]),
        ""])


def default_script_path(plan_path: str) -> str:
    """``<plan folder>/<plan stem>.sbatch``."""
    return str(Path(plan_path).with_suffix(".sbatch"))


def default_output(script_path: str) -> str:
    """``<script folder>/<script stem>-%j.out`` (absolute), the job's output file."""
    path = Path(os.path.abspath(script_path))
    return str(path.with_name(f"{path.stem}-%j.out"))


def check_sbatch() -> str:
    """The path of ``sbatch``; ValueError when it is not on PATH."""
    found = shutil.which("sbatch")
    if found is None:
        raise ValueError("--submit: sbatch is not on PATH (run on a SLURM login node, or "
                         "submit the script there with sbatch)")
    return found


def submit(script_path: str) -> str:
    """``sbatch --parsable SCRIPT``; returns the job id. ValueError when sbatch refuses."""
    sbatch = check_sbatch()
    try:
        done = subprocess.run([sbatch, "--parsable", script_path], capture_output=True,
                              text=True, timeout=SBATCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ValueError(f"sbatch {script_path}: no answer within {SBATCH_TIMEOUT_S:.0f} s "
                         "(is slurmctld up?)") from None
    if done.returncode != 0:
        reason = (done.stderr.strip() or done.stdout.strip()).splitlines() or ["(no message)"]
        raise ValueError(f"sbatch {script_path} failed with exit code {done.returncode}: "
                         f"{reason[-1]}")
    return done.stdout.strip().split(";")[0]
