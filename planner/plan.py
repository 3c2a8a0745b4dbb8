"""``Plan``: a chosen configuration with its predictions and provenance, and the plan file format.

The plan file (DESIGN.md) is one JSON object: the keys of the estimate's ``plan`` object at top
level (``tp``, ``pp``, ...; ``recompute`` a string or one entry per stage), plus ``framework``,
``model`` (the ModelSpec fields), ``cluster`` (the ClusterSpec fields, ``gpu`` nested),
``predicted`` (the whole ``estimate --json`` document for this plan), ``provenance`` (meshplan
version, calibration, solver status and wall time) and ``schema_version``. Readers reject
unknown and missing keys, naming them.

A ``Plan`` holds the configuration once (``config``) and the prediction typed
(``prediction``: ``costmodel.prediction.Prediction``); ``to_dict`` writes both copies the
contract asks for, and ``plan_from_dict`` checks that ``predicted``'s copy of the
configuration, framework, model and cluster agrees with the top level.
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
from meshplan.costmodel.config import (COMPILE_MODES, DTYPES, MESH_AXES, OFFLOAD_DEVICES,
                                       OFFLOAD_MODES, RECOMPUTE_MODES)
from meshplan.costmodel.estimate import (OPTIONAL_PLAN_KEYS, Estimate, config_to_dict,
                                         estimate_to_dict)
from meshplan.costmodel.hardware import MAX_GPUS, cluster_from_dict
from meshplan.costmodel.jsonio import (Limit, Rule, check_object, count, load_json_document,
                                       schema_of)
from meshplan.costmodel.model import MAX_LAYERS, MAX_SEQ_LEN
from meshplan.costmodel.models import spec_from_dict
from meshplan.costmodel.prediction import Prediction, prediction_from_dict
from meshplan.planner.space import check_pins

SCHEMA_VERSION = schema.PLAN_FILE
CONFIG_KEYS = ("tp", "pp", "dp", "cp", "ep", "sp", "zero_stage", "offload", "offload_device",
               "recompute", "micro_batch_size", "global_batch_size", "grad_accum_steps", "vpp",
               "seq_len", "layers_per_stage", "mesh_order", "flash_attention", "dtype")
"""Plan keys at the top level of a plan file (``grad_accum_steps`` is derived, checked)."""
OPTIONAL_CONFIG_KEYS = OPTIONAL_PLAN_KEYS
"""Configuration keys a plan file holds only when they differ from the default (torchtitan's
selective policy, early-stopping recomputation, torch.compile and float8 training), so older
plan files still read. Their JSON types are ``ParallelConfig``'s (``PLAN_FILE_SCHEMA``)."""
OTHER_KEYS = ("schema_version", "framework", "model", "cluster", "predicted", "provenance")
PLAN_FILE_KEYS = frozenset(CONFIG_KEYS + OTHER_KEYS)
MAX_GLOBAL_BATCH = 2**24
"""Sequences per step (and per micro-batch): 16,777,216, thousands of times the largest
published batches (GPT-3: 1,536; Llama 3 405B: 2,048 of 8K tokens). ``explain`` enumerates the
micro-batch sizes that divide the global batch, so it must be bounded."""
_DEGREE = count(MAX_GPUS, "MAX_GPUS")
_BATCH = count(MAX_GLOBAL_BATCH, "MAX_GLOBAL_BATCH")
PLAN_FILE_SCHEMA = schema_of(
    ParallelConfig, name="plan file", required=PLAN_FILE_KEYS,
    limits={"tp": _DEGREE, "pp": _DEGREE, "dp": _DEGREE, "cp": _DEGREE, "ep": _DEGREE,
            "zero_stage": Limit(choices=(0, 1, 2, 3)), "offload": Limit(choices=OFFLOAD_MODES),
            "offload_device": Limit(choices=OFFLOAD_DEVICES),
            "recompute": Limit(choices=RECOMPUTE_MODES), "micro_batch_size": _BATCH,
            "global_batch_size": _BATCH, "vpp": count(MAX_LAYERS, "MAX_LAYERS"),
            "seq_len": count(MAX_SEQ_LEN, "MAX_SEQ_LEN"),
            "layers_per_stage": count(MAX_LAYERS, "MAX_LAYERS"),
            "mesh_order": Limit(choices=MESH_AXES), "dtype": Limit(choices=DTYPES),
            "compile": Limit(choices=COMPILE_MODES)},
    rules={"layers_per_stage": Rule(kind="list", items=Rule(kind="int")),
           "grad_accum_steps": Rule(kind="int", limit=_BATCH),
           "schema_version": Rule(kind="int"),
           "framework": Rule(kind="str", limit=Limit(choices=FRAMEWORKS)),
           "model": Rule(kind="object"), "cluster": Rule(kind="object"),
           "predicted": Rule(kind="object"), "provenance": Rule(kind="object")})
"""The top level of a plan file: exactly ``PLAN_FILE_KEYS``, the configuration keys typed as
``ParallelConfig``'s fields (``layers_per_stage`` always a list). ``model``, ``cluster`` and
``predicted`` are checked by their own readers."""
_CLUSTER_SUMMARY = ("name", "gpu", "nodes", "gpus_per_node", "num_gpus")
"""Keys of the estimate's ``cluster`` object, compared with the plan file's ``cluster``."""


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
    prediction: Prediction
    """What the cost model predicts for ``config`` (memory per stage, time terms, throughput);
    the configuration itself is ``config``, held once."""
    provenance: dict[str, Any] = field(hash=False)
    """meshplan version, calibration, solver status, wall time, rank among candidates."""

    @classmethod
    def from_estimate(cls, est: Estimate, *, provenance: dict[str, Any]) -> "Plan":
        return cls(config=est.config, model=est.model, cluster=est.cluster,
                   framework=est.framework, prediction=Prediction.of(est),
                   provenance={"meshplan_version": meshplan_version(), **provenance})

    @property
    def estimate(self) -> Estimate:
        """The prediction as the ``Estimate`` of this plan's configuration."""
        return self.prediction.estimate(model=self.model, cluster=self.cluster,
                                        config=self.config, framework=self.framework)

    @property
    def step_s(self) -> float:
        return self.prediction.step_s

    @property
    def peak_bytes(self) -> float:
        return self.prediction.peak_bytes

    def to_dict(self) -> dict[str, Any]:
        """The plan file object; ``predicted`` repeats the configuration, as DESIGN.md says."""
        cluster = dataclasses.asdict(self.cluster)
        cluster["gpu"] = dataclasses.asdict(self.cluster.gpu)
        return {"schema_version": SCHEMA_VERSION, **config_to_dict(self.config, self.model),
                "framework": self.framework, "model": self.model.to_dict(), "cluster": cluster,
                "predicted": estimate_to_dict(self.estimate), "provenance": self.provenance}


def plan_from_dict(data: dict[str, Any], *, origin: str = "plan") -> Plan:
    """Read a plan-file object; ValueError naming unknown, missing or inconsistent keys.

    Checked in turn: the schema version; the keys and their JSON types (``PLAN_FILE_SCHEMA``);
    the model, the cluster and the configuration, and that they fit together; the prediction
    (``prediction_from_dict``), and that its copies of the configuration, framework, model and
    cluster agree with the plan's own.
    """
    if not isinstance(data, dict):
        raise ValueError(f"{origin}: a plan file holds one JSON object")
    if "schema_version" in data and data["schema_version"] != SCHEMA_VERSION:
        raise ValueError(f"{origin}: schema_version {data['schema_version']!r} is not supported; "
                         f"this meshplan reads schema_version {SCHEMA_VERSION}")
    check_object(data, PLAN_FILE_SCHEMA, origin=origin)
    model = spec_from_dict(data["model"], origin=f"{origin} model")
    cluster = cluster_from_dict(data["cluster"], origin=f"{origin} cluster",
                                name=str(data["cluster"].get("name", "cluster")))
    values = {k: data[k] for k in CONFIG_KEYS if k != "grad_accum_steps"}
    for key in OPTIONAL_CONFIG_KEYS:  # written only when not the default
        if key in data:
            values[key] = data[key]
    for key in ("recompute", "layers_per_stage", "mesh_order"):
        if isinstance(values[key], list):
            values[key] = tuple(values[key])
    try:
        config = ParallelConfig(**values)
    except ValueError as err:
        raise ValueError(f"{origin}: {err}") from None
    try:
        check_fits_model(config, model, num_gpus=cluster.num_gpus)
    except ValueError as err:
        raise ValueError(f"{origin}: the plan does not fit its own model and cluster: "
                         f"{err}") from None
    if config.grad_accum_steps != data["grad_accum_steps"]:
        raise ValueError(f"{origin}: grad_accum_steps {data['grad_accum_steps']} does not equal "
                         f"global batch / (dp x micro-batch) = {config.grad_accum_steps}")
    if "pinned" in data["provenance"]:  # the search's pins, which explain and replanning reuse
        try:
            check_pins(data["provenance"]["pinned"], global_batch_size=config.global_batch_size,
                       seq_len=config.seq_len)
        except ValueError as err:
            raise ValueError(f"{origin}: provenance: {err}") from None
    prediction = prediction_from_dict(data["predicted"], origin=origin, path="predicted")
    plan = Plan(config=config, model=model, cluster=cluster, framework=data["framework"],
                prediction=prediction, provenance=data["provenance"])
    _check_prediction_agrees(plan, data["predicted"], origin=origin)
    return plan


def _check_prediction_agrees(plan: Plan, predicted: dict[str, Any], *, origin: str) -> None:
    """ValueError unless ``predicted`` is the estimate of ``plan``'s own configuration.

    The copies compared: ``predicted.plan`` (every key ``config_to_dict`` writes),
    ``predicted.framework``, ``predicted.model.name`` and ``predicted.cluster``'s summary; the
    stages of ``predicted.memory.per_stage`` against the plan's pipeline. Not compared:
    ``predicted.model.num_params``, a count the cost model derives from the model (a later
    meshplan may count differently; the plan file's ``model`` is what is read).
    """
    copies = {"plan": config_to_dict(plan.config, plan.model), "framework": plan.framework,
              "model": {"name": plan.model.name},
              "cluster": {"name": plan.cluster.name, "gpu": plan.cluster.gpu.key,
                          "nodes": plan.cluster.nodes,
                          "gpus_per_node": plan.cluster.gpus_per_node,
                          "num_gpus": plan.cluster.num_gpus}}
    for section, own in copies.items():
        if not isinstance(own, dict):
            if not _same(predicted[section], own):
                raise ValueError(f"{origin}: predicted.{section} {predicted[section]!r} disagrees "
                                 f"with the plan's {section} {own!r}; the prediction must be of "
                                 f"this plan (write the plan file again with meshplan plan -o)")
            continue
        theirs = predicted[section]
        for key, value in own.items():
            if key not in theirs:
                raise ValueError(f"{origin}: missing key {key!r} in predicted.{section}; it "
                                 f"repeats the plan's {key} ({value!r})")
            if not _same(theirs[key], value):
                raise ValueError(f"{origin}: predicted.{section}.{key} {theirs[key]!r} disagrees "
                                 f"with the plan's {key} {value!r}; the prediction must be of "
                                 f"this plan (write the plan file again with meshplan plan -o)")
    stages = [s.stage for s in plan.prediction.memory.per_stage]
    if stages != list(range(plan.config.pp)):
        raise ValueError(f"{origin}: predicted.memory.per_stage lists stages {stages}; the plan "
                         f"has pp {plan.config.pp}, so stages {list(range(plan.config.pp))}")
    if not 0 <= plan.prediction.time.bottleneck_stage < plan.config.pp:
        raise ValueError(f"{origin}: predicted.time.bottleneck_stage "
                         f"{plan.prediction.time.bottleneck_stage} is not one of the plan's "
                         f"stages 0..{plan.config.pp - 1}")


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON (``1`` is not ``true``, ``8`` is not ``8.0``)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def read_plan(path: str | Path) -> Plan:
    return plan_from_dict(load_json_document(path, what="plan"), origin=str(path))


def write_plan(plan: Plan, path: str | Path) -> None:
    Path(path).write_text(json.dumps(plan.to_dict(), indent=2) + "\n")
