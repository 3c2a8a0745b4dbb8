"""``Plan``: a chosen configuration with its predictions and provenance, and the plan file format.

The plan file (DESIGN.md) is one JSON object: the keys of the estimate's ``plan`` object at top
level (``tp``, ``pp``, ...; ``recompute`` a string or one entry per stage), plus ``framework``,
``model`` (the ModelSpec fields), ``cluster`` (the ClusterSpec fields, ``gpu`` nested),
``predicted`` (the whole ``estimate --json`` document for this plan), ``provenance`` (meshplan
version, calibration, solver status and wall time) and ``schema_version``. Readers reject
unknown and missing keys, naming them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from meshplan.costmodel import FRAMEWORKS, ClusterSpec, ModelSpec, ParallelConfig, check_fits_model
from meshplan.costmodel import schema
from meshplan.costmodel.estimate import Estimate, config_to_dict, estimate_to_dict
from meshplan.costmodel.hardware import cluster_from_dict
from meshplan.costmodel.models import spec_from_dict

SCHEMA_VERSION = schema.PLAN_FILE
CONFIG_KEYS = ("tp", "pp", "dp", "cp", "ep", "sp", "zero_stage", "offload", "offload_device",
               "recompute", "micro_batch_size", "global_batch_size", "grad_accum_steps", "vpp",
               "seq_len", "layers_per_stage", "mesh_order", "flash_attention", "dtype")
"""Plan keys at the top level of a plan file (``grad_accum_steps`` is derived, checked)."""
OTHER_KEYS = ("schema_version", "framework", "model", "cluster", "predicted", "provenance")
PLAN_FILE_KEYS = frozenset(CONFIG_KEYS + OTHER_KEYS)


def meshplan_version() -> str:
    try:
        return metadata.version("meshplan")
    except metadata.PackageNotFoundError:
        return "0+unknown"


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A configuration for ``model`` on ``cluster`` and what the cost model predicts for it."""

    config: ParallelConfig
    model: ModelSpec
    cluster: ClusterSpec
    framework: str
    predicted: dict[str, Any] = field(hash=False)
    """The ``estimate --json`` document of this configuration."""
    provenance: dict[str, Any] = field(hash=False)
    """meshplan version, calibration, solver status, wall time, rank among candidates."""

    @classmethod
    def from_estimate(cls, est: Estimate, *, provenance: dict[str, Any]) -> "Plan":
        return cls(config=est.config, model=est.model, cluster=est.cluster,
                   framework=est.framework, predicted=estimate_to_dict(est),
                   provenance={"meshplan_version": meshplan_version(), **provenance})

    @property
    def step_s(self) -> float:
        return float(self.predicted["time"]["step_s"])

    @property
    def peak_bytes(self) -> float:
        return float(self.predicted["memory"]["peak_bytes"])

    def to_dict(self) -> dict[str, Any]:
        cluster = dataclasses.asdict(self.cluster)
        cluster["gpu"] = dataclasses.asdict(self.cluster.gpu)
        return {"schema_version": SCHEMA_VERSION, **config_to_dict(self.config, self.model),
                "framework": self.framework, "model": self.model.to_dict(), "cluster": cluster,
                "predicted": self.predicted, "provenance": self.provenance}


def plan_from_dict(data: dict[str, Any], *, origin: str = "plan") -> Plan:
    """Read a plan-file object; ValueError naming unknown, missing or inconsistent keys."""
    if not isinstance(data, dict):
        raise ValueError(f"{origin}: a plan file holds one JSON object")
    unknown = sorted(set(data) - PLAN_FILE_KEYS)
    missing = sorted(PLAN_FILE_KEYS - set(data))
    if unknown:
        raise ValueError(f"{origin}: unknown keys {unknown}; a plan file has exactly "
                         f"{sorted(PLAN_FILE_KEYS)}")
    if missing:
        raise ValueError(f"{origin}: missing keys {missing}")
    if data["schema_version"] != SCHEMA_VERSION:
        raise ValueError(f"{origin}: schema_version {data['schema_version']!r} is not supported; "
                         f"this meshplan reads schema_version {SCHEMA_VERSION}")
    model = spec_from_dict(data["model"], origin=f"{origin} model") \
        if isinstance(data["model"], dict) else None
    if model is None:
        raise ValueError(f"{origin}: 'model' must be an object of ModelSpec fields")
    if not isinstance(data["cluster"], dict):
        raise ValueError(f"{origin}: 'cluster' must be an object of cluster fields")
    cluster_fields = dict(data["cluster"])
    cluster = cluster_from_dict(cluster_fields, name=str(cluster_fields.get("name", "cluster")))
    values = {k: data[k] for k in CONFIG_KEYS if k != "grad_accum_steps"}
    for key in ("recompute", "layers_per_stage", "mesh_order"):
        value = values[key]
        if key == "recompute" and isinstance(value, str):
            continue
        if not isinstance(value, list):
            raise ValueError(f"{origin}: '{key}' must be a list"
                             + (" or a string" if key == "recompute" else "")
                             + f", got {value!r}")
        values[key] = tuple(value)
    try:
        config = ParallelConfig(**values)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{origin}: {err}") from None
    if data["framework"] not in FRAMEWORKS:
        raise ValueError(f"{origin}: framework must be one of {', '.join(FRAMEWORKS)}, got "
                         f"{data['framework']!r}")
    try:
        check_fits_model(config, model, num_gpus=cluster.num_gpus)
    except ValueError as err:
        raise ValueError(f"{origin}: the plan does not fit its own model and cluster: "
                         f"{err}") from None
    if config.grad_accum_steps != data["grad_accum_steps"]:
        raise ValueError(f"{origin}: grad_accum_steps {data['grad_accum_steps']} does not equal "
                         f"global batch / (dp x micro-batch) = {config.grad_accum_steps}")
    for name in ("predicted", "provenance"):
        if not isinstance(data[name], dict):
            raise ValueError(f"{origin}: '{name}' must be an object")
    return Plan(config=config, model=model, cluster=cluster, framework=str(data["framework"]),
                predicted=data["predicted"], provenance=data["provenance"])


def read_plan(path: str | Path) -> Plan:
    from meshplan.costmodel.jsonio import read_json_object
    return plan_from_dict(read_json_object(path, what="plan"), origin=str(path))


def write_plan(plan: Plan, path: str | Path) -> None:
    Path(path).write_text(json.dumps(plan.to_dict(), indent=2) + "\n")
