"""meshplan's cost model: memory per GPU per pipeline stage and time per step.

Public entry points: ``load_model``, ``load_cluster``, ``ParallelConfig``, ``estimate``.

The names below are re-exported lazily (PEP 562): ``from meshplan.costmodel import
ParallelConfig`` imports ``config`` only, not the estimator and its dependencies, so the
plan-file type and ``meshplan --help`` stay light (DESIGN.md, "Shape").
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Calibration": "calibration", "default_calibration": "calibration",
    "load_calibration": "calibration",
    "FRAMEWORKS": "config", "ParallelConfig": "config",
    "check_fits_model": "layout",
    "Estimate": "estimate", "estimate": "estimate", "estimate_to_dict": "estimate",
    "ClusterSpec": "hardware", "GpuSpec": "hardware", "cluster_names": "hardware",
    "gpu_catalog": "hardware", "load_cluster": "hardware",
    "ModelSpec": "model",
    "load_model": "models", "model_catalog": "models",
}
"""Each public name and the submodule that defines it."""

__all__ = ["Calibration", "ClusterSpec", "Estimate", "FRAMEWORKS", "GpuSpec", "ModelSpec",
           "ParallelConfig", "check_fits_model", "cluster_names", "default_calibration",
           "estimate", "estimate_to_dict", "gpu_catalog", "load_calibration", "load_cluster",
           "load_model", "model_catalog"]

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports on use
    from meshplan.costmodel.calibration import Calibration, default_calibration, load_calibration
    from meshplan.costmodel.config import FRAMEWORKS, ParallelConfig
    from meshplan.costmodel.estimate import Estimate, estimate, estimate_to_dict
    from meshplan.costmodel.hardware import (ClusterSpec, GpuSpec, cluster_names, gpu_catalog,
                                             load_cluster)
    from meshplan.costmodel.layout import check_fits_model
    from meshplan.costmodel.model import ModelSpec
    from meshplan.costmodel.models import load_model, model_catalog


def _export(name: str) -> Any:
    module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
    return getattr(module, name)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = _export(name)
    if name != "estimate":  # the property of _Package below serves that one
        globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """This package's module type: ``estimate`` names both a submodule and the function this
    package exports. Importing the submodule binds it as the package's attribute ``estimate``
    (the import system's ``setattr``); the property keeps the attribute the function, as the
    eager ``from .estimate import estimate`` of 0.1 did."""

    @property
    def estimate(self) -> Any:
        return self.__dict__.get("_estimate_override") or _export("estimate")

    @estimate.setter
    def estimate(self, value: Any) -> None:
        if isinstance(value, types.ModuleType):  # the submodule, bound by the import system
            return
        self.__dict__["_estimate_override"] = value  # e.g. a test's monkeypatch


sys.modules[__name__].__class__ = _Package
