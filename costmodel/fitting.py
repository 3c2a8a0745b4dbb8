"""Turn measurements into a ``Calibration``: ``meshplan profile`` and ``validate --refit``.

Pure functions, no torch: the measurements come from ``runtime/measure.py`` (profile) or a
run report (validate) as plain numbers.

* GEMM: ``t = flop / (peak * eff) + overhead`` (the cost model's ``_gemm_s`` for one call), a
  least-squares line of time against FLOPs: slope ``1 / (peak * eff)``, intercept ``overhead``.
* Collectives: the alpha-beta model of ``collectives.py`` (Thakur et al. 2005), its one rule
  included. For a group of ``n`` ranks an operation on ``S`` bytes costs
  ``c_bw * S / B + c_lat * alpha`` with ``(c_bw, c_lat)`` the coefficients of the algorithm
  ``collectives.fastest`` picks for that size at ``B`` and ``alpha`` (small all-reduces take
  the double binary tree). One least-squares fit over all operations, group sizes and message
  sizes of one link kind (``intra``: inside a node, ``inter``: one rank per node) gives that
  link's achieved bandwidth ``B`` and one-hop latency ``alpha``; since the choice depends on
  the values being fitted, ``fit_alpha_beta`` alternates fit and choice until it is stable.
* Both profile fits weigh each sample by ``1 / t^2`` (relative residuals): times span three
  decades, and unweighted least squares lets the noise of the largest sizes set the intercept.
  On a GPU the GEMM fit leaves out the launch-bound sizes (``fit_gemm_rate``).
* Refit of one plan: one multiplicative factor ``f`` on every compute and communication cost
  (efficiencies divided by ``f``, per-call overheads and link latency multiplied by it), found
  by a fixed-point iteration on the estimator itself so that the predicted step equals the
  measured one.
* Refit of several plans (``refit_plans``): the compute factor, the seconds per collective
  call and per GEMM call (``RefitTerms``), by non-negative least squares of relative residuals
  over the plans. The estimator's step is piecewise linear in these terms, so slopes taken by
  finite differences on the estimator make each round an exact linear solve.

Why one module of ~500 lines: the profile fits and the refits are one job (numbers in, a
Calibration out) and share the relative weighting, the clamping of efficiencies and the
calibration builders; the solver of the several-plan refit is the last ~150 lines.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from meshplan.costmodel import collectives as coll
from meshplan.costmodel.calibration import Calibration, DeviceCalibration

MAX_EFFICIENCY = 1.0
"""Efficiencies are fractions of a catalog peak; a measurement above it is clamped here."""
MIN_EFFICIENCY = 1e-6
"""Smallest efficiency written (a calibration needs values in (0, 1])."""
REFIT_ITERATIONS = 8
"""Fixed-point steps of ``refit_step_scale``; each multiplies the factor by measured/predicted."""


@dataclass(frozen=True)
class LineFit:
    """``y = slope * x + intercept`` by ordinary least squares."""

    slope: float
    intercept: float


def fit_line(xs: Sequence[float], ys: Sequence[float],
             weights: Sequence[float] | None = None) -> LineFit:
    """Least-squares line through ``(xs, ys)``, point i weighted by ``weights[i]`` (default
    1); ValueError with fewer than two distinct xs."""
    if (len(xs) != len(ys) or len(set(xs)) < 2
            or (weights is not None and len(weights) != len(xs))):
        raise ValueError(f"a line fit needs >= 2 distinct x values (and one weight each), got "
                         f"xs={list(xs)}")
    w = [1.0] * len(xs) if weights is None else list(weights)
    total = sum(w)
    mean_x = sum(wi * x for wi, x in zip(w, xs)) / total
    mean_y = sum(wi * y for wi, y in zip(w, ys)) / total
    sxx = sum(wi * (x - mean_x) ** 2 for wi, x in zip(w, xs))
    sxy = sum(wi * (x - mean_x) * (y - mean_y) for wi, x, y in zip(w, xs, ys))
    slope = sxy / sxx
    return LineFit(slope=slope, intercept=mean_y - slope * mean_x)


def relative_weights(ys: Sequence[float]) -> list[float]:
    """``1 / y^2``: least squares with these weights minimises relative residuals, so a
    0.1 ms sample counts as much as a 10 ms one (timings spread over decades)."""
    if any(y <= 0 for y in ys):
        raise ValueError(f"relative weights need positive values, got {list(ys)}")
    return [1.0 / (y * y) for y in ys]


def clamp_efficiency(value: float) -> float:
    return min(MAX_EFFICIENCY, max(MIN_EFFICIENCY, value))


LAUNCH_BOUND_FACTOR = 4.0
"""On a device that queues kernels ahead of the host (a GPU), back-to-back GEMMs shorter than
the host's launch interval all take that interval, whatever their FLOPs: a sample within this
factor of the fastest one is taken as launch-bound and left out of the rate fit."""


def fit_gemm_rate(flop: Sequence[float], seconds: Sequence[float], *,
                  asynchronous: bool = False) -> tuple[float, float]:
    """(flop_per_s, overhead_s) of ``t = flop / rate + overhead`` from per-call GEMM times.

    Relative least squares (``relative_weights``): the small GEMMs, where the fixed cost is
    most of the time, pin the overhead; the large ones the rate. A negative intercept (noise)
    becomes 0 with the rate refitted through the origin; a non-positive slope falls back to
    the best single sample's rate.

    ``asynchronous`` (a GPU): the samples within ``LAUNCH_BOUND_FACTOR`` of the fastest are
    launch-bound, not ``flop / rate + overhead``, and are left out when at least two others
    remain. On an H200 (``benchmarks/results/profile-h200-2026-12-04-measurements.json``)
    512- to 2048-cubes took 16-26 us each, near-flat in FLOPs; fitted with them, the rate came
    out 915 TFLOP/s, where the 4096- and 8192-cubes run at 767-786.
    """
    if asynchronous:
        floor = min(seconds)
        kept = [(f, s) for f, s in zip(flop, seconds) if s >= LAUNCH_BOUND_FACTOR * floor]
        if len(kept) >= 2:
            flop, seconds = [f for f, _ in kept], [s for _, s in kept]
    weights = relative_weights(seconds)
    line = fit_line(flop, seconds, weights)
    if line.intercept < 0:
        slope = (sum(w * f * s for w, f, s in zip(weights, flop, seconds))
                 / sum(w * f * f for w, f in zip(weights, flop)))
        line = LineFit(slope=slope, intercept=0.0)
    if line.slope <= 0:
        return max(f / s for f, s in zip(flop, seconds)), 0.0
    return 1.0 / line.slope, line.intercept


def fit_gemm(flop: Sequence[float], seconds: Sequence[float], *,
             peak_flop_per_s: float) -> tuple[float, float]:
    """(matmul_efficiency, matmul_overhead_s) from per-call GEMM times (``fit_gemm_rate``).

    The efficiency is the fitted rate over ``peak_flop_per_s``, not clamped here (a value
    above 1 means the catalog peak is too low); ``clamp_efficiency`` does that when writing a
    calibration.
    """
    flop_per_s, overhead_s = fit_gemm_rate(flop, seconds)
    return flop_per_s / peak_flop_per_s, overhead_s


FIT_CHOICE_ROUNDS = 8
"""Most fit-then-choose rounds of ``fit_alpha_beta``. Only samples near a crossover (where
two algorithms cost nearly the same) change algorithm between rounds; over 400 random links,
group sizes, size ranges and up to 10 % noise the choice was stable after at most 3 fits."""


def collective_coefficients(op: str, n: int, size_bytes: float | None = None, *,
                            bytes_per_s: float | None = None,
                            latency_s: float | None = None) -> tuple[float, float]:
    """(bytes factor, latency steps) of ``op`` over ``n`` ranks as ``collectives.py`` charges
    it: time = factor * S / B + steps * alpha, for the algorithm ``collectives.fastest`` picks
    on ``size_bytes`` at ``bytes_per_s`` and ``latency_s``.

    Without a size: the algorithm that is fastest at every size (no more bytes and no more
    steps than any other candidate), e.g. the ring all-reduce of 2 ranks; ValueError where
    the choice depends on the size (an all-reduce of 3 or more ranks).
    """
    if size_bytes is not None:
        chosen = coll.fastest(op, n, size_bytes, bytes_per_s=bytes_per_s, latency_s=latency_s)
        return chosen.bytes_factor, chosen.latency_steps
    candidates = coll.algorithms(op, n)
    for a in candidates:
        if all(a.bytes_factor <= b.bytes_factor and a.latency_steps <= b.latency_steps
               for b in candidates):
            return a.bytes_factor, a.latency_steps
    raise ValueError(f"{op} over {n} ranks runs {' or '.join(a.name for a in candidates)} "
                     "depending on the message size; give size_bytes, bytes_per_s and latency_s")


def fit_alpha_beta(samples: Sequence[tuple[str, int, float, float]], *,
                   nvls: float = 0.0) -> tuple[float, float]:
    """(bytes_per_s, latency_s) of one link from ``(op, n, size_bytes, seconds)`` samples.
    ``nvls``: the GPU's NVLS efficiency for groups inside one node (``GpuSpec``), whose
    all-reduces the estimator may charge as NVLS (``collectives.algorithms``).

    Charges each sample as the estimator does (the algorithm ``collectives.fastest`` picks),
    which needs the very ``B`` and ``alpha`` being fitted, so it iterates: start every sample
    on its bandwidth-bound algorithm (fewest bytes, then fewest steps: the ring all-reduce),
    fit (``_fit_with``), re-choose each sample's algorithm at the fitted values, refit, until
    no choice changes, at most ``FIT_CHOICE_ROUNDS`` fits. If the choice still moves then
    (samples on a crossover), the fit whose estimator times (``collectives.collective_s``)
    have the smallest relative residual is returned. On samples the estimator itself made,
    the true link is a fixed point: its choice reproduces every sample exactly.
    """
    chosen = [min(coll.algorithms(op, n, 1, nvls),
                  key=lambda a: (a.bytes_factor, a.latency_steps)) for op, n, _, _ in samples]
    best: tuple[float, float, float] | None = None
    for _ in range(FIT_CHOICE_ROUNDS):
        bytes_per_s, latency_s = _fit_with(samples, chosen)
        again = [coll.fastest(op, n, size, bytes_per_s=bytes_per_s, latency_s=latency_s,
                              nvls=nvls) for op, n, size, _ in samples]
        if again == chosen:
            return bytes_per_s, latency_s
        residual = _relative_residual(samples, bytes_per_s=bytes_per_s, latency_s=latency_s,
                                      nvls=nvls)
        if best is None or residual < best[0]:
            best = (residual, bytes_per_s, latency_s)
        chosen = again
    return best[1], best[2]


def _relative_residual(samples: Sequence[tuple[str, int, float, float]], *,
                       bytes_per_s: float, latency_s: float, nvls: float = 0.0) -> float:
    """Sum of squared relative errors of the estimator's times (``collectives.collective_s``)."""
    return sum((coll.collective_s(op, n, size, bytes_per_s=bytes_per_s, latency_s=latency_s,
                                  nvls=nvls) / t - 1) ** 2 for op, n, size, t in samples)


def _fit_with(samples: Sequence[tuple[str, int, float, float]],
              chosen: Sequence[coll.Algorithm]) -> tuple[float, float]:
    """(bytes_per_s, latency_s) with each sample charged by its ``chosen`` algorithm.

    Relative least squares (``relative_weights``) of ``t = x1 * (c_bw S) + x2 * c_lat`` over
    two unknowns (``x1 = 1 / B``, ``x2 = alpha``), ``t`` less the algorithm's fixed latency
    (``Algorithm.fixed_latency_s``), solved by the 2x2 normal equations: the
    small messages pin the latency, the large ones the bandwidth. Negative parts are clamped
    (a negative latency becomes 0 and the bandwidth is refitted through the origin; a
    non-positive ``1 / B``, from noise, falls back to the smallest per-sample ``t / (c_bw S)``).
    """
    rows = [(a.bytes_factor * size, a.latency_steps, t - a.fixed_latency_s)
            for (_, _, size, t), a in zip(samples, chosen)]
    weights = relative_weights([t for _, _, _, t in samples])  # of the measured times
    a11 = sum(w * u * u for w, (u, _, _) in zip(weights, rows))
    a12 = sum(w * u * v for w, (u, v, _) in zip(weights, rows))
    a22 = sum(w * v * v for w, (_, v, _) in zip(weights, rows))
    b1 = sum(w * u * t for w, (u, _, t) in zip(weights, rows))
    b2 = sum(w * v * t for w, (_, v, t) in zip(weights, rows))
    det = a11 * a22 - a12 * a12
    if det <= 1e-12 * a11 * a22:
        raise ValueError("collective samples need at least two different sizes")
    inv_bw, alpha = (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det
    if alpha < 0:
        inv_bw, alpha = b1 / a11, 0.0
    if inv_bw <= 0:  # noise hid the size dependence: the tightest bound from any one sample
        inv_bw = min(t / u for u, _, t in rows if t > 0)
        stepped = [(u, v, t) for u, v, t in rows if v > 0]  # NVLS rows have no steps
        alpha = max(0.0, sum((t - u * inv_bw) / v for u, v, t in stepped)
                    / max(1, len(stepped)))
    return 1.0 / inv_bw, alpha


def profiled_device(base: DeviceCalibration, *, matmul_efficiency: float,
                    matmul_overhead_s: float, memory_efficiency: float) -> DeviceCalibration:
    """``base`` with measured GEMM and memory constants; attention efficiencies are not
    measured and keep their ratio to the matmul efficiency of ``base``."""
    ratio = clamp_efficiency(matmul_efficiency) / base.matmul_efficiency
    return dataclasses.replace(
        base, matmul_efficiency=clamp_efficiency(matmul_efficiency),
        matmul_overhead_s=matmul_overhead_s,
        attention_efficiency=clamp_efficiency(base.attention_efficiency * ratio),
        flash_attention_efficiency=clamp_efficiency(base.flash_attention_efficiency * ratio),
        memory_efficiency=clamp_efficiency(memory_efficiency))


def scaled_calibration(calibration: Calibration, *, gpu_key: str, factor: float,
                       intra_latency_s: float, inter_latency_s: float) -> Calibration:
    """Every compute and communication cost of ``calibration`` made ``factor`` times slower.

    Efficiencies (matmul, attention, memory, the eager ones where set, link) are divided by
    ``factor`` and clamped to (0, 1], and so are the device's measured rates (its AdamW
    step, its fresh pages); GEMM overhead, the per-op and per-call host costs, link latencies
    (``*_latency_s``: the ones in force before the refit) and the per-call collective cost
    are multiplied by it. Overlaps, traffic factors and the thin-GEMM row count (a shape, not
    a cost) are left alone.
    """
    dev = calibration.device(gpu_key)

    def slower(rate: float | None) -> float | None:
        return None if rate is None else rate / factor

    def lower(efficiency: float | None) -> float | None:
        return None if efficiency is None else clamp_efficiency(efficiency / factor)

    device = dataclasses.replace(
        dev, matmul_efficiency=lower(dev.matmul_efficiency),
        matmul_overhead_s=dev.matmul_overhead_s * factor,
        attention_efficiency=lower(dev.attention_efficiency),
        flash_attention_efficiency=lower(dev.flash_attention_efficiency),
        memory_efficiency=lower(dev.memory_efficiency),
        eager_matmul_efficiency=lower(dev.eager_matmul_efficiency),
        eager_flash_attention_efficiency=lower(dev.eager_flash_attention_efficiency),
        op_overhead_s=dev.op_overhead_s * factor, host_op_s=dev.host_op_s * factor,
        collective_call_s=dev.collective_call_s * factor,
        optimizer_params_per_s=slower(dev.optimizer_params_per_s),
        fresh_page_bytes_per_s=slower(dev.fresh_page_bytes_per_s))
    return dataclasses.replace(
        calibration, devices={**calibration.devices, gpu_key: device},
        nvlink_efficiency=clamp_efficiency(calibration.nvlink_efficiency / factor),
        network_efficiency=clamp_efficiency(calibration.network_efficiency / factor),
        link_latency_s={"intra": intra_latency_s * factor, "inter": inter_latency_s * factor},
        collective_call_s=calibration.collective_call_s * factor)


def refit_step_scale(predict_step_s: Callable[[float], float], *,
                     measured_step_s: float) -> float:
    """The factor ``f`` with ``predict_step_s(f) == measured_step_s`` (to a few per cent).

    Fixed point ``f <- f * measured / predict(f)`` from ``f = 1``: exact in one step when the
    prediction is proportional to ``f``; clamped efficiencies make it sub-linear, which the
    later steps correct.
    """
    if measured_step_s <= 0:
        raise ValueError(f"measured step time must be > 0, got {measured_step_s!r}")
    factor = 1.0
    for _ in range(REFIT_ITERATIONS):
        factor *= measured_step_s / predict_step_s(factor)
    return factor


@dataclass(frozen=True, kw_only=True)
class LinkFit:
    """Alpha-beta fit of one link kind."""

    bytes_per_s: float
    """Achieved bandwidth B (beta is 1 / B)."""
    latency_s: float
    """One-hop latency alpha."""
    group_sizes: tuple[int, ...]
    """Group sizes the samples came from."""


@dataclass(frozen=True, kw_only=True)
class ProfileFit:
    """What ``meshplan profile`` fitted, in the units of the measurement."""

    matmul_flop_per_s: float
    """Asymptotic GEMM throughput (``fit_gemm_rate``)."""
    matmul_overhead_s: float
    memory_bytes_per_s: float
    links: dict[str, LinkFit] = field(default_factory=dict, hash=False)
    """Per link kind measured: ``intra`` (inside a node), ``inter`` (across nodes)."""
    host_copy_bytes_per_s: dict[str, float] = field(default_factory=dict, hash=False)
    """Pinned host-device copy rate by direction (``h2d``, ``d2h``); empty without a GPU."""
    host_adam_params_per_s: dict[int, float] = field(default_factory=dict, hash=False)
    """Host AdamW parameters per second by thread count (the largest: the node's cores)."""
    gemm_half_rows: float | None = None
    """Rows at which a GEMM reaches half the asymptotic rate (``fit_half_rows``); None when
    no thin GEMM was timed (GPUs)."""
    fresh_page_bytes_per_s: float | None = None
    """Rate of zeroing freshly mapped memory; None when not timed (GPUs)."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def fit_half_rows(thin_gemm: Sequence[tuple[float, float, float]], *,
                  flop_per_s: float) -> float:
    """The ``h`` of ``rows / (rows + h)``, the share of the asymptotic GEMM rate
    ``flop_per_s`` a product with few rows reaches (``DeviceCalibration.gemm_half_rows``),
    from ``(rows, flop, s)`` samples: each gives ``h = rows (flop_per_s s / flop - 1)``; the
    median of them (at least a hundredth of a row: a sample at the full rate says only that
    ``h`` is small)."""
    if not thin_gemm:
        raise ValueError("no thin GEMM samples")
    each = sorted(max(0.01, rows * (flop_per_s * s / flop - 1)) for rows, flop, s in thin_gemm)
    return each[len(each) // 2]


def fit_profile(*, gemm: Sequence[tuple[float, float]], copy: tuple[float, float],
                collectives: Sequence[tuple[str, str, int, float, float]] = (),
                host_copy: Sequence[tuple[str, float, float]] = (),
                host_adam: Sequence[tuple[int, int, float]] = (),
                thin_gemm: Sequence[tuple[float, float, float]] = (),
                fresh_pages: Sequence[float] = (),
                asynchronous: bool = False, nvls: float = 0.0) -> ProfileFit:
    """Fit raw ``(flop, s)`` GEMM, ``(bytes, s)`` copy, ``(link, op, n, size_bytes, s)``
    collective and ``(direction, bytes, s)`` host-copy samples; one alpha-beta fit per link
    kind present; ``(rows, flop, s)`` thin GEMMs (``fit_half_rows``) and the ``(bytes, s)``
    of zeroing fresh pages where timed. ``asynchronous``: the device queues kernels (a GPU;
    ``fit_gemm_rate``). ``nvls``: the GPU's NVLS efficiency, for the ``intra`` link's groups
    (``fit_alpha_beta``)."""
    flop_per_s, overhead_s = fit_gemm_rate([f for f, _ in gemm], [s for _, s in gemm],
                                           asynchronous=asynchronous)
    links = {}
    for link in sorted({row[0] for row in collectives}):
        rows = [(op, n, size, s) for kind, op, n, size, s in collectives if kind == link]
        bytes_per_s, latency_s = fit_alpha_beta(rows, nvls=nvls if link == "intra" else 0.0)
        links[link] = LinkFit(bytes_per_s=bytes_per_s, latency_s=latency_s,
                              group_sizes=tuple(sorted({n for _, n, _, _ in rows})))
    return ProfileFit(matmul_flop_per_s=flop_per_s, matmul_overhead_s=overhead_s,
                      memory_bytes_per_s=copy[0] / copy[1], links=links,
                      host_copy_bytes_per_s={way: b / s for way, b, s in host_copy},
                      host_adam_params_per_s={t: n / s for t, n, s in host_adam},
                      gemm_half_rows=(fit_half_rows(thin_gemm, flop_per_s=flop_per_s)
                                      if thin_gemm else None),
                      fresh_page_bytes_per_s=(fresh_pages[0] / fresh_pages[1]
                                              if fresh_pages else None))


@dataclass(frozen=True, kw_only=True)
class CatalogRates:
    """The catalog figures a profile is expressed against (efficiency = measured / these)."""

    peak_flop_per_s: float
    hbm_bytes_per_s: float
    link_bytes_per_s: float
    """In-node GPU-to-GPU bandwidth (the ``intra`` link)."""
    nic_bytes_per_s: float
    """One NIC of the reference cluster (the ``inter`` link, one rank per node)."""


PINNED_COPY_WAYS = ("h2d", "d2h")
"""``ProfileFit.host_copy_bytes_per_s`` keys of pinned host-device copies."""
PAGEABLE_COPY_WAY = "d2h_pageable"
"""The key of the blocking device-to-host copy into fresh pageable memory
(``measure.time_host_copies``): the calibration's ``pageable`` rate."""


def profiled_calibration(base: Calibration, fit: ProfileFit, *, gpu_key: str,
                         catalog: CatalogRates, note: str) -> Calibration:
    """``base`` with the device entry ``gpu_key`` and, per measured link, its efficiency
    (``intra``: ``nvlink_efficiency``, ``inter``: ``network_efficiency``) and
    ``link_latency_s`` taken from ``fit``, against ``catalog`` (clamped to 1 where the
    measurement beats the catalog), and the measured pinned host-device rate as
    ``host_copy_bytes_per_s["pinned"]`` (the pageable device-to-host rate, where measured, as
    ``["pageable"]``), and the host AdamW rate on the node's cores as
    ``host_memory_bytes_per_s[gpu_key]`` (that rate times ``host_adam_bytes_per_param``: the
    cost model's offloaded optimizer step is that traffic over that bandwidth), and the thin
    GEMMs' ``gemm_half_rows`` and the ``fresh_page_bytes_per_s`` where measured (the CPU).
    Links and values not measured keep ``base``'s."""
    device = profiled_device(base.device(gpu_key),
                             matmul_efficiency=fit.matmul_flop_per_s / catalog.peak_flop_per_s,
                             matmul_overhead_s=fit.matmul_overhead_s,
                             memory_efficiency=fit.memory_bytes_per_s / catalog.hbm_bytes_per_s)
    measured = {name: getattr(fit, name) for name in ("gemm_half_rows", "fresh_page_bytes_per_s")
                if getattr(fit, name) is not None}
    device = dataclasses.replace(device, **measured)
    efficiency = {"intra": ("nvlink_efficiency", catalog.link_bytes_per_s),
                  "inter": ("network_efficiency", catalog.nic_bytes_per_s)}
    links = {efficiency[k][0]: clamp_efficiency(v.bytes_per_s / efficiency[k][1])
             for k, v in fit.links.items()}
    host_copy = dict(base.host_copy_bytes_per_s)
    pinned = [rate for way, rate in fit.host_copy_bytes_per_s.items()
              if way in PINNED_COPY_WAYS]
    if pinned:  # pinned buffers, both directions: the slower binds
        host_copy["pinned"] = min(pinned)
    if PAGEABLE_COPY_WAY in fit.host_copy_bytes_per_s:
        host_copy["pageable"] = fit.host_copy_bytes_per_s[PAGEABLE_COPY_WAY]
    host_memory = dict(base.host_memory_bytes_per_s)
    if fit.host_adam_params_per_s:  # the node's cores: the host step of optimizer offload
        rate = fit.host_adam_params_per_s[max(fit.host_adam_params_per_s)]
        host_memory[gpu_key] = rate * base.host_adam_bytes_per_param
    return dataclasses.replace(
        base, devices={**base.devices, gpu_key: device}, **links,
        host_copy_bytes_per_s=host_copy, host_memory_bytes_per_s=host_memory,
        link_latency_s={**base.link_latency_s,
                        **{k: v.latency_s for k, v in fit.links.items()}},
        source={**base.source, "profile": profile_summary(fit, catalog=catalog, note=note)})


def profile_summary(fit: ProfileFit, *, catalog: CatalogRates, note: str) -> str:
    """One paragraph of what was measured, next to the catalog figures."""
    parts = [f"meshplan profile ({note}): GEMM {fit.matmul_flop_per_s / 1e9:.1f} GFLOP/s "
             f"(catalog peak {catalog.peak_flop_per_s / 1e9:.1f}), overhead "
             f"{fit.matmul_overhead_s * 1e6:.2f} us/call; copy "
             f"{fit.memory_bytes_per_s / 1e9:.1f} GB/s (catalog "
             f"{catalog.hbm_bytes_per_s / 1e9:.1f})"]
    parts += [f"host-device {way} {rate / 1e9:.1f} GB/s"
              for way, rate in fit.host_copy_bytes_per_s.items()]
    parts += [f"host AdamW {rate / 1e6:.0f} M params/s on {threads} thread"
              f"{'s' if threads > 1 else ''}"
              for threads, rate in sorted(fit.host_adam_params_per_s.items())]
    if fit.gemm_half_rows is not None:
        parts.append(f"thin GEMMs at half that rate at {fit.gemm_half_rows:.1f} rows")
    if fit.fresh_page_bytes_per_s is not None:
        parts.append(f"fresh pages {fit.fresh_page_bytes_per_s / 1e9:.2f} GB/s")
    reference = {"intra": ("catalog link", catalog.link_bytes_per_s),
                 "inter": ("catalog NIC", catalog.nic_bytes_per_s)}
    parts += [f"{kind} collectives (groups of {', '.join(map(str, link.group_sizes))}) alpha "
              f"{link.latency_s * 1e6:.1f} us, beta {link.bytes_per_s / 1e9:.2f} GB/s "
              f"({reference[kind][0]} {reference[kind][1] / 1e9:.2f})"
              for kind, link in fit.links.items()]
    return "; ".join(parts) + ". Efficiencies above 1 are clamped to 1."


# ----- validate --refit over several plans -------------------------------------------------------
REFIT_TERMS = ("compute_factor", "collective_call_s", "gemm_call_s")
"""The constants a several-plan refit fits (``RefitTerms``), in the order it frees them: with
two plans the compute factor and the per-collective cost, the per-GEMM cost from three."""
REFIT_ROUNDS = 4
"""Linearise-and-solve rounds of ``refit_plans``: the step is piecewise linear in the terms, so
one round is exact unless a bottleneck stage or an overlap switches under the new values."""
REFIT_MIN_SINGULAR = 1e-3
"""Smallest singular value, relative to the largest, of the normalised slope matrix of the
freed terms; below it the plans cannot tell two terms apart and the last one is kept as is."""
_SLOPE_STEP = 1e-3
"""Relative step of the finite-difference slopes."""
_TERM_SCALE = {"compute_factor": 1.0, "gemm_call_s": 1e-5, "collective_call_s": 1e-4}
"""Typical size of each term: the finite-difference step and column scale for a zero term."""


@dataclass(frozen=True, kw_only=True)
class RefitTerms:
    """What a refit over several plans fits; the predicted step is linear in each term."""

    compute_factor: float
    """Multiplier of FLOP- and byte-bound compute time (``Calibration.framework_compute_factor``
    of the plans' framework)."""
    collective_call_s: float
    """``Calibration.collective_call_s``: fixed cost per latency step of a collective call."""
    gemm_call_s: float
    """Seconds charged per GEMM call, ``compute_factor * matmul_overhead_s``: in eager mode on a
    CPU, the host work (Python, dispatcher, autograd, element-wise ops) around each GEMM."""

    def __post_init__(self) -> None:
        if not self.compute_factor > 0:
            raise ValueError(f"compute_factor must be > 0, got {self.compute_factor!r}")
        for name in ("gemm_call_s", "collective_call_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")

    def values(self) -> tuple[float, float, float]:
        """The terms in ``REFIT_TERMS`` order."""
        return tuple(getattr(self, name) for name in REFIT_TERMS)


def refit_terms_of(calibration: Calibration, *, gpu_key: str, framework: str) -> RefitTerms:
    """The ``RefitTerms`` that ``calibration`` implies for ``gpu_key`` and ``framework``."""
    factor = calibration.compute_factor(framework)
    return RefitTerms(compute_factor=factor,
                      gemm_call_s=factor * calibration.device(gpu_key).matmul_overhead_s,
                      collective_call_s=calibration.collective_call_s)


def with_refit_terms(calibration: Calibration, terms: RefitTerms, *, gpu_key: str,
                     framework: str) -> Calibration:
    """``calibration`` with ``terms`` written into the device entry ``gpu_key``, the compute
    factor of ``framework`` and ``collective_call_s``; everything else unchanged."""
    device = dataclasses.replace(calibration.device(gpu_key),
                                 matmul_overhead_s=terms.gemm_call_s / terms.compute_factor)
    return dataclasses.replace(
        calibration, devices={**calibration.devices, gpu_key: device},
        framework_compute_factor={**calibration.framework_compute_factor,
                                  framework: terms.compute_factor},
        collective_call_s=terms.collective_call_s)


def refit_plans(predict_s: Callable[[RefitTerms], Sequence[float]], *,
                measured_s: Sequence[float], start: RefitTerms) -> RefitTerms:
    """Terms with which the predicted steps of several plans best match their measured steps.

    Minimises ``sum_i (predicted_i / measured_i - 1)^2`` (relative residuals: a 20 ms plan
    counts as much as a 300 ms one) with every term >= 0. ``predict_s`` is the estimator's
    step of each plan under given terms; it is piecewise linear in them, so each of
    ``REFIT_ROUNDS`` rounds takes finite-difference slopes at the current terms and solves
    the linear problem exactly (``_nonnegative_lstsq``). Only terms the plans determine are
    freed (``free_terms``): at most one per plan, in ``REFIT_TERMS`` order; the others keep
    their ``start`` value.
    """
    measured = np.asarray(measured_s, dtype=float)
    if measured.ndim != 1 or not len(measured) or np.any(measured <= 0):
        raise ValueError(f"measured steps must be seconds > 0, got {list(measured_s)}")
    terms = start
    for _ in range(REFIT_ROUNDS):
        base = np.asarray(predict_s(terms), dtype=float)
        slopes = _slopes(predict_s, terms, base)
        free = free_terms(slopes / measured[:, None])
        if not free:
            return terms
        x = np.array(terms.values())
        offset = base - slopes @ x  # prediction = offset + slopes @ x on this linear piece
        solved = _nonnegative_lstsq(slopes[:, free] / measured[:, None],
                                    1 - (offset + slopes @ _zeroed(x, free)) / measured)
        x[free] = solved
        if x[0] <= 0:
            raise ValueError("the measured steps leave no time for compute (compute_factor "
                             "fitted to 0); check the plans and their measurements")
        terms = RefitTerms(**dict(zip(REFIT_TERMS, x)))
    return terms


def _zeroed(x: np.ndarray, free: list[int]) -> np.ndarray:
    out = x.copy()
    out[free] = 0.0
    return out


def _slopes(predict_s: Callable[[RefitTerms], Sequence[float]], terms: RefitTerms,
            base: np.ndarray) -> np.ndarray:
    """d prediction_i / d term_j by forward differences (columns in ``REFIT_TERMS`` order)."""
    x = np.array(terms.values())
    columns = []
    for j, name in enumerate(REFIT_TERMS):
        step = _SLOPE_STEP * max(abs(x[j]), _TERM_SCALE[name])
        moved = x.copy()
        moved[j] += step
        shifted = np.asarray(predict_s(RefitTerms(**dict(zip(REFIT_TERMS, moved)))), dtype=float)
        columns.append((shifted - base) / step)
    return np.stack(columns, axis=1)


def free_terms(relative_slopes: np.ndarray) -> list[int]:
    """Indices of the terms a refit can determine from these plans.

    ``relative_slopes[i, j]``: change of plan i's predicted/measured ratio per unit of term
    j. A term no plan depends on is skipped; the others are taken in ``REFIT_TERMS`` order,
    at most one per plan, while the normalised columns stay independent
    (``REFIT_MIN_SINGULAR``).
    """
    plans, _ = relative_slopes.shape
    chosen: list[int] = []
    for j in range(relative_slopes.shape[1]):
        if len(chosen) == plans or not np.any(relative_slopes[:, j]):
            continue
        trial = relative_slopes[:, chosen + [j]]
        trial = trial / np.linalg.norm(trial, axis=0)
        singular = np.linalg.svd(trial, compute_uv=False)
        if singular[-1] >= REFIT_MIN_SINGULAR * singular[0]:
            chosen.append(j)
    return chosen


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``argmin ||a x - b||`` over ``x >= 0`` for a few unknowns: the best unconstrained
    solution over every subset of unknowns, the rest held at 0, that is non-negative."""
    n = a.shape[1]
    best, best_cost = np.zeros(n), float(b @ b)
    for size in range(1, n + 1):
        for subset in itertools.combinations(range(n), size):
            cols = list(subset)
            x_sub, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.any(x_sub < 0):
                continue
            x = np.zeros(n)
            x[cols] = x_sub
            cost = float(np.sum((a @ x - b) ** 2))
            if cost < best_cost - 1e-15:
                best, best_cost = x, cost
    return best
