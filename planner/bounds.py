"""Split-aware lower bounds on a candidate's step time, from the stages' capacities.

The search (``search.py``) needs, for a candidate or a whole family of them, a step time that
no layer split or recompute choice beats, at a fraction of what building its CP-SAT tables
costs. ``split_bound`` is that bound on given per-stage forms: stage i under mode r holds at
most ``most_i(r)`` layers and costs at least ``base + slope (n - lo)`` of linear work per
micro-batch, so the slowest stage takes at least the smallest T at which the stages can hold
every layer within T (bisection), and the stages together at least the sum of their smallest
bases plus the smallest slope for the layers above the ``lo`` each must hold. The tables'
bound (``search.tables_bound``) applies it to the tables' exact forms; ``capacity_bound``
applies it to forms read off a few stages:

* linear work per kind of stage (first, last, communication links: ``search._stage_kinds``)
  and mode, at ``lo`` and ``lo + 1`` layers (the tables' own two-point forms);
* the most layers each mode fits, exactly, at the first and last stage and at a sample of the
  middle stages; a middle stage holds at most what the next sampled stage after it holds,
  because its memory does not fall as the stage index falls: the same states and buffers and
  at least as many micro-batches in flight (``costmodel.activations.in_flight_microbatches``
  does not grow with the index, 1F1B or interleaved). That needs every layer to be of one
  kind; models that mix dense and MoE layers sample every stage.
"""

from __future__ import annotations

from collections.abc import Callable

from meshplan.costmodel import Calibration, ClusterSpec, ModelSpec, ParallelConfig
from meshplan.costmodel.estimate import stage_micro
from meshplan.costmodel.timing import link_period, stage_link_signature
from meshplan.planner.tables import stage_config

MIDDLE_SAMPLES = 3
"""Middle stages whose capacity ``capacity_bound`` evaluates (all of them when fewer). Fewer
samples give a looser bound for fewer memory evaluations; on the 14 cases of
``benchmarks/planner_scaling.py`` 3 made the least work (Python calls over all 14: 2: +5 %,
and +43 % on 70B on 64 GPUs; 4: +1 %; 6: +4 %)."""

Row = tuple[int, list[tuple[tuple[tuple[float, float], ...], int]]]
"""One stage: its ``lo`` and, per usable mode, its time as the largest of linear pieces
((base, slope) each: ``base + slope (n - lo)``) and the most layers that fit."""


def split_bound(rows: list[Row], total_layers: int) -> tuple[float, float] | None:
    """(slowest stage, sum over stages) lower bounds of the per-micro-batch time of any split
    of ``total_layers`` layers over stages of ``rows`` (module docstring); None when the
    stages cannot hold the layers at all.

    A form's time is the largest of its linear pieces (one piece: linear work; more: the
    exposed traffic ``max(0, raw - hidden)`` written out), so it is convex in the layer count
    and at least its two-point line from ``lo``: the sum over stages is at least the sum of
    each stage's least time at ``lo`` plus the least such slope for the layers above."""
    risen: dict[tuple, tuple] = {}  # each distinct stage's forms, made rising once
    order = []  # per stage, its entry of ``risen``
    for lo, forms in rows:
        key = (lo, tuple(forms))
        if key not in risen:
            risen[key] = (lo, tuple((_rising(pieces, lo, most), most) for pieces, most in forms))
        order.append(risen[key])
    if any(not forms for _, forms in order):
        return None
    if sum(max(f[1] for f in forms) for _, forms in order) < total_layers:
        return None
    alike: dict[tuple, int] = {}  # identical stages, counted once each
    for key in order:
        alike[key] = alike.get(key, 0) + 1

    # per distinct stage: each form's largest base (above the limit, it holds nothing), its
    # rising pieces and the most layers that fit
    kinds = [(lo, [(max(base for base, _ in pieces),
                    [(base, slope) for base, slope in pieces if slope > 0], fit)
                   for pieces, fit in forms], times)
             for (lo, forms), times in alike.items()]

    def holds(limit: float) -> bool:
        """Whether the stages hold every layer within ``limit`` each: the most layers each
        form fits under its pieces and capacity, the best form per stage, summed (stopping
        once the sum reaches the total, as it only grows)."""
        count = 0
        for lo, forms, times in kinds:
            most = 0
            for top, rising, fit in forms:
                if top > limit:
                    continue
                n = fit
                for base, slope in rising:
                    within = lo + int((limit - base) // slope)
                    if within < n:
                        n = within
                if n > most:
                    most = n
            count += times * most
            if count >= total_layers:
                return True
        return False

    def at(pieces, n: int, lo: int) -> float:
        return max(base + slope * (n - lo) for base, slope in pieces)

    least = {key: min(at(p, key[0], key[0]) for p, _ in key[1]) for key in alike}
    low = max(least.values())
    high = max(at(p, fit, lo) for lo, forms in alike for p, fit in forms)
    if not holds(low):
        for _ in range(48):
            mid = (low + high) / 2
            if holds(mid):
                high = mid
            else:
                low = mid
    sums = sum(least[key] for key in order)  # stage by stage, in order
    slope = min(at(p, lo + 1, lo) - at(p, lo, lo) for lo, forms in alike for p, _ in forms)
    sums += max(slope, 0) * (total_layers - sum(lo for lo, _ in order))
    return max(low, sums / len(order)), sums


def _rising(pieces, lo: int, most: int) -> tuple[tuple[float, float], ...]:
    """``pieces`` with each falling piece replaced by its least value over [lo, most] (a
    constant no larger than the piece anywhere there), each distinct piece once."""
    rising = {(base, slope) if slope >= 0 else (base + slope * max(most - lo, 0), 0.0)
              for base, slope in pieces}
    return tuple(sorted(rising))


def stage_classes(cluster: ClusterSpec, config: ParallelConfig,
                  cache: dict | None = None) -> tuple[int, ...]:
    """Per stage, the first stage of its kind (first, last, communication links); cached by
    rank layout, which is all the links depend on."""
    key = ("classes", config.tp, config.cp, config.dp, config.pp, config.ep,
           tuple(config.mesh_order))
    if cache is not None and key in cache:
        return cache[key]
    p = config.pp
    period = link_period(cluster, config)  # stages period..p-2 repeat the links of 0..period-1
    ids: dict[tuple, int] = {}  # each distinct signature's number (hashed once each)
    known = [ids.setdefault(stage_link_signature(cluster, config, stage), len(ids))
             for stage in range(min(period, p))]
    last = ids.setdefault(stage_link_signature(cluster, config, p - 1), len(ids))
    firsts: dict[tuple, int] = {}
    out = tuple(firsts.setdefault((stage == 0, stage == p - 1,
                                   known[stage % period] if stage < p - 1 else last), stage)
                for stage in range(p))
    if cache is not None:
        cache[key] = out
    return out


def uniform_layers(model: ModelSpec) -> bool:
    """Every layer of one kind (all dense or all MoE): what the stage-order argument needs."""
    return model.layers_of_one_kind


def sampled_stages(model: ModelSpec, p: int) -> tuple[int, ...]:
    """The stages whose capacity ``capacity_bound`` evaluates: every stage of a model with
    layers of two kinds, else the first, the last, the first and last middle stages and up to
    ``MIDDLE_SAMPLES`` middle stages spread between."""
    if p <= MIDDLE_SAMPLES + 2 or not uniform_layers(model):
        return tuple(range(p))
    middle = {1 + round(k * (p - 3) / (MIDDLE_SAMPLES - 1)) for k in range(MIDDLE_SAMPLES)}
    return tuple(sorted({0, p - 1} | middle))


def stage_caps(model: ModelSpec, p: int, exact: dict[int, int]) -> list[int]:
    """Per stage, the most layers it can hold: ``exact`` at the sampled stages, and for a
    middle stage the value of the next sampled middle stage (module docstring)."""
    caps = []
    for stage in range(p):
        if stage in exact:
            caps.append(exact[stage])
            continue
        later = min(s for s in exact if stage < s < p - 1)
        caps.append(exact[later])
    return caps


def capacity_bound(model: ModelSpec, cluster: ClusterSpec, *, memory_config: ParallelConfig,
                   time_config: ParallelConfig, framework: str, calibration: Calibration,
                   capacity: float, modes: tuple[str, ...], lo: int, hi: int,
                   most_layers: Callable, cache: dict | None = None, time_scale: float = 1.0,
                   relaxed: bool = False) -> tuple[float, float] | None:
    """``split_bound`` of a candidate with the capacities of ``memory_config`` and the time
    per micro-batch of ``time_config`` (``micro_pieces``, seconds), or None when no split
    fits.

    For one candidate both are the candidate. For a family that differs only in ZeRO stage and
    offload, ``memory_config`` is its leanest member (no member holds more layers) and
    ``time_config`` its ZeRO-0 member without offload (linear work does not depend on ZeRO or
    offload, which only add exposed traffic).
    ``most_layers(config, stage, mode, lo, hi)`` is the most layers the stage fits (the
    tables' exact rule). ``time_scale`` multiplies the times (``1 / b``: per sample).

    ``relaxed``: each stage may take the fastest mode's time (``none``: recomputation only
    adds time) with the most memory-saving mode's capacity (``full``: it holds the most
    layers), a third of the evaluations for a bound no higher than the exact one (the search's
    degree level, where it rarely binds).
    """
    p = memory_config.pp
    time_modes = memory_modes = modes
    if relaxed and len(modes) > 1 and "none" in modes and "full" in modes:
        time_modes, memory_modes = ("none",), ("full",)
    elif len(modes) > 1 and "none" in modes and fastest_mode_fits(
            model, memory_config, most_layers, lo, hi):
        time_modes = memory_modes = ("none",)
    classes = stage_classes(cluster, time_config, cache)
    forms: dict[tuple[int, str], tuple[tuple[float, float], ...]] = {}
    for stage in set(classes):
        for mode in time_modes:
            at = [_micro_terms(model, cluster, time_config, stage, n, mode, framework,
                               calibration, cache) for n in ((lo, lo + 1) if hi > lo else (lo,))]
            forms[stage, mode] = tuple((first * time_scale, (last - first) * time_scale)
                                       for first, last in zip(at[0], at[-1]))
    exact = {}
    caps = {}
    for mode in memory_modes:
        for stage in sampled_stages(model, p):
            exact[stage] = most_layers(memory_config, stage, mode, lo, hi)
        caps[mode] = stage_caps(model, p, exact)
    rows = []
    for stage in range(p):
        if time_modes != memory_modes:  # relaxed: the fastest time, the most layers
            pieces = [(forms[classes[stage], time_modes[0]], caps[memory_modes[0]][stage])]
        else:
            pieces = [(forms[classes[stage], mode], caps[mode][stage]) for mode in modes
                      if mode in caps]
        rows.append((lo, [(form, cap) for form, cap in pieces if cap >= lo]))
    return split_bound(rows, model.num_layers)


def fastest_mode_fits(model: ModelSpec, memory_config: ParallelConfig, most_layers: Callable,
                      lo: int, hi: int) -> bool:
    """True when every sampled stage holds ``hi`` layers without recomputation: then no
    stage needs another mode, and ``capacity_bound`` over mode ``none`` alone is its value
    over every mode (recomputation only adds time: each mode's two-point form lies on or
    above ``none``'s from ``lo`` on), at a third of the evaluations."""
    return all(most_layers(memory_config, stage, "none", lo, hi) >= hi
               for stage in sampled_stages(model, memory_config.pp))


def micro_pieces(linear, zero_comm, zero_hidden, offload_raw, offload_hidden) -> tuple:
    """A stage's time per micro-batch (``composition.micro_total``) as the largest of three
    values: linear work, plus the ZeRO traffic's ``raw - hidden``, plus the offload
    traffic's (works on numbers and on (base, slope) pairs alike, term by term)."""
    zero, offload = zero_comm - zero_hidden, offload_raw - offload_hidden
    return (linear, linear + zero, linear + offload)


def _micro_terms(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, stage: int,
                 layers: int, mode: str, framework: str, calibration: Calibration,
                 cache: dict | None) -> tuple[float, ...]:
    """``micro_pieces`` of the stage at ``layers`` layers under ``mode`` (seconds)."""
    key = ("micro", config, stage, layers, mode)
    if cache is not None and key in cache:
        return cache[key]
    t = stage_micro_terms(model, cluster, config, stage, layers, mode, framework=framework,
                          calibration=calibration, cache=cache)
    value = micro_pieces(t.linear_s, t.zero_comm_s, t.zero_hidden_s, t.offload_raw_s,
                         t.offload_hidden_s)
    if cache is not None:
        cache[key] = value
    return value


def stage_micro_terms(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig,
                      stage: int, layers: int, mode: str, *, framework: str,
                      calibration: Calibration, cache: dict | None):
    """The stage's time per micro-batch by term (``estimate.stage_micro``) at ``layers``
    layers under ``mode``; cached by (config, stage, layers, mode), and read off the full
    terms ``search.bound`` keeps under (config, stage, layers) where those exist."""
    key = ("stage micro", config, stage, layers, mode)
    if cache is not None:
        hit = cache.get(key)
        if hit is not None:
            return hit
        full = cache.get((config, stage, layers)) if mode == "none" else None
        if full is not None:
            return full.micro
    micro = stage_micro(model, cluster, stage_config(config, model, stage, layers, mode), stage,
                        framework=framework, calibration=calibration)
    if cache is not None:
        cache[key] = micro
    return micro
