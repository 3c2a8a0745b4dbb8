"""The planner: branch and bound over global candidates, CP-SAT for each candidate's split.

1. ``space.candidates`` lists the global configurations (degrees and knobs).
2. Each gets a lower bound on its step time that holds for every split and recompute choice
   (``lower_bound_s``): the per-micro-batch terms that only add, with no recomputation, spread
   perfectly over the stages.
3. Candidates are solved in order of their bound (``tables.build_tables`` + ``solver.solve``);
   once the k-th best solved step time is at most the next bound, no unsolved candidate can
   enter the top k and the search stops. The result is optimal within the cost model and the
   space unless a time limit cut it short (then ``status`` is ``FEASIBLE``).
4. Every solution is re-evaluated with ``costmodel.estimate`` (the authoritative numbers).
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

from meshplan.costmodel import Calibration, ClusterSpec, ModelSpec, ParallelConfig, estimate
from meshplan.costmodel import composition
from meshplan.costmodel.estimate import Estimate, stage_terms
from meshplan.costmodel.memory import stage_memory
from meshplan.costmodel.timing import stage_link_signature
from meshplan.costmodel.traced import TRACED_RECOMPUTE
from meshplan.planner import solver as cpsat
from meshplan.planner.space import SearchSpace, candidates
from meshplan.planner.tables import (TracedTables, build_tables, build_traced_tables, layer_bounds,
                            stage_config)

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


class SearchTimeout(Exception):
    """The time limit passed before any plan was found (distinct from "nothing fits")."""


class NoPlanFits(Exception):
    """No candidate of the space fits in memory; carries the least-memory configuration."""

    def __init__(self, message: str, *, least: Estimate | None):
        super().__init__(message)
        self.least = least


@dataclass(frozen=True)
class Bound:
    """Pieces of a candidate's lower bound: per-micro-batch work summed over stages (``S``)
    and once-per-step terms; ``value`` composes them as the step time does."""

    per_micro_s: float
    once_s: float
    stages: int
    micro_batches: int
    vpp: int

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
    smallest value any stage class takes for a count in [ceil(L/p), hi] (each is linear, or
    max(0, linear), in the count, so that minimum sits at an end of the range).
    """
    p, total_layers = config.pp, model.num_layers
    heavy = max(lo, min(hi, -(-total_layers // p)))
    # one representative per kind of stage: role and links (see costmodel.estimate._stage_key)
    counts = _stage_kinds(cluster, config, cache)
    classes = list(counts)
    forms: dict[int, dict[int, object]] = {}
    for stage in classes:
        forms[stage] = {}
        for n in (lo, lo + 1):
            key = (config, stage, n)
            if cache is not None and key in cache:
                forms[stage][n] = cache[key]
                continue
            terms = stage_terms(model, cluster, stage_config(config, model, stage, n, "none"),
                                stage, framework=framework, calibration=calibration)
            forms[stage][n] = terms
            if cache is not None:
                cache[key] = terms

    def at(stage: int, n: int, getter) -> float:
        """A term linear in the layer count, extrapolated from lo and lo + 1."""
        first, second = getter(forms[stage][lo]), getter(forms[stage][lo + 1])
        return first + (second - first) * (n - lo)

    def summed(getter) -> float:
        """sum over stages of a term linear in the layer count, for any split of L layers."""
        at_lo = {s: getter(forms[s][lo].micro) for s in classes}
        slope = getter(forms[classes[0]][lo + 1].micro) - at_lo[classes[0]]
        return sum(at_lo[s] * counts[s] for s in classes) + slope * (total_layers - p * lo)

    # sum_i max(0, x_i) >= max(0, sum_i x_i) for the exposed ZeRO and parameter-offload traffic
    total = composition.micro_total(
        linear=summed(lambda t: t.linear_s),
        zero_comm=summed(lambda t: t.zero_comm_s), zero_hidden=summed(lambda t: t.zero_hidden_s),
        offload_raw=summed(lambda t: t.offload_raw_s),
        offload_hidden=summed(lambda t: t.offload_hidden_s))
    once = composition.once_per_step(
        dp_exposed=min(composition.exposed(at(s, n, lambda t: t.dp_comm_s),
                                           at(s, n, lambda t: t.dp_hidden_s))
                       for s in classes for n in (heavy, hi)),
        optimizer=min(at(s, n, lambda t: t.optimizer_s) for s in classes for n in (heavy, hi)),
        offload_step=min(at(s, n, lambda t: t.offload_s) for s in classes for n in (heavy, hi)))
    return Bound(per_micro_s=total, once_s=once, stages=p, micro_batches=config.grad_accum_steps,
                 vpp=config.vpp)


def _stage_kinds(cluster: ClusterSpec, config: ParallelConfig,
                 cache: dict | None) -> dict[int, int]:
    """First stage of each kind (role and links) and how many stages are of that kind; cached
    by layout, which is all the links depend on."""
    key = ("kinds", config.tp, config.cp, config.dp, config.pp, config.ep,
           tuple(config.mesh_order))
    if cache is not None and key in cache:
        return cache[key]
    p = config.pp
    kinds: dict[tuple, int] = {}
    counts: dict[int, int] = {}
    for stage in range(p):
        kind = (stage == 0, stage == p - 1, stage_link_signature(cluster, config, stage))
        first = kinds.setdefault(kind, stage)
        counts[first] = counts.get(first, 0) + 1
    if cache is not None:
        cache[key] = counts
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


def _reserved(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, stage: int,
              layers: int, mode: str, framework: str, calibration: Calibration) -> float:
    return stage_memory(model, cluster, stage_config(config, model, stage, layers, mode), stage,
                        framework=framework, calibration=calibration).reserved_bytes


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


def search(model: ModelSpec, cluster: ClusterSpec, space: SearchSpace, *, framework: str,
           calibration: Calibration, top_k: int = 5, time_limit_s: float = 60.0,
           seed: int = 0, workers: int = 1) -> SearchResult:
    """The ``top_k`` fastest plans of ``space``; raises NoPlanFits when none fits."""
    start = time.perf_counter()
    configs = candidates(model, cluster, space)
    if not configs:
        raise ValueError("the search space is empty: no tp/pp/cp/dp combination divides the "
                         f"{cluster.num_gpus} GPUs, the heads, the layers and the global batch "
                         f"{space.global_batch_size}; check the pinned choices")
    capacity = cluster.gpu.hbm_bytes * (1 - space.memory_margin)
    cache: dict = {}
    bounds, pieces = [], []
    traced_modes = tuple(m for m in space.recompute_modes if m in TRACED_RECOMPUTE)
    if model.is_traced and not traced_modes:
        raise ValueError(f"{model.name} is a traced module: recompute must include none or "
                         f"full")
    for index, config in enumerate(configs):
        if index % 256 == 0 and time.perf_counter() - start > time_limit_s:
            raise SearchTimeout(f"the time limit of {time_limit_s:g} s passed while bounding "
                                f"{len(configs)} candidates, before any plan was found; "
                                f"raise --time-limit or pin more choices")
        if model.is_traced:  # tables now, the bound from them; the solve reuses them
            tables = _traced_tables(model, cluster, config, space, traced_modes,
                                    framework=framework, calibration=calibration)
            cache[("traced", index)] = tables
            piece = traced_bound(tables)
            pieces.append(piece)
            bounds.append(piece.value())
            continue
        if space.layers_per_stage is None:
            lows, highs = layer_bounds(model, config, None)
            lo, hi = lows[0], highs[0]
        else:
            lo, hi = 1, model.num_layers
        piece = bound(model, cluster, config, framework=framework, calibration=calibration,
                      lo=lo, hi=max(hi, lo + 1), cache=cache)
        pieces.append(piece)
        bounds.append(piece.value())
    order = sorted(range(len(configs)), key=lambda i: bounds[i])
    best: list[tuple[float, int, Solved]] = []  # max-heap by step time via negation
    explored: list[Solved] = []
    status, solves, infeasible, pruned = "OPTIMAL", 0, 0, 0
    for rank, i in enumerate(order):
        if len(best) == top_k and bounds[i] >= -best[0][0]:
            pruned += len(order) - rank
            break
        remaining = time_limit_s - (time.perf_counter() - start)
        if remaining <= 0:
            status = "FEASIBLE"
            pruned += len(order) - rank
            break
        config = configs[i]
        modes = space.recompute_modes
        lo = max(1, config.vpp)
        if (space.layers_per_stage is None and space.recompute_pinned is None
                and not model.is_traced):
            if surely_infeasible(model, cluster, config, framework=framework,
                                 calibration=calibration, lo=lo, capacity=capacity, modes=modes):
                infeasible += 1
                continue
            extra = recompute_deficit(model, cluster, config, framework=framework,
                                      calibration=calibration, lo=lo, capacity=capacity,
                                      modes=modes)
            if extra is None:
                infeasible += 1
                continue
            if extra and len(best) == top_k and pieces[i].value(extra) >= -best[0][0]:
                pruned += 1
                continue
        cutoff = -best[0][0] if len(best) == top_k else None
        solved = _solve_one(model, cluster, config, space, framework=framework,
                            calibration=calibration, seed=seed, workers=workers,
                            time_limit_s=min(remaining, SOLVE_TIME_CAP_S), bound=bounds[i],
                            cutoff_s=cutoff, tables=cache.get(("traced", i)))
        solves += 1
        if solved == "timeout":
            status = "FEASIBLE"  # this candidate's optimum is unknown: the search is incomplete
            continue
        if solved is None:
            infeasible += 1
            continue
        if solved.status != "OPTIMAL":
            status = "FEASIBLE"
        explored.append(solved)
        entry = (-solved.step_s, i, solved)
        if len(best) < top_k:
            heapq.heappush(best, entry)
        elif solved.step_s < -best[0][0]:
            heapq.heapreplace(best, entry)
    if not best and status == "FEASIBLE":
        raise SearchTimeout(f"the time limit of {time_limit_s:g} s passed before any plan was "
                            f"found ({solves} of {len(configs)} candidates solved); raise "
                            f"--time-limit or pin more choices")
    if not best:
        message, least = _no_fit_message(model, cluster, configs, space, framework=framework,
                                         calibration=calibration)
        raise NoPlanFits(message, least=least)
    ranked = tuple(s for _, _, s in sorted(best, key=lambda e: (-e[0], e[1])))
    return SearchResult(ranked=ranked, explored=tuple(explored), status=status,
                        wall_s=time.perf_counter() - start, candidates=len(configs),
                        solves=solves, infeasible=infeasible, pruned=pruned)


def _solve_one(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig,
               space: SearchSpace, *, framework: str, calibration: Calibration, seed: int,
               workers: int, time_limit_s: float, bound: float,
               cutoff_s: float | None = None,
               tables: TracedTables | None = None) -> Solved | str | None:
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
                         cutoff_s=cutoff_s)
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
    """A traced candidate's lower bound: each stage's per-micro-batch linear term is at least
    its smallest base over modes plus, per layer, the smallest slope of its kind over stages
    and modes; summed over stages this holds for every split (exposed traffic and the
    once-per-step terms are at least 0)."""
    p = len(tables.allowed)
    forms = [[tables.time_ns[i][r].linear for r in tables.allowed[i]] for i in range(p)]
    total = sum(min(f.base for f in stage) for stage in forms)
    for kind, row in enumerate(tables.prefix):
        total += row[-1] * min(f.slopes[kind] for stage in forms for f in stage)
    return Bound(per_micro_s=total / 1e9, once_s=0.0, stages=p,
                 micro_batches=tables.micro_batches, vpp=1)


def _compact(modes: tuple[str, ...]) -> str | tuple[str, ...]:
    return modes[0] if len(set(modes)) == 1 else modes


def _no_fit_message(model: ModelSpec, cluster: ClusterSpec, configs: list[ParallelConfig],
                    space: SearchSpace, *, framework: str,
                    calibration: Calibration) -> tuple[str, Estimate | None]:
    """Name the least-memory configuration, its peak per stage against capacity, and what
    would make it fit; also return that configuration's estimate."""
    saving = [m for m in ("full", "selective", "none") if m in space.recompute_modes
              and (m in TRACED_RECOMPUTE or not model.is_traced)][0]
    least, least_peak = None, float("inf")
    for config in configs:
        trial = config.replace(recompute=saving)
        try:
            est = estimate(model, cluster, trial, framework=framework, calibration=calibration)
        except ValueError:
            continue
        if est.memory.peak_reserved_bytes < least_peak:
            least, least_peak = est, est.memory.peak_reserved_bytes
    capacity = cluster.gpu.hbm_bytes * (1 - space.memory_margin)
    if least is None:
        return "no plan fits: no candidate configuration could be evaluated", None
    c = least.config
    stages = ", ".join(f"{s.reserved_bytes / 2**30:.1f}" for s in least.memory.per_stage)
    hints = [f"more GPUs (at least {least_peak / capacity:.1f}x the memory is needed)",
             "offload (--offload optimizer or optimizer+params with --zero 3)"
             if c.offload == "none" and space.offload is None else "",
             f"a shorter sequence than {c.seq_len}" if least.memory.per_stage[0]
             .activations_bytes > 0.3 * least_peak else ""]
    return (f"no plan fits: the least-memory configuration (tp {c.tp}, pp {c.pp}, dp {c.dp}, "
            f"cp {c.cp}, ZeRO-{c.zero_stage}, offload {c.offload}, recompute {saving}, "
            f"micro-batch {c.micro_batch_size}) needs {stages} GiB reserved per stage against "
            f"{capacity / 2**30:.1f} GiB per GPU; try " + ", ".join(h for h in hints if h),
            least)
