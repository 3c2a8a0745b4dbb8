"""Elastic runs: a plan for the world size each attempt finds, and the record of every change.

``meshplan run PLAN --nnodes MIN:MAX`` runs under torchrun's elastic agent (c10d rendezvous).
When membership changes (a node lost: its peers' collectives fail and torchrun restarts them;
a node joining: torchrun restarts everyone into a larger rendezvous), each new attempt's
workers:

1. agree on a plan for their world size (``choose_plan``): the user's plan when it has that
   many ranks, else rank 0 replans (``planner/replan.py``: same model, cluster type, global
   batch, framework and time objective; the user's pins kept where they fit; only what this
   runtime executes, ``runtime_pins``) and broadcasts the plan file;
2. resume from the last complete checkpoint of the run (``train.run_plan``: every elastic
   attempt resumes when one exists), resharded by torch.distributed.checkpoint onto the new
   layout; the global batch is the plan's, so only the micro-batches per rank change;
3. rank 0 appends one record of the change to ``DIR/membership.jsonl`` (``record_start``):
   its time, the step it continues from, old and new world size and plan, replan and reshard
   seconds, and the steps the previous attempt had done past the checkpoint (redone now;
   they are dropped from the metrics log, so no step is logged twice). ``DIR/progress.json``
   (rank 0, after each step) tells the next attempt how far this one got.

The run report lists the run's records (``report_changes``) with the predicted and measured
step time under each plan. The store of the c10d rendezvous lives in the torchrun agent of the
node named by ``--rdzv-endpoint``: losing that node ends the job (as with any c10d
rendezvous; an etcd rendezvous has no such node).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from meshplan.costmodel.estimate import config_to_dict
from meshplan.planner.plan import Plan, plan_from_dict
from meshplan.runtime import mesh as mesh_mod

logger = logging.getLogger(__name__)

MEMBERSHIP_FILE = "membership.jsonl"
PROGRESS_FILE = "progress.json"


class NoElasticPlan(ValueError):
    """No plan this runtime can execute fits the world size the rendezvous produced."""


@dataclass(frozen=True)
class Chosen:
    """The plan an attempt runs and how it was chosen (the same on every rank)."""

    plan: Plan
    replan_s: float
    """Seconds rank 0 spent replanning (0 when the user's plan fits the world size)."""
    status: str
    """``given`` (the user's plan), or the search's OPTIMAL / FEASIBLE."""
    pins_dropped: bool = False


def runtime_pins(plan: Plan, world_size: int) -> dict[str, Any]:
    """Pins (``pins_of`` form) that keep a search inside what this runtime executes
    (``mesh.check_supported``): no context or expert parallelism, host offload only, one
    stage for tied embeddings, tensor-parallel degrees that divide the FFN and vocabulary."""
    model = plan.model
    tps = [t for t in range(1, world_size + 1) if world_size % t == 0
           and model.ffn_hidden_size % t == 0 and model.vocab_rows % t == 0]
    pins: dict[str, Any] = {"cp": [1], "ep": [1], "offload_device": ["cpu"], "tp": tps}
    if model.tied_embeddings:
        pins["pp"] = [1]
    return pins


def choose_plan(given: Plan, *, world_size: int, local_world_size: int,
                time_limit_s: float) -> Chosen:
    """The plan of this attempt, agreed by all ranks (a collective on the default group).

    Rank 0 decides and broadcasts the plan file; ``NoElasticPlan`` on every rank when nothing
    fits (rank 0's message)."""
    payload: dict[str, Any] = {}
    if dist.get_rank() == 0:
        payload = _decide(given, world_size=world_size, local_world_size=local_world_size,
                          time_limit_s=time_limit_s)
    box = [payload]
    dist.broadcast_object_list(box, src=0)
    payload = box[0]
    if payload.get("error"):
        raise NoElasticPlan(payload["error"])
    plan = plan_from_dict(payload["plan"], origin=f"the plan for {world_size} processes")
    return Chosen(plan=plan, replan_s=payload["replan_s"], status=payload["status"],
                  pins_dropped=payload["pins_dropped"])


def _decide(given: Plan, *, world_size: int, local_world_size: int,
            time_limit_s: float) -> dict[str, Any]:
    if given.config.world_size == world_size:
        return {"plan": given.to_dict(), "replan_s": 0.0, "status": "given",
                "pins_dropped": False}
    from meshplan.planner.replan import from_table, replan  # CP-SAT only where needed

    if world_size % local_world_size:
        return {"error": f"{world_size} processes are not whole nodes of {local_world_size}"}
    nodes = world_size // local_world_size
    started = time.perf_counter()
    listed = from_table(given, nodes=nodes, gpus_per_node=local_world_size)
    if listed is not None:
        try:
            mesh_mod.check_supported(listed.config, listed.model)
            return {"plan": listed.to_dict(), "replan_s": time.perf_counter() - started,
                    "status": "table", "pins_dropped": False}
        except ValueError as err:
            logger.warning("the plan table's entry for %d nodes cannot run here (%s); "
                           "replanning", nodes, err)
    try:
        pins = runtime_pins(given, world_size)
        done = replan(given, nodes=nodes, gpus_per_node=local_world_size,
                      time_limit_s=time_limit_s, required=pins)
        try:
            mesh_mod.check_supported(done.plan.config, done.plan.model)
        except mesh_mod.UnsupportedPlan:  # e.g. fewer micro-batches than stages: no pipeline
            done = replan(given, nodes=nodes, gpus_per_node=local_world_size,
                          time_limit_s=time_limit_s, required={**pins, "pp": [1]})
            mesh_mod.check_supported(done.plan.config, done.plan.model)
        if done.plan.config.world_size != world_size:
            raise ValueError(f"the plan found uses {done.plan.config.world_size} of "
                             f"{world_size} processes")
    except ValueError as err:
        return {"error": f"elastic replan for {nodes} node(s) x {local_world_size} "
                         f"processes: {err}"}
    logger.info("replanned for %d processes in %.2f s (%s): %s", world_size, done.wall_s,
                done.status, _layout(done.plan))
    return {"plan": done.plan.to_dict(), "replan_s": done.wall_s, "status": done.status,
            "pins_dropped": done.pins_dropped}


def _layout(plan: Plan) -> str:
    c = plan.config
    return (f"tp {c.tp} pp {c.pp} dp {c.dp} zero {c.zero_stage} micro-batch "
            f"{c.micro_batch_size} x {c.grad_accum_steps}")


# ----- records (rank 0) --------------------------------------------------------------------------

def read_progress(directory: str) -> dict[str, Any] | None:
    path = os.path.join(directory, PROGRESS_FILE)
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def write_progress(directory: str, *, run_id: str | None, step: int, plan: Plan) -> None:
    """How far this attempt got (rank 0, after each step; replaced atomically)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, PROGRESS_FILE)
    with open(path + ".tmp", "w") as handle:
        json.dump({"run_id": run_id, "step": step, "world_size": plan.config.world_size,
                   "plan": config_to_dict(plan.config, plan.model),
                   "predicted_step_s": plan.step_s}, handle)
    os.replace(path + ".tmp", path)


def record_start(directory: str, *, run_id: str | None, chosen: Chosen, resumed_step: int,
                 reshard_s: float) -> None:
    """At the start of an attempt (rank 0): one membership record when an earlier attempt of
    the same run got somewhere (``progress.json``), then this attempt's progress."""
    os.makedirs(directory, exist_ok=True)
    progress = read_progress(directory)
    plan = chosen.plan
    if progress is not None and progress.get("run_id") == run_id:
        entry = {"run_id": run_id, "time": time.time(), "step": resumed_step,
                 "world_size": plan.config.world_size,
                 "plan": config_to_dict(plan.config, plan.model),
                 "predicted_step_s": plan.step_s, "replan_s": chosen.replan_s,
                 "replan_status": chosen.status, "pins_dropped": chosen.pins_dropped,
                 "reshard_s": reshard_s,
                 "steps_redone": max(0, int(progress["step"]) - resumed_step),
                 "old_world_size": progress["world_size"], "old_plan": progress["plan"],
                 "old_predicted_step_s": progress["predicted_step_s"],
                 "reason": ("membership" if progress["world_size"] != plan.config.world_size
                            else "restart")}
        with open(os.path.join(directory, MEMBERSHIP_FILE), "a") as handle:
            handle.write(json.dumps(entry) + "\n")
        logger.info("membership change: %d -> %d processes at step %d (replan %.2f s, reshard "
                    "%.2f s, %d steps redone)", entry["old_world_size"], entry["world_size"],
                    resumed_step, chosen.replan_s, reshard_s, entry["steps_redone"])
    write_progress(directory, run_id=run_id, step=resumed_step, plan=plan)


def report_changes(directory: str, run_id: str | None,
                   step_s: list[float]) -> tuple[dict[str, Any], ...]:
    """The run's membership records, each with the measured median step time under the plan
    before (``old_measured_step_s``) and after it (``measured_step_s``), from the run's
    per-step times (steps that were redone count once, from the attempt that kept them)."""
    path = os.path.join(directory, MEMBERSHIP_FILE)
    if not os.path.exists(path):
        return ()
    with open(path) as handle:
        entries = [json.loads(line) for line in handle if line.strip()]
    entries = [e for e in entries if e.get("run_id") == run_id]
    bounds = [0] + [e["step"] for e in entries] + [len(step_s)]
    segments = [_median(step_s[a:b]) for a, b in zip(bounds, bounds[1:])]
    return tuple({**e, "old_measured_step_s": segments[i], "measured_step_s": segments[i + 1]}
                 for i, e in enumerate(entries))


def _median(values: list[float]) -> float | None:
    """Median step time of a segment, its first step (a warm-up after each start) left out
    when there are others."""
    values = values[1:] if len(values) > 1 else values
    return statistics.median(values) if values else None
