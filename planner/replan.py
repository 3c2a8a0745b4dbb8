"""Replan a plan for another number of nodes: what an elastic job does when membership changes.

``replan(plan, nodes=n)`` searches the same model on the same kind of cluster with ``n`` nodes
of the plan's GPUs per node, for the same global batch, sequence length, dtype, framework and
time objective (a cost-objective plan is replanned for time: the node count is no longer a
choice). The plan's pins (``provenance.pinned``, as ``plan`` recorded them) are kept when a
plan with them fits on ``n`` nodes; otherwise they are dropped and the whole space is searched
(``Replanned.pins_dropped``). The search runs on CP-SAT's deterministic work limit
(``deterministic=True``), so every node of a job that replanned would get the same answer, and under
a wall-clock ``time_limit_s`` that bounds how long the job waits (anytime: the best plan found
by then; the status says whether it is proven optimal).

The calibration is the built-in one unless the plan names a calibration file that exists here.

A plan table (``with_table``; ``meshplan plan --elastic MIN:MAX``) holds the replanned plan of
every node count from MIN to MAX in the plan's provenance (``TABLE_KEY``), searched ahead of
the run, so an elastic job's replan is a lookup (``from_table``).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

from meshplan.costmodel import load_calibration
from meshplan.costmodel.calibration import default_calibration
from typing import Any

from meshplan.planner.plan import Plan, plan_from_dict
from meshplan.planner.planning import plan as plan_search
from meshplan.planner.search import EmptySpace, NoPlanFits, SearchTimeout
from meshplan.planner.space import space_with_pins

TABLE_KEY = "elastic_plans"
"""Provenance key of a plan's table: node count (a string) -> plan file of that size."""
DEFAULT_TIME_LIMIT_S = 30.0
"""Wall-clock bound of one replan (the job waits for it)."""


@dataclass(frozen=True)
class Replanned:
    """The plan for the new node count and how it was found."""

    plan: Plan
    wall_s: float
    status: str
    """OPTIMAL, or FEASIBLE (the time limit ended the search first)."""
    pins_dropped: bool
    """The original plan's pins did not fit on the new node count and were dropped."""


def replan(plan: Plan, *, nodes: int, gpus_per_node: int | None = None,
           time_limit_s: float = DEFAULT_TIME_LIMIT_S, required: dict | None = None) -> Replanned:
    """The best plan for ``plan``'s job on ``nodes`` nodes (of ``gpus_per_node`` GPUs; default
    the plan's); ValueError when nothing fits there (the message says why).

    ``required``: pins (as ``pins_of`` writes them) that hold in every attempt, e.g. what the
    runtime that will execute the plan can run; they win over the plan's own pins."""
    if nodes < 1:
        raise ValueError(f"cannot replan for {nodes} nodes")
    start = time.perf_counter()
    cluster = dataclasses.replace(plan.cluster, nodes=nodes,
                                  gpus_per_node=gpus_per_node or plan.cluster.gpus_per_node)
    name = str(plan.provenance.get("calibration", "built-in"))
    calibration = (load_calibration(name) if name != "built-in" and os.path.isfile(name)
                   else default_calibration())
    pins = plan.provenance.get("pinned") or {}
    fixed = dict(global_batch_size=plan.config.global_batch_size, seq_len=plan.config.seq_len,
                 dtype=plan.config.dtype, flash_attention=plan.config.flash_attention)
    required = required or {}
    kept = {k: v for k, v in pins.items() if k == "memory_margin"}
    attempts = [{**pins, **required}, {**kept, **required}] if pins else [required]
    failure: Exception | None = None
    for index, attempt in enumerate(attempts):
        try:
            result = plan_search(plan.model, cluster, space_with_pins(attempt, **fixed),
                                 framework=plan.framework, calibration=calibration,
                                 calibration_name=name, objective="time", top_k=1,
                                 time_limit_s=time_limit_s)
        except (EmptySpace, NoPlanFits, SearchTimeout) as err:
            failure = err
            continue
        return Replanned(plan=result.plans[0], wall_s=time.perf_counter() - start,
                         status=result.status, pins_dropped=index > 0)
    raise ValueError(f"no plan for {plan.model.name} on {nodes} x {cluster.gpus_per_node} "
                     f"{cluster.gpu.key}: {failure}")


def with_table(plan: Plan, nodes: range, *, time_limit_s: float = DEFAULT_TIME_LIMIT_S
               ) -> tuple[Plan, dict[int, str]]:
    """``plan`` with the table of its replans for each node count in ``nodes`` (its own count
    maps to itself), and the node counts nothing fits on, each with the reason."""
    table: dict[str, Any] = {}
    missing: dict[int, str] = {}
    for n in nodes:
        if n == plan.cluster.nodes:
            entry = plan
        else:
            try:
                entry = replan(plan, nodes=n, time_limit_s=time_limit_s).plan
            except ValueError as err:
                missing[n] = str(err)
                continue
        table[str(n)] = entry.to_dict()
    provenance = {**plan.provenance, TABLE_KEY: table}
    return dataclasses.replace(plan, provenance=provenance), missing


def from_table(plan: Plan, *, nodes: int, gpus_per_node: int) -> Plan | None:
    """The plan the table of ``plan`` holds for ``nodes`` x ``gpus_per_node``, or None."""
    entry = (plan.provenance.get(TABLE_KEY) or {}).get(str(nodes))
    if entry is None or entry.get("cluster", {}).get("gpus_per_node") != gpus_per_node:
        return None
    return plan_from_dict(entry, origin=f"the plan table's entry for {nodes} nodes")
