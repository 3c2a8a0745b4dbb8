"""meshplan's cost model: memory per GPU per pipeline stage and time per step.

Public entry points: ``load_model``, ``load_cluster``, ``ParallelConfig``, ``estimate``.
"""

from costmodel.calibration import Calibration, default_calibration, load_calibration
from costmodel.config import FRAMEWORKS, ParallelConfig, check_fits_model
from costmodel.estimate import Estimate, estimate, estimate_to_dict
from costmodel.hardware import ClusterSpec, GpuSpec, cluster_names, gpu_catalog, load_cluster
from costmodel.model import ModelSpec
from costmodel.models import load_model, model_catalog

__all__ = ["Calibration", "ClusterSpec", "Estimate", "FRAMEWORKS", "GpuSpec", "ModelSpec",
           "ParallelConfig", "check_fits_model", "cluster_names", "default_calibration",
           "estimate", "estimate_to_dict", "gpu_catalog", "load_calibration", "load_cluster",
           "load_model", "model_catalog"]
