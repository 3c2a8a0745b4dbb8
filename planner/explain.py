"""``meshplan explain``: why a plan, what binds it, how the runners-up lose, and what-ifs.

Everything is recomputed from the plan file with the cost model (so the explanation reflects
the calibration in use) and one search of the same space for the runners-up and the what-ifs:
one more node, twice the inter-node bandwidth, and the next ZeRO stage.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from meshplan.costmodel import Calibration, ParallelConfig, estimate
from meshplan.costmodel.estimate import Estimate
from meshplan.planner.plan import Plan
from meshplan.planner.planning import summary
from meshplan.planner.search import NoPlanFits, search
from meshplan.planner.space import SearchSpace, space_with_pins

TIME_TERMS = ("compute_s", "tp_comm_s", "cp_comm_s", "ep_comm_s", "pp_comm_s", "pp_bubble_s",
              "dp_comm_s", "offload_s", "optimizer_s")
COMM_TERMS = ("tp_comm_s", "cp_comm_s", "ep_comm_s", "pp_comm_s", "dp_comm_s")
MEMORY_TERMS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
                "buffers_bytes")


def explain(plan: Plan, *, calibration: Calibration, runners_up: int = 3,
            time_limit_s: float = 30.0) -> dict[str, Any]:
    """The explanation as JSON-ready data."""
    est = estimate(plan.model, plan.cluster, plan.config, framework=plan.framework,
                   calibration=calibration)
    pins = plan.provenance.get("pinned", {})
    space = space_with_pins(pins if isinstance(pins, dict) else {},
                            global_batch_size=plan.config.global_batch_size,
                            seq_len=plan.config.seq_len, dtype=plan.config.dtype,
                            flash_attention=plan.config.flash_attention)
    return {"plan": {**summary(est), "step_s": est.time.step_s,
                     "tokens_per_s": est.throughput.tokens_per_s, "mfu": est.throughput.mfu,
                     "fits": est.fits},
            "binding": binding(est),
            "runners_up": _runners_up(plan, est, space, calibration, runners_up, time_limit_s),
            "what_if": what_ifs(plan, est, space, calibration, time_limit_s)}


def binding(est: Estimate) -> dict[str, Any]:
    """The stage whose memory is closest to capacity and the terms that dominate the step."""
    stage = max(est.memory.per_stage, key=lambda s: s.reserved_bytes)
    components = {name: getattr(stage, name) for name in MEMORY_TERMS}
    largest = max(components, key=components.get)
    times = {name: getattr(est.time, name) for name in TIME_TERMS}
    dominant = max(times, key=times.get)
    comm = max(COMM_TERMS, key=lambda name: times[name])
    return {"memory": {"stage": stage.stage, "reserved_bytes": int(stage.reserved_bytes),
                       "capacity_bytes": int(est.memory.capacity_bytes),
                       "headroom_fraction": 1 - stage.reserved_bytes / est.memory.capacity_bytes,
                       "largest_component": largest,
                       "largest_component_bytes": int(components[largest])},
            "time": {"dominant_term": dominant, "dominant_s": times[dominant],
                     "dominant_fraction": times[dominant] / est.time.step_s,
                     "dominant_comm": comm, "dominant_comm_s": times[comm],
                     "bottleneck_stage": est.time.bottleneck_stage}}


def _term_deltas(other: Estimate, est: Estimate) -> list[dict[str, float]]:
    """Time terms where ``other`` differs most from ``est`` (largest increase first)."""
    deltas = [(name, getattr(other.time, name) - getattr(est.time, name)) for name in TIME_TERMS]
    deltas.sort(key=lambda d: -d[1])
    return [{"term": name, "delta_s": delta} for name, delta in deltas[:3] if abs(delta) > 0]


def _runners_up(plan: Plan, est: Estimate, space: SearchSpace, calibration: Calibration,
                count: int, time_limit_s: float) -> list[dict[str, Any]]:
    try:
        result = search(plan.model, plan.cluster, space, framework=plan.framework,
                        calibration=calibration, top_k=count + 1, time_limit_s=time_limit_s)
    except NoPlanFits:
        return []
    out = []
    for solved in result.ranked:
        other = solved.estimate
        if other.config == est.config:
            continue
        out.append({**summary(other), "step_s": other.time.step_s,
                    "delta_s": other.time.step_s - est.time.step_s,
                    "why": _term_deltas(other, est)})
    return out[:count]


def what_ifs(plan: Plan, est: Estimate, space: SearchSpace, calibration: Calibration,
             time_limit_s: float) -> list[dict[str, Any]]:
    """One more node (re-planned), 2x inter-node bandwidth (same plan, and re-planned), the
    next ZeRO stage (same plan)."""
    out = []
    bigger = dataclasses.replace(plan.cluster, nodes=plan.cluster.nodes + 1)
    out.append(_replanned("one more node", plan, bigger, space, calibration, time_limit_s))
    faster = dataclasses.replace(plan.cluster, nic_bytes_per_s=2 * plan.cluster.nic_bytes_per_s)
    same = estimate(plan.model, faster, plan.config, framework=plan.framework,
                    calibration=calibration)
    entry = _replanned("2x inter-node bandwidth", plan, faster, space, calibration,
                       time_limit_s)
    entry["same_plan_step_s"] = same.time.step_s
    out.append(entry)
    if plan.config.zero_stage < 3 and plan.config.dp * plan.config.cp > 1:
        config: ParallelConfig = plan.config.replace(zero_stage=plan.config.zero_stage + 1)
        nxt = estimate(plan.model, plan.cluster, config, framework=plan.framework,
                       calibration=calibration)
        out.append({"change": f"ZeRO-{config.zero_stage}", "step_s": nxt.time.step_s,
                    "delta_s": nxt.time.step_s - est.time.step_s,
                    "peak_reserved_bytes": int(nxt.memory.peak_reserved_bytes),
                    "delta_peak_bytes": int(nxt.memory.peak_reserved_bytes
                                            - est.memory.peak_reserved_bytes),
                    "fits": nxt.fits})
    return out


def _replanned(change: str, plan: Plan, cluster, space: SearchSpace,
               calibration: Calibration, time_limit_s: float) -> dict[str, Any]:
    try:
        result = search(plan.model, cluster, space, framework=plan.framework,
                        calibration=calibration, top_k=1, time_limit_s=time_limit_s)
    except (NoPlanFits, ValueError) as err:
        return {"change": change, "fits": False, "why": str(err)}
    best = result.ranked[0].estimate
    return {"change": change, "fits": True, "step_s": best.time.step_s,
            "tokens_per_s": best.throughput.tokens_per_s,
            "num_gpus": cluster.num_gpus, "plan": summary(best)}


def render(data: dict[str, Any]) -> str:
    """The explanation as text."""
    p, bind = data["plan"], data["binding"]
    mem, time = bind["memory"], bind["time"]
    lines = [f"plan: tp {p['tp']} pp {p['pp']} dp {p['dp']} cp {p['cp']} ep {p['ep']}, "
             f"ZeRO-{p['zero_stage']}, offload {p['offload']}, recompute {p['recompute']}, "
             f"micro-batch {p['micro_batch_size']}, vpp {p['vpp']}, layers "
             f"{p['layers_per_stage']}",
             f"  step {p['step_s']:.3f} s, {p['tokens_per_s']:,.0f} tokens/s, "
             f"MFU {p['mfu']:.1%}, {'fits' if p['fits'] else 'DOES NOT FIT'}",
             "",
             "what binds:",
             f"  memory: stage {mem['stage']} reserves {mem['reserved_bytes'] / 2**30:.1f} GiB "
             f"of {mem['capacity_bytes'] / 2**30:.1f} GiB ({mem['headroom_fraction']:.0%} "
             f"headroom); its largest part is {mem['largest_component'].replace('_bytes', '')} "
             f"({mem['largest_component_bytes'] / 2**30:.1f} GiB)",
             f"  time: {time['dominant_term'].replace('_s', '')} is "
             f"{time['dominant_fraction']:.0%} of the step; the largest communication term is "
             f"{time['dominant_comm'].replace('_s', '')} ({time['dominant_comm_s']:.3f} s); "
             f"bottleneck stage {time['bottleneck_stage']}"]
    lines += ["", "runners-up:"]
    for r in data["runners_up"] or []:
        why = ", ".join(f"{d['term'].replace('_s', '')} {d['delta_s']:+.3f} s"
                        for d in r["why"])
        lines.append(f"  tp {r['tp']} pp {r['pp']} dp {r['dp']} cp {r['cp']} "
                     f"ZeRO-{r['zero_stage']} {r['offload']} {r['recompute']} "
                     f"mb {r['micro_batch_size']} v {r['vpp']}: {r['step_s']:.3f} s "
                     f"({r['delta_s']:+.3f} s; {why or 'same terms'})")
    if not data["runners_up"]:
        lines.append("  (none found)")
    lines += ["", "what if:"]
    for w in data["what_if"]:
        if not w.get("fits", True):
            lines.append(f"  {w['change']}: no plan fits ({w.get('why', '')})")
        elif "delta_peak_bytes" in w:
            lines.append(f"  {w['change']}: step {w['step_s']:.3f} s ({w['delta_s']:+.3f} s), "
                         f"peak {w['peak_reserved_bytes'] / 2**30:.1f} GiB "
                         f"({w['delta_peak_bytes'] / 2**30:+.1f} GiB)")
        else:
            extra = (f"; this plan alone: {w['same_plan_step_s']:.3f} s"
                     if "same_plan_step_s" in w else "")
            lines.append(f"  {w['change']}: best step {w['step_s']:.3f} s on {w['num_gpus']} "
                         f"GPUs, {w['tokens_per_s']:,.0f} tokens/s{extra}")
    return "\n".join(lines)
