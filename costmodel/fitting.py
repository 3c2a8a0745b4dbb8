"""Turn measurements into a ``Calibration``: ``meshplan profile`` and ``validate --refit``.

Pure functions, no torch: the measurements come from ``runtime/profile_hw.py`` (profile) or a
run report (validate) as plain numbers.

* GEMM: ``t = flop / (peak * eff) + overhead`` (the cost model's ``_gemm_s`` for one call), an
  ordinary least-squares line of time against FLOPs: slope ``1 / (peak * eff)``, intercept
  ``overhead``.
* Collectives: the alpha-beta model of ``collectives.py`` (Thakur et al. 2005). For a group of
  ``n`` ranks on one node an operation on ``S`` bytes costs ``c_bw(op, n) * S / B + c_lat(op, n)
  * alpha``; one least-squares fit over all operations and sizes gives the achieved link
  bandwidth ``B`` and the one-hop latency ``alpha``.
* Refit: one multiplicative factor ``f`` on every compute and communication cost (efficiencies
  divided by ``f``, per-call overhead and link latency multiplied by it), found by a fixed-point
  iteration on the estimator itself so that the predicted step equals the measured one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from costmodel.calibration import Calibration, DeviceCalibration

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


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> LineFit:
    """Least-squares line through ``(xs, ys)``; ValueError with fewer than two distinct xs."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError(f"a line fit needs >= 2 distinct x values, got xs={list(xs)}")
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys))
    slope = sxy / sxx
    return LineFit(slope=slope, intercept=mean_y - slope * mean_x)


def clamp_efficiency(value: float) -> float:
    return min(MAX_EFFICIENCY, max(MIN_EFFICIENCY, value))


def fit_gemm(flop: Sequence[float], seconds: Sequence[float], *,
             peak_flop_per_s: float) -> tuple[float, float]:
    """(matmul_efficiency, matmul_overhead_s) from per-call GEMM times.

    Slope of time against FLOPs is ``1 / (peak * eff)``; the intercept, clamped at 0, is the
    fixed cost per call. The efficiency is not clamped here (a value above 1 means the
    catalog peak is too low); ``clamp_efficiency`` does that when writing a calibration.
    """
    line = fit_line(flop, seconds)
    if line.slope <= 0:
        best = max(f / s for f, s in zip(flop, seconds))
        return best / peak_flop_per_s, 0.0
    return 1.0 / (line.slope * peak_flop_per_s), max(0.0, line.intercept)


def collective_coefficients(op: str, n: int) -> tuple[float, float]:
    """(bytes factor, latency steps) of ``op`` over ``n`` ranks of one node, as
    ``collectives.py`` charges them: time = factor * S / B + steps * alpha."""
    if op == "all_reduce":
        ring = (2 * (n - 1) / n, 2 * (n - 1))
        tree = (2.0, 2 * math.log2(n))
        return min(ring, tree)
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n, min(n - 1, 2 * math.log2(n))
    if op == "send_recv":
        return 1.0, 1.0
    raise ValueError(f"unknown collective {op!r}; expected all_reduce, all_gather, "
                     "reduce_scatter or send_recv")


def fit_alpha_beta(samples: Sequence[tuple[str, int, float, float]]) -> tuple[float, float]:
    """(bytes_per_s, latency_s) of one link from ``(op, n, size_bytes, seconds)`` samples.

    Least squares of ``t = x1 * (c_bw S) + x2 * c_lat`` over two unknowns (``x1 = 1 / B``,
    ``x2 = alpha``), solved by the 2x2 normal equations; negative parts are clamped (a
    negative latency becomes 0 and the bandwidth is refitted through the origin; a
    non-positive ``1 / B``, from noise, falls back to the smallest per-sample ``t / (c_bw S)``).
    """
    rows = [(*_scaled(op, n, size), t) for op, n, size, t in samples]
    a11 = sum(u * u for u, _, _ in rows)
    a12 = sum(u * v for u, v, _ in rows)
    a22 = sum(v * v for _, v, _ in rows)
    b1 = sum(u * t for u, _, t in rows)
    b2 = sum(v * t for _, v, t in rows)
    det = a11 * a22 - a12 * a12
    if det <= 0:
        raise ValueError("collective samples need at least two different sizes")
    inv_bw, alpha = (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det
    if alpha < 0:
        inv_bw, alpha = b1 / a11, 0.0
    if inv_bw <= 0:  # noise hid the size dependence: the tightest bound from any one sample
        inv_bw = min(t / u for u, _, t in rows)
        alpha = max(0.0, sum((t - u * inv_bw) / v for u, v, t in rows) / len(rows))
    return 1.0 / inv_bw, alpha


def _scaled(op: str, n: int, size_bytes: float) -> tuple[float, float]:
    factor, steps = collective_coefficients(op, n)
    return factor * size_bytes, steps


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

    Efficiencies (matmul, attention, memory, link) are divided by ``factor`` and clamped to
    (0, 1]; GEMM overhead and link latencies (``*_latency_s``: the ones in force before the
    refit) are multiplied by it. Overlaps and traffic factors are left alone.
    """
    dev = calibration.device(gpu_key)
    device = DeviceCalibration(
        matmul_efficiency=clamp_efficiency(dev.matmul_efficiency / factor),
        matmul_overhead_s=dev.matmul_overhead_s * factor,
        attention_efficiency=clamp_efficiency(dev.attention_efficiency / factor),
        flash_attention_efficiency=clamp_efficiency(dev.flash_attention_efficiency / factor),
        memory_efficiency=clamp_efficiency(dev.memory_efficiency / factor))
    return dataclasses.replace(
        calibration, devices={**calibration.devices, gpu_key: device},
        nvlink_efficiency=clamp_efficiency(calibration.nvlink_efficiency / factor),
        network_efficiency=clamp_efficiency(calibration.network_efficiency / factor),
        link_latency_s={"intra": intra_latency_s * factor, "inter": inter_latency_s * factor})


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
class ProfileFit:
    """What ``meshplan profile`` fitted, in the units of the measurement."""

    matmul_flop_per_s: float
    """Asymptotic GEMM throughput (1 / slope of the time-vs-FLOP line)."""
    matmul_overhead_s: float
    memory_bytes_per_s: float
    link_bytes_per_s: float
    link_latency_s: float


def fit_profile(*, gemm: Sequence[tuple[float, float]], copy: tuple[float, float],
                collectives: Sequence[tuple[str, int, float, float]]) -> ProfileFit:
    """Fit the raw ``(flop, s)`` GEMM, ``(bytes, s)`` copy and collective samples."""
    line = fit_line([f for f, _ in gemm], [s for _, s in gemm])
    flop_per_s = 1 / line.slope if line.slope > 0 else max(f / s for f, s in gemm)
    link_bytes_per_s, latency_s = fit_alpha_beta(collectives)
    return ProfileFit(matmul_flop_per_s=flop_per_s, matmul_overhead_s=max(0.0, line.intercept),
                      memory_bytes_per_s=copy[0] / copy[1], link_bytes_per_s=link_bytes_per_s,
                      link_latency_s=latency_s)


def profiled_calibration(base: Calibration, fit: ProfileFit, *, gpu_key: str,
                         peak_flop_per_s: float, hbm_bytes_per_s: float,
                         link_bytes_per_s: float, note: str) -> Calibration:
    """``base`` with the device entry ``gpu_key``, ``nvlink_efficiency`` and the in-node
    ``link_latency_s`` taken from ``fit``, expressed against the catalog's peak FLOP/s, HBM
    and in-node link bandwidth (clamped to 1 where the measurement beats the catalog)."""
    device = profiled_device(base.device(gpu_key),
                             matmul_efficiency=fit.matmul_flop_per_s / peak_flop_per_s,
                             matmul_overhead_s=fit.matmul_overhead_s,
                             memory_efficiency=fit.memory_bytes_per_s / hbm_bytes_per_s)
    measured = (f"meshplan profile ({note}): GEMM {fit.matmul_flop_per_s / 1e9:.1f} GFLOP/s "
                f"(catalog peak {peak_flop_per_s / 1e9:.1f}), overhead "
                f"{fit.matmul_overhead_s * 1e6:.1f} us/call; copy "
                f"{fit.memory_bytes_per_s / 1e9:.1f} GB/s (catalog {hbm_bytes_per_s / 1e9:.1f});"
                f" collectives alpha {fit.link_latency_s * 1e6:.1f} us, beta "
                f"{fit.link_bytes_per_s / 1e9:.2f} GB/s (catalog link "
                f"{link_bytes_per_s / 1e9:.2f}). Efficiencies above 1 are clamped to 1.")
    return dataclasses.replace(
        base, devices={**base.devices, gpu_key: device},
        nvlink_efficiency=clamp_efficiency(fit.link_bytes_per_s / link_bytes_per_s),
        link_latency_s={**base.link_latency_s, "intra": fit.link_latency_s},
        source={**base.source, "profile": measured})
