"""``meshplan plan``: run the search for an objective and shape its result (plans, Pareto front).

Objectives:

* ``time``: the fastest step on all GPUs of the cluster.
* ``cost``: the cheapest run for ``train_tokens`` at ``gpu_hour_price`` per GPU-hour, optionally
  within ``deadline_days``; the planner may use fewer of the cluster's nodes (it tries powers of
  two and the full count). Cost = steps x step time x GPUs x price / 3600, steps =
  ceil(tokens / (global batch x sequence length)).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from meshplan.costmodel import Calibration, ClusterSpec, ModelSpec
from meshplan.costmodel.estimate import Estimate
from meshplan.planner.plan import Plan
from meshplan.planner.search import (AboveCeiling, EmptySpace, NoPlanFits, SearchResult,
                                     SearchTimeout, Solved, empty_space_message,
                                     framework_space, nearest_feasible, search,
                                     space_is_empty)
from meshplan.planner.space import SearchSpace, framework_refusal, pins_of

SECONDS_PER_DAY = 86400.0


@dataclass(frozen=True, kw_only=True)
class Budget:
    """What a training run must achieve and what GPU time costs."""

    train_tokens: float | None = None
    gpu_hour_price: float | None = None
    deadline_days: float | None = None

    def __post_init__(self) -> None:
        for name in ("train_tokens", "gpu_hour_price", "deadline_days"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")

    def steps(self, est: Estimate) -> int | None:
        if self.train_tokens is None:
            return None
        return math.ceil(self.train_tokens / (est.config.global_batch_size * est.config.seq_len))

    def days(self, est: Estimate) -> float | None:
        steps = self.steps(est)
        return None if steps is None else steps * est.time.step_s / SECONDS_PER_DAY

    def cost(self, est: Estimate) -> float | None:
        steps = self.steps(est)
        if steps is None or self.gpu_hour_price is None:
            return None
        return steps * est.time.step_s * est.cluster.num_gpus * self.gpu_hour_price / 3600.0

    def meets_deadline(self, est: Estimate) -> bool:
        days = self.days(est)
        return self.deadline_days is None or days is None or days <= self.deadline_days


@dataclass(frozen=True)
class PlanningResult:
    plans: tuple[Plan, ...]
    """Best first."""
    explored: tuple[Solved, ...]
    status: str
    wall_s: float
    candidates: int
    pareto: tuple[dict[str, Any], ...]
    gap: float = 0.0
    """With status FEASIBLE: the best plan is at most this fraction slower than the optimum."""


def node_counts(nodes: int) -> list[int]:
    """Node counts the cost objective tries, in the order it tries them: every count from 1 to
    ``nodes``; ``nodes`` and the powers of two first (their plans usually set a low cost
    early, which then prunes the other counts' searches), then the rest from the top down."""
    first = [nodes] + [n for n in (2 ** k for k in range(nodes.bit_length() - 1, -1, -1))
                       if n < nodes]
    return first + [n for n in range(nodes - 1, 0, -1) if n not in first]


def _step_ceiling(budget: Budget, cluster: ClusterSpec, space: SearchSpace,
                  kth_cost: float | None) -> float | None:
    """The slowest step a plan on ``cluster`` may take to meet the deadline and (with
    ``kth_cost``) to cost less than the k-th cheapest plan found so far."""
    steps = math.ceil(budget.train_tokens / (space.global_batch_size * space.seq_len))
    limits = []
    if budget.deadline_days is not None:
        limits.append(budget.deadline_days * SECONDS_PER_DAY / steps)
    if kth_cost is not None:
        limits.append(kth_cost * 3600.0 / (steps * cluster.num_gpus * budget.gpu_hour_price))
    return min(limits) if limits else None


def plan(model: ModelSpec, cluster: ClusterSpec, space: SearchSpace, *, framework: str,
         calibration: Calibration, calibration_name: str, objective: str = "time",
         budget: Budget = Budget(), top_k: int = 5, time_limit_s: float = 60.0, seed: int = 0,
         workers: int = 1, deterministic: bool = False, batch_tolerance: float = 0.0,
         allow_fewer_gpus: bool = False) -> PlanningResult:
    """Search and rank plans for ``objective``; raises NoPlanFits (and ValueError).

    When the space is empty (no configuration divides the GPUs and the global batch):
    ``batch_tolerance`` F lets the planner take the nearest global batches within F of the
    requested one (below and above), and ``allow_fewer_gpus`` the nearest smaller node count
    (leaving GPUs idle); plans are then ranked by tokens per second, since steps of different
    batches are not comparable. Without them an empty space raises ``EmptySpace`` naming the
    nearest batches and node counts that work.
    """
    if not 0 <= batch_tolerance < 1:
        raise ValueError(f"--global-batch-tolerance must be in [0, 1), got {batch_tolerance}")
    space = framework_space(space, framework)
    refusal = framework_refusal(model, cluster, space, framework)
    if refusal is not None:  # the pins leave nothing the framework runs
        raise ValueError(refusal)
    if space_is_empty(model, cluster, space) and (batch_tolerance or allow_fewer_gpus):
        return _plan_nearby(model, cluster, space, framework=framework,
                            calibration=calibration, calibration_name=calibration_name,
                            objective=objective, budget=budget, top_k=top_k,
                            time_limit_s=time_limit_s, seed=seed, workers=workers,
                            deterministic=deterministic, batch_tolerance=batch_tolerance,
                            allow_fewer_gpus=allow_fewer_gpus)
    if objective not in ("time", "cost"):
        raise ValueError(f"--objective must be time or cost, got {objective!r}")
    if objective == "cost" and (budget.train_tokens is None or budget.gpu_hour_price is None):
        raise ValueError("--objective cost needs --train-tokens and --gpu-hour-price")
    if objective == "time" and budget.deadline_days is not None:
        raise ValueError("--deadline-days applies to --objective cost (the cheapest run that "
                         "meets it); with --objective time every plan reports its days")
    clusters = [cluster] if objective == "time" else [
        dataclasses.replace(cluster, nodes=n) for n in node_counts(cluster.nodes)]
    results: list[SearchResult] = []
    failures = []
    costs: list[float] = []
    for option in clusters:
        ceiling = None
        if objective == "cost":
            kth = sorted(costs)[top_k - 1] if len(costs) >= top_k else None
            ceiling = _step_ceiling(budget, option, space, kth)
        try:
            result = search(model, option, space, framework=framework,
                            calibration=calibration, top_k=top_k,
                            time_limit_s=time_limit_s / len(clusters), seed=seed,
                            workers=workers, deterministic=deterministic, ceiling_s=ceiling)
            results.append(result)
            costs.extend(budget.cost(s.estimate) for s in result.ranked
                         if objective == "cost" and budget.meets_deadline(s.estimate))
        except (NoPlanFits, SearchTimeout) as err:
            if objective == "time":
                raise
            failures.append(err)
        except ValueError:
            if objective == "time":
                raise
    if not results and objective == "cost" and failures and all(
            isinstance(f, AboveCeiling) for f in failures):
        raise NoPlanFits(f"no plan trains {budget.train_tokens:.3g} tokens within "
                         f"{budget.deadline_days} days on up to {cluster.nodes} nodes", least=None)
    if not results:
        timeouts = [f for f in failures if isinstance(f, SearchTimeout)]
        raise (timeouts or failures or [NoPlanFits("no plan fits", least=None)])[-1]
    solved = [s for r in results for s in r.ranked]
    if objective == "cost":
        solved = [s for s in solved if budget.meets_deadline(s.estimate)]
        if not solved:
            raise NoPlanFits(f"no plan trains {budget.train_tokens:.3g} tokens within "
                             f"{budget.deadline_days} days on up to {cluster.nodes} nodes",
                             least=None)
        solved.sort(key=lambda s: (budget.cost(s.estimate), s.step_s))
    else:
        solved.sort(key=lambda s: s.step_s)
    status = "OPTIMAL" if all(r.status == "OPTIMAL" for r in results) else "FEASIBLE"
    wall = sum(r.wall_s for r in results)
    candidates = sum(r.candidates for r in results)
    plans = []
    for rank, s in enumerate(solved[:top_k], start=1):
        provenance = {"calibration": calibration_name, "objective": objective, "rank": rank,
                      "pinned": pins_of(space),
                      "solver": {"status": status, "wall_s": round(wall, 4),
                                 "candidates": candidates, "seed": seed, "workers": workers,
                                 "time_limit_s": time_limit_s, "split_status": s.status}}
        provenance.update(budget_summary(budget, s.estimate))
        plans.append(Plan.from_estimate(s.estimate, provenance=provenance))
    explored = tuple(x for r in results for x in r.explored)
    gap = max((r.stats.get("gap", 0.0) for r in results), default=0.0)
    return PlanningResult(plans=tuple(plans), explored=explored, status=status, wall_s=wall,
                          candidates=candidates, gap=gap,
                          pareto=pareto_front(explored, by_gpus=objective == "cost"))


def _plan_nearby(model: ModelSpec, cluster: ClusterSpec, space: SearchSpace, *,
                 batch_tolerance: float, allow_fewer_gpus: bool, **kwargs) -> PlanningResult:
    """``plan`` on the nearest non-empty spaces the flags allow, best tokens/s first."""
    batch = space.global_batch_size
    options = []
    if batch_tolerance:
        low, high = math.ceil(batch * (1 - batch_tolerance)), math.floor(
            batch * (1 + batch_tolerance))
        batches = nearest_feasible(set(range(max(1, low), high + 1)), lambda b: not space_is_empty(
            model, cluster, dataclasses.replace(space, global_batch_size=b)), want=batch, count=1)
        options += [(cluster, dataclasses.replace(space, global_batch_size=b)) for b in batches]
    if allow_fewer_gpus:
        for n in range(cluster.nodes - 1, 0, -1):
            smaller = dataclasses.replace(cluster, nodes=n)
            if not space_is_empty(model, smaller, space):
                options.append((smaller, space))
                break
    if not options:
        raise EmptySpace(empty_space_message(model, cluster, space) + (
            f" (nothing within --global-batch-tolerance {batch_tolerance:g})"
            if batch_tolerance else ""))
    results = [plan(model, c, s, **kwargs) for c, s in options]
    results.sort(key=lambda r: -r.plans[0].prediction.throughput.tokens_per_s)
    return results[0]


def budget_summary(budget: Budget, est: Estimate) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if budget.train_tokens is not None:
        out["train_tokens"] = budget.train_tokens
        out["train_steps"] = budget.steps(est)
        out["train_days"] = budget.days(est)
    if budget.gpu_hour_price is not None and budget.train_tokens is not None:
        out["gpu_hour_price"] = budget.gpu_hour_price
        out["train_cost"] = budget.cost(est)
    return out


def pareto_front(explored: tuple[Solved, ...], *, by_gpus: bool) -> tuple[dict[str, Any], ...]:
    """Plans no other explored plan beats on both step time and peak memory (and GPU count
    when the node count is free), fastest first."""
    points = [(s.step_s, s.estimate.memory.peak_reserved_bytes,
               s.estimate.cluster.num_gpus if by_gpus else 0, s) for s in explored]
    front = []
    for a in points:
        dominated = any(b[0] <= a[0] and b[1] <= a[1] and b[2] <= a[2] and b[:3] != a[:3]
                        for b in points)
        if not dominated and all(f[:3] != a[:3] for f in front):
            front.append(a)
    front.sort(key=lambda p: p[0])
    return tuple({"step_s": step, "peak_reserved_bytes": int(peak),
                  "num_gpus": s.estimate.cluster.num_gpus,
                  "tokens_per_s": s.estimate.throughput.tokens_per_s,
                  "plan": summary(s.estimate)} for step, peak, _, s in front)


def summary(est: Estimate) -> dict[str, Any]:
    """A compact description of a configuration, for tables and Pareto points."""
    c = est.config
    recompute = c.recompute if isinstance(c.recompute, str) else list(c.recompute)
    return {"tp": c.tp, "pp": c.pp, "dp": c.dp, "cp": c.cp, "ep": c.ep, "sp": c.sp,
            "zero_stage": c.zero_stage, "offload": c.offload,
            "offload_device": c.offload_device, "recompute": recompute,
            "micro_batch_size": c.micro_batch_size, "vpp": c.vpp,
            "layers_per_stage": list(c.stage_layers(est.model.num_layers)),
            "mesh_order": list(c.mesh_order)}
