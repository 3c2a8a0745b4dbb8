"""The planner: best-first branch and bound over the search space, CP-SAT for each candidate's
layer split and recompute modes.

1. The space is a tree (``_Refiner``): degree tuples, then micro-batch, sp and rank layout,
   then ZeRO stage and offload, then vpp; its leaves are global candidates.
2. Every node carries a step time no candidate below it can beat, for any split and recompute
   choice: linear work spread over the stages, the capacities memory leaves each stage
   (``bounds.capacity_bound``), exposed traffic and once-per-step terms where the node fixes
   them. Bounds that need memory are evaluated lazily, when the search reaches the node.
3. Nodes are refined in order of their bound; a candidate gets its CP-SAT tables
   (``tables.build_tables``), an incumbent from its even split, and a solve
   (``solver.solve``) only when its bound leaves room. Once the k-th best plan is at most the
   lowest open bound, no configuration can enter the top k and the search stops: the result
   is optimal within the cost model and the space unless a budget cut it short (then
   ``status`` is ``FEASIBLE`` with its proven gap).
4. Every solution is re-evaluated with ``costmodel.estimate`` (the authoritative numbers).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Any

from meshplan.costmodel import Calibration, ClusterSpec, ModelSpec, ParallelConfig, estimate
from meshplan.costmodel import composition
from meshplan.costmodel.estimate import Estimate, stage_once, stage_terms
from meshplan.costmodel.frameworks import (CP_COMM_TYPES_BY_FRAMEWORK, cp_exchange,
                                            min_micro_batches, per_stage_recompute)
from meshplan.costmodel.layout import (FRAMEWORK_MESH_ORDERS, FRAMEWORK_NAMES,
                                       framework_layout_error, framework_splits)
from meshplan.costmodel.memory import host_bytes_per_node, stage_memory
from meshplan.costmodel.timing import stage_compute_s, stage_link_signature
from meshplan.costmodel.traced import TRACED_RECOMPUTE
from meshplan.planner import solver as cpsat
from meshplan.planner.bounds import (capacity_bound, micro_pieces, split_bound, stage_classes,
                                     stage_micro_terms, uniform_layers)
from meshplan.planner.space import (CORE_MIN_CP_SEQ_LEN, MESH_ORDERS, SearchSpace, candidates,
                                    degree_tuples, divisors, framework_refusal, layout_error,
                                    micro_batch_choices, offload_choices, pick, settings_of,
                                    vpp_choices, zero_choices)
from meshplan.planner.tables import (CandidateTables, TracedTables, build_tables,
                                     build_traced_tables, layer_bounds, mixed_layers,
                                     stage_config,
                                     stage_most_layers)

SOLVE_TIME_CAP_S = 10.0
"""No single candidate's CP-SAT solve gets more than this."""


@dataclass(frozen=True)
class Solved:
    """One candidate with its best split and the cost model's estimate of it."""

    estimate: Estimate
    status: str
    lower_bound_s: float

    @property
    def step_s(self) -> float:
        return self.estimate.time.step_s


@dataclass(frozen=True)
class SearchResult:
    ranked: tuple[Solved, ...]
    """Best first, at most ``top_k``."""
    explored: tuple[Solved, ...]
    """Every candidate solved (for Pareto fronts and explanations)."""
    status: str
    """``OPTIMAL`` (search complete, every solve optimal) or ``FEASIBLE``."""
    wall_s: float
    candidates: int
    solves: int
    infeasible: int
    pruned: int
    stats: dict = field(default_factory=dict, hash=False)


class EmptySpace(ValueError):
    """No configuration of the space exists (not "none fits": none can even be formed)."""


def space_is_empty(model: ModelSpec, cluster: ClusterSpec, space: SearchSpace) -> bool:
    """True when no (degrees, micro-batch, sp, layout) of ``space`` forms a configuration."""
    refiner = _Refiner(model, cluster, space, framework="ideal", calibration=None)
    for degrees in degree_tuples(model, cluster, space):
        if refiner.layouts(degrees):
            return False
    return True


def nearest_feasible(values, feasible, *, want: int, count: int = 2) -> list[int]:
    """Up to ``count`` values nearest to ``want`` (below and above) for which ``feasible``."""
    below = [v for v in range(want - 1, 0, -1) if v in values]
    above = [v for v in range(want + 1, 2 * want + 1) if v in values]
    out = []
    for side in (below, above):
        found = 0
        for v in side:
            if feasible(v):
                out.append(v)
                found += 1
                if found == count:
                    break
    return sorted(out)


def empty_space_message(model: ModelSpec, cluster: ClusterSpec, space: SearchSpace) -> str:
    """Why the space is empty and what would make it non-empty: the nearest global batches on
    these GPUs, and the nearest node counts at this batch."""
    batch = space.global_batch_size
    batches = nearest_feasible(set(range(1, 2 * batch + 1)), lambda b: not space_is_empty(
        model, cluster, dataclasses.replace(space, global_batch_size=b)), want=batch)
    nodes = nearest_feasible(set(range(1, 2 * cluster.nodes + 1)), lambda n: not space_is_empty(
        model, dataclasses.replace(cluster, nodes=n), space), want=cluster.nodes) \
        if cluster.nodes > 1 else []
    hints = []
    if batches:
        hints.append("--global-batch " + " or ".join(map(str, batches)) +
                     " (or --global-batch-tolerance)")
    if nodes:
        hints.append("--nodes " + " or ".join(
            f"{n} ({n * cluster.gpus_per_node} GPUs)" for n in nodes) +
            (" (or --allow-fewer-gpus)" if any(n < cluster.nodes for n in nodes) else ""))
    if space.min_micro_batches_per_stage and not space_is_empty(
            model, cluster, dataclasses.replace(space, min_micro_batches_per_stage=False)):
        hints.insert(0, "a larger global batch or a smaller --micro-batch (this framework's "
                        "pipeline schedules need at least pp micro-batches per step)")
    return (f"the search space is empty: no tp/pp/cp/dp combination divides the "
            f"{cluster.num_gpus} GPUs, the heads ({model.num_heads}), the layers "
            f"({model.num_layers}) and the global batch {batch} with the pinned choices; try "
            + ("; ".join(hints) if hints else "fewer pinned choices"))


FRAMEWORK_SINGLE_VALUES: dict[str, tuple[tuple[str, Any], ...]] = {
    "deepspeed": (("vpp", 1),),
    "megatron": (("offload_device", "cpu"),),
    "torchtitan": (("offload_device", "cpu"),),
    "meshplan": (("cp", 1), ("offload_device", "cpu")),
}
"""Choices a framework runs with one value only (``layout.framework_layout_error``):
DeepSpeed's pipeline engine has no interleaved schedule; only DeepSpeed offloads to NVMe;
meshplan's runtime has no context parallelism."""


def framework_space(space: SearchSpace, framework: str) -> SearchSpace:
    """``space`` with the limits ``framework`` itself puts on configurations: its pipeline
    schedules' fewest micro-batches (``costmodel.frameworks.min_micro_batches``), the rank
    layouts it builds (``layout.FRAMEWORK_MESH_ORDERS``, unless the user pinned one: the
    exports warn about it, as ``estimate`` accepts it) and the choices it runs with one value
    only (``FRAMEWORK_SINGLE_VALUES``). ValueError for a per-stage recompute list pinned under
    a framework that takes one mode for the model (``frameworks.per_stage_recompute``), and,
    with ``layout.framework_layout_error``'s
    reason, when the user pinned only values the framework cannot run; the rest of that rule
    is applied configuration by configuration (``candidates``, ``_Refiner``)."""
    changes: dict[str, Any] = {}
    if min_micro_batches(framework, 2) > 1 and not space.min_micro_batches_per_stage:
        changes["min_micro_batches_per_stage"] = True
    orders = FRAMEWORK_MESH_ORDERS.get(framework)
    if orders is not None and space.mesh_order is None:  # a pinned layout is the user's call
        changes["mesh_order"] = orders
    pinned_modes = space.recompute_pinned
    if pinned_modes and len(set(pinned_modes)) > 1 and not per_stage_recompute(framework):
        raise ValueError(f"{FRAMEWORK_NAMES.get(framework, framework)} takes one recompute "
                         f"mode for all pipeline stages, got --recompute "
                         f"{','.join(pinned_modes)}; pin one mode, or plan for meshplan's "
                         f"runtime (--framework meshplan)")
    for name, value in FRAMEWORK_SINGLE_VALUES.get(framework, ()):
        pinned = getattr(space, name)
        if pinned is None:
            changes[name] = (value,)
        elif value not in pinned:
            raise ValueError(framework_layout_error(framework, _probe(name, pinned[0]), None))
    return dataclasses.replace(space, **changes) if changes else space


def _probe(name: str, value: Any) -> ParallelConfig:
    """A small configuration whose only unusual choice is ``name`` = ``value`` (one of
    ``FRAMEWORK_SINGLE_VALUES``'s), to read the framework's reason for refusing it."""
    fields: dict[str, Any] = {"global_batch_size": 2, "seq_len": 2, name: value}
    if name == "vpp":
        fields["pp"] = 2
    elif name == "cp":
        fields["seq_len"] = 2 * value
    else:  # offload_device
        fields.update(offload="optimizer", zero_stage=1, dp=2)
    return ParallelConfig(**fields)


class SearchTimeout(Exception):
    """The time limit passed before any plan was found (distinct from "nothing fits")."""


class NoPlanFits(Exception):
    """No candidate of the space fits in memory; carries the least-memory configuration."""

    def __init__(self, message: str, *, least: Estimate | None, stopped: bool = False):
        super().__init__(message)
        self.least = least
        self.stopped = stopped
        """Whether the search stopped at its budget before covering its whole space."""


@dataclass(frozen=True)
class Bound:
    """Pieces of a candidate's lower bound: per-micro-batch work summed over stages (``S``)
    and once-per-step terms; ``value`` composes them as the step time does."""

    per_micro_s: float
    once_s: float
    stages: int
    micro_batches: int
    vpp: int

    def with_split(self, top_micro_s: float, sum_micro_s: float) -> float:
        """``value`` with a split-aware slowest stage and sum (``bounds.capacity_bound``):
        each is the larger of the two lower bounds."""
        total = max(self.per_micro_s, sum_micro_s)
        return composition.scaled_step(micro_batches=self.micro_batches, vpp=self.vpp,
                                       top_micro=max(top_micro_s, total / self.stages),
                                       sum_micro=total, once=self.once_s) / self.vpp

    def value(self, extra_per_micro_s: float = 0.0) -> float:
        """``composition.scaled_step`` over v, with the slowest stage's time bounded below
        by the mean over stages, ``S / p``."""
        total = self.per_micro_s + extra_per_micro_s
        return composition.scaled_step(micro_batches=self.micro_batches, vpp=self.vpp,
                                       top_micro=total / self.stages, sum_micro=total,
                                       once=self.once_s) / self.vpp


def lower_bound_s(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, *,
                  framework: str, calibration: Calibration, lo: int, hi: int,
                  cache: dict | None = None) -> float:
    """A step time no split or recompute choice of ``config`` can beat (see ``bound``)."""
    return bound(model, cluster, config, framework=framework, calibration=calibration, lo=lo,
                 hi=hi, cache=cache).value()


def bound(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, *,
          framework: str, calibration: Calibration, lo: int, hi: int,
          cache: dict | None = None) -> Bound:
    """A step time no split or recompute choice of ``config`` can beat.

    Per micro-batch: t_i(n, r) >= t_i(n, none) (recomputation adds compute X and hides at most
    X more traffic), max_i t_i >= mean_i t_i, and sums over stages of terms linear in the layer
    count (one slope for all stages) are fixed for a given layer total; with S a lower bound of
    sum_i t_i, ``v * step >= (m v - 1) S / p + S``. Once per step: some stage holds at least
    ceil(L/p) layers, so the largest exposed data-parallel, optimizer and offload terms are at least the
    smallest value any stage class takes for a count in [ceil(L/p), hi]: each grows with the
    count (linearly, or as a ceiling of it where collectives are bucketed, which the two-point
    line over-estimates far from ``lo``), so the smaller of its exact value at ceil(L/p) and
    the line's value at ``hi`` is taken.
    """
    p, total_layers = config.pp, model.num_layers
    if p == 1:  # one stage holds every layer: read the terms at that count, exactly
        lo = hi = total_layers
    heavy = max(lo, min(hi, -(-total_layers // p)))
    ends = (heavy,) if p == 1 else (heavy, hi)
    # one representative per kind of stage: role and links (see costmodel.estimate._stage_key)
    counts = _stage_kinds(cluster, config, cache)
    classes = list(counts)

    def terms(stage: int, n: int):
        return _none_terms(model, cluster, config, stage, n, framework=framework,
                           calibration=calibration, cache=cache)

    def at(stage: int, n: int, getter) -> float:
        """A term at ``n`` layers: exact where it is evaluated (``lo``, ``lo + 1`` and the
        heaviest stage's count), else extrapolated from lo and lo + 1 (linear in the count,
        or a ceiling of it: bucketed collectives)."""
        if n in (lo, heavy) or (p > 1 and n == lo + 1):
            return getter(terms(stage, n))
        first, second = getter(terms(stage, lo)), getter(terms(stage, lo + 1))
        return first + (second - first) * (n - lo)

    total = _micro_sum(model, config, counts, lo, lambda stage, n: terms(stage, n).micro)
    once = composition.once_per_step(
        dp_exposed=min(composition.exposed(at(s, n, lambda t: t.dp_comm_s),
                                           at(s, n, lambda t: t.dp_hidden_s))
                       for s in classes for n in ends),
        optimizer=min(at(s, n, lambda t: t.optimizer_s) for s in classes for n in ends),
        offload_step=min(at(s, n, lambda t: t.offload_s) for s in classes for n in ends))
    return Bound(per_micro_s=total, once_s=once, stages=p, micro_batches=config.grad_accum_steps,
                 vpp=config.vpp)


def per_micro_s(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, *,
                framework: str, calibration: Calibration, lo: int,
                cache: dict | None = None) -> float:
    """``bound(...).per_micro_s`` (the same number), from the only evaluations it needs:
    each kind of stage at ``lo`` layers and one kind at ``lo + 1`` (the shared slope); the
    once-per-step terms, which need the heaviest stage's count too, are left out."""
    if config.pp == 1:
        lo = model.num_layers
    counts = _stage_kinds(cluster, config, cache)
    return _micro_sum(model, config, counts, lo, lambda stage, n: stage_micro_terms(
        model, cluster, config, stage, n, "none", framework=framework, calibration=calibration,
        cache=cache))


def _micro_sum(model: ModelSpec, config: ParallelConfig, counts: dict[int, int], lo: int,
               micro) -> float:
    """The per-micro-batch work summed over stages for any split of the layers (``bound``):
    the terms linear in the layer count summed over the kinds of stage at ``lo`` layers,
    plus one slope (``micro(first kind, lo + 1)``) for the layers above ``p lo``; the exposed
    ZeRO and offload traffic composed from the sums (sum_i max(0, x_i) >= max(0, sum_i x_i)).
    ``micro(stage, n)``: a stage's time per micro-batch by term (``timing.StageTime``) at
    ``n`` layers."""
    linear, zero_comm, zero_hidden, offload_raw, offload_hidden = _layer_sums(
        model, config, counts, lo, micro, _MICRO_GETTERS)
    return composition.micro_total(linear=linear, zero_comm=zero_comm, zero_hidden=zero_hidden,
                                   offload_raw=offload_raw, offload_hidden=offload_hidden)


_MICRO_GETTERS = (lambda t: t.linear_s, lambda t: t.zero_comm_s, lambda t: t.zero_hidden_s,
                  lambda t: t.offload_raw_s, lambda t: t.offload_hidden_s)
_RAW_TRAFFIC_GETTERS = (lambda t: t.zero_comm_s, lambda t: t.offload_raw_s)


def _layer_sums(model: ModelSpec, config: ParallelConfig, counts: dict[int, int], lo: int,
                micro, getters) -> tuple[float, ...]:
    """Per getter, the sum over stages of a term linear in the layer count, for any split of
    the layers (``_micro_sum``): each kind of stage at ``lo`` layers times its count, plus one
    slope (``micro(first kind, lo + 1)``) for the layers above ``p lo``."""
    classes = list(counts)
    at_lo = {s: micro(s, lo) for s in classes}
    spread = model.num_layers - config.pp * lo
    above = micro(classes[0], lo + 1) if spread else None

    def summed(getter) -> float:
        values = {s: getter(at_lo[s]) for s in classes}
        slope = getter(above) - values[classes[0]] if spread else 0.0
        return sum(values[s] * counts[s] for s in classes) + slope * spread

    return tuple(summed(g) for g in getters)


def _none_terms(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, stage: int,
                n: int, *, framework: str, calibration: Calibration, cache: dict | None):
    """``estimate.stage_terms`` of ``stage`` holding ``n`` layers without recomputation,
    cached by (config, stage, n) (``bounds.stage_micro_terms`` reads the same entries)."""
    key = (config, stage, n)
    if cache is not None:
        hit = cache.get(key)
        if hit is not None:
            return hit
    terms = stage_terms(model, cluster, stage_config(config, model, stage, n, "none"), stage,
                        framework=framework, calibration=calibration)
    if cache is not None:
        cache[key] = terms
    return terms


def _stage_kinds(cluster: ClusterSpec, config: ParallelConfig,
                 cache: dict | None) -> dict[int, int]:
    """First stage of each kind (role and links, ``bounds.stage_classes``) and how many
    stages are of that kind."""
    counts: dict[int, int] = {}
    for first in stage_classes(cluster, config, cache):
        counts[first] = counts.get(first, 0) + 1
    return counts


def recompute_deficit(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, *,
                      framework: str, calibration: Calibration, lo: int, capacity: float,
                      modes: tuple[str, ...]) -> float | None:
    """Extra per-micro-batch seconds (summed over stages) that memory forces, or None if no
    split fits.

    Let cap_r(i) be the most layers stage i holds under mode r. Memory per layer does not fall
    with the micro-batches in flight, which fall with the stage index, and the first stage also
    holds the embedding, so cap_r(i) <= cap_r(p - 2) for i < p - 1. If the stages hold at most
    C_none < L layers without recomputation, at least L - C_none layers sit on recomputing
    stages, each costing at least the cheapest mode's extra time per layer. If even the most
    memory-saving mode holds fewer than L layers, nothing fits.
    """
    p, total_layers = config.pp, model.num_layers
    if p == 1:
        return _one_stage_deficit(model, cluster, config, framework=framework,
                                  calibration=calibration, capacity=capacity, modes=modes)
    positions = [0] if p == 1 else ([0, 1] if p == 2 else [p - 2, p - 1])
    multiplicity = {positions[0]: p - 1 if p > 1 else 1, positions[-1]: 1} if p > 1 \
        else {0: 1}

    def holds(mode: str) -> int:
        total = 0
        for stage in positions:
            first = _reserved(model, cluster, config, stage, lo, mode, framework, calibration)
            second = _reserved(model, cluster, config, stage, lo + 1, mode, framework,
                               calibration)
            slope = max(second - first, 1.0)
            most = lo + int((capacity - first) // slope) if first <= capacity else 0
            total += multiplicity[stage] * most
        return total

    if holds([m for m in ("full", "selective", "none") if m in modes][0]) < total_layers:
        return None
    if "none" not in modes:
        return 0.0
    deficit = total_layers - holds("none")
    if deficit <= 0:
        return 0.0
    stage = positions[0]
    per_layer = {}
    for mode in modes:
        at = [stage_terms(model, cluster, stage_config(config, model, stage, n, mode), stage,
                          framework=framework, calibration=calibration).micro.linear_s
              for n in (lo, lo + 1)]
        per_layer[mode] = at[1] - at[0]
    extra = min(per_layer[m] - per_layer["none"] for m in modes if m != "none")
    return deficit * max(extra, 0.0)


def _one_stage_deficit(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, *,
                       framework: str, calibration: Calibration, capacity: float,
                       modes: tuple[str, ...]) -> float | None:
    """``recompute_deficit`` of a one-stage pipeline, exactly: its step under each mode is
    ``m t + once`` with nothing left to split, so the per-micro-batch amount that lifts the
    no-recompute step to the fastest fitting mode's step; None if no mode fits."""
    total, m = model.num_layers, config.grad_accum_steps

    def step(mode: str) -> float:
        terms = stage_terms(model, cluster, stage_config(config, model, 0, total, mode), 0,
                            framework=framework, calibration=calibration)
        t = terms.micro
        micro = composition.micro_total(linear=t.linear_s, zero_comm=t.zero_comm_s,
                                        zero_hidden=t.zero_hidden_s,
                                        offload_raw=t.offload_raw_s,
                                        offload_hidden=t.offload_hidden_s)
        once = composition.once_per_step(
            dp_exposed=composition.exposed(terms.dp_comm_s, terms.dp_hidden_s),
            optimizer=terms.optimizer_s, offload_step=terms.offload_s)
        return m * micro + once

    fitting = [r for r in modes if _reserved(model, cluster, config, 0, total, r, framework,
                                             calibration) <= capacity]
    if not fitting:
        return None
    return max(0.0, (min(step(r) for r in fitting) - step("none")) / m)


def _reserved(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, stage: int,
              layers: int, mode: str, framework: str, calibration: Calibration) -> float:
    return stage_memory(model, cluster, stage_config(config, model, stage, layers, mode), stage,
                        framework=framework, calibration=calibration).reserved_bytes


def offload_capacity(cluster: ClusterSpec, config: ParallelConfig) -> float:
    """Bytes per node the offloaded states may take: host memory, or NVMe."""
    if config.offload == "none":
        return float("inf")
    return cluster.nvme_bytes if config.offload_device == "nvme" else cluster.host_bytes


def offload_need(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, *,
                 framework: str, calibration: Calibration) -> tuple[float, str]:
    """A lower bound, valid for every layer split, of the offloaded bytes per node, and where
    they go ("host memory" or "NVMe"). Offloaded bytes per stage are linear in its layer
    count, so the largest stage holds at least the mean over stages of the even split's;
    DeepSpeed's estimator does not depend on the split (its largest layer is the model's)."""
    if config.offload == "none":
        return 0.0, "host memory"
    where = "NVMe" if config.offload_device == "nvme" else "host memory"
    even = config.replace(layers_per_stage=None, recompute="full")
    stages = [stage_memory(model, cluster, even, i, framework=framework,
                           calibration=calibration) for i in range(config.pp)]
    if framework == "deepspeed":
        return host_bytes_per_node(model, cluster, even, stages, framework=framework), where
    mean = sum(x.offloaded_bytes for x in stages) / len(stages)
    return mean * min(cluster.gpus_per_node, cluster.num_gpus), where


def surely_infeasible(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, *,
                      framework: str, calibration: Calibration, lo: int, capacity: float,
                      modes: tuple[str, ...]) -> bool:
    """True if the first or the last stage cannot fit even with ``lo`` layers under the most
    memory-saving allowed mode (memory only grows with layers)."""
    saving = [m for m in ("full", "selective", "none") if m in modes][0]
    for stage in {0, config.pp - 1}:
        staged = stage_config(config, model, stage, lo, saving)
        if stage_memory(model, cluster, staged, stage, framework=framework,
                        calibration=calibration).reserved_bytes > capacity:
            return True
    return False


SOLVE_DETERMINISTIC_CAP = 20.0
"""CP-SAT deterministic-time budget of one candidate's solve under ``deterministic=True``."""


@dataclass(order=True)
class _Node:
    """A node of the best-first search: a set of candidates and a step time none of them can
    beat. ``kind`` is how far the node is refined (``_refine``)."""

    bound: float
    seq: int
    kind: str = field(compare=False)
    data: object = field(compare=False)
    core: bool = field(compare=False, default=False)
    """Whether the node belongs to the core space's tree (``_Refiner.core``)."""


def search(model: ModelSpec, cluster: ClusterSpec, space: SearchSpace, *, framework: str,
           calibration: Calibration, top_k: int = 5, time_limit_s: float = 60.0,
           seed: int = 0, workers: int = 1, deterministic: bool = False,
           max_nodes: int | None = None, ceiling_s: float | None = None) -> SearchResult:
    """The ``top_k`` fastest plans of ``space``; raises NoPlanFits when none fits, EmptySpace
    when no configuration can be formed, ValueError with the framework's reason when its pins
    leave only layouts the framework does not run (``space.framework_refusal``).

    One best-first branch and bound (``_Refiner``) over a tree of candidate sets with bounds
    valid for all their members (degree tuples; then micro-batch, sp and rank layout; then
    ZeRO and offload; then vpp), in two trees:

    1. the core space's (``space.candidates(core=True)``: where fast plans usually are), from
       which a dive (``_Pass.dive``) takes the first plan: an incumbent, usually within a few
       percent of the optimum, after a few dozen refinements;
    2. the rest of the whole space's, added to the same heap, and both refined in the order
       of their bounds: every candidate whose bound is below the k-th best plan gets its
       memory-aware bounds, a greedy split (an incumbent at once) and, if the bound leaves
       room, a CP-SAT solve.

    Under a wall-clock limit below ``CORE_FIRST_BELOW_S`` the core space is solved to
    completion before the rest is opened, which gives better plans when the limit ends the
    search early. Longer limits do not: where the optimum lies outside the core space (cp 8
    on 8,000 H100s: 9.75 s against the core's 12.33 s), proving the core's own optimum first
    took up to a third of the search, work one order of bounds over both trees prunes.

    ``status`` is ``OPTIMAL`` when the heap empties: no configuration of the whole space is
    faster, within the cost model. When the budget runs out it is ``FEASIBLE`` and
    ``stats["gap"]`` is the proven gap: the best plan is at most that fraction slower than the
    optimum. ``stats["first_plan_s"]``: wall-clock seconds to the first plan.

    Budget: ``time_limit_s`` of wall-clock time; or, with ``deterministic``, a budget that does
    not depend on the machine's load: each CP-SAT solve gets ``SOLVE_DETERMINISTIC_CAP`` of
    CP-SAT's deterministic time and the search refines at most ``max_nodes`` nodes
    (``DETERMINISTIC_NODES`` if None). Either way the search runs until it holds one plan, so
    every budget gives an answer when a plan fits.

    ``ceiling_s``: plans slower than this are not wanted (the cost objective's bound from the
    plans of other node counts, or a deadline); nodes whose bound reaches it are pruned, and
    ``NoPlanFits`` says so when no plan is faster.

    Where the framework runs several context-parallel exchanges and the space does not pin
    one (``searched_exchanges``), each exchange's space is searched in turn and the results
    merged (``_search_exchanges``); ``stats["exchanges"]`` and ``stats["nodes_by_exchange"]``
    say which were searched and at what cost.
    """
    refusal = vpp_refusal(model, cluster, space)
    if refusal is not None:
        raise ValueError(refusal)
    with _collector_paused():
        spaces = exchange_spaces(space, framework)
        if len(spaces) > 1:
            return _search_exchanges(model, cluster, spaces, framework=framework,
                                     calibration=calibration, top_k=top_k,
                                     time_limit_s=time_limit_s, seed=seed, workers=workers,
                                     deterministic=deterministic, max_nodes=max_nodes,
                                     ceiling_s=ceiling_s)
        return _search(model, cluster, space, framework=framework, calibration=calibration,
                       top_k=top_k, time_limit_s=time_limit_s, seed=seed, workers=workers,
                       deterministic=deterministic, max_nodes=max_nodes, ceiling_s=ceiling_s)


def vpp_refusal(model: ModelSpec, cluster: ClusterSpec, space: SearchSpace) -> str | None:
    """Why a pinned ``--vpp`` admits no configuration, or None: interleaving (v > 1) needs
    pp >= 2 stages of v chunks each, so pp x v <= the model's layers, and a pinned v of 1
    always has one. Without this the search finds nothing and the "no plan fits" diagnosis,
    which samples layouts before their vpp, blamed memory."""
    if space.vpp is None or 1 in space.vpp:
        return None
    stages = [p for p in (space.pp or divisors(cluster.num_gpus)) if p > 1]
    fits = [(p, v) for p in stages for v in space.vpp if p * v <= model.num_layers]
    if fits:
        return None
    most = max((model.num_layers // p for p in stages), default=0)
    limit = (f"at most {most} with pp {min(stages)}" if most >= 2
             else "no interleaving fits these stages")
    return (f"--vpp {','.join(map(str, space.vpp))}: interleaving needs pp >= 2 stages of "
            f"vpp chunks each, pp x vpp <= the model's {model.num_layers} layers: {limit}"
            + ("" if stages else f" (no pp >= 2 divides the {cluster.num_gpus} GPUs)"))


def searched_exchanges(space: SearchSpace, framework: str) -> tuple[str, ...]:
    """The context-parallel exchanges (``ParallelConfig.cp_comm_type``) ``search`` searches:
    the space's own, and where that is ``auto`` and the space has cp > 1, every other
    exchange the framework runs (``frameworks.CP_COMM_TYPES_BY_FRAMEWORK``; Megatron-LM's
    ``all_gather`` and ``a2a`` beside its ring). The exchange changes the attention's traffic,
    what of it is exposed and the ring's merges, and no numerics: a layout choice, which
    exchange is fastest depends on the sequence, the degrees and the network."""
    if space.cp_comm_type != "auto" or (space.cp is not None and max(space.cp) < 2):
        return (space.cp_comm_type,)
    own = cp_exchange(framework, "auto")
    return ("auto",) + tuple(x for x in CP_COMM_TYPES_BY_FRAMEWORK.get(framework, ())
                             if x not in ("auto", own))


def exchange_spaces(space: SearchSpace, framework: str) -> list[SearchSpace]:
    """The spaces ``search`` searches, one per exchange of ``searched_exchanges``: ``space``
    itself (every configuration, with its own exchange), then one per other exchange over
    cp > 1 only (``SearchSpace.min_cp``: cp 1 exchanges nothing). Their candidates together
    are the configurations the planner considers."""
    exchanges = searched_exchanges(space, framework)
    return [space] + [dataclasses.replace(space, cp_comm_type=x, min_cp=max(2, space.min_cp))
                      for x in exchanges[1:]]


EXCHANGE_MIN_SHARE = 0.1
"""When ``search`` searches several exchanges (``searched_exchanges``), the searches run in
turn, each with the budget the ones before it left (the framework's own first: its space
holds every configuration, the others' only cp > 1). Under a wall-clock limit, one starts
only if at least this share of the limit is left; else what it would have searched is bounded
from its roots (``_search_exchanges``). Sharing the limit instead (half to the first search)
took plans at a 1 s limit from within 2 % of the 60 s optimum to 1.15-1.38x of it on five of
the fourteen ``benchmarks/planner_scaling.py`` cases."""


def _search_exchanges(model: ModelSpec, cluster: ClusterSpec, spaces: list[SearchSpace], *,
                      framework: str, calibration: Calibration,
                      top_k: int, time_limit_s: float, seed: int, workers: int,
                      deterministic: bool, max_nodes: int | None, ceiling_s: float | None
                      ) -> SearchResult:
    """``_search`` of each space of ``exchange_spaces`` (the first with the framework's own
    exchange, over the whole space; the others over cp > 1 only), merged. Each
    search after the first only wants plans faster than the k-th best so far (its
    ``ceiling_s``), so the merged top k is the top k of the union. Optimal when every search
    completed; errors only when every search failed (then the first search's error). The
    budget holds for all of them: each search gets what the ones before it left (none left,
    or under a wall-clock limit less than ``EXCHANGE_MIN_SHARE`` of it: the rest are not
    searched, the result is ``FEASIBLE`` and its gap covers them from their roots' bounds)."""
    start = time.perf_counter()
    results: list[SearchResult] = []
    errors: list[Exception] = []
    incomplete = False
    nodes_total = DETERMINISTIC_NODES if max_nodes is None else max_nodes
    searched: list[str] = []
    unsearched: list[SearchSpace] = []
    for i, sub in enumerate(spaces):
        ceiling = ceiling_s
        ranked = distinct(s for r in results for s in r.ranked)
        if len(ranked) >= top_k:
            kth = ranked[top_k - 1].step_s
            ceiling = kth if ceiling is None else min(ceiling, kth)
        left = time_limit_s - (time.perf_counter() - start)
        nodes = nodes_total - sum(r.stats["nodes"] for r in results)
        spent = nodes <= 0 if deterministic else left < EXCHANGE_MIN_SHARE * time_limit_s
        if i > 0 and spent:
            incomplete = True  # the budget went to the searches before: bound what is left
            unsearched.append(sub)
            continue
        try:
            results.append(_search(model, cluster, sub, framework=framework,
                                   calibration=calibration, top_k=top_k,
                                   time_limit_s=max(left, 0.0), seed=seed, workers=workers,
                                   deterministic=deterministic,
                                   max_nodes=nodes if deterministic else max_nodes,
                                   ceiling_s=ceiling, insist=i == 0))
            searched.append(sub.cp_comm_type)
        except (NoPlanFits, SearchTimeout, ValueError) as err:  # EmptySpace is a ValueError
            # a ValueError: pins the exchange cannot run (e.g. heads its a2a cannot split)
            if isinstance(err, SearchTimeout) or getattr(err, "stopped", False):
                incomplete = True
                unsearched.append(sub)
            errors.append(err)
    if not results:
        raise errors[0]
    plans = [s for r in results for s in r.ranked]
    incomplete = incomplete or any(r.status != "OPTIMAL" for r in results)
    first = results[0]
    top = min(s.step_s for s in plans)
    gaps = [r.stats.get("gap", 0.0) for r in results]
    for sub in unsearched:  # what no search covered: its roots' bounds hold for all of it
        refiner = _Refiner(model, cluster, sub, framework=framework, calibration=calibration)
        floor = min((node.bound for node in refiner.roots()), default=math.inf)
        gaps.append(max(0.0, (top - floor) / top))
    return SearchResult(
        ranked=tuple(distinct(plans)[:top_k]),
        explored=tuple(s for r in results for s in r.explored),
        status="FEASIBLE" if incomplete else "OPTIMAL",
        wall_s=time.perf_counter() - start,
        candidates=sum(r.candidates for r in results), solves=sum(r.solves for r in results),
        infeasible=sum(r.infeasible for r in results), pruned=sum(r.pruned for r in results),
        stats={"gap": max(gaps),
               "first_plan_s": first.stats["first_plan_s"],
               "core_candidates": sum(r.stats["core_candidates"] for r in results),
               "nodes": sum(r.stats["nodes"] for r in results),
               "nodes_by_exchange": {x: r.stats["nodes"] for x, r in zip(searched, results)},
               "evaluated": sum(r.stats["evaluated"] for r in results),
               "exchanges": searched})


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off for the duration (and back as it was after).

    A search allocates hundreds of thousands of long-lived objects (configurations, nodes,
    cached terms) and frees no cycles, so each collection the allocations trigger only
    re-scans them: 5-9 % of a search's CPU time on 405B-parameter spaces, for nothing
    collected. Reference counting still frees everything that is not a cycle."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _search(model: ModelSpec, cluster: ClusterSpec, space: SearchSpace, *, framework: str,
            calibration: Calibration, top_k: int, time_limit_s: float, seed: int, workers: int,
            deterministic: bool, max_nodes: int | None, ceiling_s: float | None,
            insist: bool = True) -> SearchResult:
    start = time.perf_counter()
    space = framework_space(space, framework)
    short = not deterministic and time_limit_s < CORE_FIRST_BELOW_S
    core_cp_seq_len = SHORT_LIMIT_CORE_CP_SEQ_LEN if short else CORE_MIN_CP_SEQ_LEN
    refiner = _Refiner(model, cluster, space, framework=framework, calibration=calibration,
                       core_cp_seq_len=core_cp_seq_len)
    core = candidates(model, cluster, space, core=True, framework=framework,
                      core_cp_seq_len=core_cp_seq_len)
    best = _Best(top_k, ceiling=ceiling_s)
    if deterministic and max_nodes is None:
        max_nodes = DETERMINISTIC_NODES
    budget = _Budget(start=start, time_limit_s=time_limit_s, deterministic=deterministic,
                     max_nodes=max_nodes, insist=insist)
    refiner.core = True
    search_pass = _Pass(refiner, refiner.roots(), best, budget, model=model, cluster=cluster,
                        space=space, framework=framework, calibration=calibration, seed=seed,
                        workers=workers)
    search_pass.dive()  # the core space's first plan
    if short:
        search_pass.run()  # a short budget: the core space's best plan before the rest
    refiner.core = False
    refiner.skip = set(core)
    rest = refiner.roots()
    if not core and not rest:
        refusal = framework_refusal(model, cluster, space, framework)
        if refusal is not None:  # configurations exist, the framework runs none of them
            raise ValueError(refusal)
        raise EmptySpace(empty_space_message(model, cluster, space))
    for node in rest:
        heapq.heappush(search_pass.heap, node)
    search_pass.run()
    stopped = search_pass.stopped
    status = "FEASIBLE" if stopped or search_pass.incomplete else "OPTIMAL"
    if not best and search_pass.incomplete:
        raise SearchTimeout(f"no plan found: {search_pass.solves} CP-SAT solves ran "
                            f"out of time before finding a split; raise --time-limit or pin "
                            f"more choices")
    if not best and ceiling_s is not None and not stopped:
        raise AboveCeiling(f"no plan is faster than {ceiling_s:.4g} s per step", least=None)
    if not best:
        message, least = _no_fit_message(model, cluster, core or refiner.sample(), space,
                                         framework=framework, calibration=calibration)
        if stopped and least is not None and _fits(least, cluster, space, framework=framework,
                                                   calibration=calibration):
            raise SearchTimeout("no plan found within the time limit, though configurations "
                                "fit (e.g. tp {0.tp} pp {0.pp} dp {0.dp} ZeRO-{0.zero_stage} "
                                "offload {0.offload}); raise --time-limit or pin more choices"
                                .format(least.config))
        if stopped:
            message += ("; the search stopped at its budget before covering the whole space "
                        "(raise --time-limit to search the rest)")
        raise NoPlanFits(message, least=least, stopped=stopped)
    top = min(x.step_s for x in best.values())
    floor = search_pass.floor()
    gap = max(0.0, (top - floor) / top) if stopped else 0.0
    ranked = tuple(distinct(best.values())[:top_k])
    return SearchResult(
        ranked=ranked, explored=tuple(best.values()), status=status,
        wall_s=time.perf_counter() - start, candidates=refiner.counted,
        solves=search_pass.solves, infeasible=search_pass.infeasible,
        pruned=search_pass.pruned,
        stats={"gap": gap, "first_plan_s": best.first_at - start,
               "core_candidates": len(core), "nodes": budget.nodes,
               "evaluated": refiner.evaluated})


SHORT_LIMIT_CORE_CP_SEQ_LEN = 8192
"""Under such a limit the core space also holds cp > 1 from this many tokens on (the core's
rule for longer searches, ``space.CORE_MIN_CP_SEQ_LEN``, starts at 16,384): at 8,192 tokens
the fastest plans of 405B-parameter models use cp 4-16, and a core without them gave plans
1.26-1.36x slower than the optimum at a 1 s limit. Longer searches only dive in the core, and
a wider core made them 5-18 % slower there."""
CORE_FIRST_BELOW_S = 5.0
"""Under a wall-clock limit shorter than this, the core space is solved to completion before
the rest of the space is opened: the limit may end the search before one order of bounds
over both trees reaches the plans the core holds (at 1 s, plans 1.2-1.6x slower than the
core's best on five of the fourteen ``benchmarks/planner_scaling.py`` cases). Longer limits
and deterministic budgets search both trees in one order, which completes in less work."""
NO_PLAN_GRACE_S = 5.0
NO_PLAN_NODES = 8000
"""Nodes a wall-clock search refines before it may give up without a plan (``past_grace``)."""
DIVE_NODES = 500
"""Nodes ``_Pass.dive`` refines at most looking for a first plan."""
DIVE_LEAVE = 2.0
"""The dive leaves a path once a node priced with every term (``PRICED_KINDS``) is bounded
above this many times the heap's lowest bound, and dives again from there. Only priced nodes
are compared: the bounds above them leave out the ZeRO and offload traffic and the
once-per-step terms and are often 3x too low on 405B-parameter spaces, so comparing those sends
the dive back to breadth-first order before any plan; following every path to its plan instead
gave 17x slower plans at a 1 s limit (Llama-3-405B on 32,768 GPUs: ZeRO-3 over dp 2,048)."""
PRICED_KINDS = frozenset({"kind_fit", "kind_caps", "member", "candidate", "memory", "solve"})
"""Nodes whose bound counts every term (ZeRO and offload traffic, once-per-step terms)."""
DETERMINISTIC_NODES = 20000
"""Nodes a ``deterministic`` search refines at most (most are a handful of cost-model calls or
fewer: a lazily evaluated node is refined twice). Every case of
``benchmarks/planner_scaling.py`` completes within 4,500 (4,415 for Mixtral on 128 GPUs)."""


@dataclass
class _Budget:
    start: float
    time_limit_s: float
    deterministic: bool
    max_nodes: int | None
    nodes: int = 0
    insist: bool = True
    """Whether the search goes on past its budget until it holds a plan (``past_grace``);
    ``_search_exchanges``'s later searches do not: the plans before them are the answer."""

    def spent(self) -> bool:
        if self.deterministic:
            return self.max_nodes is not None and self.nodes >= self.max_nodes
        return time.perf_counter() - self.start > self.time_limit_s

    def past_grace(self) -> bool:
        """Past the budget with no plan: the search gives up (``SearchTimeout``) when it has
        spent four times its budget plus ``NO_PLAN_GRACE_S`` and refined at least
        ``NO_PLAN_NODES`` nodes (or four times its nodes): work, not only time, so a loaded
        machine does not give up before a plan an idle one finds. Without ``insist``, at
        once."""
        if not self.insist:
            return True
        if self.deterministic:
            return self.max_nodes is not None and self.nodes >= 4 * self.max_nodes
        return (time.perf_counter() - self.start > 4 * self.time_limit_s + NO_PLAN_GRACE_S
                and self.nodes >= NO_PLAN_NODES)

    def remaining_s(self) -> float:
        return max(self.time_limit_s - (time.perf_counter() - self.start), 0.05)


class _Pass:
    """Best-first refinement of a heap of nodes (``search``), with its first dive."""

    def __init__(self, refiner: "_Refiner", roots: list, best: "_Best", budget: _Budget,
                 **solve_args):
        self.refiner, self.best, self.budget = refiner, best, budget
        self.heap = list(roots)
        heapq.heapify(self.heap)
        self.solve_args = solve_args
        self.solves = self.infeasible = self.pruned = 0
        self.stopped = False
        self.incomplete = False  # some CP-SAT solve ended without proving its optimum
        self.last_resort = False  # the budget ran out without a plan and a last dive was made

    def floor(self) -> float:
        return self.heap[0].bound if self.heap else float("inf")

    def run(self) -> None:
        heap, best = self.heap, self.best
        if not best:
            self.dive()
        while heap:
            if heap[0].bound >= best.kth():
                self.pruned += len(heap)
                heap.clear()
                return
            if self.budget.spent() and (best or self.budget.past_grace()):
                if not best and not self.last_resort and self.budget.insist:
                    # a plan however far above the bound (its gap says so) beats none: follow
                    # one path to its plan, the leave rule off
                    self.last_resort = True
                    self.dive(leave=math.inf)
                    continue
                self.stopped = True
                return
            node = heapq.heappop(heap)
            self.budget.nodes += 1
            if node.kind != "solve":
                children, dropped = self.refiner.refine(node, best)
                self.infeasible += dropped
                for child in children:
                    heapq.heappush(heap, child)
                continue
            self.solve(node)

    def dive(self, leave: float | None = None) -> None:
        """Depth first from the lowest bound until a plan is held (at most ``DIVE_NODES``
        nodes), stopping short of a CP-SAT solve once one is: the refined node's lowest
        child is refined next, its siblings go to the heap, and a path whose priced bound
        rises above ``leave`` times the heap's lowest is left for a new dive from there
        (``DIVE_LEAVE``; ``run`` makes a last dive with none when the budget ends without a
        plan).
        Best-first order reaches its first plan only after refining every node whose bound is
        below that plan's, which on a large space is more than a short time limit; the dive
        usually holds a plan within a few dozen refinements. The plan is usually a
        candidate's greedy split (``_greedy_incumbent``); that candidate's solve then waits
        in the heap for its bound's turn, which the plans found meanwhile often prune (on
        405B-parameter spaces it was one 45 ms CP-SAT proof that the greedy split was
        already the candidate's best). It only changes the order in
        which nodes are refined: every node still ends refined or pruned, so a search that
        completes gives the best-first answer."""
        heap, best = self.heap, self.best
        leave = DIVE_LEAVE if leave is None else leave
        node = None
        for _ in range(DIVE_NODES):
            if best and (node is None or node.kind == "solve" or self.budget.spent()):
                break
            if not self.budget.insist and self.budget.spent():
                break  # a later exchange's search: no plan of its own is owed
            if node is None:
                if not heap:
                    return
                node = heapq.heappop(heap)
            if node.bound >= best.kth():  # nothing below it beats the k-th plan (or ceiling)
                self.pruned += 1
                node = None
                continue
            self.budget.nodes += 1
            if node.kind == "solve":
                self.solve(node)
                node = None
                continue
            children, dropped = self.refiner.refine(node, best)
            self.infeasible += dropped
            children.sort()
            node = children[0] if children else None
            for child in children[1:]:
                heapq.heappush(heap, child)
            if (node is not None and node.kind in PRICED_KINDS and heap
                    and node.bound > heap[0].bound * leave):
                node = heapq.heappushpop(heap, node)  # priced far above the rest: dive again
        if node is not None:
            heapq.heappush(heap, node)

    def solve(self, node: "_Node") -> None:
        index, config, tables = node.data
        args = self.solve_args
        best = self.best
        solved = _solve_one(args["model"], args["cluster"], config, args["space"],
                            framework=args["framework"], calibration=args["calibration"],
                            seed=args["seed"], workers=args["workers"],
                            time_limit_s=min(self.budget.remaining_s(), SOLVE_TIME_CAP_S),
                            bound=node.bound, cutoff_s=_cutoff(best.kth(), best.get(index)),
                            tables=tables, deterministic=self.budget.deterministic)
        self.solves += 1
        if solved == "timeout":
            self.incomplete = True  # this candidate's optimum is unknown
            return
        if solved is None:
            if index in best:  # nothing beats its greedy split (or the k-th best plan)
                best[index] = dataclasses.replace(best[index], status="OPTIMAL")
            else:
                self.infeasible += 1
            return
        if solved.status != "OPTIMAL":
            self.incomplete = True
        if index not in best or solved.step_s <= best[index].step_s:
            best[index] = solved


def _equivalence(solved: Solved) -> tuple:
    """Plans with equal keys differ only in a rank layout that changes nothing the cost model
    sees (e.g. both mesh orders inside one node): same degrees and knobs, same split, same
    step time and peak memory."""
    config, est = solved.estimate.config, solved.estimate
    return (config.replace(mesh_order=MESH_ORDERS[0]), est.time.step_s,
            est.memory.peak_reserved_bytes)


def distinct(plans) -> list[Solved]:
    """``plans`` fastest first, one of each equivalence class (``_equivalence``), the
    default mesh order preferred."""
    out, seen = [], set()
    for solved in sorted(plans, key=lambda x: (x.step_s,
                                               x.estimate.config.mesh_order != MESH_ORDERS[0])):
        key = _equivalence(solved)
        if key not in seen:
            seen.add(key)
            out.append(solved)
    return out


class AboveCeiling(NoPlanFits):
    """Plans may fit, but none is faster than the search's ``ceiling_s``."""


class _Best(dict):
    """Best known plan per candidate index, with the k-th best step time kept current."""

    def __init__(self, k: int, ceiling: float | None = None):
        super().__init__()
        self.k = k
        self.ceiling = float("inf") if ceiling is None else ceiling
        self._kth = self.ceiling
        self._keys: dict[int, tuple] = {}  # each entry's ``_equivalence``
        self._holders: dict[tuple, int] = {}  # entries per equivalence class
        self._steps: dict[tuple, float] = {}  # each class's step time
        self.first_at: float | None = None
        """``time.perf_counter()`` when the first plan came."""

    def __setitem__(self, index: int, solved: Solved) -> None:
        if self.first_at is None:
            self.first_at = time.perf_counter()
        super().__setitem__(index, solved)
        old = self._keys.get(index)
        if old is not None:
            self._holders[old] -= 1
            if not self._holders[old]:
                del self._holders[old], self._steps[old]
        key = self._keys[index] = _equivalence(solved)
        self._holders[key] = self._holders.get(key, 0) + 1
        self._steps[key] = solved.step_s
        if len(self._steps) >= self.k:  # the k-th of the distinct plans (equivalent layouts once)
            self._kth = min(self.ceiling, heapq.nsmallest(self.k, self._steps.values())[-1])

    def kth(self) -> float:
        return self._kth


def _cutoff(kth_s: float, incumbent: Solved | None) -> float | None:
    """Only splits faster than the k-th best plan, and than this candidate's own greedy split,
    are wanted from its solve."""
    values = [v for v in (kth_s, incumbent.step_s if incumbent else None)
              if v is not None and v != float("inf")]
    return min(values) if values else None


@dataclass(frozen=True)
class _Family:
    """Lower bounds shared by the members of a family (``_Refiner.family``): the slowest
    stage's and the summed per-micro-batch work, and the micro-batches per step."""

    top: float
    total: float
    micro_batches: int
    once: float = 0.0

    def value(self, v: int) -> float:
        """The step of any member with ``v`` virtual chunks (``composition.scaled_step``)."""
        return composition.scaled_step(micro_batches=self.micro_batches, vpp=v,
                                       top_micro=self.top, sum_micro=self.total,
                                       once=self.once) / v

    def least(self, vpps) -> float:
        """``min(value(v) for v in vpps)``: ``value(v) = m T + (S - T) / v + once`` is
        monotonic in v, so the least is at the smallest or the largest v."""
        return min(self.value(min(vpps)), self.value(max(vpps)))


def _with_kind(family: _Family, floor: float, once: float, stages: int) -> _Family:
    """``family``'s bounds for one (ZeRO, offload) choice of a ``stages``-stage pipeline: its
    summed per-micro-batch work at least ``floor`` (``_Refiner.traffic_floor``), its
    once-per-step terms ``once``."""
    total = max(family.total, floor)
    return _Family(top=max(family.top, total / stages), total=total,
                   micro_batches=family.micro_batches, once=once)


class _Refiner:
    """The search tree (``search``), refined one node at a time.

    The bounds rest on these properties of the cost model (checked by
    ``tests/planner/test_bounds.py::test_the_invariants_the_search_bounds_rest_on``):

    1. linear work (compute, TP/CP/EP/PP traffic) is least without ZeRO or offload, which
       only add terms that are at least 0;
    2. a stage's linear work and time per micro-batch do not fall with v (interleaving adds
       transfers; the ZeRO and offload traffic and the compute that hides it do not depend on
       v), nor does its memory;
    3. per sample, a stage's linear work does not grow with the micro-batch, and its memory
       does not fall with it;
    4. memory does not grow with the ZeRO stage or offload among the choices the framework
       runs (the leanest member of a family holds the most layers; ``least_split``);
    5. a middle stage needs no less memory than a later one (``bounds``);
    6. compute per micro-batch depends on neither v nor ZeRO and offload, and the
       once-per-step terms (data-parallel traffic, optimizer, offload step) grow with a
       stage's layer count and fall only with its compute (``once_bounds``);
    7. a stage's time per micro-batch is at least its raw ZeRO-2/3 traffic and at least its
       raw parameter-offload traffic, neither of which depends on the micro-batch or falls
       under recomputation (``traffic_floor``).

    Levels, each bounding every candidate below it. Down to ``layout_fit`` the bounds leave
    the once-per-step terms out (they are at least 0); the ``kind`` level adds its own lower
    bound of them (``once_bounds``), so every bound below it counts them. A node first
    carries a cheap bound (its parent's, or one read off its parent's numbers) and is
    evaluated only when the search reaches it; it then comes back with its own bound
    (``refine``):

    ``degrees`` (tp, cp, pp, dp, ep)
        at the root ``pipeline_floor`` of the per-sample linear work at the largest
        micro-batch (3): ``B / dp`` slowest stages plus the bubble's share at the smallest
        micro-batch and the most virtual chunks; reached, ``fitting``: per (sp, rank
        layout), the same with the per-sample slowest stage and sum of
        ``bounds.capacity_bound`` (largest micro-batch's work, smallest micro-batch's leanest
        capacities: 3, 4); degree tuples no member of which fits drop. Each layout below
        starts from that floor at its own micro-batch b and its own most virtual chunks (the
        bubble's share, ``b (S - T) / v``, grows with b), not the tuple's smallest b.
    ``layout`` (+ micro-batch, sp, rank layout)
        the layout's linear work over every v (2), then its leanest member's capacities
        (``family``: 1, 4) with, per (ZeRO, offload) choice, its raw traffic as a floor of
        the summed work (``traffic_floor``: 7), the least over choices; ``layout_fit`` bounds
        each v from the v = 1 terms (2). Where memory forces nothing (``once_first``), the
        same terms in the other order: floors and once-per-step bounds on the linear work
        first, capacities after (``layout_late_caps``, which creates the ``kind`` nodes).
    ``kind`` (+ ZeRO stage, offload)
        created with the layout's capacities, its own traffic floor and its once-per-step
        bound (``once_bounds``; 0 where the rest already reaches the k-th best plan);
        dropped if its v = 1 member cannot hold its heaviest stage (``heavy_infeasible``;
        2, 5); else that member's every term (``bound``: exposed ZeRO and offload traffic
        too) over every v (2), then its own capacities (``kind_fit``).
    ``member`` (+ vpp) and ``candidate``
        ``bound`` of the candidate itself (every term, split-free).
    ``memory``
        its own capacities with its exposed traffic (``capacity_split``); candidates no split
        fits, or whose offloaded states exceed host memory or NVMe, drop.
    ``tables``
        the split-aware bound of the CP-SAT tables (``tables_bound``); the even split with the
        fastest fitting modes (``solver.greedy_hint``) becomes an incumbent plan at once, and
        the node goes on to ``solve`` only if the bound leaves room below it.
    """

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, space: SearchSpace, *,
                 framework: str, calibration: Calibration,
                 core_cp_seq_len: int = CORE_MIN_CP_SEQ_LEN):
        self.model, self.cluster, self.space = model, cluster, space
        self.framework, self.calibration = framework, calibration
        self.capacity = cluster.gpu.hbm_bytes * (1 - space.memory_margin)
        self.cache: dict = {}
        self.configs: dict[tuple, ParallelConfig | None] = {}
        self.seq = 0
        self.evaluated = 0
        self.counted = 0
        self.indices: dict[ParallelConfig, int] = {}
        self.linear_of: dict[tuple, _Family] = {}
        """Each layout's linear work over every v (``layout``), by (degrees, b, sp, order)."""
        self.skip: set[ParallelConfig] = set()
        self.core_cp_seq_len = core_cp_seq_len
        """The core space's ``space.degree_tuples`` rule for cp (``search``)."""
        self.core = False
        """While True, the tree spans the core space only (``space.candidates(core=True)``);
        ``refine`` sets it to the refined node's own, as both trees share one heap. The
        whole-space tree leaves out the core space's members (``skip``), not the core tree."""
        # traced models and models mixing dense and MoE layers: split by stage boundaries
        # (``tables.build_traced_tables``), each candidate bounded by its own tables
        self.kinded = model.is_traced or mixed_layers(model)
        self.flat = (self.kinded or space.layers_per_stage is not None
                     or space.recompute_pinned is not None)
        self.traced_modes = (tuple(m for m in space.recompute_modes if m in TRACED_RECOMPUTE)
                             if model.is_traced else space.recompute_modes)
        if model.is_traced and not self.traced_modes:
            raise ValueError(f"{model.name} is a traced module: recompute must include none "
                             f"or full")

    def node(self, bound: float, kind: str, data: object) -> _Node:
        self.seq += 1
        return _Node(bound, self.seq, kind, data, self.core)

    def sample(self) -> list[ParallelConfig]:
        """Some candidates of the whole space (for the "no plan fits" message when the core
        space is empty): the first of each degree tuple."""
        out = []
        for degrees in degree_tuples(self.model, self.cluster, self.space):
            for b, sp, order in self.layouts(degrees)[:1]:
                config = self.leanest(degrees, b, sp, order, 1)
                if config is not None:
                    out.append(config)
        return out

    # ----- roots ----------------------------------------------------------------------------

    def flat_roots(self, configs: list[ParallelConfig]) -> list[_Node]:
        return [n for c in configs for n in self.candidate_nodes(c)]

    def roots(self) -> list[_Node]:
        """Roots of the whole space (of the core space while ``core``), less ``skip``."""
        if self.flat:
            configs = [c for c in candidates(self.model, self.cluster, self.space,
                                             core=self.core, framework=self.framework,
                                             core_cp_seq_len=self.core_cp_seq_len)
                       if c not in self.skip]
            return self.flat_roots(configs)
        out = []
        for degrees in degree_tuples(self.model, self.cluster, self.space, core=self.core,
                                     core_cp_seq_len=self.core_cp_seq_len):
            layouts = self.layouts(degrees)
            if not layouts:
                continue
            out.append(self.node(self.degrees_bound(degrees, layouts), "degrees",
                                 (degrees, layouts)))
        return out

    def layouts(self, degrees) -> list[tuple[int, bool, tuple[str, ...]]]:
        """(micro-batch, sp, rank layout) choices of a degree tuple, largest micro-batch
        first; the ones ``ParallelConfig`` refuses are left out."""
        tp, cp, pp, dp, ep = degrees
        space = self.space
        per_replica = space.global_batch_size // dp
        mbs = micro_batch_choices(space, per_replica, pp, core=self.core)
        sps = [tp > 1] if space.sp is None else [s for s in space.sp if tp > 1 or not s]
        orders = pick(space.mesh_order, list(MESH_ORDERS))
        if space.mesh_order is None and (pp == 1 or dp == 1 or self.orders_alike(degrees)):
            orders = orders[:1]
        out = []
        for b in sorted(mbs, reverse=True):
            for sp in sps:
                for order in orders:
                    if self.base(degrees, b, sp, order, 1) is not None:
                        out.append((b, sp, order))
        return out

    def orders_alike(self, degrees) -> bool:
        """Whether every stage has the same communication groups and pipeline link
        (``timing.stage_link_signature``) under both rank layouts of ``MESH_ORDERS``: the cost
        model then prices both alike (memory does not depend on the rank layout), so only the
        first is searched, the one ``distinct`` reports of two equivalent plans."""
        key = ("orders alike", degrees)
        hit = self.cache.get(key)
        if hit is None:
            tp, cp, pp, dp, ep = degrees
            try:
                first, second = (ParallelConfig(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep,
                                                mesh_order=order, global_batch_size=dp,
                                                seq_len=cp) for order in MESH_ORDERS[:2])
            except ValueError:
                hit = False  # one of them is not a layout
            else:  # stage by stage, to the first that differs
                hit = all(stage_link_signature(self.cluster, first, stage)
                          == stage_link_signature(self.cluster, second, stage)
                          for stage in (0, pp - 1, *range(1, pp - 1)))
            self.cache[key] = hit
        return hit

    def config(self, degrees, mb, sp, order, vpp, zero, offload, device) -> ParallelConfig | None:
        """The configuration of these choices, None if ``ParallelConfig`` refuses them
        (cached: the levels of the tree ask for the same ones repeatedly)."""
        key = (degrees, mb, sp, order, vpp, zero, offload, device)
        if key not in self.configs:
            self.configs[key] = self._make_config(*key)
        return self.configs[key]

    def base(self, degrees, mb, sp, order, vpp) -> ParallelConfig | None:
        """The family's ZeRO-0 configuration without offload, whose linear work every member
        shares (the work depends on neither choice): built whether or not the framework runs
        ZeRO-0 with these degrees (torchtitan runs it only as its one parallelism), None where
        ``ParallelConfig`` refuses it or the framework runs no (ZeRO, offload) choice of the
        degrees (``kind_choices``). Cached."""
        key = ("base", degrees, mb, sp, order, vpp, self.core)
        if key not in self.cache:
            self.cache[key] = (self._build(degrees, mb, sp, order, vpp, 0, "none", "cpu")
                               if self.kind_choices(degrees) else None)
        return self.cache[key]

    def _make_config(self, degrees, mb, sp, order, vpp, zero, offload,
                     device) -> ParallelConfig | None:
        config = self._build(degrees, mb, sp, order, vpp, zero, offload, device)
        # only what the plan's framework runs (the same rule as space.candidates)
        return config if config is not None and layout_error(
            self.framework, config, self.model, self.space) is None else None

    def _build(self, degrees, mb, sp, order, vpp, zero, offload,
               device) -> ParallelConfig | None:
        """The configuration of these choices, None if ``ParallelConfig`` refuses them."""
        tp, cp, pp, dp, ep = degrees
        space = self.space
        try:
            return ParallelConfig(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, sp=sp, zero_stage=zero,
                                  offload=offload, offload_device=device, micro_batch_size=mb,
                                  global_batch_size=space.global_batch_size, vpp=vpp,
                                  seq_len=space.seq_len, mesh_order=order, dtype=space.dtype,
                                  flash_attention=space.flash_attention,
                                  **settings_of(space))
        except ValueError:
            return None

    def linear_bound(self, config: ParallelConfig) -> Bound:
        """``bound`` of ``config`` (ZeRO-0, no offload: linear work only per micro-batch)
        without its once-per-step terms, which every caller leaves out (``work_bound``)."""
        return self.work_bound(config)

    def work_bound(self, config: ParallelConfig) -> Bound:
        """``bound`` of ``config`` with its once-per-step terms taken as 0 (they are at least
        0): the same per-micro-batch sum (``per_micro_s``) without the evaluations at the
        heaviest stage's count that only the once-per-step terms need."""
        self.evaluated += 1
        lo, _ = layer_bounds(self.model, config, None)
        total = per_micro_s(self.model, self.cluster, config, framework=self.framework,
                            calibration=self.calibration, lo=lo[0], cache=self.cache)
        return Bound(per_micro_s=total, once_s=0.0, stages=config.pp,
                     micro_batches=config.grad_accum_steps, vpp=config.vpp)

    def degrees_bound(self, degrees, layouts) -> float:
        """``pipeline_floor`` with the per-sample work of the largest micro-batch's ZeRO-0
        members (slowest stage at least the mean: property 3)."""
        largest = layouts[0][0]
        smallest = min(b for b, _, _ in layouts)
        v_max = self.v_max(degrees, {b for b, _, _ in layouts})
        values = []
        for b, sp, order in layouts:
            if b != largest:
                break
            piece = self.linear_bound(self.base(degrees, b, sp, order, 1))
            per_sample = piece.per_micro_s / b
            values.append(self.pipeline_floor(degrees, per_sample / piece.stages, per_sample,
                                              smallest, v_max))
        return min(values)

    def v_max(self, degrees, sizes) -> int:
        """The most virtual chunks any member with a micro-batch in ``sizes`` has."""
        return max((max(vs) for vs in (self.vpps(degrees, b) for b in sizes) if vs), default=1)

    def pipeline_floor(self, degrees, top: float, total: float, smallest: int,
                       v_max: int) -> float:
        """A step no member of a degree tuple beats, from per-sample lower bounds of its
        slowest stage's (``top``) and summed (``total``) work per micro-batch, for every
        micro-batch b >= ``smallest`` and every v <= ``v_max``.

        With T >= b top and S >= b total (S >= T >= S / p), ``step = (m - 1/v) T + S / v``
        grows with T and S, so with total' = max(total, top), top' = max(top, total' / p):
        ``step >= (m - 1/v) b top' + b total' / v = (B / dp) top' + b (total' - top') / v``,
        least at the smallest b and the largest v (the bubble's share)."""
        tp, cp, pp, dp, ep = degrees
        total = max(total, top)
        top = max(top, total / pp)
        return (self.space.global_batch_size / dp * top
                + smallest * (total - top) / v_max)

    # ----- refinement -----------------------------------------------------------------------

    def refine(self, node: _Node, best: dict) -> tuple[list[_Node], int]:
        """The children of ``node`` and how many candidates it dropped as not fitting.

        Bounds that need memory are computed lazily: a node first carries a bound inherited
        from its parent (cheap), and when it is reached it is evaluated and pushed back with
        its own bound (``fitting``, ``layout_caps``, ``layout_fit``, ``kind_fit``,
        ``kind_caps``), so nodes that an incumbent prunes on the cheap bound cost nothing. The
        tree is built only for non-flat searches (``roots``)."""
        self.core = node.core
        kind = node.kind
        if kind == "degrees":
            degrees, layouts = node.data
            per_layout = self.degrees_fit_bounds(degrees, layouts)
            if not per_layout:
                return [], 1
            smallest = min(b for b, _, _ in layouts)
            v_max = self.v_max(degrees, {b for b, _, _ in layouts})
            value = min(self.pipeline_floor(degrees, top, total, smallest, v_max)
                        for top, total in per_layout.values())
            return [self.node(max(value, node.bound), "fitting",
                              (degrees, layouts, per_layout))], 0
        if kind == "fitting":  # each micro-batch's own floor: the bubble's share grows with b
            degrees, layouts, per_layout = node.data
            out = []
            for b, sp, order in layouts:
                if (sp, order) not in per_layout:
                    continue
                vpps = self.vpps(degrees, b)
                floor = self.pipeline_floor(degrees, *per_layout[sp, order], b,
                                            max(vpps, default=1))
                out.append(self.node(max(floor, node.bound), "layout",
                                     (degrees, b, sp, order, vpps)))
            return out, 0
        if kind == "layout":  # its linear work alone first (cheaper than its capacities)
            degrees, b, sp, order, vpps = node.data
            if not vpps:
                return [], 0
            base = self.base(degrees, b, sp, order, 1)
            if base is None:
                return [self.node(node.bound, "layout_caps", node.data)], 0
            piece = self.linear_bound(base)
            linear = _Family(top=piece.per_micro_s / piece.stages, total=piece.per_micro_s,
                             micro_batches=piece.micro_batches)
            self.linear_of[node.data[:4]] = linear
            return [self.node(max(linear.least(vpps), node.bound), "layout_caps",
                              node.data)], 0
        if (kind == "layout_caps" and node.data[:4] in self.linear_of
                and self.once_first(*node.data[:4])):
            degrees, b, sp, order, vpps = node.data
            linear, p, kth = self.linear_of[node.data[:4]], degrees[2], best.kth()
            floors = {c: self.traffic_floor(degrees, b, sp, order, c)
                      for c in self.kind_choices(degrees)}
            if not floors:
                return [], 0
            fams = {c: _with_kind(linear, floors[c], 0.0, p) for c in floors}
            wanted = [c for c in floors if fams[c].least(vpps) < kth]
            onces = self.once_bounds(degrees, b, sp, order, wanted) if wanted else {}
            value = min(dataclasses.replace(fams[c], once=onces.get(c, 0.0)).least(vpps)
                        for c in floors)
            return [self.node(max(value, node.bound), "layout_late_caps",
                              (node.data, floors, onces))], 0
        if kind == "layout_late_caps":
            (degrees, b, sp, order, vpps), floors, onces = node.data
            family = self.family(degrees, b, sp, order, 1)
            if family is None:
                return [], 1
            p, out = degrees[2], []
            for choice in floors:
                terms = dataclasses.replace(_with_kind(family, floors[choice], 0.0, p),
                                            once=onces.get(choice, 0.0))
                out.append(self.node(max(terms.least(vpps), node.bound), "kind",
                                     (degrees, b, sp, order, vpps, choice, terms)))
            return out, 0
        if kind == "layout_caps":  # the capacities of its leanest member, and each (ZeRO,
            # offload) choice's raw traffic
            degrees, b, sp, order, vpps = node.data
            family = self.family(degrees, b, sp, order, 1)
            if family is None:  # the leanest sibling fits no split, so none does
                return [], 1
            p = degrees[2]
            floors = {c: self.traffic_floor(degrees, b, sp, order, c)
                      for c in self.kind_choices(degrees)}
            if not floors:
                return [], 0
            value = min(_with_kind(family, floors[c], 0.0, p).least(vpps) for c in floors)
            return [self.node(max(value, node.bound), "layout_fit",
                              (node.data, family, floors))], 0
        if kind == "layout_fit":  # each choice's once-per-step terms: one child per choice
            (degrees, b, sp, order, vpps), family, floors = node.data
            p, kth = degrees[2], best.kth()
            fams = {c: _with_kind(family, floors[c], 0.0, p) for c in floors}
            # the once-per-step terms of the choices not already ruled out (the rest keep 0,
            # a lower bound, and are pruned on it)
            wanted = [c for c in floors if fams[c].least(vpps) < kth]
            onces = self.once_bounds(degrees, b, sp, order, wanted) if wanted else {}
            out = []
            for choice, fam in fams.items():
                terms = dataclasses.replace(fam, once=onces.get(choice, 0.0))
                out.append(self.node(max(terms.least(vpps), node.bound), "kind",
                                     (degrees, b, sp, order, vpps, choice, terms)))
            return out, 0
        if kind == "kind":
            return self.kind_node(node)
        if kind == "kind_fit":
            return self.kind_caps_node(node)
        if kind == "kind_caps":
            degrees, b, sp, order, vpps, (zero, offload, device), terms = node.data
            out = []
            for v in vpps:
                config = self.config(degrees, b, sp, order, v, zero, offload, device)
                if config is None or (not self.core and config in self.skip):
                    continue
                value = max(terms.value(v), node.bound)
                if v == 1:
                    out.extend(self.candidate_nodes(config, floor=value))
                else:
                    out.append(self.node(value, "member", config))
            return out, 0
        if kind == "member":
            return self.candidate_nodes(node.data, floor=node.bound), 0
        if kind == "candidate":
            return self.memory_node(node)
        if kind == "memory":
            return self.tables_node(node, best)
        raise AssertionError(kind)

    def kind_node(self, node: _Node) -> tuple[list[_Node], int]:
        """A (ZeRO, offload) choice of a family, for every v at once, from its v = 1 member:
        dropped when that member cannot fit even its heaviest stage (``heavy_infeasible``;
        memory does not fall with v), else bounded by that member's every term
        (``bound``: its exposed ZeRO and offload traffic too) with the family's split-aware
        slowest stage and sum. The per-micro-batch terms of a stage do not fall with v
        (linear work: interleaving adds transfers; the ZeRO and offload traffic and the
        compute that hides it do not depend on v), so the v = 1 terms bound every v."""
        degrees, b, sp, order, vpps, choice, family = node.data
        member = self.config(degrees, b, sp, order, 1, *choice)
        if member is None:
            return [self.node(node.bound, "kind_caps", (*node.data[:6], family))], 0
        if self.heavy_infeasible(member):
            return [], 1
        terms = self.member_terms(member, family.top, family.total, family.once)
        value = terms.least(vpps)
        return [self.node(max(value, node.bound), "kind_fit", (*node.data[:6], terms,
                                                               member))], 0

    def kind_caps_node(self, node: _Node) -> tuple[list[_Node], int]:
        """The (ZeRO, offload) choice's bound with its own v = 1 member's capacities
        (``capacity_split``; at least the leanest member's, so at least as tight)."""
        degrees, b, sp, order, vpps, choice, terms, member = node.data
        if member.pp == 1:  # ``family`` read its one stage exactly
            return [self.node(node.bound, "kind_caps", (*node.data[:6], terms))], 0
        split = self.capacity_split(member, member, roomy=self.roomy(member))
        if split is None:
            return [], 1
        terms = self.member_terms(member, max(split[0], terms.top), max(split[1], terms.total),
                                  terms.once)
        value = terms.least(vpps)
        return [self.node(max(value, node.bound), "kind_caps", (*node.data[:6], terms))], 0

    def member_terms(self, member: ParallelConfig, top: float, total: float,
                     once: float) -> "_Family":
        piece = self.work_bound(member)
        total = max(total, piece.per_micro_s)
        return _Family(top=max(top, total / piece.stages), total=total,
                       micro_batches=piece.micro_batches, once=once)

    def once_first(self, degrees, b, sp, order) -> bool:
        """Whether a layout's traffic floors and once-per-step bounds are computed before its
        capacities (``layout_caps``): when its leanest member holds ceil(L / p) layers on
        every stage without recomputation (``heavy_reserved``), memory forces no
        recomputation and no uneven split, so the capacities add little to the linear work,
        while the floors and once-per-step terms are what prunes (405B-parameter spaces:
        three to one in cost). Otherwise capacities first, which is what prunes 70B-parameter
        layouts on a few nodes. Either order gives the same bound in the end; this only
        decides which is computed for layouts the first already prunes (a few stage memories
        per layout, cached)."""
        lean = self.leanest(degrees, b, sp, order, 1)
        return lean is not None and self.roomy(lean)

    def roomy(self, config: ParallelConfig) -> bool:
        """Whether ``config`` holds ceil(L / p) layers on every stage without recomputation
        (``heavy_reserved``): memory then forces neither recomputation nor an uneven split
        on it, nor on any member that needs no more memory."""
        return ("none" in self.space.recompute_modes
                and all(r <= self.capacity for r in self.heavy_reserved(config, "none")))

    def kind_choices(self, degrees) -> list[tuple]:
        """The (ZeRO stage, offload, offload device) choices of a degree tuple that the
        framework runs with these degrees (``space.layout_error``: its rule reads no other
        choice of a configuration, and the space's pinned split), so that no branch of the
        tree is spent on a choice whose every member ``config`` would refuse."""
        tp, cp, pp, dp, ep = degrees
        key = ("kind choices", degrees, self.core)
        hit = self.cache.get(key)
        if hit is None:
            hit = self.cache[key] = [
                (zero, offload, device)
                for zero in zero_choices(self.space, dp * cp, core=self.core,
                                         framework=self.framework)
                for offload, device in offload_choices(self.space, zero, self.model,
                                                       self.cluster)
                if self.runs(degrees, zero, offload, device)]
        return hit

    def runs(self, degrees, zero, offload, device) -> bool:
        """Whether the framework runs these degrees with this (ZeRO, offload) choice: its rule
        on a configuration of them (micro-batch 1, no interleaving; a choice ``ParallelConfig``
        refuses is left to the members, which it refuses too)."""
        probe = self._build(degrees, 1, degrees[0] > 1, MESH_ORDERS[0], 1, zero, offload,
                            device)
        return probe is None or layout_error(self.framework, probe, self.model,
                                             self.space) is None

    def traffic_floor(self, degrees, b, sp, order, choice) -> float:
        """A lower bound of the per-micro-batch work summed over stages of every member of a
        (ZeRO, offload) choice of a layout, for any split, v and recompute mode: the summed
        raw ZeRO-2/3 traffic, or the summed raw parameter-offload traffic, whichever is
        larger.

        A stage's time per micro-batch is at least each of its raw ZeRO and offload traffic
        (compute hides at most itself, and linear work includes compute), neither is smaller
        under recomputation than without it, and neither depends on the micro-batch (both are
        parameter-sized): so the v = 1 member's terms without recomputation at this ``b``
        serve every micro-batch of the (degrees, sp, rank layout), and are cached as such.
        Nor do they depend on where the optimizer runs: the choices that offload only the
        optimizer share their ZeRO stage's floor (``tests/planner/test_bounds.py`` checks
        the four properties)."""
        zero, offload, _ = choice
        if zero < 2 and offload != "optimizer+params":
            return 0.0  # no ZeRO-2/3 or parameter-offload traffic per micro-batch to read
        if offload != "optimizer+params":  # the optimizer's place changes no per-micro term
            choice = (zero, "none", "cpu")
        key = ("traffic floor", degrees, sp, order, choice)
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        member = self.config(degrees, b, sp, order, 1, *choice)
        if member is None:
            return 0.0
        model, p = self.model, member.pp
        lo = model.num_layers if p == 1 else layer_bounds(model, member, None)[0][0]
        counts = _stage_kinds(self.cluster, member, self.cache)
        zero, offload = _layer_sums(model, member, counts, lo, lambda stage, n: stage_micro_terms(
            model, self.cluster, member, stage, n, "none", framework=self.framework,
            calibration=self.calibration, cache=self.cache), _RAW_TRAFFIC_GETTERS)
        self.cache[key] = value = max(zero, offload, 0.0)
        return value

    def once_bounds(self, degrees, b, sp, order, choices) -> dict[tuple, float]:
        """Per (ZeRO, offload, device) choice of a layout, a lower bound of the once-per-step
        terms (``composition.once_per_step``) of its every member (any v, split and
        recompute): the bounds above this level leave them out, so adding this keeps them
        lower bounds.

        Some stage holds at least ceil(L/p) layers, and each term grows with the count, so
        the smallest value over the kinds of stage at that count bounds the largest below.
        The terms depend on the compute only through the part of the data-parallel traffic
        the last backward hides, which is proportional to the compute; the most compute any
        allowed recompute mode gives (at v = 1 and ZeRO-0, as compute depends on neither:
        ``estimate.stage_once``) makes the bound hold for every mode. The rest of the terms
        do not depend on the micro-batch, so they are shared by the layouts of a (degrees,
        sp, rank layout) (``once_terms``)."""
        base = self.base(degrees, b, sp, order, 1)
        if base is None:
            return {choice: 0.0 for choice in choices}
        model, cluster = self.model, self.cluster
        heavy = -(-model.num_layers // base.pp)
        classes = list(_stage_kinds(cluster, base, self.cache))
        compute = {}
        for stage in classes:
            key = ("once compute", base, stage, heavy)
            if key not in self.cache:
                self.cache[key] = max(
                    stage_compute_s(model, cluster, stage_config(base, model, stage, heavy, mode),
                                    self.calibration, stage, framework=self.framework)
                    for mode in self.space.recompute_modes)
            compute[stage] = self.cache[key]
        out = {}
        for choice in choices:
            member = self.config(degrees, b, sp, order, 1, *choice)
            if member is None:
                out[choice] = 0.0
                continue
            terms = [self.once_terms(member, (degrees, sp, order, choice), stage, heavy)
                     for stage in classes]
            # the hidden part a hair larger than exact: products rounded either way stay below
            out[choice] = composition.once_per_step(
                dp_exposed=min(composition.exposed(comm, hides * compute[s] * (1 + 1e-12))
                               for (comm, hides, _, _), s in zip(terms, classes)),
                optimizer=min(t[2] for t in terms), offload_step=min(t[3] for t in terms))
        return out

    def once_terms(self, member: ParallelConfig, family: tuple, stage: int, heavy: int
                   ) -> tuple[float, float, float, float]:
        """``estimate.stage_once`` of ``stage`` holding ``heavy`` layers without
        recomputation at 1 s of compute: (dp traffic, the part each second of compute hides,
        optimizer, offload step). Cached by ``family`` (degrees, sp, rank layout, choice):
        none of them depends on the micro-batch (``tests/planner/test_bounds.py`` checks
        both)."""
        key = ("once terms", family, stage, heavy)
        hit = self.cache.get(key)
        if hit is None:
            hit = self.cache[key] = stage_once(
                self.model, self.cluster, stage_config(member, self.model, stage, heavy, "none"),
                stage, framework=self.framework, calibration=self.calibration, compute_s=1.0)
        return hit

    def heavy_infeasible(self, config: ParallelConfig) -> bool:
        """True when no stage can hold ceil(L/p) layers (some stage must) under the most
        memory-saving mode allowed. A middle stage needs at least what stage p - 2 needs
        (``bounds``: memory does not fall as the stage index falls), so stages 0, p - 2 and
        p - 1 are evaluated; every stage for models with two kinds of layer."""
        saving = [m for m in ("full", "selective", "none") if m in self.space.recompute_modes][0]
        return all(r > self.capacity for r in self.heavy_reserved(config, saving))

    def heavy_reserved(self, config: ParallelConfig, mode: str):
        """Reserved bytes under ``mode`` of stages 0, p - 2 and p - 1 (every stage for models
        with two kinds of layer), each holding ceil(L/p) layers, one at a time (cached)."""
        p = config.pp
        heavy = -(-self.model.num_layers // p)
        stages = {0, max(0, p - 2), p - 1} if uniform_layers(self.model) else set(range(p))
        if config.mesh_order != MESH_ORDERS[0]:  # memory does not depend on rank layout
            config = self._first_order(config)
        for stage in sorted(stages):
            key = ("heavy", config, stage, heavy, mode)
            if key not in self.cache:
                self.cache[key] = _reserved(self.model, self.cluster, config, stage, heavy, mode,
                                            self.framework, self.calibration)
            yield self.cache[key]

    def leanest(self, degrees, b, sp, order, v) -> ParallelConfig | None:
        """The member of a (degrees, micro-batch, sp, layout, vpp) family that holds the least
        device memory: the highest allowed ZeRO stage with the most offload (memory does not
        grow with the ZeRO stage or with offload)."""
        for zero in sorted(self._zero_stages(degrees), reverse=True):
            config = self._most_offloaded(degrees, b, sp, order, v, zero)
            if config is not None:
                return config
        return None

    def _zero_stages(self, degrees) -> list[int]:
        tp, cp, pp, dp, ep = degrees
        return zero_choices(self.space, dp * cp, core=self.core, framework=self.framework)

    def _most_offloaded(self, degrees, b, sp, order, v, zero) -> ParallelConfig | None:
        """The family's member at ZeRO stage ``zero`` with the most offload allowed."""
        order_of = {"optimizer+params": 0, "optimizer": 1, "none": 2}
        choices = offload_choices(self.space, zero, self.model, self.cluster)
        for offload, device in sorted(choices, key=lambda c: order_of[c[0]]):
            config = self.config(degrees, b, sp, order, v, zero, offload, device)
            if config is not None:
                return config
        return None

    def least_split(self, degrees, b, sp, order, v, time_config: ParallelConfig,
                    **options) -> tuple[float, float] | None:
        """``capacity_split`` (options passed on) of the family's leanest member
        (``leanest``: among the choices the framework runs memory does not grow with the ZeRO
        stage or offload; torchtitan, whose FSDP2 beside a pipeline can hold more than DDP
        with a sharded optimizer, runs neither ZeRO-0 nor ZeRO-1 there); None where it fits
        no split."""
        lean = self.leanest(degrees, b, sp, order, v)
        if lean is None:
            return None
        return self.capacity_split(lean, time_config, roomy=self.roomy(lean), **options)

    def family(self, degrees, b, sp, order, v) -> "_Family | None":
        """Bounds of every ZeRO / offload choice at (degrees, b, sp, order, v): the linear
        work (ZeRO-0, no offload: it does not depend on either) with the capacities of the
        leanest member (``capacity_split``); None if even the leanest fits no split. Cached:
        each (ZeRO, offload) child of a layout asks for it."""
        key = ("family", degrees, b, sp, order, v)
        if key not in self.cache:
            self.cache[key] = self._family(degrees, b, sp, order, v)
        return self.cache[key]

    def _family(self, degrees, b, sp, order, v) -> "_Family | None":
        base = self.base(degrees, b, sp, order, v)
        lean = self.leanest(degrees, b, sp, order, v)
        if base is None or lean is None:
            return None
        piece = self.linear_bound(base)
        p = piece.stages
        if base.pp == 1:  # exactly: the fastest fitting mode's step (_one_stage_deficit)
            args = dict(framework=self.framework, calibration=self.calibration, lo=1,
                        capacity=self.capacity, modes=self.space.recompute_modes)
            if surely_infeasible(self.model, self.cluster, lean, **args):
                return None
            extra = recompute_deficit(self.model, self.cluster, lean, **args)
            if extra is None:
                return None
            total = piece.per_micro_s + extra
            return _Family(top=total, total=total, micro_batches=piece.micro_batches)
        split = self.least_split(degrees, b, sp, order, v, base)
        if split is None:
            return None
        total = max(split[1], piece.per_micro_s)
        return _Family(top=max(split[0], total / p), total=total,
                       micro_batches=piece.micro_batches)

    def capacity_split(self, memory_config: ParallelConfig, time_config: ParallelConfig,
                       time_scale: float = 1.0, relaxed: bool = False, roomy: bool = False
                       ) -> tuple[float, float] | None:
        """``bounds.capacity_bound`` of a candidate or family (one stage: at its layer
        count, exactly).

        ``roomy``: ``memory_config`` is ``roomy``, so its capacities are left out: every stage
        may take any layer count of the split's range without recomputation. That bounds
        every split below whatever the memory (recomputation only adds time); where every
        stage holds ceil(L/p) layers unrecomputed, memory can only bind the uneven splits
        above that, so the bound gives up little, and it evaluates no memory: on
        405B-parameter spaces most layouts are roomy, and their capacities had cost about a
        tenth of a search."""
        lows, highs = layer_bounds(self.model, time_config, None)
        lo, hi = lows[0], max(highs[0], lows[0])
        if time_config.pp == 1:
            lo = hi = self.model.num_layers
        cache = self.cache

        def most(config: ParallelConfig, stage: int, mode: str, lo: int, hi: int) -> int:
            if config.mesh_order != MESH_ORDERS[0]:  # memory does not depend on rank layout
                config = self._first_order(config)
            key = ("most", config, stage, mode, lo, hi)
            if key not in cache:
                cache[key] = stage_most_layers(self.model, self.cluster, config, stage, mode,
                                               lo, hi, self.capacity, framework=self.framework,
                                               calibration=self.calibration)
            return cache[key]

        self.evaluated += 1
        modes, most_layers = self.space.recompute_modes, most
        if roomy:
            modes, most_layers = ("none",), lambda config, stage, mode, lo, hi: hi
        return capacity_bound(self.model, self.cluster, memory_config=memory_config,
                              time_config=time_config, framework=self.framework,
                              calibration=self.calibration, capacity=self.capacity,
                              modes=modes, lo=lo, hi=hi, most_layers=most_layers, cache=cache,
                              time_scale=time_scale, relaxed=relaxed)

    def _first_order(self, config: ParallelConfig) -> ParallelConfig:
        key = ("first order", config)
        if key not in self.cache:
            self.cache[key] = config.replace(mesh_order=MESH_ORDERS[0])
        return self.cache[key]

    def degrees_fit_bounds(self, degrees, layouts) -> dict[tuple, tuple[float, float]]:
        """Per (sp, rank layout) of a degree tuple, memory-aware per-sample lower bounds
        (slowest stage, sum over stages) of its members' linear work per micro-batch, for
        ``pipeline_floor``; the layouts where none fits are left out.

        Any member with micro-batch b, m = B / (dp b) micro-batches and any v takes at least
        ``m T_b`` (``v step >= (m v - 1) T + S`` and S >= T), T_b its slowest stage's linear
        work per micro-batch (``bounds.capacity_bound``). Per sample, linear work does not
        grow with b, and memory does not fall with b or v and is least for the leanest ZeRO and
        offload, so the per-sample work at the layout's largest b with the capacities of its
        leanest member at its smallest b bounds ``T_b / b`` below: the step is at least
        ``B / dp`` times that."""
        sizes: dict[tuple, list[int]] = {}
        for b, sp, order in layouts:
            sizes.setdefault((sp, order), []).append(b)
        out = {}
        for (sp, order), bs in sizes.items():
            timing = self.base(degrees, max(bs), sp, order, 1)
            if timing is None:
                continue
            split = self.least_split(degrees, min(bs), sp, order, 1, timing,
                                     time_scale=1.0 / max(bs), relaxed=True)
            if split is not None:
                out[sp, order] = split
        return out

    def vpps(self, degrees, b) -> list[int]:
        tp, cp, pp, dp, ep = degrees
        m = self.space.global_batch_size // (dp * b)
        return vpp_choices(self.space, self.model, pp, m, core=self.core)

    def candidate_nodes(self, config: ParallelConfig, floor: float = 0.0) -> list[_Node]:
        """``candidate_node`` of ``config``; where the framework builds the split itself, from
        several methods (``layout.framework_splits``: DeepSpeed's partition methods), and
        the space pins none, one candidate per split, each with its split in its
        configuration (its tables hold it: ``tables.build_tables``)."""
        splits = (framework_splits(self.framework, self.model, config.pp)
                  if self.space.layers_per_stage is None else None)
        configs = ([config] if not splits else
                   [config.replace(layers_per_stage=split) for split in splits])
        return [node for c in configs if (node := self.candidate_node(c, floor)) is not None]

    def candidate_node(self, config: ParallelConfig, floor: float = 0.0) -> _Node | None:
        index = self.indices.setdefault(config, len(self.indices))
        self.counted += 1
        if self.kinded:
            tables = _traced_tables(self.model, self.cluster, config, self.space,
                                    self.traced_modes, framework=self.framework,
                                    calibration=self.calibration)
            return self.node(max(floor, traced_bound(tables).value()), "solve",
                             (index, config, tables))
        if self.space.layers_per_stage is None:
            lows, highs = layer_bounds(self.model, config, None)
            lo, hi = lows[0], highs[0]
        else:
            lo, hi = 1, self.model.num_layers
        self.evaluated += 1
        piece = bound(self.model, self.cluster, config, framework=self.framework,
                      calibration=self.calibration, lo=lo, hi=max(hi, lo + 1), cache=self.cache)
        return self.node(max(floor, piece.value()), "candidate", (index, config, piece))

    def memory_node(self, node: _Node) -> tuple[list[_Node], int]:
        index, config, piece = node.data
        if self.flat:
            return [self.node(node.bound, "memory", (index, config, node.bound,
                                                     piece.once_s))], 0
        modes = self.space.recompute_modes
        lo = max(1, config.vpp)
        args = dict(framework=self.framework, calibration=self.calibration, lo=lo,
                    capacity=self.capacity, modes=modes)
        if surely_infeasible(self.model, self.cluster, config, **args):
            return [], 1
        if offload_need(self.model, self.cluster, config, framework=self.framework,
                        calibration=self.calibration)[0] > offload_capacity(self.cluster,
                                                                            config):
            return [], 1
        if config.pp == 1:
            extra = recompute_deficit(self.model, self.cluster, config, **args)
            if extra is None:
                return [], 1
            value = max(node.bound, piece.value(extra))
        else:
            split = self.capacity_split(config, config)
            if split is None:
                return [], 1
            value = max(node.bound, piece.with_split(*split))
        return [self.node(value, "memory", (index, config, value, piece.once_s))], 0

    def tables_node(self, node: _Node, best: dict) -> tuple[list[_Node], int]:
        index, config, floor, once_s = node.data
        tables = build_tables(self.model, self.cluster, config, modes=self.space.recompute_modes,
                              framework=self.framework, calibration=self.calibration,
                              memory_margin=self.space.memory_margin,
                              pinned_layers=self.space.layers_per_stage,
                              pinned_modes=self.space.recompute_pinned)
        value = tables_bound(tables, once_s)
        if value is None:
            return [], 1
        value = max(value, floor)
        greedy = _greedy_incumbent(self.model, self.cluster, config, tables, self.framework,
                                   self.calibration, value)
        if greedy is not None:
            best[index] = greedy
            if greedy.status == "OPTIMAL":
                return [], 0
        return [self.node(value, "solve", (index, config, tables))], 0


def _greedy_incumbent(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig,
                      tables: CandidateTables, framework: str, calibration: Calibration,
                      bound_s: float) -> Solved | None:
    """The even split with each stage's fastest fitting mode (``solver.greedy_hint``) as a
    plan, ``OPTIMAL`` when it meets ``bound_s`` (no split can beat it) or the pipeline has
    one stage; None if it does not fit."""
    hint = cpsat.greedy_hint(tables)
    if hint is None:
        return None
    final = config.replace(layers_per_stage=tuple(hint[0]), recompute=_compact(tuple(hint[1])))
    est = estimate(model, cluster, final, framework=framework, calibration=calibration)
    if not est.fits:
        return None
    # one stage: nothing to split, and the hint took the fastest fitting mode by the tables'
    # own objective, so no solve can beat it
    met = est.time.step_s <= bound_s * (1 + 1e-9) or config.pp == 1
    return Solved(estimate=est, status="OPTIMAL" if met else "FEASIBLE", lower_bound_s=bound_s)


def tables_bound(tables, once_s: float = 0.0) -> float | None:
    """A step time no split of ``tables`` beats, or None when none fits: ``bounds.split_bound``
    on the tables' exact per-stage forms (each stage's time per micro-batch, linear work
    plus its exposed ZeRO and offload traffic, and the most layers each mode fits), composed
    as the step is, with ``once_s`` for the once-per-step terms (a lower bound of them)."""
    rows = []
    for i in range(len(tables.lo)):
        lo = tables.lo[i]
        forms = []
        for r in tables.allowed[i]:
            most = tables.most(i, r)
            if most >= lo:
                forms.append((_micro_pieces(tables.time_ns[i][r]), int(most)))
        rows.append((lo, forms))
    split = split_bound(rows, tables.num_layers)
    if split is None:
        return None
    top, sums = split
    value = composition.scaled_step(micro_batches=tables.micro_batches, vpp=tables.vpp,
                                    top_micro=top, sum_micro=sums, once=once_s * 1e9)
    return value / tables.vpp / 1e9


def _micro_pieces(terms) -> tuple[tuple[int, int], ...]:
    """``bounds.micro_pieces`` of a stage's tables forms, as (base, slope) pairs."""
    forms = (terms.linear, terms.zero_comm, terms.zero_hidden, terms.offload_raw,
             terms.offload_hidden)
    return tuple(zip(micro_pieces(*(f.base for f in forms)),
                     micro_pieces(*(f.slope for f in forms))))


def _solve_one(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig,
               space: SearchSpace, *, framework: str, calibration: Calibration, seed: int,
               workers: int, time_limit_s: float, bound: float,
               cutoff_s: float | None = None,
               tables: CandidateTables | TracedTables | None = None,
               deterministic: bool = False) -> Solved | str | None:
    """The candidate's best split; None if nothing fits or (with ``cutoff_s``) nothing beats
    the current k-th best plan; ``"timeout"`` if its solve ran out of time without a split.
    ``tables``: a traced model's tables, already built for its bound."""
    if tables is None:
        tables = build_tables(model, cluster, config, modes=space.recompute_modes,
                              framework=framework, calibration=calibration,
                              memory_margin=space.memory_margin,
                              pinned_layers=space.layers_per_stage,
                              pinned_modes=space.recompute_pinned)
    solve = cpsat.solve_traced if isinstance(tables, TracedTables) else cpsat.solve
    try:
        solution = solve(tables, time_limit_s=time_limit_s, seed=seed, workers=workers,
                         cutoff_s=cutoff_s,
                         deterministic_s=SOLVE_DETERMINISTIC_CAP if deterministic else None)
    except cpsat.Infeasible:
        return None
    except cpsat.NoSolutionInTime:
        return "timeout"
    final = config.replace(layers_per_stage=solution.layers,
                           recompute=_compact(solution.modes))
    est = estimate(model, cluster, final, framework=framework, calibration=calibration)
    if not est.fits:  # e.g. host memory for offloaded states
        return None
    return Solved(estimate=est, status=solution.status, lower_bound_s=bound)


def _traced_tables(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig,
                   space: SearchSpace, modes: tuple[str, ...], *, framework: str,
                   calibration: Calibration) -> TracedTables:
    return build_traced_tables(model, cluster, config, modes=modes, framework=framework,
                               calibration=calibration, memory_margin=space.memory_margin,
                               pinned_layers=space.layers_per_stage,
                               pinned_modes=space.recompute_pinned)


def traced_bound(tables: TracedTables) -> Bound:
    """A traced (or mixed dense/MoE) candidate's lower bound: each stage's per-micro-batch
    linear term is at least its smallest base over modes (and classes) plus, per layer, the
    smallest slope of its kind over stages and modes; summed over stages this holds for every
    split (exposed traffic and the once-per-step terms are at least 0)."""
    p = len(tables.allowed)
    forms = [[terms[r].linear for terms in (tables.time_ns[i], *(
                 (tables.light_time_ns[i],) if tables.light_time_ns else ()))
              for r in tables.allowed[i] if r in terms] for i in range(p)]
    total = sum(min(f.base for f in stage) for stage in forms)
    for kind, row in enumerate(tables.prefix):
        total += row[-1] * min(f.slopes[kind] for stage in forms for f in stage)
    return Bound(per_micro_s=total / 1e9, once_s=0.0, stages=p,
                 micro_batches=tables.micro_batches, vpp=tables.vpp)


def _compact(modes: tuple[str, ...]) -> str | tuple[str, ...]:
    return modes[0] if len(set(modes)) == 1 else modes


NO_FIT_SAMPLE = 400
"""Configurations the "no plan fits" diagnosis evaluates at most (the leanest first)."""


def _fits(est: Estimate, cluster: ClusterSpec, space: SearchSpace, *, framework: str,
          calibration: Calibration) -> bool:
    """``est``'s configuration fits the GPUs (with the margin) and its offloaded states the
    node's host memory or NVMe."""
    if est.memory.peak_reserved_bytes > cluster.gpu.hbm_bytes * (1 - space.memory_margin):
        return False
    if est.config.offload == "none":
        return True
    need, where = offload_need(est.model, cluster, est.config, framework=framework,
                               calibration=calibration)
    return need <= (cluster.nvme_bytes if where == "NVMe" else cluster.host_bytes)


def _context_parallel_hint(framework: str, config: ParallelConfig, model: ModelSpec) -> str:
    """Where the sequence binds and ``framework`` cannot split it (cp > 1) but other frameworks
    can (``framework_layout_error`` on the layout with cp 2 in place of half its dp, tp or
    pp): name them."""
    if config.cp > 1:
        return ""
    split = None
    for degree in ("dp", "tp", "pp"):
        if getattr(config, degree) % 2 == 0:
            try:
                split = config.replace(cp=2, **{degree: getattr(config, degree) // 2})
                break
            except ValueError:
                continue
    if split is None or framework_layout_error(framework, split, model) is None:
        return ""
    others = [name for name in ("torchtitan", "megatron")
              if name != framework and framework_layout_error(name, split, model) is None]
    if not others:
        return ""
    return (f"context parallelism (cp > 1 splits the sequence; "
            f"{FRAMEWORK_NAMES.get(framework, framework)} does not run it: "
            f"--framework {' or '.join(others)})")


def _no_fit_message(model: ModelSpec, cluster: ClusterSpec, configs: list[ParallelConfig],
                    space: SearchSpace, *, framework: str,
                    calibration: Calibration) -> tuple[str, Estimate | None]:
    """Name what binds and what would make a plan fit; also return the estimate of the
    configuration closest to fitting.

    Each configuration is taken with its most memory-saving recompute mode and its even split.
    If one of them fits in GPU memory, host memory (or NVMe) per node is what binds: the
    message gives the offloaded bytes it needs against the node's. Otherwise GPU memory binds:
    the least-memory configuration's reserved bytes per stage, the stage that binds, and the
    factor of memory (so of GPUs) it lacks."""
    saving = [m for m in ("full", "selective", "none") if m in space.recompute_modes
              and (m in TRACED_RECOMPUTE or not model.is_traced)][0]
    capacity = cluster.gpu.hbm_bytes * (1 - space.memory_margin)
    lean_first = sorted(configs, key=lambda c: (-c.zero_stage, c.offload == "none",
                                                c.micro_batch_size))[:NO_FIT_SAMPLE]
    least, least_peak, host_bound = None, float("inf"), None
    for config in lean_first:
        trial = config.replace(recompute=saving)
        try:
            est = estimate(model, cluster, trial, framework=framework, calibration=calibration)
        except ValueError:
            continue
        peak = est.memory.peak_reserved_bytes
        if peak <= capacity and trial.offload != "none":
            need, where = offload_need(model, cluster, trial, framework=framework,
                                       calibration=calibration)
            if host_bound is None or need < host_bound[0]:
                host_bound = (need, where, est)
        if peak < least_peak:
            least, least_peak = est, peak
    if least is None:
        return "no plan fits: no candidate configuration could be evaluated", None
    if host_bound is not None:
        need, where, est = host_bound
        c = est.config
        have = cluster.nvme_bytes if where == "NVMe" else cluster.host_bytes
        other = ("NVMe offload (--offload-device nvme; the nodes have "
                 f"{cluster.nvme_bytes / 2**30:.0f} GiB)" if where == "host memory"
                 else "host-memory offload (--offload-device cpu)")
        return (f"no plan fits: {where} per node binds: the configurations that fit in GPU "
                f"memory offload (least: tp {c.tp}, pp {c.pp}, dp {c.dp}, ZeRO-{c.zero_stage}, "
                f"offload {c.offload}) and need at least {need / 2**30:.1f} GiB of {where} per "
                f"node against {have / 2**30:.1f} GiB; try more {where} per node, {other}, or "
                f"more GPUs (the offloaded states shard over them)", est)
    c = least.config
    per_stage = least.memory.per_stage
    stages = ", ".join(f"{x.reserved_bytes / 2**30:.1f}" for x in per_stage)
    worst = max(range(len(per_stage)), key=lambda i: per_stage[i].reserved_bytes)
    long_sequence = per_stage[0].activations_bytes > 0.3 * least_peak
    hints = [f"more GPUs (at least {least_peak / capacity:.1f}x the memory is needed)",
             "offload (--offload optimizer or optimizer+params with --zero 3)"
             if c.offload == "none" and space.offload is None else "",
             f"a shorter sequence than {c.seq_len}" if long_sequence else "",
             _context_parallel_hint(framework, c, model) if long_sequence else ""]
    binds = f" (stage {worst} binds)" if len(per_stage) > 1 else ""
    return (f"no plan fits: GPU memory binds: the least-memory configuration (tp {c.tp}, "
            f"pp {c.pp}, dp {c.dp}, cp {c.cp}, ZeRO-{c.zero_stage}, offload {c.offload}, "
            f"recompute {saving}, micro-batch {c.micro_batch_size}) needs {stages} GiB reserved "
            f"per stage{binds} against {capacity / 2**30:.1f} GiB per GPU; try "
            + ", ".join(h for h in hints if h), least)
