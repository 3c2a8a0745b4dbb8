"""``estimate``: memory per stage and time per step of one configuration, and its JSON form."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from meshplan.costmodel import composition, flops, schema, traced
from meshplan.costmodel.calibration import Calibration, default_calibration
from meshplan.costmodel.config import FRAMEWORKS, ParallelConfig
from meshplan.costmodel.layout import check_fits_model, framework_split
from meshplan.costmodel.frameworks import check_framework_options, min_micro_batches
from meshplan.costmodel.hardware import ClusterSpec
from meshplan.costmodel.memory import (StageMemory, StageParams, host_bytes_per_node,
                                       stage_layer_range, stage_memory, stage_params)
from meshplan.costmodel.model import ModelSpec
from meshplan.costmodel.timing import (BACKWARD_FACTOR, Links, StageTime, calibrated_links,
                                       dp_bucket_terms, dp_step_s, optimizer_step_s,
                                       prefetch_contention, stage_link_signature, stage_links,
                                       stage_microbatch_time, te_weight_cast_s,
                                       zero1_broadcast_s)

SCHEMA_VERSION = schema.ESTIMATE


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank; ``per_stage`` lists every pipeline stage."""

    peak_bytes: float
    peak_reserved_bytes: float
    model_states_bytes: float
    per_stage: tuple[StageMemory, ...]
    cpu_bytes_per_node: float
    nvme_bytes_per_node: float
    capacity_bytes: float
    """Device memory of one GPU."""

    @property
    def bottleneck_stage(self) -> int:
        return max(self.per_stage, key=lambda s: s.reserved_bytes).stage


@dataclass(frozen=True)
class TimeEstimate:
    """Seconds per step; the terms add up to ``step_s`` (communication as exposed time)."""

    step_s: float
    compute_s: float
    tp_comm_s: float
    cp_comm_s: float
    ep_comm_s: float
    pp_comm_s: float
    pp_bubble_s: float
    dp_comm_s: float
    offload_s: float
    optimizer_s: float
    exposed_comm_s: float
    dp_comm_total_s: float
    """Data-parallel traffic before overlap with compute."""
    bottleneck_stage: int
    host_wait_s: float = 0.0
    """Part of ``compute_s``: the device waiting for the host to issue kernels (host-bound
    layers of eager frameworks on small micro-batches; ``timing.HOST_OP_EQUIVALENTS``)."""


@dataclass(frozen=True)
class Throughput:
    tokens_per_s: float
    model_flop_per_step: float
    model_flop_per_s_per_gpu: float
    mfu: float


@dataclass(frozen=True)
class Estimate:
    """Everything the cost model predicts for one configuration."""

    model: ModelSpec
    cluster: ClusterSpec
    config: ParallelConfig
    framework: str
    memory: MemoryEstimate
    time: TimeEstimate
    throughput: Throughput
    fits: bool
    why_not: str
    """Empty when ``fits``; otherwise which capacity is exceeded."""


def estimate(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, *,
             framework: str = "meshplan", calibration: Calibration | None = None) -> Estimate:
    """Predict memory and step time of ``config`` for ``model`` on ``cluster``.

    Without a layer split (``layers_per_stage``), the split the framework builds itself where
    it takes none of the user's (``layout.framework_split``: DeepSpeed's), else the even one.
    Raises ValueError if the configuration cannot run the model on the cluster.
    """
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {', '.join(FRAMEWORKS)}, got {framework!r}")
    if config.layers_per_stage is None and config.pp > 1:
        split = framework_split(framework, model, config.pp)
        if split is not None and min(split) >= config.vpp:
            config = config.replace(layers_per_stage=split)
    check_fits_model(config, model, num_gpus=cluster.num_gpus)
    check_framework_options(framework, compile_mode=config.compile, float8=config.float8,
                            async_tp=config.async_tp, float8_head=config.float8_head,
                            tp_comm_overlap=config.tp_comm_overlap,
                            cross_entropy_fusion=config.cross_entropy_fusion,
                            attention_kernel=config.attention_kernel,
                            cp_comm_type=config.cp_comm_type,
                            float8_recipe=config.float8_recipe,
                            grad_reduce_dtype=config.grad_reduce_dtype,
                            peak_flop_per_s=cluster.gpu.peak_flop_per_s, gpu_key=cluster.gpu.key)
    if config.float8_head and model.tied_embeddings:
        raise ValueError(f"--float8-head needs an LM head of its own; model "
                         f"{model.name} ties it to the token embedding")
    cal = calibration or default_calibration()
    memory = _memory(model, cluster, config, framework, cal)
    time = _time(model, cluster, config, framework, cal)
    model_flop = (traced.step_flop(model, global_batch_size=config.global_batch_size)
                  if model.is_traced else
                  flops.model_flop_per_step(model, global_batch_size=config.global_batch_size,
                                            seq_len=config.seq_len))
    per_gpu = model_flop / time.step_s / cluster.num_gpus
    throughput = Throughput(
        tokens_per_s=config.global_batch_size * config.seq_len / time.step_s,
        model_flop_per_step=model_flop, model_flop_per_s_per_gpu=per_gpu,
        mfu=per_gpu / cluster.gpu.peak(config.dtype))
    why = _why_not(memory, cluster, config, framework)
    return Estimate(model=model, cluster=cluster, config=config, framework=framework,
                    memory=memory, time=time, throughput=throughput, fits=not why, why_not=why)


def _stage_key(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig,
               stage: int) -> tuple:
    """Stages with equal keys take equal time: same layers, role, recompute mode and links
    (the pipeline neighbour of a stage may sit on another node than its predecessor's)."""
    layers = stage_layer_range(model, config, stage)
    moe = tuple(model.is_moe_layer(i) for i in layers) if model.is_moe else ()
    if model.is_traced:  # layers differ: which ones the stage holds matters
        moe = (layers.start, layers.stop)
    return (len(layers), moe, stage == 0, stage == config.pp - 1,
            config.stage_recompute(stage), stage_link_signature(cluster, config, stage))


def _memory(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, framework: str,
            cal: Calibration) -> MemoryEstimate:
    stages: list[StageMemory] = []
    for s in range(config.pp):  # not cached: in-flight micro-batches differ per stage
        stages.append(stage_memory(model, cluster, config, s, framework=framework,
                                   calibration=cal))
    worst = max(stages, key=lambda m: m.peak_bytes)
    host = host_bytes_per_node(model, cluster, config, stages, framework=framework)
    nvme = host if config.offload_device == "nvme" and config.offload != "none" else 0.0
    cpu = 0.0 if nvme else host
    return MemoryEstimate(peak_bytes=worst.peak_bytes,
                          peak_reserved_bytes=max(m.reserved_bytes for m in stages),
                          model_states_bytes=worst.model_states_bytes, per_stage=tuple(stages),
                          cpu_bytes_per_node=cpu, nvme_bytes_per_node=nvme,
                          capacity_bytes=cluster.gpu.hbm_bytes)


@dataclass(frozen=True)
class StageTerms:
    """What one stage contributes to the step: per-micro-batch time and once-per-step terms."""

    micro: StageTime
    """Seconds per micro-batch, by term."""
    dp_comm_s: float
    """Once-per-step data-parallel traffic before overlap."""
    dp_hidden_s: float
    """How much of it the last micro-batch's backward can hide."""
    optimizer_s: float
    offload_s: float
    """Once-per-step offload: PCIe transfers, host Adam, NVMe."""

    @property
    def dp_exposed_s(self) -> float:
        return composition.exposed(self.dp_comm_s, self.dp_hidden_s)


def stage_micro(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, stage: int, *,
                framework: str, calibration: Calibration) -> StageTime:
    """``stage_terms(...).micro`` (the same numbers) without the once-per-step terms: what
    the planner's per-micro-batch bounds read."""
    return stage_microbatch_time(model, cluster, config, calibration, stage,
                                 params=stage_params(model, config, stage),
                                 links=stage_links(cluster, config, stage), framework=framework)


def stage_terms(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, stage: int, *,
                framework: str, calibration: Calibration) -> StageTerms:
    """Time terms of ``stage`` under ``config`` (its layers and recompute mode)."""
    params = stage_params(model, config, stage)
    links = stage_links(cluster, config, stage)
    micro = stage_microbatch_time(model, cluster, config, calibration, stage, params=params,
                                  links=links, framework=framework)
    terms = StageTerms(micro, *stage_once(model, cluster, config, stage, framework=framework,
                                          calibration=calibration, compute_s=micro.compute_s,
                                          params=params, links=links))
    _check_finite(terms, stage)
    return terms


MAX_TERM_S = 1e12
"""The longest time term a prediction may hold (about 31,700 years): rates of 1e-300 bytes/s
or latencies of 1e300 s are valid JSON numbers, but the times they give are infinite (no JSON
document holds them) or too large for the planner's nanosecond integers, and no real machine
gives them: a unit slip does."""


def _check_finite(terms: StageTerms, stage: int) -> None:
    """ValueError unless every time term of ``stage`` is finite and at most ``MAX_TERM_S``
    (on the planner's hot path: the names are built only for a term that fails)."""
    micro = vars(terms.micro)
    once = (terms.dp_comm_s, terms.dp_hidden_s, terms.optimizer_s, terms.offload_s)
    if all(abs(v) <= MAX_TERM_S for v in once) and all(
            abs(v) <= MAX_TERM_S for v in micro.values() if isinstance(v, float)):
        return  # NaN and infinity fail the comparison
    values = {**{f"micro-batch {name}": value for name, value in micro.items()
                 if isinstance(value, float)},
              "dp_comm_s": terms.dp_comm_s, "dp_hidden_s": terms.dp_hidden_s,
              "optimizer_s": terms.optimizer_s, "offload_s": terms.offload_s}
    for name, value in values.items():
        if not math.isfinite(value) or abs(value) > MAX_TERM_S:
            raise ValueError(f"stage {stage}'s predicted {name} is {value:.3g} s, beyond "
                             f"{MAX_TERM_S:.0e} s: a rate or efficiency of the cluster or "
                             f"calibration is too small, or a latency too large (rates are "
                             f"per second, latencies in seconds)")


def stage_once(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, stage: int, *,
               framework: str, calibration: Calibration, compute_s: float,
               params: StageParams | None = None, links: Links | None = None
               ) -> tuple[float, float, float, float]:
    """``stage_terms``' once-per-step terms (dp traffic, the part of it the last backward can
    hide, optimizer, offload step) given the stage's compute per micro-batch, which does not
    depend on the ZeRO stage or offload: the planner prices every (ZeRO, offload) choice of a
    configuration from one evaluation of its compute."""
    if params is None:
        params = stage_params(model, config, stage)
    if links is None:
        links = stage_links(cluster, config, stage)
    last_bwd = compute_s * BACKWARD_FACTOR / (1 + BACKWARD_FACTOR)
    dp_link = calibrated_links(links, calibration, cluster.gpu.key).dp
    comm, hidden = dp_step_s(config, calibration, params=params, link=dp_link,
                             last_backward_s=last_bwd, framework=framework,
                             gpu_key=cluster.gpu.key, first_forward_s=compute_s - last_bwd,
                             contention=prefetch_contention(cluster, calibration, dp_link))
    opt, off = optimizer_step_s(config, cluster, calibration, params=params,
                                framework=framework)
    # meshplan's ZeRO-1 broadcasts the updated parameters inside its optimizer step
    opt += zero1_broadcast_s(config, calibration, params=params, link=dp_link,
                             framework=framework, gpu_key=cluster.gpu.key)
    if framework == "megatron" and config.float8:  # Transformer Engine's per-step weight casts
        opt += te_weight_cast_s(model, cluster, config, calibration, stage=stage)
    return comm, hidden, opt, off


def stage_dp_buckets(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig,
                     stage: int, *, framework: str, calibration: Calibration
                     ) -> tuple[tuple[float, float, float], ...]:
    """The per-bucket part of ``stage``'s once-per-step data-parallel traffic
    (``timing.dp_bucket_terms``), for the planner's tables."""
    links = calibrated_links(stage_links(cluster, config, stage), calibration, cluster.gpu.key)
    return dp_bucket_terms(config, calibration, params=stage_params(model, config, stage),
                           link=links.dp, framework=framework, gpu_key=cluster.gpu.key)


def compose_step(terms: list[StageTerms], *, micro_batches: int, vpp: int) -> TimeEstimate:
    """Step time from per-stage terms, composed by ``composition.scaled_step`` (Narayanan et
    al. 2021 Sec. 2.2): ``m * max_i t_i + (sum_i t_i - max_i t_i) / v`` plus the largest
    once-per-step exposed data-parallel, optimizer and offload terms over stages. The
    breakdown charges the slowest stage's terms ``m`` times and the rest to the bubble; its
    terms add up to ``step_s`` (to rounding)."""
    m, v = micro_batches, vpp
    totals = [t.micro.total_s for t in terms]
    b = max(range(len(terms)), key=lambda i: totals[i])
    top = terms[b].micro
    dp_exposed = max(t.dp_exposed_s for t in terms)
    optimizer = max(t.optimizer_s for t in terms)
    offload_step = max(t.offload_s for t in terms)
    once = composition.once_per_step(dp_exposed=dp_exposed, optimizer=optimizer,
                                     offload_step=offload_step)
    step = composition.scaled_step(micro_batches=m, vpp=v, top_micro=totals[b],
                                   sum_micro=sum(totals), once=once) / v
    bubble = composition.pipeline_bubble(vpp=v, top_micro=totals[b], sum_micro=sum(totals))
    dp_mb = m * top.dp_comm_s
    exposed = m * (top.tp_comm_s + top.cp_comm_s + top.ep_comm_s + top.pp_comm_s) \
        + dp_mb + dp_exposed
    offload = m * (top.offload_s + top.offload_wait_s) + offload_step
    return TimeEstimate(step_s=step, compute_s=m * top.compute_s, tp_comm_s=m * top.tp_comm_s,
                        cp_comm_s=m * top.cp_comm_s, ep_comm_s=m * top.ep_comm_s,
                        pp_comm_s=m * top.pp_comm_s, pp_bubble_s=bubble,
                        dp_comm_s=dp_mb + dp_exposed, offload_s=offload, optimizer_s=optimizer,
                        exposed_comm_s=exposed,
                        dp_comm_total_s=max(t.dp_comm_s for t in terms) + dp_mb,
                        bottleneck_stage=b, host_wait_s=m * top.host_wait_s)


def _time(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, framework: str,
          cal: Calibration) -> TimeEstimate:
    cache: dict[tuple, StageTerms] = {}
    terms = []
    for s in range(config.pp):
        key = _stage_key(model, cluster, config, s)
        if key not in cache:
            cache[key] = stage_terms(model, cluster, config, s, framework=framework,
                                     calibration=cal)
        terms.append(cache[key])
    return compose_step(terms, micro_batches=config.grad_accum_steps, vpp=config.vpp)


def _why_not(memory: MemoryEstimate, cluster: ClusterSpec, config: ParallelConfig,
             framework: str) -> str:
    fewest = min_micro_batches(framework, config.pp)
    if config.grad_accum_steps < fewest:
        return (f"{framework}'s pipeline schedules (torch.distributed.pipelining 1F1B) need at "
                f"least pp = {fewest} micro-batches per step, the plan has "
                f"{config.grad_accum_steps} (global batch / (dp x micro-batch))")
    if memory.peak_reserved_bytes > cluster.gpu.hbm_bytes:
        stage = memory.bottleneck_stage
        return (f"stage {stage} needs {memory.peak_reserved_bytes / 2**30:.1f} GiB reserved per "
                f"GPU, more than the {cluster.gpu.hbm_bytes / 2**30:.1f} GiB of one "
                f"{cluster.gpu.name}")
    if memory.cpu_bytes_per_node > cluster.host_bytes:
        return (f"offloaded states need {memory.cpu_bytes_per_node / 2**30:.1f} GiB of host "
                f"memory per node, more than its {cluster.host_bytes / 2**30:.1f} GiB")
    if memory.nvme_bytes_per_node > cluster.nvme_bytes:
        return (f"offloaded states need {memory.nvme_bytes_per_node / 1e12:.2f} TB of NVMe per "
                f"node, more than its {cluster.nvme_bytes / 1e12:.2f} TB")
    return ""


# ----- JSON (schema_version 1, DESIGN.md) ---------------------------------------------------------

OPTIONAL_PLAN_KEYS = ("selective_ac", "recompute_early_stop", "compile", "float8",
                      "float8_recipe", "float8_head", "async_tp", "tp_comm_overlap",
                      "cross_entropy_fusion", "attention_kernel", "overlap_comm", "cp_comm_type",
                      "grad_reduce_dtype")
"""Settings the ``plan`` object holds only when they differ from their default (torchtitan's
selective policy, early-stopping recomputation, torch.compile, float8 training), so that the
documents of plans without them read as before."""


def config_to_dict(config: ParallelConfig, model: ModelSpec) -> dict[str, Any]:
    """The ``plan`` object of the estimate JSON (``OPTIONAL_PLAN_KEYS`` where set)."""
    recompute = config.recompute if isinstance(config.recompute, str) else list(config.recompute)
    extra = {key: getattr(config, key) for key in OPTIONAL_PLAN_KEYS
             if getattr(config, key) != getattr(ParallelConfig, key)}
    return {"tp": config.tp, "pp": config.pp, "dp": config.dp, "cp": config.cp, "ep": config.ep,
            "sp": config.sp, "zero_stage": config.zero_stage, "offload": config.offload,
            "offload_device": config.offload_device, "recompute": recompute,
            "micro_batch_size": config.micro_batch_size,
            "global_batch_size": config.global_batch_size,
            "grad_accum_steps": config.grad_accum_steps, "vpp": config.vpp,
            "seq_len": config.seq_len,
            "layers_per_stage": list(config.stage_layers(model.num_layers)),
            "mesh_order": list(config.mesh_order), "flash_attention": config.flash_attention,
            "dtype": config.dtype, **extra}


def estimate_to_dict(est: Estimate) -> dict[str, Any]:
    """The ``estimate --json`` document (DESIGN.md, schema_version 1), plus extra keys."""
    mem, t, th = est.memory, est.time, est.throughput
    stages = [{"stage": s.stage, "layers": s.layers, "params_bytes": int(s.params_bytes),
               "grads_bytes": int(s.grads_bytes), "optimizer_bytes": int(s.optimizer_bytes),
               "activations_bytes": int(s.activations_bytes),
               "buffers_bytes": int(s.buffers_bytes), "peak_bytes": int(s.peak_bytes),
               "reserved_bytes": int(s.reserved_bytes),
               "offloaded_bytes": int(s.offloaded_bytes)} for s in mem.per_stage]
    return {
        "schema_version": SCHEMA_VERSION,
        "model": {"name": est.model.name, "num_params": est.model.num_params},
        "cluster": {"name": est.cluster.name, "gpu": est.cluster.gpu.key,
                    "nodes": est.cluster.nodes, "gpus_per_node": est.cluster.gpus_per_node,
                    "num_gpus": est.cluster.num_gpus},
        "framework": est.framework,
        "fits": est.fits,
        "why_not": est.why_not,
        "plan": config_to_dict(est.config, est.model),
        "memory": {"peak_bytes": int(mem.peak_bytes),
                   "peak_reserved_bytes": int(mem.peak_reserved_bytes),
                   "model_states_bytes": int(mem.model_states_bytes),
                   "capacity_bytes": int(mem.capacity_bytes),
                   "per_stage": stages,
                   "cpu_bytes_per_node": int(mem.cpu_bytes_per_node),
                   "nvme_bytes_per_node": int(mem.nvme_bytes_per_node)},
        "time": {"step_s": t.step_s, "compute_s": t.compute_s, "tp_comm_s": t.tp_comm_s,
                 "cp_comm_s": t.cp_comm_s, "ep_comm_s": t.ep_comm_s, "pp_comm_s": t.pp_comm_s,
                 "pp_bubble_s": t.pp_bubble_s, "dp_comm_s": t.dp_comm_s,
                 "offload_s": t.offload_s, "exposed_comm_s": t.exposed_comm_s,
                 "optimizer_s": t.optimizer_s, "dp_comm_total_s": t.dp_comm_total_s,
                 "bottleneck_stage": t.bottleneck_stage, "host_wait_s": t.host_wait_s},
        "throughput": {"tokens_per_s": th.tokens_per_s,
                       "model_flop_per_step": th.model_flop_per_step,
                       "model_flop_per_s_per_gpu": th.model_flop_per_s_per_gpu,
                       "mfu": th.mfu},
    }
