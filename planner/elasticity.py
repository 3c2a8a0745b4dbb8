"""What a node failure costs a plan, and the checkpoint interval that minimises the time lost
(``meshplan explain plan.json --node-mtbf-hours H``).

The model is Daly's (2006, below). Nodes fail independently at a constant rate, so the job fails
as a Poisson process with mean time between failures M = node MTBF / nodes. Training saves a
checkpoint after every tau seconds of work; a save takes delta and blocks training (``save`` in
runtime/checkpoint.py is collective and synchronous: every rank waits at its barriers). A failure
loses the work since the last committed checkpoint (on average half an interval and its save),
then R to come back:

* restart: the lost node's peers wait in a collective until the process-group timeout, torchrun
  restarts the workers, an elastic rendezvous closes, the workers start (``DEFAULT_RESTART_S``);
* replan: the planner's search for the new node count (``DEFAULT_REPLAN_S``);
* reshard: ``checkpoint.load`` first re-hashes every file (integrity.py; the ranks share the
  files), then every rank reads the states it holds (DCP reads any layout).

What a checkpoint holds (``checkpoint_bytes``): per parameter, the parameters as the framework
keeps them and the optimizer state (the fp32 master weights where they are a separate copy, and
Adam's two moments), i.e. the cost model's params and optimizer bytes with nothing offloaded
(``frameworks.model_state_bytes``): 4 + 8 = 12 bytes for meshplan and torchtitan, whose fp32
parameters are the master weights; 2 + 12 = 14 for Megatron, DeepSpeed and ``ideal``. DCP writes
a replicated tensor once, by one of its holders (``dedup_save_plans`` balances them), so a node
writes its share of the whole; on load every rank reads what it holds and a node fetches each
byte its ranks hold once (the page cache serves its other ranks), so replicated states (the
parameters under ZeRO-0/1, all states under ZeRO-0) are read by every node that holds a replica.
A save also hashes the files it wrote (``checksums.json``): each byte is read back once, mostly
by a rank of another node (ranks take every world-th file).

Left out: Adam's step counters, ``.metadata``, ``train_state.json`` and ``checksums.json``
(kilobytes); the hash's own speed (hashlib's SHA-256 did 0.9 GB/s on one core of the build
machine, which the ranks of a node together exceed on a shared file system); the storage's
aggregate limit when every node writes at once (fold it into the per-node bandwidths); the new
plan's step after the job shrinks; failures during a save counted apart (they lose the interval
before it, which the model's half-segment average includes).

Sources:

* J. W. Young, "A first order approximation to the optimum checkpoint interval",
  Communications of the ACM 17(9):530-531, 1974: tau = sqrt(2 delta M).
* J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps",
  Future Generation Computer Systems 22(3):303-312, 2006, doi:10.1016/j.future.2004.11.016:
  the expected wall time of a run with restarts, T_w = M e^(R/M) (e^((tau+delta)/M) - 1) T_s / tau
  (T_s: the work), and his perturbation solution for its optimum, the higher-order estimate of
  ``daly_interval_s``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshplan.costmodel import ModelSpec, ParallelConfig
from meshplan.costmodel.estimate import Estimate
from meshplan.costmodel.frameworks import model_state_bytes
from meshplan.costmodel.layout import mesh_dims, rank_of
from meshplan.costmodel.memory import stage_params

FAILURE_DETECTION_S = 60.0
"""The runtime's process-group timeout once training runs (runtime/mesh.py ``DEFAULT_TIMEOUT_S``,
``meshplan run --timeout``): a lost node's peers wait this long in a collective, then fail and
torchrun restarts them."""
RENDEZVOUS_S = 30.0
"""torchelastic's c10d rendezvous ``last_call`` timeout (torch 2.13,
``dynamic_rendezvous.RendezvousTimeout``): an elastic job (``--nnodes MIN:MAX``) left with fewer
than MAX nodes waits this long for more before it starts."""
WORKER_START_S = 30.0
"""Starting the workers again: Python and torch imports, CUDA context, process groups, building
the model. An allowance, not a measurement; ``--restart-s`` takes yours."""
DEFAULT_RESTART_S = FAILURE_DETECTION_S + RENDEZVOUS_S + WORKER_START_S
"""From a node's failure to workers ready to load the checkpoint: 120 s."""
DEFAULT_REPLAN_S = 1.0
"""The planner's search for the shrunken cluster: a pinned or warm search takes well under a
second, a whole space seconds (a plan file's provenance records its solver time)."""
DEFAULT_STORAGE_BYTES_PER_S = 2e9
"""Checkpoint read and write bandwidth of one node to a shared file system, 2 GB/s: a
conservative share of a parallel file system while every node of the job reads or writes at
once. The node's storage NICs (hundreds of Gb/s on a DGX) are the ceiling; the file system's
aggregate bandwidth over the nodes is usually the bound. Measure yours (e.g. fio on all nodes at
once) and pass ``--checkpoint-read-gb-per-s`` / ``--checkpoint-write-gb-per-s``."""


@dataclass(frozen=True, kw_only=True)
class FailureModel:
    """How often nodes fail and what coming back costs (``explain --node-mtbf-hours``)."""

    node_mtbf_s: float
    """Mean time between failures of one node, seconds."""
    restart_s: float = DEFAULT_RESTART_S
    """Failure detection, restart and rendezvous, worker start."""
    replan_s: float = DEFAULT_REPLAN_S
    """The planner's time for the new node count."""
    read_bytes_per_s: float = DEFAULT_STORAGE_BYTES_PER_S
    """Checkpoint storage read bandwidth of one node."""
    write_bytes_per_s: float = DEFAULT_STORAGE_BYTES_PER_S
    """Checkpoint storage write bandwidth of one node."""
    checkpoint_every: int | None = None
    """A checkpoint interval in steps to compare with the optimum; None: none."""

    def __post_init__(self) -> None:
        for name in ("node_mtbf_s", "restart_s", "replan_s", "read_bytes_per_s",
                     "write_bytes_per_s"):
            value, zero_ok = getattr(self, name), name in ("restart_s", "replan_s")
            if not (math.isfinite(value) and (value >= 0 if zero_ok else value > 0)):
                raise ValueError(f"{name} must be a finite number {'>=' if zero_ok else '>'} 0, "
                                 f"got {value}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1 step, got {self.checkpoint_every}")


@dataclass(frozen=True, kw_only=True)
class CheckpointBytes:
    """Sizes of a plan's checkpoint (``checkpoint_bytes``)."""

    total_bytes: float
    """The whole checkpoint, each replicated state once."""
    write_bytes_per_node: float
    """What the busiest node writes of it."""
    load_bytes_per_node: float
    """What the busiest node reads back on load: every state its ranks hold, once."""


@dataclass(frozen=True, kw_only=True)
class IntervalCost:
    """Checkpointing every ``every_steps`` steps: what a failure loses, the time lost overall."""

    every_steps: int
    interval_s: float
    """Work between two saves (tau)."""
    redone_s: float
    """Work a failure loses on average: half an interval and its save."""
    lost_per_failure_s: float
    """``redone_s`` plus restart, replan and reshard."""
    loss_fraction: float
    """Expected fraction of the wall time that is not new work (saves and failures)."""
    save_fraction: float
    """The saves' share of the failure-free time: delta / (tau + delta)."""

    def to_dict(self) -> dict[str, Any]:
        """The fields, and ``failure_fraction``: the rest of ``loss_fraction``."""
        return {**dataclasses.asdict(self),
                "failure_fraction": self.loss_fraction - self.save_fraction}


@dataclass(frozen=True, kw_only=True)
class Elasticity:
    """The cost of node failures for one plan and the best checkpoint interval."""

    failures: FailureModel
    nodes: int
    step_s: float
    """The plan's predicted step time."""
    checkpoint: CheckpointBytes
    save_write_s: float
    """The busiest node's share of the checkpoint over the write bandwidth."""
    verify_s: float
    """Hashing every file of the checkpoint once, the ranks sharing the files: a save does it
    after writing, a load before reading (the checkpoint over the nodes, read back)."""
    load_s: float
    """The busiest node's states read back, over the read bandwidth."""
    young_interval_s: float
    daly_interval_s: float
    optimal: IntervalCost
    """The whole number of steps closest to Daly's optimum that loses the least time."""
    chosen: IntervalCost | None = None
    """At ``failures.checkpoint_every``, where given."""

    @property
    def job_mtbf_s(self) -> float:
        return self.failures.node_mtbf_s / self.nodes

    @property
    def save_s(self) -> float:
        """delta: a save blocks training for its whole time."""
        return self.save_write_s + self.verify_s

    @property
    def reshard_s(self) -> float:
        return self.verify_s + self.load_s

    @property
    def recovery_s(self) -> float:
        return self.failures.restart_s + self.failures.replan_s + self.reshard_s

    def to_dict(self) -> dict[str, Any]:
        """The ``"elasticity"`` object of ``explain --json``."""
        f = self.failures
        return {"node_mtbf_s": f.node_mtbf_s, "nodes": self.nodes, "job_mtbf_s": self.job_mtbf_s,
                "step_s": self.step_s, "checkpoint_bytes": round(self.checkpoint.total_bytes),
                "write_bytes_per_node": round(self.checkpoint.write_bytes_per_node),
                "load_bytes_per_node": round(self.checkpoint.load_bytes_per_node),
                "read_bytes_per_s": f.read_bytes_per_s, "write_bytes_per_s": f.write_bytes_per_s,
                "save_s": self.save_s, "save_write_s": self.save_write_s,
                "verify_s": self.verify_s, "saves_block_training": True,
                "restart_s": f.restart_s, "replan_s": f.replan_s, "reshard_s": self.reshard_s,
                "load_s": self.load_s, "recovery_s": self.recovery_s,
                "young_interval_s": self.young_interval_s,
                "daly_interval_s": self.daly_interval_s, "optimal": self.optimal.to_dict(),
                "checkpoint_every": self.chosen.to_dict() if self.chosen else None}


# ----- the interval ------------------------------------------------------------------------------

def young_interval_s(*, save_s: float, mtbf_s: float) -> float:
    """Young (1974): tau = sqrt(2 delta M), seconds of work between saves.

    ``save_s`` is delta, ``mtbf_s`` M. First order in tau / M; leaves out the restart time and
    the failures during saves and restarts.
    """
    return math.sqrt(2.0 * save_s * mtbf_s)


def daly_interval_s(*, save_s: float, mtbf_s: float) -> float:
    """Daly (2006), the higher-order estimate of the optimum of ``loss_fraction``, seconds:

    tau = sqrt(2 delta M) [1 + sqrt(delta / 2M) / 3 + (delta / 2M) / 9] - delta  for delta < 2M,
    tau = M otherwise.

    ``save_s`` is delta, ``mtbf_s`` M. Its leading terms, sqrt(2 delta M) - delta, are the form
    often quoted. The restart time R does not move the optimum (e^(R/M) is a constant factor of
    T_w). Golden: his Figs. 3-5 (delta = 5 min; M = 24 h, 6 h, 15 min: 117, 57, 9.1 min).
    """
    if save_s >= 2.0 * mtbf_s:
        return mtbf_s
    ratio = save_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * save_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - save_s


def loss_fraction(*, interval_s: float, save_s: float, recovery_s: float,
                  mtbf_s: float) -> float:
    """Expected fraction of wall time that is not new work: 1 - T_s / T_w with Daly's (2006)
    T_w = M e^(R/M) (e^((tau+delta)/M) - 1) T_s / tau.

    ``interval_s`` is tau (work between saves), ``save_s`` delta, ``recovery_s`` R (restart,
    replan, reshard), ``mtbf_s`` M. To first order in (tau+delta)/M it is
    delta/(tau+delta) + (R + (tau+delta)/2)/M. Computed in logarithms, so that a tiny M gives
    a fraction near 1 rather than an overflow.
    """
    segment = (interval_s + save_s) / mtbf_s
    log_expm1 = segment + math.log(-math.expm1(-segment))  # log(e^x - 1), stable for all x > 0
    log_useful = math.log(interval_s / mtbf_s) - recovery_s / mtbf_s - log_expm1
    return -math.expm1(log_useful)


def interval_cost(every_steps: int, *, step_s: float, save_s: float, recovery_s: float,
                  mtbf_s: float) -> IntervalCost:
    """``IntervalCost`` of a save every ``every_steps`` steps of ``step_s`` seconds."""
    interval_s = every_steps * step_s
    redone_s = (interval_s + save_s) / 2
    return IntervalCost(every_steps=every_steps, interval_s=interval_s, redone_s=redone_s,
                        lost_per_failure_s=recovery_s + redone_s,
                        loss_fraction=loss_fraction(interval_s=interval_s, save_s=save_s,
                                                    recovery_s=recovery_s, mtbf_s=mtbf_s),
                        save_fraction=save_s / (interval_s + save_s))


def best_steps(cost: Callable[[int], IntervalCost], *, near_steps: float) -> IntervalCost:
    """The whole number of steps (>= 1) that loses the least time, walking from the one closest
    to ``near_steps`` while a neighbour loses less (``loss_fraction`` has a single minimum in
    tau: Daly 2006)."""
    best = cost(max(1, round(near_steps)))
    for direction in (-1, 1):
        while best.every_steps + direction >= 1:
            other = cost(best.every_steps + direction)
            if other.loss_fraction >= best.loss_fraction:
                break
            best = other
    return best


# ----- the checkpoint's bytes --------------------------------------------------------------------

def _coords(config: ParallelConfig, rank: int) -> dict[str, int]:
    """Mesh coordinates of ``rank``: the inverse of ``layout.rank_of``."""
    names, sizes = mesh_dims(config)
    coords = {}
    for name, size in zip(reversed(names), reversed(sizes)):
        rank, coords[name] = divmod(rank, size)
    return coords


def _expert_shards(config: ParallelConfig) -> dict[tuple[int, int], int]:
    """(dp, cp) coordinates -> the expert shard that replica holds: expert-parallel groups are
    runs of ``ep`` consecutive ranks of a dp x cp group (``layout.ep_group``)."""
    members = sorted(((d, c) for d in range(config.dp) for c in range(config.cp)),
                     key=lambda dc: rank_of(config, {"dp": dc[0], "cp": dc[1]}))
    return {dc: index % config.ep for index, dc in enumerate(members)}


def _stage_states(model: ModelSpec, config: ParallelConfig, framework: str,
                  stage: int) -> dict[str, tuple[float, bool]]:
    """Per kind of checkpointed state of a rank of ``stage`` (dense and expert parameters and
    optimizer states): its bytes, and whether ZeRO shards it over the replicas (else each
    replica holds the same bytes)."""
    params = stage_params(model, config, stage)
    replicas = config.dp * config.cp
    states = {}
    for kind, count, shard in (("dense", params.dense, replicas),
                               ("expert", params.expert, max(1, replicas // config.ep))):
        if not count:
            continue
        held, whole = (model_state_bytes(framework, params=count, shard=n,
                                         zero_stage=config.zero_stage, offload="none",
                                         fp32=config.dtype == "fp32") for n in (shard, 1))
        states[f"{kind} params"] = (held.params, held.params < whole.params)
        states[f"{kind} optimizer"] = (held.optimizer, held.optimizer < whole.optimizer)
    return states


def _pieces(est: Estimate) -> dict[tuple, tuple[float, set[int]]]:
    """Each distinct piece of the checkpointed states (its key names the kind, stage, tensor
    shard and, where replicas differ, the replica or expert shard): its bytes and the nodes
    whose ranks hold it."""
    config = est.config
    per_stage = [_stage_states(est.model, config, est.framework, s) for s in range(config.pp)]
    expert_shard = _expert_shards(config)
    pieces: dict[tuple, tuple[float, set[int]]] = {}
    for rank in range(config.world_size):
        c = _coords(config, rank)
        replica = (c["dp"], c["cp"])
        for kind, (size, sharded) in per_stage[c["pp"]].items():
            which = replica if sharded else (
                (expert_shard[replica],) if kind.startswith("expert") else ())
            key = (kind, c["pp"], c["tp"], *which)
            pieces.setdefault(key, (size, set()))[1].add(est.cluster.node_of(rank))
    return pieces


def checkpoint_bytes(est: Estimate) -> CheckpointBytes:
    """What the checkpoint of ``est``'s plan holds, and what its busiest node writes (its share
    of every piece it holds, split evenly over the piece's holders) and reads back (every piece
    it holds). Module docstring: which states, and what is left out."""
    nodes = est.cluster.nodes
    write, load = [0.0] * nodes, [0.0] * nodes
    pieces = _pieces(est)
    for size, holders in pieces.values():
        for node in holders:
            write[node] += size / len(holders)
            load[node] += size
    return CheckpointBytes(total_bytes=sum(size for size, _ in pieces.values()),
                           write_bytes_per_node=max(write), load_bytes_per_node=max(load))


# ----- everything together -----------------------------------------------------------------------

def failure_cost(est: Estimate, failures: FailureModel) -> Elasticity:
    """What node failures cost ``est``'s plan under ``failures``, and the best interval."""
    nodes = est.cluster.nodes
    mtbf_s = failures.node_mtbf_s / nodes
    ckpt = checkpoint_bytes(est)
    verify_s = ckpt.total_bytes / nodes / failures.read_bytes_per_s
    save_write_s = ckpt.write_bytes_per_node / failures.write_bytes_per_s
    load_s = ckpt.load_bytes_per_node / failures.read_bytes_per_s
    save_s = save_write_s + verify_s
    recovery_s = failures.restart_s + failures.replan_s + verify_s + load_s
    step_s = est.time.step_s

    def cost(steps: int) -> IntervalCost:
        return interval_cost(steps, step_s=step_s, save_s=save_s, recovery_s=recovery_s,
                             mtbf_s=mtbf_s)

    daly_s = daly_interval_s(save_s=save_s, mtbf_s=mtbf_s)
    return Elasticity(
        failures=failures, nodes=nodes, step_s=step_s, checkpoint=ckpt,
        save_write_s=save_write_s, verify_s=verify_s, load_s=load_s,
        young_interval_s=young_interval_s(save_s=save_s, mtbf_s=mtbf_s), daly_interval_s=daly_s,
        optimal=best_steps(cost, near_steps=daly_s / step_s),
        chosen=cost(failures.checkpoint_every) if failures.checkpoint_every else None)
