"""Integer cost tables of one global candidate, built from the cost model, for the CP-SAT model.

For a global configuration (degrees and knobs) every term the cost model adds up for a stage is
linear in the stage's layer count n for a fixed recompute mode r (parameters, activations,
compute and per-layer communication all scale with n; first and last stages add constants):

* per micro-batch: the terms that simply add (compute, TP/CP/EP/PP communication), and the
  ZeRO-2/3 and parameter-offload traffic with the part of it compute can hide;
* once per step: data-parallel traffic and the part the last backward hides, optimizer step,
  offload step;
* reserved memory of one rank.

So each is ``base + slope * (n - lo)`` per stage and mode, read off two evaluations of the cost
model (``costmodel.estimate.stage_terms`` once per kind of stage: first, middle, last, and
stages whose communication links differ; ``costmodel.memory.stage_memory`` for every stage,
which also differ by the micro-batches in flight). Times are integer nanoseconds, memory integer
bytes. ``costmodel.composition`` combines the terms, for ``costmodel.estimate.compose_step``
on float seconds, here on integer nanoseconds and in ``solver.py`` on CP-SAT expressions.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Generic, TypeVar

import numpy as np

from meshplan.costmodel import Calibration, ClusterSpec, ModelSpec, ParallelConfig
from meshplan.costmodel.calls import buckets
from meshplan.costmodel.estimate import stage_dp_buckets, stage_terms
from meshplan.costmodel import composition, traced
from meshplan.costmodel.config import even_split
from meshplan.costmodel.frameworks import per_stage_recompute
from meshplan.costmodel.layout import framework_split
from meshplan.costmodel.memory import recompute_workspace_bytes, stage_memory
from meshplan.costmodel.timing import stage_link_signature

NS_PER_S = 1e9

T = TypeVar("T")
U = TypeVar("U")


@dataclass(frozen=True, kw_only=True)
class StageTerms(Generic[T]):
    """Every time term the cost model adds up for one stage under one recompute mode, each a
    ``T``: a ``Linear`` or ``KindForm`` in the tables, integer ns once evaluated, float seconds
    from ``costmodel.estimate.stage_terms``, a CP-SAT expression in ``solver.py``."""

    linear: T
    """Per micro-batch: the terms that simply add (compute, TP/CP/EP/PP communication)."""
    zero_comm: T
    """Per micro-batch: ZeRO-2/3 traffic."""
    zero_hidden: T
    """Per micro-batch: how much of ``zero_comm`` compute can hide."""
    offload_raw: T
    """Per micro-batch: parameter-offload traffic."""
    offload_hidden: T
    """Per micro-batch: how much of ``offload_raw`` compute can hide."""
    dp_comm: T
    """Once per step: data-parallel gradient traffic."""
    dp_hidden: T
    """Once per step: how much of ``dp_comm`` the last backward hides."""
    optimizer: T
    """Once per step: the optimizer step."""
    offload_step: T
    """Once per step: the offload step (moving optimizer states and gradients)."""

    def values(self) -> tuple[T, ...]:
        """The terms in ``TIME_TERMS`` order."""
        return tuple(getattr(self, name) for name in TIME_TERMS)


TIME_TERMS = tuple(field.name for field in fields(StageTerms))
"""Names of the fields of ``StageTerms``, in order."""


def map_terms(fn: Callable[..., U], *terms: StageTerms) -> StageTerms[U]:
    """``StageTerms`` of ``fn`` applied term by term to ``terms`` (one argument each)."""
    return StageTerms(**{name: fn(*(getattr(t, name) for t in terms)) for name in TIME_TERMS})


@dataclass(frozen=True, kw_only=True)
class StageTime(StageTerms[int]):
    """A stage's time terms in integer ns with the totals ``costmodel.composition`` makes of
    them (``_with_totals``)."""

    micro_total: int
    """Per micro-batch: ``linear`` plus the exposed ZeRO and offload traffic."""
    dp_exposed: int
    """Once per step: the exposed part of ``dp_comm``."""


@dataclass(frozen=True)
class Linear:
    """``base + slope * (n - lo)`` (integers)."""

    base: int
    slope: int

    def at(self, offset: int) -> int:
        return self.base + self.slope * offset


@dataclass(frozen=True)
class BucketTerm:
    """``cost * buckets(amount(n), bucket)`` ns of a stage holding n layers, with
    ``amount(n) = base + slope * (n - lo)`` (``costmodel.timing.dp_bucket_terms``: bucketed
    gradient reductions issue a call per bucket, a ceiling of the amount over the bucket)."""

    base: float
    slope: float
    bucket: float
    cost: int

    def amount(self, offset: int) -> float:
        return self.base + self.slope * offset

    def at(self, offset: int) -> int:
        return self.cost * buckets(self.amount(offset), self.bucket)


@dataclass(frozen=True)
class CandidateTables:
    """Linear forms per stage and mode for one candidate."""

    config: ParallelConfig
    allowed: tuple[tuple[str, ...], ...]
    """Recompute modes each stage may use."""
    uniform_modes: bool
    """Every stage must take the same mode (``frameworks.per_stage_recompute`` false)."""
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    time_ns: tuple[dict[str, StageTerms[Linear]], ...]
    """Per stage, per mode: every time term."""
    memory_bytes: tuple[dict[str, Linear], ...]
    """Per stage, per mode: reserved bytes of one rank (exact at ``lo`` and ``lo + 1``)."""
    capacity_bytes: int
    num_layers: int
    micro_batches: int
    vpp: int
    most_layers: tuple[dict[str, int], ...] | None = None
    """Per stage, per mode: the most layers that fit ``capacity_bytes`` by the cost model's
    own stage memory (``lo - 1``: none); None reads it off the linear ``memory_bytes``."""
    dp_buckets: tuple[tuple[BucketTerm, ...], ...] = ()
    """Per stage (empty: none anywhere): the per-bucket costs of its once-per-step
    data-parallel traffic, which ``time_ns``'s ``dp_comm`` forms leave out; a stage's
    ``dp_comm`` is its form plus each term's ``at(n)`` (``stage_time_ns``)."""

    def most(self, stage: int, mode: str) -> int:
        """The most layers ``stage`` holds within capacity under ``mode``."""
        if self.most_layers is not None:
            return self.most_layers[stage][mode]
        return _most_of_form(self.memory_bytes[stage][mode], self.lo[stage], self.hi[stage],
                             self.capacity_bytes)

    def fit_form(self, stage: int, mode: str) -> Linear:
        """The CP-SAT memory constraint's form: at most ``capacity_bytes`` exactly for the
        counts ``most`` allows (``memory_bytes`` itself when no ``most_layers`` are given)."""
        if self.most_layers is None:
            return self.memory_bytes[stage][mode]
        return _fit_form(self.memory_bytes[stage][mode], self.most(stage, mode),
                         self.lo[stage], self.hi[stage], self.capacity_bytes)


def _fit_form(form: Linear, most: int, lo: int, hi: int, capacity: int) -> Linear:
    """A linear form in the layer count that is at most ``capacity`` exactly for counts up to
    ``most`` (the memory form shifted to cross the capacity there; unchanged when nothing
    fits)."""
    if most < lo:
        return form
    slope = max(form.slope, 1)
    if most >= hi:
        return Linear(base=min(form.base, capacity - slope * (hi - lo)), slope=slope)
    return Linear(base=capacity - slope * (most - lo), slope=slope)


def _most_of_form(form: Linear, lo: int, hi: int, capacity: int) -> int:
    if form.base > capacity:
        return lo - 1
    if form.slope <= 0:
        return hi
    return min(hi, lo + (capacity - form.base) // form.slope)


def layer_bounds(model: ModelSpec, config: ParallelConfig,
                 pinned: tuple[int, ...] | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Allowed layer counts per stage: at least vpp (one layer per virtual chunk)."""
    p, total = config.pp, model.num_layers
    if pinned is not None:
        return tuple(pinned), tuple(pinned)
    lo = max(1, config.vpp)
    hi = total - (p - 1) * lo
    return (lo,) * p, (hi,) * p


def stage_config(config: ParallelConfig, model: ModelSpec, stage: int, layers: int,
                 mode: str) -> ParallelConfig:
    """``config`` with ``layers`` layers and recompute ``mode`` on ``stage``; the other stages
    share the remaining layers (``even_split``, first stages first; they do not affect this
    stage's terms)."""
    return config.with_split(*_probe_split(config.pp, model.num_layers, stage, layers, mode))


@functools.lru_cache(maxsize=65536)
def _probe_split(p: int, total: int, stage: int, layers: int,
                 mode: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Layer counts and recompute modes of ``stage_config``'s split (cached: the planner
    probes the same few splits for many configurations)."""
    counts = [layers] * p
    if p > 1:
        rest = max(p - 1, total - layers)
        shares = even_split(rest, p - 1, remainder="first")
        counts[:stage] = shares[:stage]
        counts[stage + 1:] = shares[stage:]
    modes = ["none"] * p
    modes[stage] = mode
    return tuple(counts), tuple(modes)


def _time_terms(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, stage: int,
                layers: int, mode: str, framework: str,
                calibration: Calibration) -> StageTerms[float]:
    return _terms_of(stage_terms(model, cluster,
                                 stage_config(config, model, stage, layers, mode), stage,
                                 framework=framework, calibration=calibration))


def _linear(first: float, second: float, scale: float) -> Linear:
    return Linear(base=int(round(first * scale)), slope=int(round((second - first) * scale)))


def _uniform_modes(framework: str, stages: int, pinned_modes) -> bool:
    """Whether the solver must give every stage one mode: a framework that takes one for the
    whole model, several stages, and no per-stage list the user pinned."""
    return stages > 1 and not pinned_modes and not per_stage_recompute(framework)


def _pinned(model: ModelSpec, config: ParallelConfig, framework: str,
            pinned_layers: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """The split tables hold (``build_tables``), None when free."""
    if pinned_layers is not None:
        return pinned_layers
    if config.layers_per_stage is not None and config.pp > 1:
        return config.layers_per_stage
    return framework_split(framework, model, config.pp)


def build_tables(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, *,
                 modes: tuple[str, ...], framework: str, calibration: Calibration,
                 memory_margin: float = 0.0,
                 pinned_layers: tuple[int, ...] | None = None,
                 pinned_modes: tuple[str, ...] | None = None) -> CandidateTables:
    """Tables for ``config``; stages may use ``modes`` (or exactly ``pinned_modes[i]``).
    Layers per stage: ``pinned_layers``, else ``config``'s own split (a candidate of one of
    the splits a framework builds itself: ``search._Refiner.candidate_nodes``), else the
    framework's default where it takes none of the plan's (``layout.framework_split``), else
    free."""
    p = config.pp
    pinned_layers = _pinned(model, config, framework, pinned_layers)
    lo, hi = layer_bounds(model, config, pinned_layers)
    if p == 1:  # one stage holds every layer: its terms are read at that count, exactly
        lo, hi = (model.num_layers,), (model.num_layers,)
    allowed = tuple((pinned_modes[i],) for i in range(p)) if pinned_modes else (modes,) * p
    by_class: dict[tuple, StageTerms[Linear]] = {}
    bucket_class: dict[tuple, tuple[BucketTerm, ...]] = {}
    times, memories, mosts, bucket_terms = [], [], [], []
    capacity = math.floor(cluster.gpu.hbm_bytes * (1 - memory_margin))
    for stage in range(p):
        cls = (stage == 0, stage == p - 1, lo[stage], hi[stage],
               stage_link_signature(cluster, config, stage))
        stage_times, stage_memory_forms, stage_most = {}, {}, {}
        if cls not in bucket_class:
            bucket_class[cls] = _bucket_terms(model, cluster, config, stage, lo[stage],
                                              hi[stage], framework, calibration)
        terms_b = bucket_class[cls]
        bucket_terms.append(terms_b)
        for mode in allowed[stage]:
            key = (*cls, mode)
            if key not in by_class:
                a = _time_terms(model, cluster, config, stage, lo[stage], mode, framework,
                                calibration)
                b = (_time_terms(model, cluster, config, stage, lo[stage] + 1, mode, framework,
                                 calibration) if hi[stage] > lo[stage] else a)
                if terms_b:  # the forms hold the rest; the bucketed part is added exactly
                    a = dataclasses.replace(a, dp_comm=a.dp_comm - sum(
                        t.at(0) for t in terms_b) / NS_PER_S)
                    b = dataclasses.replace(b, dp_comm=b.dp_comm - sum(
                        t.at(1) for t in terms_b) / NS_PER_S)
                by_class[key] = map_terms(lambda x, y: _linear(x, y, NS_PER_S), a, b)
            stage_times[mode] = by_class[key]
            first = _reserved(model, cluster, config, stage, lo[stage], mode, framework,
                              calibration)
            second = (_reserved(model, cluster, config, stage, lo[stage] + 1, mode, framework,
                                calibration) if hi[stage] > lo[stage] else first)
            stage_memory_forms[mode] = form = _linear(first, second, 1.0)
            stage_most[mode] = _most_layers(
                lambda n, stage=stage, mode=mode: _reserved(model, cluster, config, stage, n,
                                                            mode, framework, calibration),
                lo[stage], hi[stage], capacity,
                guess=_most_of_form(form, lo[stage], hi[stage], capacity),
                known={lo[stage]: first, lo[stage] + 1: second} if hi[stage] > lo[stage]
                else {lo[stage]: first})
        times.append(stage_times)
        memories.append(stage_memory_forms)
        mosts.append(stage_most)
    return CandidateTables(config=config, allowed=allowed,
                           uniform_modes=_uniform_modes(framework, p, pinned_modes),
                           lo=lo, hi=hi, time_ns=tuple(times),
                           memory_bytes=tuple(memories), capacity_bytes=capacity,
                           num_layers=model.num_layers, micro_batches=config.grad_accum_steps,
                           vpp=config.vpp, most_layers=tuple(mosts),
                           dp_buckets=(tuple(bucket_terms) if any(bucket_terms) else ()))


def _bucket_terms(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, stage: int,
                  lo: int, hi: int, framework: str,
                  calibration: Calibration) -> tuple[BucketTerm, ...]:
    """``stage``'s per-bucket data-parallel costs (``costmodel.estimate.stage_dp_buckets``)
    with their amounts as a linear form from ``lo`` (read at ``lo`` and ``lo + 1``); terms
    that cost nothing are left out."""
    first = stage_dp_buckets(model, cluster, stage_config(config, model, stage, lo, "none"),
                             stage, framework=framework, calibration=calibration)
    second = (stage_dp_buckets(model, cluster, stage_config(config, model, stage, lo + 1,
                                                            "none"),
                               stage, framework=framework, calibration=calibration)
              if hi > lo else first)
    return tuple(BucketTerm(base=a, slope=a2 - a, bucket=bucket, cost=int(round(cost * NS_PER_S)))
                 for (a, bucket, cost), (a2, _, _) in zip(first, second)
                 if int(round(cost * NS_PER_S)) > 0)


def _most_layers(reserved: Callable[[int], float], lo: int, hi: int, capacity: int, *,
                 guess: int, known: dict[int, float]) -> int:
    """The largest n in [lo, hi] with ``reserved(n) <= capacity`` (``lo - 1`` if none), for a
    ``reserved`` that does not fall as layers are added; ``known`` holds values already
    computed. Starts at ``guess`` (the linear form's answer, usually right: two more
    evaluations) and bisects when it is not."""
    def fits(n: int) -> bool:
        if n not in known:
            known[n] = reserved(n)
        return known[n] <= capacity

    if not fits(lo):
        return lo - 1
    guess = max(lo, min(hi, guess))
    if fits(guess):
        if guess == hi or not fits(guess + 1):
            return guess
        if fits(hi):
            return hi
        good, bad = guess + 1, hi
    else:
        good, bad = lo, guess
    while bad - good > 1:  # good fits, bad does not
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def stage_most_layers(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig,
                      stage: int, mode: str, lo: int, hi: int, capacity: float, *,
                      framework: str, calibration: Calibration) -> int:
    """The most layers in [lo, hi] ``stage`` holds within ``capacity`` under ``mode``
    (``lo - 1``: none), by the rule the tables use (``_most_layers``)."""
    def reserved(n: int) -> float:
        return _reserved(model, cluster, config, stage, n, mode, framework, calibration)

    capacity = math.floor(capacity)
    first = reserved(lo)
    known = {lo: first}
    if hi > lo:
        known[lo + 1] = reserved(lo + 1)
    form = _linear(first, known.get(lo + 1, first), 1.0)
    return _most_layers(reserved, lo, hi, capacity, guess=_most_of_form(form, lo, hi, capacity),
                        known=known)


def _reserved(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, stage: int,
              layers: int, mode: str, framework: str, calibration: Calibration) -> float:
    staged = stage_config(config, model, stage, layers, mode)
    return stage_memory(model, cluster, staged, stage, framework=framework,
                        calibration=calibration).reserved_bytes


def stage_time_ns(tables: CandidateTables, stage: int, layers: int, mode: str) -> StageTime:
    """Every time term of ``stage`` with ``layers`` layers under ``mode`` (ns)."""
    offset = layers - tables.lo[stage]
    terms = map_terms(lambda form: form.at(offset), tables.time_ns[stage][mode])
    if tables.dp_buckets and tables.dp_buckets[stage]:
        terms = dataclasses.replace(terms, dp_comm=terms.dp_comm + sum(
            term.at(offset) for term in tables.dp_buckets[stage]))
    return _with_totals(terms)


def _with_totals(terms: StageTerms[int]) -> StageTime:
    """``terms`` plus ``micro_total`` (linear work and exposed ZeRO and offload traffic) and
    ``dp_exposed``, composed by ``costmodel.composition`` as the cost model composes them."""
    micro_total = composition.micro_total(
        linear=terms.linear, zero_comm=terms.zero_comm, zero_hidden=terms.zero_hidden,
        offload_raw=terms.offload_raw, offload_hidden=terms.offload_hidden)
    dp_exposed = composition.exposed(terms.dp_comm, terms.dp_hidden)
    return StageTime(**dict(zip(TIME_TERMS, terms.values())), micro_total=micro_total,
                     dp_exposed=dp_exposed)


def scaled_step_ns(terms: list[StageTime], *, micro_batches: int, vpp: int) -> int:
    """v x step time (ns) of stages with these terms (``stage_time_ns``), by
    ``costmodel.composition.scaled_step`` with the maxima over stages taken here."""
    totals = [x.micro_total for x in terms]
    once = composition.once_per_step(dp_exposed=max(x.dp_exposed for x in terms),
                                     optimizer=max(x.optimizer for x in terms),
                                     offload_step=max(x.offload_step for x in terms))
    return composition.scaled_step(micro_batches=micro_batches, vpp=vpp, top_micro=max(totals),
                                   sum_micro=sum(totals), once=once)


def objective_ns(tables: CandidateTables, layers: list[int] | tuple[int, ...],
                 modes: list[str] | tuple[str, ...]) -> int:
    """v x step time (ns) of a split (``scaled_step_ns``); for hints and checks."""
    terms = [stage_time_ns(tables, i, n, r) for i, (n, r) in enumerate(zip(layers, modes))]
    return scaled_step_ns(terms, micro_batches=tables.micro_batches, vpp=tables.vpp)


def fits(tables: CandidateTables, stage: int, layers: int, mode: str) -> bool:
    return layers <= tables.most(stage, mode)


# ----- traced models: layers of several kinds -----------------------------------------------------

@dataclass(frozen=True)
class KindForm:
    """``base + sum_k slopes[k] * count_k`` over the kinds of layer a stage holds (integers)."""

    base: int
    slopes: tuple[int, ...]

    def at(self, counts: tuple[int, ...] | list[int]) -> int:
        return self.base + sum(s * c for s, c in zip(self.slopes, counts))


@dataclass(frozen=True)
class KindBucket:
    """``cost * buckets(amount, bucket)`` ns with ``amount`` linear in the kind counts of a
    stage (``BucketTerm`` for tables over stage boundaries)."""

    amount: KindForm
    bucket: float
    cost: int

    def at(self, counts: tuple[int, ...] | list[int]) -> int:
        return self.cost * buckets(self.amount.at(counts), self.bucket)


@dataclass(frozen=True)
class TracedTables:
    """Per stage and mode, every time term and reserved memory as a ``KindForm``.

    A traced model's layers differ, so a stage's terms depend on which layers it holds, not on
    how many: each term is linear in the count of each kind of layer in the stage (the cost
    model's traced terms are sums over the stage's layers; costmodel/traced.py). The split is a
    set of stage boundaries; ``prefix[k][j]`` counts kind-k layers among the first j.
    """

    config: ParallelConfig
    allowed: tuple[tuple[str, ...], ...]
    uniform_modes: bool
    """Every stage must take the same mode (``frameworks.per_stage_recompute`` false)."""
    kinds: tuple[int, ...]
    """Kind of every layer, in order."""
    prefix: tuple[tuple[int, ...], ...]
    time_ns: tuple[dict[str, StageTerms[KindForm]], ...]
    """Per stage, per mode: every time term."""
    memory_bytes: tuple[dict[str, KindForm], ...]
    """Reserved bytes without the full-recompute workspace (see ``workspace_bytes``)."""
    capacity_bytes: int
    num_layers: int
    micro_batches: int
    pinned_layers: tuple[int, ...] | None
    workspace_bytes: tuple[int, ...] = ()
    """Per kind: reserved bytes rebuilding one such layer needs under full recomputation; a
    full-recompute stage adds the largest over the kinds it holds (not a sum over layers)."""
    vpp: int = 1
    heavy_kind: int | None = None
    """A model whose layers mix dense and MoE (``mixed_layers``): the MoE kind. Terms that
    depend on the largest layer a stage holds (ZeRO-3 and FSDP gather buffers, the
    recomputation workspace) differ by whether the stage holds one, so ``time_ns`` and
    ``memory_bytes`` hold the forms of stages that do, ``light_time_ns`` and
    ``light_memory_bytes`` those of stages that hold none; each set is exact on its ranges."""
    light_time_ns: tuple[dict[str, StageTerms[KindForm]], ...] | None = None
    light_memory_bytes: tuple[dict[str, KindForm], ...] | None = None
    dp_buckets: tuple[tuple[KindBucket, ...], ...] = ()
    """Per stage (empty: none anywhere): the per-bucket data-parallel costs ``time_ns``'s
    ``dp_comm`` forms leave out (as ``CandidateTables.dp_buckets``); ``light_dp_buckets`` for
    the light forms."""
    light_dp_buckets: tuple[tuple[KindBucket, ...], ...] = ()

    def counts(self, start: int, stop: int) -> tuple[int, ...]:
        return tuple(row[stop] - row[start] for row in self.prefix)

    def light(self, counts: tuple[int, ...]) -> bool:
        """Whether a stage holding ``counts`` takes the light forms (no layer of the heavy
        kind)."""
        return self.heavy_kind is not None and counts[self.heavy_kind] == 0

    def classes(self, stage: int) -> tuple[bool | None, ...]:
        """The classes ``stage`` can take: (None,) for a traced model; for a mixed one True
        (holds an MoE layer) and False (holds none) where it has ranges of that class."""
        if self.heavy_kind is None:
            return (None,)
        return tuple(cls for cls, forms in ((True, self.memory_bytes[stage]),
                                            (False, self.light_memory_bytes[stage])) if forms)

    def buckets(self, stage: int, light: bool) -> tuple[KindBucket, ...]:
        """The per-bucket terms of ``stage``'s light or heavy forms."""
        table = self.light_dp_buckets if light else self.dp_buckets
        return table[stage] if table else ()

    def forms(self, stage: int, counts: tuple[int, ...]
              ) -> tuple[dict[str, StageTerms[KindForm]], dict[str, KindForm]]:
        """(time forms, memory forms) per mode of ``stage`` holding ``counts``."""
        if self.light(counts):
            return self.light_time_ns[stage], self.light_memory_bytes[stage]
        return self.time_ns[stage], self.memory_bytes[stage]


def layer_kinds(model: ModelSpec) -> tuple[int, ...]:
    """Kind of every layer: a traced model's own kinds; 1 for an MoE layer, 0 for a dense one
    (``ModelSpec.is_moe_layer``)."""
    if model.is_traced:
        return tuple(layer.kind for layer in model.traced)
    return tuple(int(model.is_moe_layer(i)) for i in range(model.num_layers))


def mixed_layers(model: ModelSpec) -> bool:
    """An analytic model whose layers are not all of one kind (dense and MoE layers mixed,
    e.g. every second layer MoE): a stage's terms depend on which layers it holds, so the
    planner solves its split by stage boundaries (``build_traced_tables``), as for a traced
    model."""
    return not model.is_traced and len(set(layer_kinds(model))) > 1


def range_config(config: ParallelConfig, model: ModelSpec, stage: int, start: int, stop: int,
                 mode: str) -> ParallelConfig:
    """``config`` with ``stage`` holding layers ``[start, stop)`` under ``mode``; the stages
    before share ``start`` layers and those after the rest (one or more each; ``even_split``,
    first stages first)."""
    p, total = config.pp, model.num_layers
    counts = [0] * p
    for members, n in ((range(stage), start), (range(stage + 1, p), total - stop)):
        if members:
            for i, share in zip(members, even_split(n, len(members), remainder="first")):
                counts[i] = share
    counts[stage] = stop - start
    modes = ["none"] * p
    modes[stage] = mode
    return config.with_split(tuple(counts), tuple(modes))


def _probe_ranges(prefix: tuple[tuple[int, ...], ...], stage: int, p: int,
                  keep: Callable[[tuple[int, ...]], bool] | None = None
                  ) -> tuple[list[tuple[int, int]], np.ndarray]:
    """Layer ranges stage ``stage`` can hold whose kind counts (with a leading 1 for the base)
    are linearly independent and span every range it can hold, and those count rows;
    ``keep``: only ranges whose kind counts it accepts (and so only those are spanned).

    The first stage always starts at layer 0, so its ranges are prefixes, and the last ends at
    the last layer, so its ranges are suffixes; a kind an end stage always holds (the
    embedding) cannot be told from the base there, and need not be.
    """
    total = len(prefix[0]) - 1
    first, last = stage, total - (p - 1 - stage)  # reachable layers [first, last)
    if stage == 0:
        options = ((0, stop) for stop in range(1, last + 1))
    elif stage == p - 1:
        options = ((start, total) for start in range(total - 1, first - 1, -1))
    else:  # every middle range, narrowest first (a wide one may hold a kind twice)
        options = ((j, j + width) for width in range(1, last - first + 1)
                   for j in range(first, last - width + 1))
    chosen: list[tuple[int, int]] = []
    rows: list[list[int]] = []
    full = len(prefix) + 1
    for start, stop in options:
        counts = tuple(kind[stop] - kind[start] for kind in prefix)
        if keep is not None and not keep(counts):
            continue
        row = [1, *counts]
        if np.linalg.matrix_rank(np.array(rows + [row], dtype=float)) > len(rows):
            chosen.append((start, stop))
            rows.append(row)
            if len(rows) == full:
                break
    return chosen, np.array(rows, dtype=float)


def _solve_forms(rows: np.ndarray, values: list[float], scale: float, *,
                 round_up: bool = False) -> KindForm:
    """Base and per-kind slopes that reproduce ``values`` on the probe rows (least norm where
    the probes cannot tell a kind from the base; exact on every range the stage can hold).
    ``round_up``: integers never below the real values (memory: a split the tables accept
    must also fit when ``estimate`` checks it byte for byte)."""
    solution, *_ = np.linalg.lstsq(rows, np.array(values, dtype=float) * scale, rcond=None)
    whole = math.ceil if round_up else round
    return KindForm(base=int(whole(solution[0] + (1e-6 if round_up else 0.0))),
                    slopes=tuple(int(whole(x + (1e-6 if round_up else 0.0)))
                                 for x in solution[1:]))


def build_traced_tables(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, *,
                        modes: tuple[str, ...], framework: str, calibration: Calibration,
                        memory_margin: float = 0.0,
                        pinned_layers: tuple[int, ...] | None = None,
                        pinned_modes: tuple[str, ...] | None = None) -> TracedTables:
    """Tables for a candidate of a traced model or of one that mixes dense and MoE layers
    (see ``TracedTables``); layers per stage as ``build_tables`` pins them."""
    p = config.pp
    pinned_layers = _pinned(model, config, framework, pinned_layers)
    kinds = layer_kinds(model)
    num_kinds = max(kinds) + 1
    prefix = tuple(tuple(sum(1 for k in kinds[:j] if k == kind) for j in range(len(kinds) + 1))
                   for kind in range(num_kinds))
    allowed = tuple((pinned_modes[i],) for i in range(p)) if pinned_modes else (modes,) * p
    heavy = 1 if mixed_layers(model) else None
    # a traced model's recomputation workspace is a max over the kinds a stage holds, added
    # by the solver; a mixed model's forms hold theirs (one value per heavy/light class)
    apart = model.is_traced and framework != "ideal"

    def stage_forms(stage: int, keep: Callable[[tuple[int, ...]], bool] | None):
        ranges, rows = _probe_ranges(prefix, stage, p, keep)
        stage_times, stage_memory_forms = {}, {}
        if not ranges:  # the stage holds no range of this class
            return stage_times, stage_memory_forms, ()
        # the per-bucket data-parallel costs, carried apart (``KindBucket``)
        probes = [stage_dp_buckets(model, cluster,
                                   range_config(config, model, stage, start, stop, "none"),
                                   stage, framework=framework, calibration=calibration)
                  for start, stop in ranges]
        bucket_terms = tuple(
            KindBucket(amount=_solve_forms(rows, [probe[j][0] for probe in probes], 1.0),
                       bucket=probes[0][j][1], cost=int(round(probes[0][j][2] * NS_PER_S)))
            for j in range(len(probes[0])) if int(round(probes[0][j][2] * NS_PER_S)) > 0)
        for mode in allowed[stage]:
            terms, reserved = [], []
            for start, stop in ranges:
                staged = range_config(config, model, stage, start, stop, mode)
                got = _terms_of(stage_terms(model, cluster, staged, stage, framework=framework,
                                            calibration=calibration))
                if bucket_terms:
                    counts = tuple(kind[stop] - kind[start] for kind in prefix)
                    got = dataclasses.replace(got, dp_comm=got.dp_comm - sum(
                        term.at(counts) for term in bucket_terms) / NS_PER_S)
                terms.append(got)
                workspace = recompute_workspace_bytes(model, staged, stage) if apart else 0.0
                reserved.append(stage_memory(model, cluster, staged, stage,
                                             framework=framework,
                                             calibration=calibration).reserved_bytes
                                - workspace * (1 + calibration.allocator_fragmentation))
            stage_times[mode] = map_terms(
                lambda *values: _solve_forms(rows, list(values), NS_PER_S), *terms)
            stage_memory_forms[mode] = _solve_forms(rows, reserved, 1.0, round_up=True)
        return stage_times, stage_memory_forms, bucket_terms

    heavy_forms = [stage_forms(stage, None if heavy is None else
                               (lambda counts: counts[heavy] > 0)) for stage in range(p)]
    light_forms = ([stage_forms(stage, lambda counts: counts[heavy] == 0) for stage in range(p)]
                   if heavy is not None else None)
    workspace = [0] * num_kinds
    if apart:
        for index, kind in enumerate(kinds):
            workspace[kind] = math.ceil(traced.layer_workspace_bytes(model, config, index)
                                        * (1 + calibration.allocator_fragmentation))
    heavy_buckets = tuple(b for _, _, b in heavy_forms)
    light_buckets = tuple(b for _, _, b in light_forms) if light_forms else ()
    return TracedTables(config=config, allowed=allowed,
                        uniform_modes=_uniform_modes(framework, p, pinned_modes),
                        kinds=kinds, prefix=prefix,
                        time_ns=tuple(t for t, _, _ in heavy_forms),
                        memory_bytes=tuple(m for _, m, _ in heavy_forms),
                        capacity_bytes=math.floor(cluster.gpu.hbm_bytes * (1 - memory_margin)),
                        num_layers=model.num_layers, micro_batches=config.grad_accum_steps,
                        pinned_layers=pinned_layers, workspace_bytes=tuple(workspace),
                        vpp=config.vpp, heavy_kind=heavy,
                        light_time_ns=(tuple(t for t, _, _ in light_forms) if light_forms
                                       else None),
                        light_memory_bytes=(tuple(m for _, m, _ in light_forms) if light_forms
                                            else None),
                        dp_buckets=heavy_buckets if any(heavy_buckets) else (),
                        light_dp_buckets=light_buckets if any(light_buckets) else ())


def _terms_of(terms) -> StageTerms[float]:
    micro = terms.micro
    return StageTerms(linear=micro.linear_s, zero_comm=micro.zero_comm_s,
                      zero_hidden=micro.zero_hidden_s, offload_raw=micro.offload_raw_s,
                      offload_hidden=micro.offload_hidden_s, dp_comm=terms.dp_comm_s,
                      dp_hidden=terms.dp_hidden_s, optimizer=terms.optimizer_s,
                      offload_step=terms.offload_s)


def traced_stage_ns(tables: TracedTables, stage: int, start: int, stop: int,
                    mode: str) -> StageTime:
    """Every time term of ``stage`` holding ``[start, stop)`` under ``mode`` (ns)."""
    counts = tables.counts(start, stop)
    times, _ = tables.forms(stage, counts)
    terms = map_terms(lambda form: form.at(counts), times[mode])
    extra = sum(term.at(counts) for term in tables.buckets(stage, tables.light(counts)))
    if extra:
        terms = dataclasses.replace(terms, dp_comm=terms.dp_comm + extra)
    return _with_totals(terms)


def traced_objective_ns(tables: TracedTables, layers: list[int] | tuple[int, ...],
                        modes: list[str] | tuple[str, ...]) -> int:
    """v x step time (ns) of a split of a traced or mixed model (``scaled_step_ns``)."""
    bounds = [0]
    for n in layers:
        bounds.append(bounds[-1] + n)
    terms = [traced_stage_ns(tables, i, bounds[i], bounds[i + 1], r)
             for i, r in enumerate(modes)]
    return scaled_step_ns(terms, micro_batches=tables.micro_batches, vpp=tables.vpp)
