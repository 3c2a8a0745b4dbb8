"""``meshplan launch``: what every scheduler shares -- the nodes of a job and the one
``meshplan run`` each node starts.

A multi-node job is one ``meshplan run`` per node (each starts torchrun, the node's agent),
all meeting at one c10d rendezvous: the same ``--rdzv-endpoint HOST:PORT`` and ``--rdzv-id``,
and ``--nnodes N`` (or ``MIN:MAX``, elastic: torchrun admits between MIN and MAX nodes). The
SLURM batch script (``workflows.slurm``) and the local processes (``workflows.local``) only
differ in where those commands run and how the endpoint is found.

The user's run flags are handed to every node verbatim, after the plan and before the flags
launch sets itself; the CLI has checked them against ``meshplan run``'s parser.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from meshplan.planner.plan import Plan, read_plan

CPU_GPU_KEY = "cpu"
"""``gpu.key`` of the ``cpu`` cluster: one process is one CPU core, no GPUs to ask for."""


@dataclass(frozen=True, kw_only=True)
class Nodes:
    """How many nodes meet at the rendezvous and how many processes each one starts."""

    nodes: int
    """Nodes started (local), or asked of the scheduler without ``elastic``."""
    nproc_per_node: int
    """Processes (one per GPU) that each node's torchrun starts."""
    elastic: tuple[int, int] | None = None
    """(MIN, MAX): torchrun's ``--nnodes MIN:MAX``; None: exactly ``nodes``."""

    def __post_init__(self) -> None:
        for name in ("nodes", "nproc_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.elastic is not None:
            low, high = self.elastic
            if not 1 <= low <= high:
                raise ValueError(f"--elastic {low}:{high}: needs 1 <= MIN <= MAX")
            if not low <= self.nodes <= high:
                raise ValueError(f"--nodes {self.nodes} is outside --elastic {low}:{high}")

    @property
    def nnodes(self) -> str:
        """The value of ``meshplan run --nnodes``: ``N``, or ``MIN:MAX`` when elastic."""
        return f"{self.elastic[0]}:{self.elastic[1]}" if self.elastic else str(self.nodes)


@dataclass(frozen=True, kw_only=True)
class Rendezvous:
    """Where the nodes meet (torchrun's c10d rendezvous), the same on every node."""

    endpoint: str
    """``HOST:PORT``; in a batch script it may be a shell expression (``workflows.slurm``)."""
    rdzv_id: str
    conf: str | None = None
    """``K=V,...`` for ``meshplan run --rdzv-conf`` (torchrun's rendezvous options), verbatim."""


def plan_nodes(plan_path: str, *, nodes: int, nproc_per_node: int | None,
               elastic: tuple[int, int] | None) -> tuple[Plan, Nodes]:
    """The plan and its nodes; ValueError when they do not fit together.

    ``nproc_per_node`` defaults to the plan's cluster's GPUs per node. Without ``elastic`` the
    plan's world size must be ``nodes`` x ``nproc_per_node`` (the check ``meshplan run`` makes
    on every node, made here before anything is queued or started); with it the world size
    follows the membership and is not checked here.
    """
    plan = read_plan(plan_path)
    spec = Nodes(nodes=nodes, nproc_per_node=nproc_per_node or plan.cluster.gpus_per_node,
                 elastic=elastic)
    world_size = plan.config.world_size
    if elastic is None and world_size != spec.nodes * spec.nproc_per_node:
        raise ValueError(f"the plan needs {world_size} processes but the launch has "
                         f"{spec.nodes} nodes x {spec.nproc_per_node} processes = "
                         f"{spec.nodes * spec.nproc_per_node}; give --nodes and "
                         f"--nproc-per-node so that they multiply to {world_size}")
    return plan, spec


def uses_gpus(plan: Plan) -> bool:
    """False on the ``cpu`` cluster (no GPUs to ask a scheduler for)."""
    return plan.cluster.gpu.key != CPU_GPU_KEY


def node_command(plan_path: str, nodes: Nodes, rendezvous: Rendezvous,
                 run_flags: Sequence[str], *, python: str = sys.executable) -> list[str]:
    """``python -m meshplan run PLAN <run flags> --nnodes .. --nproc-per-node .. --rdzv-endpoint
    .. --rdzv-id .. [--rdzv-conf ..]``: what each node runs. ``python`` defaults to the
    interpreter running this, so the nodes run this meshplan."""
    conf = ["--rdzv-conf", rendezvous.conf] if rendezvous.conf else []
    return [python, "-m", "meshplan", "run", plan_path, *run_flags,
            "--nnodes", nodes.nnodes, "--nproc-per-node", str(nodes.nproc_per_node),
            "--rdzv-endpoint", rendezvous.endpoint, "--rdzv-id", rendezvous.rdzv_id, *conf]
