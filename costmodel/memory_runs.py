"""Measured peak memory of training runs (``data/memory_runs.json``) against the memory model.

Each run names a model (a catalog name, or an object of ModelSpec fields), a cluster, a framework and a ``ParallelConfig``, and what was measured:
the caching allocator's reserved peak (torchtitan's logged ``max_reserved``), the peak of live
tensor bytes (meshplan's runtime report), or only whether the run fit on its GPUs. ``compare``
turns one into the prediction of the same quantity; ``benchmarks/memory_accuracy.py`` prints
the table and ``tests/costmodel/test_framework_memory.py`` holds the model to it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from meshplan.costmodel.calibration import Calibration, default_calibration
from meshplan.costmodel.config import ParallelConfig
from meshplan.costmodel.estimate import estimate
from meshplan.costmodel.hardware import ClusterSpec, load_cluster
from meshplan.costmodel.jsonio import read_package_json
from meshplan.costmodel.model import ModelSpec
from meshplan.costmodel.models import load_model, spec_from_dict

GIB = 2**30
MEASURES = ("peak_reserved_GiB", "peak_allocated_bytes", "fits")
"""What a run's ``measured`` object may give (one of them)."""


@dataclass(frozen=True)
class MemoryRun:
    """One measured run."""

    id: str
    framework: str
    model: ModelSpec
    cluster: ClusterSpec
    config: ParallelConfig
    stage: int | None
    """Pipeline stage of the measured rank; None: the largest over stages."""
    measure: str
    """One of ``MEASURES``."""
    measured: float | bool
    """Bytes (``peak_reserved_GiB`` is converted to bytes) or, for ``fits``, a bool."""
    source: str


@dataclass(frozen=True)
class MemoryComparison:
    run: MemoryRun
    predicted: float | bool
    """Bytes of the measured quantity, or the estimate's ``fits``."""

    @property
    def error(self) -> float | None:
        """predicted / measured - 1 (positive: over-predicted); None for fit checks."""
        if self.run.measure == "fits":
            return None
        return float(self.predicted) / float(self.run.measured) - 1


@functools.cache
def memory_runs() -> tuple[MemoryRun, ...]:
    return tuple(_run_from_dict(raw) for raw in read_package_json("memory_runs.json")["runs"])


def _run_from_dict(raw: dict[str, Any]) -> MemoryRun:
    measured = raw["measured"]
    (measure,) = (key for key in MEASURES if key in measured)
    value = measured[measure]
    if measure == "peak_reserved_GiB":
        value = float(value) * GIB
    model = raw["model"]
    model = load_model(model) if isinstance(model, str) else \
        spec_from_dict(model, origin=f"memory_runs.json, run {raw['id']}")
    return MemoryRun(id=raw["id"], framework=raw["framework"], model=model,
                     cluster=load_cluster(raw["cluster"], nodes=raw["nodes"],
                                          gpus_per_node=raw["gpus_per_node"]),
                     config=ParallelConfig(**raw["config"]), stage=raw.get("stage"),
                     measure=measure, measured=value, source=raw["source"])


def compare(run: MemoryRun, calibration: Calibration | None = None) -> MemoryComparison:
    """The model's prediction of what ``run`` measured.

    Reserved peaks are compared with the allocator's part of the predicted reserve: the
    model's ``reserved_bytes`` less the communicator buffers, which NCCL allocates itself,
    outside torch's ``reserved_bytes``.
    """
    cal = calibration or default_calibration()
    est = estimate(run.model, run.cluster, run.config, framework=run.framework, calibration=cal)
    if run.measure == "fits":
        return MemoryComparison(run=run, predicted=est.fits)
    stages = est.memory.per_stage if run.stage is None else (est.memory.per_stage[run.stage],)
    if run.measure == "peak_reserved_GiB":
        comm = cal.communicator_bytes if run.config.world_size > 1 else 0.0
        return MemoryComparison(run=run, predicted=max(s.reserved_bytes for s in stages) - comm)
    return MemoryComparison(run=run, predicted=max(s.peak_bytes for s in stages))
