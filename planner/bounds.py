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
from meshplan.costmodel.estimate import stage_terms
from meshplan.costmodel.timing import stage_link_signature
from meshplan.planner.tables import stage_config

MIDDLE_SAMPLES = 6
"""Middle stages whose capacity ``capacity_bound`` evaluates (all of them when fewer)."""

Row = tuple[int, list[tuple[float, float, int]]]
"""One stage: its ``lo`` and, per usable mode, (base, slope >= 0, most layers that fit)."""


def split_bound(rows: list[Row], total_layers: int) -> tuple[float, float] | None:
    """(slowest stage, sum over stages) lower bounds of the per-micro-batch linear work of
    any split of ``total_layers`` layers over stages of ``rows`` (module docstring); None
    when the stages cannot hold the layers at all."""
    if any(not forms for _, forms in rows):
        return None
    if sum(max(f[2] for f in forms) for _, forms in rows) < total_layers:
        return None
    alike: dict[tuple, int] = {}  # identical stages, counted once each
    for lo, forms in rows:
        key = (lo, tuple(forms))
        alike[key] = alike.get(key, 0) + 1

    def held(limit: float) -> int:
        count = 0
        for (lo, forms), times in alike.items():
            most = 0
            for base, slope, fit in forms:
                if base > limit:
                    continue
                n = fit if slope == 0 else min(fit, lo + int((limit - base) // slope))
                most = max(most, n)
            count += times * most
        return count

    low = max(min(f[0] for f in forms) for _, forms in rows)
    high = max(f[0] + f[1] * (f[2] - lo) for lo, forms in rows for f in forms)
    if held(low) < total_layers:
        for _ in range(48):
            mid = (low + high) / 2
            if held(mid) >= total_layers:
                high = mid
            else:
                low = mid
    sums = sum(min(f[0] for f in forms) for _, forms in rows)
    slope = min(f[1] for _, forms in rows for f in forms)
    sums += slope * (total_layers - sum(lo for lo, _ in rows))
    return max(low, sums / len(rows)), sums


def stage_classes(cluster: ClusterSpec, config: ParallelConfig,
                  cache: dict | None = None) -> tuple[int, ...]:
    """Per stage, the first stage of its kind (first, last, communication links); cached by
    rank layout, which is all the links depend on."""
    key = ("classes", config.tp, config.cp, config.dp, config.pp, config.ep,
           tuple(config.mesh_order))
    if cache is not None and key in cache:
        return cache[key]
    p = config.pp
    firsts: dict[tuple, int] = {}
    out = tuple(firsts.setdefault((stage == 0, stage == p - 1,
                                   stage_link_signature(cluster, config, stage)), stage)
                for stage in range(p))
    if cache is not None:
        cache[key] = out
    return out


def uniform_layers(model: ModelSpec) -> bool:
    """Every layer of one kind (all dense or all MoE): what the stage-order argument needs."""
    return len({model.is_moe_layer(i) for i in range(model.num_layers)}) == 1


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
                   most_layers: Callable, cache: dict | None = None, time_scale: float = 1.0
                   ) -> tuple[float, float] | None:
    """``split_bound`` of a candidate with the capacities of ``memory_config`` and the linear
    work of ``time_config`` (seconds per micro-batch), or None when no split fits.

    For one candidate both are the candidate. For a family that differs only in ZeRO stage and
    offload, ``memory_config`` is its leanest member (no member holds more layers) and
    ``time_config`` any member (linear work does not depend on ZeRO or offload).
    ``most_layers(config, stage, mode, lo, hi)`` is the most layers the stage fits (the
    tables' exact rule). ``time_scale`` multiplies the linear work (``1 / b``: per sample).
    """
    p = memory_config.pp
    classes = stage_classes(cluster, time_config, cache)
    forms: dict[tuple[int, str], tuple[float, float]] = {}
    for stage in set(classes):
        for mode in modes:
            at = [_linear_s(model, cluster, time_config, stage, n, mode, framework,
                            calibration, cache) for n in ((lo, lo + 1) if hi > lo else (lo,))]
            forms[stage, mode] = (at[0] * time_scale,
                                  max(at[-1] - at[0], 0.0) * time_scale)
    exact = {}
    caps = {}
    for mode in modes:
        for stage in sampled_stages(model, p):
            exact[stage] = most_layers(memory_config, stage, mode, lo, hi)
        caps[mode] = stage_caps(model, p, exact)
    rows = []
    for stage in range(p):
        rows.append((lo, [(*forms[classes[stage], mode], caps[mode][stage]) for mode in modes
                          if caps[mode][stage] >= lo]))
    return split_bound(rows, model.num_layers)


def _linear_s(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, stage: int,
              layers: int, mode: str, framework: str, calibration: Calibration,
              cache: dict | None) -> float:
    key = ("linear", config, stage, layers, mode)
    if cache is not None:
        if key in cache:
            return cache[key]
        if mode == "none" and (config, stage, layers) in cache:  # ``search.bound``'s entry
            return cache[config, stage, layers].micro.linear_s
    value = stage_terms(model, cluster, stage_config(config, model, stage, layers, mode), stage,
                        framework=framework, calibration=calibration).micro.linear_s
    if cache is not None:
        cache[key] = value
    return value
