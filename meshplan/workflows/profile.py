"""``profile``: measure this machine's compute, memory and links, and fit a calibration.

The measurement is ``meshplan.runtime.measure``, the fit ``meshplan.costmodel.fitting``;
this writes the calibration (``out``) and the raw timings with the fits (``measurements``).
Under torchrun every process joins the collectives; rank 0 fits and writes, the other ranks
get None. ``meshplan profile`` is this function plus printing::

    from meshplan.workflows.profile import profile
    result = profile(out="calibration.json", quick=True)
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshplan.costmodel import fitting
from meshplan.costmodel.calibration import Calibration, default_calibration
from meshplan.costmodel.config import CPU_DEVICE_KEY, default_dtype
from meshplan.costmodel.hardware import ClusterSpec, cluster_names, gpu_catalog, load_cluster
from meshplan.workflows.files import check_folder, write_calibration, write_json

if TYPE_CHECKING:
    from meshplan.runtime.measure import Measurements

PROFILE_TIMEOUT_S = 150.0
"""Limit on the collective measurement (the whole profile stays under 3 min)."""
FALLBACK_GPU = "a100-80gb"
"""Catalog GPU a device of unknown name (``default``) is expressed against."""
FALLBACK_CLUSTER = "dgx-a100-80gb"
"""Reference cluster when no catalog cluster has this device."""


@dataclass(frozen=True, kw_only=True)
class ProfileResult:
    """What one profile measured and fitted, and where it was written."""

    device_key: str
    """Calibration device entry written: ``cpu``, a GPU catalog key, or ``default``."""
    dtype: str
    measured: Measurements
    fit: fitting.ProfileFit
    catalog: fitting.CatalogRates
    """The catalog figures the fit is expressed against (efficiency = measured / these)."""
    calibration: Calibration
    out: str
    """The calibration file written."""
    measurements: str
    """The raw timings and fits file written."""
    wall_s: float


def measurements_path(out: str, measurements: str | None = None) -> str:
    """``measurements``, or ``out`` with ``-measurements`` before ``.json``."""
    return measurements or f"{os.path.splitext(out)[0]}-measurements.json"


def profile(*, out: str = "calibration.json", measurements: str | None = None,
            nproc_per_node: int | None = None, quick: bool = False, dtype: str | None = None,
            base: Calibration | None = None,
            cluster: ClusterSpec | None = None) -> ProfileResult | None:
    """Measure, fit, write ``out`` and ``measurements``; None on a torchrun rank other than 0.

    ``nproc_per_node``: local processes for the collectives (groups of 2, 4, ... K; default 2
    on the CPU, one per GPU up to 8; 1 skips them). ``dtype``: GEMM dtype (default fp32 on the
    CPU, bf16 on a GPU). ``base``: the calibration the measured values are written over
    (default: the built-in one). ``cluster``: whose NIC bandwidth the cross-node fit is
    expressed against (default: the first catalog cluster with this device). ValueError,
    before anything is measured, for a missing folder or fp16 on the CPU.
    """
    from meshplan.runtime import measure

    start = time.perf_counter()
    key = measure.device_key()
    gpu = gpu_catalog()[FALLBACK_GPU if key == "default" else key]
    cluster = cluster or load_cluster(next(
        (name for name in cluster_names() if load_cluster(name).gpu.key == gpu.key),
        FALLBACK_CLUSTER))
    raw_path = measurements_path(out, measurements)
    check_folder("--out", out)
    check_folder("--measurements", raw_path)
    dtype = dtype or default_dtype(key)
    if key == CPU_DEVICE_KEY and dtype == "fp16":
        raise ValueError("--dtype fp16 on the CPU: torch has no fast fp16 GEMM there (about "
                         "1 GFLOP/s here), the profile would take many minutes; use fp32 or bf16")
    measured = _measure(dtype=dtype, quick=quick, cuda=key != CPU_DEVICE_KEY,
                        nproc_per_node=nproc_per_node)
    if measured is None:  # a torchrun rank other than 0
        return None
    fit = fitting.fit_profile(gemm=measured.gemm, copy=measured.copy,
                              collectives=measured.collectives, host_copy=measured.host_copy,
                              host_adam=measured.host_adam, thin_gemm=measured.thin_gemm,
                              fresh_pages=measured.fresh_pages,
                              asynchronous=key != CPU_DEVICE_KEY, nvls=gpu.nvls_efficiency)
    catalog = fitting.CatalogRates(peak_flop_per_s=gpu.peak(dtype),
                                   hbm_bytes_per_s=gpu.hbm_bytes_per_s,
                                   link_bytes_per_s=gpu.nvlink_bytes_per_s,
                                   nic_bytes_per_s=cluster.nic_bytes_per_s)
    wall_s = time.perf_counter() - start
    note = _note(measured, key=key, dtype=dtype, quick=quick, wall_s=wall_s)
    calibration = fitting.profiled_calibration(base or default_calibration(), fit, gpu_key=key,
                                               catalog=catalog, note=note)
    calibration = dataclasses.replace(calibration, source={**calibration.source,
                                                           "topology": measured.topology})
    write_calibration(calibration, out, about=f"meshplan profile of this machine ({note}; "
                      f"topology: {measured.topology}); use with --calibration {out}")
    write_json(raw_path, {"about": f"raw timings and fits of {out}", "note": note,
                          "wall_s": wall_s, "measurements": measured.to_dict(),
                          "fit": fit.to_dict(), "catalog": dataclasses.asdict(catalog),
                          "reference_cluster": cluster.name})
    return ProfileResult(device_key=key, dtype=dtype, measured=measured, fit=fit,
                         catalog=catalog, calibration=calibration, out=out,
                         measurements=raw_path, wall_s=wall_s)


def _measure(*, dtype: str, quick: bool, cuda: bool,
             nproc_per_node: int | None) -> Measurements | None:
    """This process's device and the collectives: over local processes, or under torchrun
    over every process of the job (rank 0 gets the measurements, the others None)."""
    from meshplan.runtime import measure

    sizes = measure.sizes_for(quick=quick, cuda=cuda)
    distributed = measure.under_torchrun()
    nproc = 1 if distributed else measure.local_processes(nproc_per_node)
    progress = measure.Progress(
        measure.steps_of(sizes, collectives=distributed or nproc > 1),
        shown=not distributed or os.environ["RANK"] == "0")
    try:
        if distributed:
            return measure.measure_distributed(dtype=dtype, sizes=sizes,
                                                  timeout_s=PROFILE_TIMEOUT_S,
                                                  progress=progress)
        return measure.measure(dtype=dtype, sizes=sizes, nproc=nproc,
                                  timeout_s=PROFILE_TIMEOUT_S, progress=progress)
    finally:
        progress.close()


def _note(measured: Measurements, *, key: str, dtype: str, quick: bool, wall_s: float) -> str:
    """One line on how the profile was taken (it goes into the calibration's source)."""
    where = (f"{measured.nodes} nodes x {measured.procs_per_node}" if measured.nodes > 1
             else f"{measured.procs_per_node}")
    return (f"{'quick, ' if quick else ''}{key}, {dtype}, {where} "
            f"{measured.backend or 'no collective'} processes, {measured.samples_per_case} "
            f"samples per case, {wall_s:.0f} s")

