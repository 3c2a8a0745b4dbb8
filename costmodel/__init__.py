"""meshplan's cost model: memory per GPU per pipeline stage and time per step.

Public entry points: ``load_model``, ``load_cluster``, ``ParallelConfig``, ``estimate``.
"""

from meshplan.costmodel.calibration import Calibration, default_calibration, load_calibration
from meshplan.costmodel.config import FRAMEWORKS, ParallelConfig
from meshplan.costmodel.layout import check_fits_model
from meshplan.costmodel.estimate import Estimate, estimate, estimate_to_dict
from meshplan.costmodel.hardware import ClusterSpec, GpuSpec, cluster_names, gpu_catalog, load_cluster
from meshplan.costmodel.model import ModelSpec
from meshplan.costmodel.models import load_model, model_catalog

__all__ = ["Calibration", "ClusterSpec", "Estimate", "FRAMEWORKS", "GpuSpec", "ModelSpec",
           "ParallelConfig", "check_fits_model", "cluster_names", "default_calibration",
           "estimate", "estimate_to_dict", "gpu_catalog", "load_calibration", "load_cluster",
           "load_model", "model_catalog"]
