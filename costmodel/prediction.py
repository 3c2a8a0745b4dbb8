"""``Prediction``: what the cost model predicted for one configuration, typed, and its reader.

A plan file's ``predicted`` object is the whole ``estimate --json`` document (DESIGN.md,
written by ``estimate.estimate_to_dict``). Its ``plan``, ``model``, ``cluster`` and
``framework`` repeat what the plan holds itself; a ``Prediction`` holds only what the cost
model computed (memory per stage, time terms, throughput, whether it fits and why not), with
the typed parts of ``Estimate``. Writing goes through ``estimate_to_dict`` (``Prediction.
estimate`` rebuilds the ``Estimate`` with the plan's own configuration), reading through
``prediction_from_dict``, which mirrors it section by section: the sections' keys are the
fields of ``MemoryEstimate``, ``StageMemory``, ``TimeEstimate`` and ``Throughput`` (a field
with a default is optional, so files written before it existed still read). DESIGN.md lets
the estimate document grow, so keys the reader does not know are tolerated (and dropped).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshplan.costmodel import schema
from meshplan.costmodel.config import ParallelConfig
from meshplan.costmodel.estimate import Estimate, MemoryEstimate, Throughput, TimeEstimate
from meshplan.costmodel.hardware import ClusterSpec
from meshplan.costmodel.jsonio import NON_NEGATIVE, Limit, Rule, Schema, check_object, schema_of
from meshplan.costmodel.memory import StageMemory
from meshplan.costmodel.model import ModelSpec

_STAGE_SCHEMA = schema_of(StageMemory, name="per-stage memory", extra_keys=True,
                          limits={name: NON_NEGATIVE for name in
                                  ("stage", "layers", "params_bytes", "grads_bytes",
                                   "optimizer_bytes", "activations_bytes", "buffers_bytes",
                                   "offloaded_bytes", "peak_bytes", "reserved_bytes")})
MEMORY_SCHEMA = schema_of(
    MemoryEstimate, name="estimate memory", extra_keys=True,
    limits={name: NON_NEGATIVE for name in ("peak_bytes", "peak_reserved_bytes",
                                            "model_states_bytes", "cpu_bytes_per_node",
                                            "nvme_bytes_per_node", "capacity_bytes")},
    rules={"per_stage": Rule(kind="list", items=Rule(kind="object", schema=_STAGE_SCHEMA))})
"""``predicted.memory``: the MemoryEstimate fields, ``per_stage`` a list of StageMemory."""
TIME_SCHEMA = schema_of(TimeEstimate, name="estimate time", extra_keys=True,
                        limits={"step_s": Limit(minimum=0, exclusive_minimum=True)})
"""``predicted.time``: the TimeEstimate fields (step seconds > 0)."""
THROUGHPUT_SCHEMA = schema_of(Throughput, name="estimate throughput", extra_keys=True,
                              limits={"tokens_per_s": NON_NEGATIVE,
                                      "model_flop_per_step": NON_NEGATIVE,
                                      "model_flop_per_s_per_gpu": NON_NEGATIVE,
                                      "mfu": NON_NEGATIVE})
"""``predicted.throughput``: the Throughput fields."""
ESTIMATE_SCHEMA = Schema(
    name="estimate", extra_keys=True,
    rules={"schema_version": Rule(kind="int", limit=Limit(choices=(schema.ESTIMATE,))),
           "model": Rule(kind="object"), "cluster": Rule(kind="object"),
           "framework": Rule(kind="str"), "fits": Rule(kind="bool"),
           "why_not": Rule(kind="str"), "plan": Rule(kind="object"),
           "memory": Rule(kind="object", schema=MEMORY_SCHEMA),
           "time": Rule(kind="object", schema=TIME_SCHEMA),
           "throughput": Rule(kind="object", schema=THROUGHPUT_SCHEMA)},
    required=frozenset({"schema_version", "model", "cluster", "framework", "fits", "why_not",
                        "plan", "memory", "time", "throughput"}))
"""The ``estimate --json`` document as ``estimate_to_dict`` writes it (extra keys allowed)."""


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """The cost model's prediction for a configuration, without the configuration itself."""

    memory: MemoryEstimate
    """Bytes per rank: peaks and every stage."""
    time: TimeEstimate
    """Seconds per step, by term."""
    throughput: Throughput
    fits: bool
    why_not: str
    """Empty when ``fits``; otherwise which capacity is exceeded."""

    @classmethod
    def of(cls, est: Estimate) -> "Prediction":
        return cls(memory=est.memory, time=est.time, throughput=est.throughput, fits=est.fits,
                   why_not=est.why_not)

    def estimate(self, *, model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig,
                 framework: str) -> Estimate:
        """The ``Estimate`` of ``config`` this is the prediction of (for ``estimate_to_dict``)."""
        return Estimate(model=model, cluster=cluster, config=config, framework=framework,
                        memory=self.memory, time=self.time, throughput=self.throughput,
                        fits=self.fits, why_not=self.why_not)

    @property
    def step_s(self) -> float:
        return float(self.time.step_s)

    @property
    def peak_bytes(self) -> float:
        return float(self.memory.peak_bytes)


def prediction_from_dict(data: Any, *, origin: str, path: str = "") -> Prediction:
    """The Prediction in an ``estimate --json`` document (a plan file's ``predicted``).

    ValueError (one line, starting ``origin: ``; keys named from ``path``, e.g. ``predicted``)
    for a missing section or key, a value of the wrong JSON type or sign, or another
    ``schema_version``. The document's ``plan``, ``model``, ``cluster`` and ``framework`` are
    only checked to be there: the reader of a plan file compares them with the plan
    (``planner.plan``).
    """
    check_object(data, ESTIMATE_SCHEMA, origin=origin, path=path)
    memory = data["memory"]
    stages = tuple(StageMemory(**_fields(entry, _STAGE_SCHEMA)) for entry in memory["per_stage"])
    return Prediction(
        memory=MemoryEstimate(**{**_fields(memory, MEMORY_SCHEMA), "per_stage": stages}),
        time=TimeEstimate(**_fields(data["time"], TIME_SCHEMA)),
        throughput=Throughput(**_fields(data["throughput"], THROUGHPUT_SCHEMA)),
        fits=data["fits"], why_not=data["why_not"])


def _fields(section: dict[str, Any], section_schema: Schema) -> dict[str, Any]:
    """The keys of ``section`` that are fields of the schema's dataclass (extras dropped)."""
    return {key: section[key] for key in section_schema.rules if key in section}
