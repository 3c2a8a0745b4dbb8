"""``meshplan explain``: why a plan, what binds it, how the runners-up lose, and what-ifs.

Everything is recomputed from the plan file with the cost model (so the explanation reflects
the calibration in use) and one search of the same space for the runners-up and the what-ifs:
one more node, twice the inter-node bandwidth, and the next ZeRO stage. Given a failure model
(``--node-mtbf-hours``), also what a node failure costs and the best checkpoint interval
(elasticity.py).

The result is typed (``Explanation`` and the small frozen dataclasses below, which hold the
estimates they describe); ``Explanation.to_dict`` is the one place its JSON (``explain --json``)
is produced, and ``render`` the one place its text is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from meshplan.costmodel import Calibration, ParallelConfig, estimate
from meshplan.costmodel.estimate import Estimate
from meshplan.costmodel.frameworks import (CP_COMM_TYPES_BY_FRAMEWORK, FLOAT8_FRAMEWORKS,
                                           cp_exchange)
from meshplan.costmodel.layout import framework_layout_error
from meshplan.planner.elasticity import Elasticity, FailureModel, IntervalCost, failure_cost
from meshplan.planner.plan import Plan
from meshplan.planner.report import settings_text
from meshplan.planner.planning import summary
from meshplan.planner.search import NoPlanFits, search
from meshplan.planner.space import SearchSpace, space_with_pins

TIME_TERMS = ("compute_s", "tp_comm_s", "cp_comm_s", "ep_comm_s", "pp_comm_s", "pp_bubble_s",
              "dp_comm_s", "offload_s", "optimizer_s")
COMM_TERMS = ("tp_comm_s", "cp_comm_s", "ep_comm_s", "pp_comm_s", "dp_comm_s")
MEMORY_TERMS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
                "buffers_bytes")


@dataclass(frozen=True, kw_only=True)
class MemoryBinding:
    """The stage whose reserved memory is closest to capacity, and its largest part."""

    stage: int
    reserved_bytes: int
    capacity_bytes: int
    largest_component: str
    """Name of the largest memory term (``params_bytes``, ..., ``buffers_bytes``)."""
    largest_component_bytes: int
    headroom_fraction: float
    """1 - reserved / capacity (from the unrounded bytes)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class TimeBinding:
    """The term that dominates the step, the largest communication term, the slowest stage."""

    dominant_term: str
    dominant_s: float
    step_s: float
    dominant_comm: str
    dominant_comm_s: float
    bottleneck_stage: int

    def to_dict(self) -> dict[str, Any]:
        return {"dominant_term": self.dominant_term, "dominant_s": self.dominant_s,
                "dominant_fraction": self.dominant_s / self.step_s,
                "dominant_comm": self.dominant_comm, "dominant_comm_s": self.dominant_comm_s,
                "bottleneck_stage": self.bottleneck_stage}


@dataclass(frozen=True, kw_only=True)
class Binding:
    memory: MemoryBinding
    time: TimeBinding

    def to_dict(self) -> dict[str, Any]:
        return {"memory": self.memory.to_dict(), "time": self.time.to_dict()}


@dataclass(frozen=True, kw_only=True)
class TermDelta:
    """How much one time term grows (``delta_s`` > 0) or shrinks in another plan."""

    term: str
    delta_s: float


@dataclass(frozen=True, kw_only=True)
class RunnerUp:
    """A plan of the same space that is not the explained one, and why it is slower."""

    estimate: Estimate
    delta_s: float
    """Its step minus the explained plan's step."""
    why: tuple[TermDelta, ...]

    def to_dict(self) -> dict[str, Any]:
        return {**summary(self.estimate), "step_s": self.estimate.time.step_s,
                "delta_s": self.delta_s,
                "why": [{"term": d.term, "delta_s": d.delta_s} for d in self.why]}


@dataclass(frozen=True, kw_only=True)
class Replanned:
    """The best plan after a change of the cluster (``best`` None: no plan fits, ``why``)."""

    change: str
    best: Estimate | None
    why: str = ""
    same_plan_step_s: float | None = None
    """The explained plan's own step on the changed cluster, where that was computed."""

    def to_dict(self) -> dict[str, Any]:
        if self.best is None:
            return {"change": self.change, "fits": False, "why": self.why}
        data = {"change": self.change, "fits": True, "step_s": self.best.time.step_s,
                "tokens_per_s": self.best.throughput.tokens_per_s,
                "num_gpus": self.best.cluster.num_gpus, "plan": summary(self.best)}
        if self.same_plan_step_s is not None:
            data["same_plan_step_s"] = self.same_plan_step_s
        return data


@dataclass(frozen=True, kw_only=True)
class SamePlanChange:
    """The explained plan with one choice changed (e.g. the next ZeRO stage)."""

    change: str
    estimate: Estimate
    base: Estimate

    def to_dict(self) -> dict[str, Any]:
        other, base = self.estimate, self.base
        return {"change": self.change, "step_s": other.time.step_s,
                "delta_s": other.time.step_s - base.time.step_s,
                "peak_reserved_bytes": int(other.memory.peak_reserved_bytes),
                "delta_peak_bytes": int(other.memory.peak_reserved_bytes
                                        - base.memory.peak_reserved_bytes),
                "fits": other.fits}


WhatIf = Replanned | SamePlanChange


@dataclass(frozen=True, kw_only=True)
class Explanation:
    """``meshplan explain``: the plan re-estimated, what binds, runners-up, what-ifs."""

    estimate: Estimate
    binding: Binding
    runners_up: tuple[RunnerUp, ...]
    what_if: tuple[WhatIf, ...]
    elasticity: Elasticity | None = None
    """What node failures cost, where a failure model was given."""

    def to_dict(self) -> dict[str, Any]:
        """The ``explain --json`` document (``elasticity`` only with a failure model)."""
        est = self.estimate
        data = {"plan": {**summary(est), "step_s": est.time.step_s,
                         "tokens_per_s": est.throughput.tokens_per_s,
                         "mfu": est.throughput.mfu, "fits": est.fits},
                "binding": self.binding.to_dict(),
                "runners_up": [r.to_dict() for r in self.runners_up],
                "what_if": [w.to_dict() for w in self.what_if]}
        if self.elasticity is not None:
            data["elasticity"] = self.elasticity.to_dict()
        return data


def explain(plan: Plan, *, calibration: Calibration, runners_up: int = 3,
            time_limit_s: float = 30.0, failures: FailureModel | None = None) -> Explanation:
    """Explain ``plan`` under ``calibration``; each search behind it is limited to
    ``time_limit_s``. With ``failures``, also the cost of node failures (``elasticity``)."""
    est = estimate(plan.model, plan.cluster, plan.config, framework=plan.framework,
                   calibration=calibration)
    pins = plan.provenance.get("pinned", {})
    space = space_with_pins(pins if isinstance(pins, dict) else {},
                            global_batch_size=plan.config.global_batch_size,
                            seq_len=plan.config.seq_len, dtype=plan.config.dtype,
                            flash_attention=plan.config.flash_attention)
    return Explanation(
        estimate=est, binding=binding(est),
        runners_up=_runners_up(plan, est, space, calibration, runners_up, time_limit_s),
        what_if=what_ifs(plan, est, space, calibration, time_limit_s),
        elasticity=failure_cost(est, failures) if failures is not None else None)


def binding(est: Estimate) -> Binding:
    """The stage whose memory is closest to capacity and the terms that dominate the step."""
    stage = max(est.memory.per_stage, key=lambda s: s.reserved_bytes)
    components = {name: getattr(stage, name) for name in MEMORY_TERMS}
    largest = max(components, key=components.get)
    times = {name: getattr(est.time, name) for name in TIME_TERMS}
    dominant = max(times, key=times.get)
    comm = max(COMM_TERMS, key=lambda name: times[name])
    return Binding(
        memory=MemoryBinding(stage=stage.stage, reserved_bytes=int(stage.reserved_bytes),
                             capacity_bytes=int(est.memory.capacity_bytes),
                             largest_component=largest,
                             largest_component_bytes=int(components[largest]),
                             headroom_fraction=1 - stage.reserved_bytes
                             / est.memory.capacity_bytes),
        time=TimeBinding(dominant_term=dominant, dominant_s=times[dominant],
                         step_s=est.time.step_s, dominant_comm=comm,
                         dominant_comm_s=times[comm],
                         bottleneck_stage=est.time.bottleneck_stage))


def _term_deltas(other: Estimate, est: Estimate) -> tuple[TermDelta, ...]:
    """Time terms where ``other`` differs most from ``est`` (largest increase first)."""
    deltas = [(name, getattr(other.time, name) - getattr(est.time, name)) for name in TIME_TERMS]
    deltas.sort(key=lambda d: -d[1])
    return tuple(TermDelta(term=name, delta_s=delta) for name, delta in deltas[:3]
                 if abs(delta) > 0)


def _runners_up(plan: Plan, est: Estimate, space: SearchSpace, calibration: Calibration,
                count: int, time_limit_s: float) -> tuple[RunnerUp, ...]:
    try:
        result = search(plan.model, plan.cluster, space, framework=plan.framework,
                        calibration=calibration, top_k=count + 1, time_limit_s=time_limit_s)
    except NoPlanFits:
        return ()
    out = [RunnerUp(estimate=solved.estimate,
                    delta_s=solved.estimate.time.step_s - est.time.step_s,
                    why=_term_deltas(solved.estimate, est))
           for solved in result.ranked if solved.estimate.config != est.config]
    return tuple(out[:count])


def what_ifs(plan: Plan, est: Estimate, space: SearchSpace, calibration: Calibration,
             time_limit_s: float) -> tuple[WhatIf, ...]:
    """One more node (re-planned), 2x inter-node bandwidth (same plan, and re-planned), the
    next ZeRO stage (same plan), and under torchtitan the settings the plan leaves off
    (``setting_changes``)."""
    out: list[WhatIf] = []
    bigger = dataclasses.replace(plan.cluster, nodes=plan.cluster.nodes + 1)
    out.append(_replanned("one more node", plan, bigger, space, calibration, time_limit_s))
    faster = dataclasses.replace(plan.cluster, nic_bytes_per_s=2 * plan.cluster.nic_bytes_per_s)
    same = estimate(plan.model, faster, plan.config, framework=plan.framework,
                    calibration=calibration)
    entry = _replanned("2x inter-node bandwidth", plan, faster, space, calibration,
                       time_limit_s)
    out.append(dataclasses.replace(entry, same_plan_step_s=same.time.step_s))
    if plan.config.zero_stage < 3 and plan.config.dp * plan.config.cp > 1:
        config: ParallelConfig = plan.config.replace(zero_stage=plan.config.zero_stage + 1)
        nxt = estimate(plan.model, plan.cluster, config, framework=plan.framework,
                       calibration=calibration)
        out.append(SamePlanChange(change=f"ZeRO-{config.zero_stage}", estimate=nxt, base=est))
    out += setting_changes(plan, est, calibration)
    return tuple(out)


def setting_changes(plan: Plan, est: Estimate,
                    calibration: Calibration) -> list[SamePlanChange]:
    """The same plan with what it leaves off of the run settings the planner does not search,
    where the framework's model prices them: under torchtitan, torch.compile of the blocks
    and the loss, float8 linears (bf16 plans on GPUs with float8 tensor cores) and, with
    them, a float8 LM head (an untied one), and async TP (compiled plans with
    sequence-parallel TP); under Megatron-LM, float8 linears and TP overlap (Transformer
    Engine; plans with sequence-parallel TP), the fused cross entropy, and the context-parallel
    exchanges other than the plan's that its layout runs (plans with cp > 1).
    Settings, not searched, because they are the user's call: compilation time, float8's
    numerics and async TP's symmetric memory. The exchange is searched unless pinned
    (``search.searched_exchanges``): its entries say what the plan's own saves over the
    others."""
    if plan.framework not in FLOAT8_FRAMEWORKS:
        return []
    config = plan.config
    torchtitan = plan.framework == "torchtitan"
    changes = []
    if torchtitan and config.compile != "model+loss":
        changes.append(("--compile model+loss", config.replace(compile="model+loss")))
    if not config.float8 and config.dtype == "bf16" \
            and "fp8" in plan.cluster.gpu.peak_flop_per_s:
        changes.append(("--float8", config.replace(float8=True)))
    if torchtitan and config.float8 and not config.float8_head \
            and not plan.model.tied_embeddings:
        changes.append(("--float8-head", config.replace(float8_head=True)))
    if torchtitan and config.tp > 1 and config.sp and config.compile != "none" \
            and not config.async_tp:
        changes.append(("--async-tp", config.replace(async_tp=True)))
    if plan.framework == "megatron" and config.tp > 1 and config.sp \
            and not config.tp_comm_overlap:
        changes.append(("--tp-comm-overlap", config.replace(tp_comm_overlap=True)))
    if plan.framework == "megatron" and not config.cross_entropy_fusion:
        changes.append(("--cross-entropy-fusion", config.replace(cross_entropy_fusion=True)))
    if config.cp > 1:
        own = cp_exchange(plan.framework, config.cp_comm_type)
        for exchange in CP_COMM_TYPES_BY_FRAMEWORK[plan.framework]:
            changed = config.replace(cp_comm_type=exchange)
            if exchange not in ("auto", own) \
                    and framework_layout_error(plan.framework, changed, plan.model) is None:
                changes.append((f"--cp-comm-type {exchange}", changed))
    return [SamePlanChange(change=name, base=est,
                           estimate=estimate(plan.model, plan.cluster, changed,
                                             framework=plan.framework,
                                             calibration=calibration))
            for name, changed in changes]


def _replanned(change: str, plan: Plan, cluster, space: SearchSpace,
               calibration: Calibration, time_limit_s: float) -> Replanned:
    try:
        result = search(plan.model, cluster, space, framework=plan.framework,
                        calibration=calibration, top_k=1, time_limit_s=time_limit_s)
    except (NoPlanFits, ValueError) as err:
        return Replanned(change=change, best=None, why=str(err))
    return Replanned(change=change, best=result.ranked[0].estimate)


def _describe(est: Estimate) -> str:
    c = est.config
    recompute = c.recompute if isinstance(c.recompute, str) else list(c.recompute)
    return (f"tp {c.tp} pp {c.pp} dp {c.dp} cp {c.cp} ZeRO-{c.zero_stage} {c.offload} "
            f"{recompute} mb {c.micro_batch_size} v {c.vpp}")


def _what_if_line(w: WhatIf) -> str:
    if isinstance(w, SamePlanChange):
        other, base = w.estimate, w.base
        delta_peak = int(other.memory.peak_reserved_bytes - base.memory.peak_reserved_bytes)
        return (f"  {w.change}: step {other.time.step_s:.3f} s "
                f"({other.time.step_s - base.time.step_s:+.3f} s), peak "
                f"{int(other.memory.peak_reserved_bytes) / 2**30:.1f} GiB "
                f"({delta_peak / 2**30:+.1f} GiB)")
    if w.best is None:
        return f"  {w.change}: no plan fits ({w.why})"
    extra = (f"; this plan alone: {w.same_plan_step_s:.3f} s"
             if w.same_plan_step_s is not None else "")
    return (f"  {w.change}: best step {w.best.time.step_s:.3f} s on "
            f"{w.best.cluster.num_gpus} GPUs, {w.best.throughput.tokens_per_s:,.0f} "
            f"tokens/s{extra}")


def render(explanation: Explanation) -> str:
    """The explanation as text."""
    est, mem, time = explanation.estimate, explanation.binding.memory, explanation.binding.time
    c = est.config
    recompute = c.recompute if isinstance(c.recompute, str) else list(c.recompute)
    lines = [f"plan: tp {c.tp} pp {c.pp} dp {c.dp} cp {c.cp} ep {c.ep}, "
             f"ZeRO-{c.zero_stage}, offload {c.offload}, recompute {recompute}, "
             f"micro-batch {c.micro_batch_size}, vpp {c.vpp}, layers "
             f"{list(c.stage_layers(est.model.num_layers))}{settings_text(c)}",
             f"  step {est.time.step_s:.3f} s, {est.throughput.tokens_per_s:,.0f} tokens/s, "
             f"MFU {est.throughput.mfu:.1%}, {'fits' if est.fits else 'DOES NOT FIT'}",
             "",
             "what binds:",
             f"  memory: stage {mem.stage} reserves {mem.reserved_bytes / 2**30:.1f} GiB "
             f"of {mem.capacity_bytes / 2**30:.1f} GiB ({mem.headroom_fraction:.0%} "
             f"headroom); its largest part is {mem.largest_component.replace('_bytes', '')} "
             f"({mem.largest_component_bytes / 2**30:.1f} GiB)",
             f"  time: {time.dominant_term.replace('_s', '')} is "
             f"{time.dominant_s / time.step_s:.0%} of the step; the largest communication "
             f"term is {time.dominant_comm.replace('_s', '')} ({time.dominant_comm_s:.3f} s); "
             f"bottleneck stage {time.bottleneck_stage}"]
    lines += ["", "runners-up:"]
    for r in explanation.runners_up:
        why = ", ".join(f"{d.term.replace('_s', '')} {d.delta_s:+.3f} s" for d in r.why)
        lines.append(f"  {_describe(r.estimate)}: {r.estimate.time.step_s:.3f} s "
                     f"({r.delta_s:+.3f} s; {why or 'same terms'})")
    if not explanation.runners_up:
        lines.append("  (none found)")
    lines += ["", "what if:"]
    lines += [_what_if_line(w) for w in explanation.what_if]
    if explanation.elasticity is not None:
        lines += ["", *_elasticity_lines(explanation.elasticity)]
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    """``seconds`` in the largest unit that keeps it >= 1 (s, min, h, days), 3 digits or more."""
    value, unit = next(((seconds / size, unit) for unit, size in
                        (("days", 86400.0), ("h", 3600.0), ("min", 60.0)) if seconds >= size),
                       (seconds, "s"))
    return f"{value:,.0f} {unit}" if value >= 100 else f"{value:.3g} {unit}"


def _seconds(seconds: float) -> str:
    return f"{seconds:,.0f} s ({_duration(seconds)})" if seconds >= 60 else _duration(seconds)


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.3g}%"


def _interval_line(label: str, cost: IntervalCost) -> str:
    steps = f"{cost.every_steps:,} step{'s' if cost.every_steps > 1 else ''}"
    return (f"  {label}: save every {steps} = {_seconds(cost.interval_s)}: "
            f"{_percent(cost.loss_fraction)} "
            f"of the time lost (saves {_percent(cost.save_fraction)}, failures "
            f"{_percent(cost.loss_fraction - cost.save_fraction)}); a failure loses "
            f"{_duration(cost.lost_per_failure_s)}")


def _elasticity_lines(e: Elasticity) -> list[str]:
    f, ckpt = e.failures, e.checkpoint
    lines = [f"elasticity: node MTBF {f.node_mtbf_s / 3600:,.6g} h over {e.nodes} nodes: the job "
             f"fails every {_duration(e.job_mtbf_s)} on average",
             f"  checkpoint: {ckpt.total_bytes / 1e9:,.1f} GB of parameters and optimizer "
             f"states; per node a save writes {ckpt.write_bytes_per_node / 1e9:,.1f} GB, a load "
             f"reads {ckpt.load_bytes_per_node / 1e9:,.1f} GB",
             f"  a save blocks training (saves are synchronous in meshplan's runtime) for "
             f"{_duration(e.save_s)}: write {_duration(e.save_write_s)} at "
             f"{f.write_bytes_per_s / 1e9:g} GB/s, hash read-back {_duration(e.verify_s)}",
             f"  a failure costs restart {_duration(f.restart_s)} + replan "
             f"{_duration(f.replan_s)} + reshard {_duration(e.reshard_s)} (hash "
             f"{_duration(e.verify_s)}, read {_duration(e.load_s)} at "
             f"{f.read_bytes_per_s / 1e9:g} GB/s) + the work since the last save (on average "
             "half an interval and its save)",
             f"  optimal interval: {_seconds(e.daly_interval_s)} of work (Daly 2006; Young "
             f"1974: {e.young_interval_s:,.0f} s), in steps of {e.step_s:.3f} s:",
             _interval_line("optimal", e.optimal)]
    if e.chosen is not None:
        lines.append(_interval_line(f"--checkpoint-every {e.chosen.every_steps}", e.chosen))
    if e.job_mtbf_s < e.save_s + e.recovery_s:
        lines.append(f"  the job fails more often than it can save and recover "
                     f"({_duration(e.save_s + e.recovery_s)}): it makes almost no progress")
    return lines
