"""Published training runs (``data/reference_runs.json``) as cost-model inputs with measured times.

Used to fit the default calibration (runs marked ``fit``) and by the accuracy benchmark, which
also reports runs marked ``holdout`` that the calibration never saw.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from meshplan.costmodel import flops
from meshplan.costmodel.calibration import Calibration
from meshplan.costmodel.config import RECOMPUTE_MODES, ParallelConfig
from meshplan.costmodel.estimate import Estimate, estimate
from meshplan.costmodel.jsonio import read_package_json
from meshplan.costmodel.hardware import ClusterSpec, load_cluster
from meshplan.costmodel.model import ModelSpec
from meshplan.costmodel.models import load_model, spec_from_dict

TUNE_MICRO_BATCHES = (1, 2, 4, 8, 16)
"""Micro-batch sizes tried when a source does not publish its micro-batch."""
TUNE_VPP = (1, 2, 3, 4, 6, 8)
"""Virtual pipeline chunks tried when a source does not publish them."""


@dataclass(frozen=True)
class ReferenceRun:
    """One published run: what was run, where, and how long a step took."""

    id: str
    set: str
    """``fit`` (used to fit the default calibration) or ``holdout``."""
    model: ModelSpec
    cluster: ClusterSpec
    framework: str
    config: ParallelConfig
    tune: tuple[str, ...]
    measured_step_s: float
    source: str
    golden: bool = False
    """Also in the project's golden reference set (tests/data/published.json)."""
    family: str = ""
    """The source table the run comes from (``narayanan-t1``, ``mosaicml-h100``, ...): the
    accuracy benchmark reports error and bias per family."""

    @property
    def dp_heavy(self) -> bool:
        """Sharded data parallelism carries the run: ZeRO-3 / FSDP without tensor or pipeline
        parallelism, the regime where per-call collective latency decides the step."""
        return self.config.zero_stage == 3 and self.config.tp == 1 and self.config.pp == 1


@functools.cache
def reference_runs() -> tuple[ReferenceRun, ...]:
    data = read_package_json("reference_runs.json")
    models = {name: spec_from_dict({"name": name, **fields},
                                   origin=f"reference_runs.json models.{name}")
              for name, fields in data.get("models", {}).items()}
    return tuple(_run_from_dict(raw, models) for raw in data["runs"])


def _run_from_dict(raw: dict[str, Any], models: dict[str, ModelSpec] | None = None
                   ) -> ReferenceRun:
    models = models or {}
    model = models[raw["model"]] if raw["model"] in models else load_model(raw["model"])
    cluster = load_cluster(raw["cluster"], nodes=raw["nodes"])
    values = dict(raw["config"])
    for key in ("layers_per_stage", "mesh_order"):
        if key in values:
            values[key] = tuple(values[key])
    config = ParallelConfig(**values)
    return ReferenceRun(id=raw["id"], set=raw["set"], model=model, cluster=cluster,
                        framework=raw["framework"], config=config, tune=tuple(raw["tune"]),
                        measured_step_s=_measured_step_s(raw["measured"], model, config,
                                                         cluster.num_gpus),
                        source=raw["source"], golden=raw.get("golden", False),
                        family=raw.get("family", ""))


def _measured_step_s(measured: dict[str, float], model: ModelSpec, config: ParallelConfig,
                     num_gpus: int) -> float:
    """Step seconds from what the source reports.

    ``hardware_flop_per_s_per_gpu``: Narayanan et al. 2021 Eq. 3 FLOPs (with recomputation)
    per step over that rate; ``model_flop_per_s_per_gpu``: model FLOPs (Korthikanti Eq. 7)
    over that rate; ``tokens_per_s_per_gpu``: the global batch's tokens over that rate times
    the GPU count.
    """
    if "step_s" in measured:
        return float(measured["step_s"])
    if "tokens_per_s_per_gpu" in measured:
        tokens = config.global_batch_size * config.seq_len
        return tokens / (measured["tokens_per_s_per_gpu"] * num_gpus)
    kwargs = dict(global_batch_size=config.global_batch_size, seq_len=config.seq_len)
    if "hardware_flop_per_s_per_gpu" in measured:
        work = flops.hardware_flop_per_step(model, recompute=config.stage_recompute(0), **kwargs)
        return work / (measured["hardware_flop_per_s_per_gpu"] * num_gpus)
    work = flops.model_flop_per_step(model, **kwargs)
    return work / (measured["model_flop_per_s_per_gpu"] * num_gpus)


def tuned_configs(run: ReferenceRun) -> list[ParallelConfig]:
    """``run.config`` with every knob in ``run.tune`` set to each value it can take."""
    candidates = [run.config]
    per_replica = run.config.global_batch_size // run.config.dp
    fewest_layers = min(run.config.stage_layers(run.model.num_layers))
    choices = {
        "micro_batch_size": [b for b in TUNE_MICRO_BATCHES if per_replica % b == 0],
        "vpp": [v for v in TUNE_VPP if v <= fewest_layers],
        "recompute": list(RECOMPUTE_MODES),
    }
    for knob in run.tune:
        expanded = []
        for config in candidates:
            for value in choices[knob]:
                try:
                    expanded.append(config.replace(**{knob: value}))
                except ValueError:  # e.g. interleaving needs micro-batches divisible by pp
                    continue
        candidates = expanded
    return candidates


def predict(run: ReferenceRun, calibration: Calibration) -> Estimate:
    """The estimate for ``run``; unpublished knobs in ``run.tune`` take their fastest fitting
    value (the authors tuned them), falling back to the fastest overall if none fits."""
    results = [estimate(run.model, run.cluster, c, framework=run.framework,
                        calibration=calibration) for c in tuned_configs(run)]
    fitting = [r for r in results if r.fits] or results
    return min(fitting, key=lambda r: r.time.step_s)
