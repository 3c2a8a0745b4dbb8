"""Human-readable tables for the CLI: the catalogs and one estimate.

Formatting only (the CLI's edge, STYLE.md habit 2): bytes become GiB (2**30), bandwidths GB/s
(1e9 bytes/s), FLOP/s TFLOP/s (1e12). Every function returns a string; the CLI prints it.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: `meshplan models` does not load the estimator
    from meshplan.costmodel import ClusterSpec, Estimate, ModelSpec, ParallelConfig

GIB = 2**30
"""Bytes per GiB."""
GB = 1e9
"""Bytes per GB."""
TERA = 1e12
"""FLOP/s per TFLOP/s."""
BILLION = 1e9
"""Parameters per B."""
MILLION = 1e6
"""Parameters per M."""

_TIME_ROWS = (
    ("compute", "compute_s"),
    ("tensor-parallel comm", "tp_comm_s"),
    ("context-parallel comm", "cp_comm_s"),
    ("expert-parallel comm", "ep_comm_s"),
    ("pipeline p2p comm", "pp_comm_s"),
    ("data-parallel comm (exposed)", "dp_comm_s"),
    ("pipeline bubble", "pp_bubble_s"),
    ("offload", "offload_s"),
    ("optimizer step", "optimizer_s"),
)
"""Rows of the time table: the terms that add up to ``step_s`` (communication as exposed)."""


def _table(rows: list[dict], formats: dict[str, str] | None = None,
           default_format: str = "{:.2f}") -> str:
    """``rows`` as a text table; ``formats`` maps a column to its format (floats only).

    The layout of pandas' ``DataFrame(rows).to_string(index=False)`` with one formatter per
    float column, without importing pandas (``meshplan models`` stays light): columns in order
    of first appearance, right-aligned, one space apart; an integer column's header gets one
    leading space; a value a row lacks (or ``None`` in a numeric or text column) reads NaN.
    Columns that mix floats with text or booleans (none of ours) print the floats with ``str``.
    """
    columns = list(dict.fromkeys(key for row in rows for key in row))
    if not columns:
        return "Empty DataFrame\nColumns: []\nIndex: []"
    cells = []
    for column in columns:
        header, texts = _column_cells([row.get(column, _MISSING) for row in rows],
                                      (formats or {}).get(column, default_format))
        header = header + column
        width = max(len(header), *(len(t) for t in texts))
        cells.append([header.rjust(width)] + [t.rjust(width) for t in texts])
    return "\n".join(" ".join(line) for line in zip(*cells))


_MISSING = object()
"""A key a row does not have."""
_ESCAPES = str.maketrans({"\t": "\\t", "\n": "\\n", "\r": "\\r"})


def _column_cells(values: list, float_format: str) -> tuple[str, list[str]]:
    """(header prefix, cell texts) of one column, typed as pandas infers it from the values."""
    present = [v for v in values if v is not _MISSING and v is not None]
    if present and all(isinstance(v, bool) for v in present) and len(present) == len(values):
        return " ", [str(v) for v in values]
    numeric = all(isinstance(v, (numbers.Integral, float)) and not isinstance(v, bool)
                  for v in present)
    if present and numeric:
        if len(present) == len(values) and all(isinstance(v, numbers.Integral)
                                               for v in present):
            return " ", [str(v) for v in values]
        return "", [float_format.format(float(v)) if v is not _MISSING and v is not None
                    else "NaN" for v in values]
    if present and all(isinstance(v, str) for v in present):
        return "", [v.translate(_ESCAPES) if isinstance(v, str) else "NaN" for v in values]
    if not present and _MISSING in values:  # only None and gaps: a column of NaN
        return "", ["NaN"] * len(values)
    return "", ["NaN" if v is _MISSING else str(v).translate(_ESCAPES) for v in values]


def models_table(models: Iterable[ModelSpec]) -> str:
    """One row per model: sizes, activation and MoE shape."""
    rows = [{"name": m.name, "params (B)": m.num_params / BILLION, "layers": m.num_layers,
             "hidden": m.hidden_size, "heads": m.num_heads, "kv heads": m.kv_heads,
             "ffn": m.ffn_hidden_size, "vocab": m.vocab_size, "seq": m.seq_len,
             "activation": m.activation,
             "experts/top-k": f"{m.num_experts}/{m.moe_top_k}" if m.is_moe else "-"}
            for m in models]
    return _table(rows, {"params (B)": "{:.4g}"})


def layers_table(model: ModelSpec) -> str:
    """A traced model's layers: kind, parameters, FLOPs and bytes per sequence."""
    rows = [{"layer": layer.name, "kind": layer.kind, "params (M)": layer.params / MILLION,
             "fwd GFLOP": layer.fwd_flop / 1e9, "bwd GFLOP": layer.bwd_flop / 1e9,
             "saved MB": layer.saved_bytes / 1e6, "output MB": layer.output_bytes / 1e6}
            for layer in model.traced]
    head = (f"{model.name}: {len(model.traced)} traced layers, "
            f"{_params_text(model.num_params)} params, per sequence of {model.seq_len} "
            f"tokens at {model.traced_dtype_bytes} bytes per element; "
            f"{'a chain of its layers' if model.traced_chain else 'not a chain'}")
    return head + "\n" + _table(rows, default_format="{:.4g}")


def clusters_table(clusters: Iterable[ClusterSpec]) -> str:
    """One row per cluster template (one node)."""
    rows = [{"name": c.name, "gpu": c.gpu.key, "gpus/node": c.gpus_per_node,
             "NIC GB/s": c.nic_bytes_per_s / GB, "HBM GiB": c.gpu.hbm_bytes / GIB,
             "peak bf16 TFLOP/s": c.gpu.peak("bf16") / TERA}
            for c in clusters]
    return _table(rows, {"peak bf16 TFLOP/s": "{:.4g}"}, default_format="{:.1f}")


def _params_text(num_params: int) -> str:
    if num_params >= BILLION:
        return f"{num_params / BILLION:.2f} B"
    return f"{num_params / MILLION:.2f} M"


def _header(est: Estimate) -> str:
    m, c, cfg = est.model, est.cluster, est.config
    recompute = cfg.recompute if isinstance(cfg.recompute, str) else ",".join(cfg.recompute)
    offload = "none" if cfg.offload == "none" else f"{cfg.offload} to {cfg.offload_device}"
    return "\n".join([
        f"{m.name} ({_params_text(m.num_params)} params) on {c.name}: {c.nodes} node(s) x "
        f"{c.gpus_per_node} {c.gpu.key} = {c.num_gpus} GPUs, framework {est.framework}",
        f"plan: tp {cfg.tp} x pp {cfg.pp} x dp {cfg.dp} x cp {cfg.cp}, ep {cfg.ep}, "
        f"sp {'on' if cfg.sp else 'off'}, ZeRO-{cfg.zero_stage}, offload {offload}, "
        f"recompute {recompute}, vpp {cfg.vpp}, micro-batch {cfg.micro_batch_size}, "
        f"global batch {cfg.global_batch_size} ({cfg.grad_accum_steps} micro-batches), "
        f"seq {cfg.seq_len}, {cfg.dtype}, layers/stage "
        f"{','.join(map(str, cfg.stage_layers(m.num_layers)))}{settings_text(cfg)}",
    ])


def settings_text(cfg: ParallelConfig) -> str:
    """torch.compile, float8 training, async TP, Megatron-LM's TP overlap, fused cross
    entropy, an attention kernel other than the framework's and a context-parallel exchange
    other than its own where the plan sets them, as
    ``, ...`` parts."""
    float8 = "float8 linears and LM head" if cfg.float8_head else "float8 linears"
    parts = [f"torch.compile {cfg.compile}" if cfg.compile != "none" else "",
             float8 if cfg.float8 else "",
             "async TP" if cfg.async_tp and cfg.tp > 1 and cfg.sp else "",
             "TP overlap" if cfg.tp_comm_overlap and cfg.tp > 1 and cfg.sp else "",
             "fused cross entropy" if cfg.cross_entropy_fusion else "",
             f"{cfg.attention_kernel} attention" if cfg.attention_kernel != "auto" else "",
             f"cp exchange {cfg.cp_comm_type}" if cfg.cp_comm_type != "auto" and cfg.cp > 1
             else ""]
    return "".join(f", {part}" for part in parts if part)


def memory_table(est: Estimate) -> str:
    """Per-stage bytes per GPU, in GiB."""
    rows = [{"stage": s.stage, "layers": s.layers, "params": s.params_bytes / GIB,
             "grads": s.grads_bytes / GIB, "optimizer": s.optimizer_bytes / GIB,
             "activations": s.activations_bytes / GIB, "buffers": s.buffers_bytes / GIB,
             "peak": s.peak_bytes / GIB, "reserved": s.reserved_bytes / GIB}
            for s in est.memory.per_stage]
    return _table(rows)


def time_table(est: Estimate) -> str:
    """Seconds per step by component, with their share of the step."""
    t = est.time
    rows = [{"component": label, "seconds": getattr(t, attr),
             "% of step": 100 * getattr(t, attr) / t.step_s}
            for label, attr in _TIME_ROWS]
    if t.host_wait_s > 0:  # part of compute: shown under it, not added to the step again
        rows.insert(1, {"component": "  of which waiting on the host", "seconds": t.host_wait_s,
                        "% of step": 100 * t.host_wait_s / t.step_s})
    rows.append({"component": "step", "seconds": t.step_s, "% of step": 100.0})
    return _table(rows, {"seconds": "{:.4f}", "% of step": "{:.1f}"})


def estimate_report(est: Estimate) -> str:
    """The whole readable report of ``meshplan estimate``."""
    mem, c, th = est.memory, est.cluster, est.throughput
    verdict = "FITS" if est.fits else f"DOES NOT FIT: {est.why_not}"
    from meshplan.costmodel.layout import framework_layout_error

    refusal = framework_layout_error(est.framework, est.config, est.model)
    if refusal is not None:  # priced all the same; the planner would not choose it
        verdict += f"\nnote: {refusal}"
    return "\n".join([
        _header(est),
        "",
        f"Memory per GPU (GiB; capacity {mem.capacity_bytes / GIB:.2f})",
        memory_table(est),
        f"peak {mem.peak_bytes / GIB:.2f} GiB allocated, {mem.peak_reserved_bytes / GIB:.2f} GiB "
        f"reserved; model states {mem.model_states_bytes / GIB:.2f} GiB",
        f"host memory per node {mem.cpu_bytes_per_node / GIB:.2f} GiB of "
        f"{c.host_bytes / GIB:.2f}; NVMe per node {mem.nvme_bytes_per_node / GIB:.2f} GiB of "
        f"{c.nvme_bytes / GIB:.2f}",
        "",
        f"Time per step (bottleneck stage {est.time.bottleneck_stage}; exposed communication "
        f"{est.time.exposed_comm_s:.4f} s)",
        time_table(est),
        "",
        f"tokens/s {th.tokens_per_s:,.0f}   TFLOP/s per GPU "
        f"{th.model_flop_per_s_per_gpu / TERA:.4g}   MFU {100 * th.mfu:.1f}%",
        verdict,
    ])


def _offload_cell(config) -> str:
    """The offload column, short: ``opt`` (optimizer states) or ``opt+params``, ``:nvme`` when
    they go to NVMe rather than host memory."""
    if config.offload == "none":
        return "none"
    what = config.offload.replace("optimizer", "opt")
    return what if config.offload_device == "cpu" else f"{what}:{config.offload_device}"


def plans_report(result, *, model: ModelSpec, cluster: ClusterSpec, objective: str,
                 memory_margin: float = 0.0, seq_source: str | None = None) -> str:
    """Ranked plans of ``meshplan plan`` as a table, with the solver's status."""
    from meshplan.costmodel.frameworks import cp_exchange

    rows = []
    exchanges = any(plan.config.cp > 1 for plan in result.plans)
    for plan in result.plans:
        c, predicted = plan.config, plan.prediction
        recompute = c.recompute if isinstance(c.recompute, str) else ",".join(c.recompute)
        row = {"rank": plan.provenance.get("rank")}
        if objective == "cost":  # plans of several node counts
            row["gpus"] = c.world_size
        row |= {"tp": c.tp, "pp": c.pp, "dp": c.dp, "cp": c.cp}
        if exchanges:  # how context parallelism exchanges keys and values (--cp-comm-type)
            row["exchange"] = cp_exchange(plan.framework, c.cp_comm_type) if c.cp > 1 else "-"
        row |= {"ep": c.ep, "sp": "on" if c.sp else "off", "zero": c.zero_stage,
                "offload": _offload_cell(c),
                "recompute": recompute, "mb": c.micro_batch_size, "vpp": c.vpp,
                "layers": layers_summary(c.stage_layers(plan.model.num_layers)),
                "mesh": "".join(axis[0] for axis in c.mesh_order),
                "step s": predicted.time.step_s,
                "tokens/s": predicted.throughput.tokens_per_s,
                "MFU": predicted.throughput.mfu,
                "peak GiB": predicted.memory.peak_reserved_bytes / GIB,
                "free GiB": plan.cluster.gpu.hbm_bytes / GIB
                - predicted.memory.peak_reserved_bytes / GIB}
        if objective == "cost":  # the batch is fixed: tokens/s follows the step time
            del row["tokens/s"]
        if "train_days" in plan.provenance:
            row["days"] = plan.provenance["train_days"]
        if "train_cost" in plan.provenance:
            row["cost"] = plan.provenance["train_cost"]
        rows.append(row)
    _mark_differences(rows)
    table = _table(rows, {"step s": "{:.3f}", "tokens/s": "{:,.0f}", "MFU": "{:.1%}",
                          "peak GiB": "{:.1f}", "free GiB": "{:.1f}", "days": "{:.1f}",
                          "cost": "{:,.0f}"})
    best = result.plans[0].config if result.plans else None
    header = (f"{model.name} ({_params_text(model.num_params)} params) on {cluster.name}: "
              f"up to {cluster.num_gpus} {cluster.gpu.key}; objective {objective}")
    if best is not None:
        header += (f"\nglobal batch {best.global_batch_size} x sequence {best.seq_len} "
                   f"({seq_source or 'given'}); memory margin {memory_margin:.0%} of "
                   f"{cluster.gpu.hbm_bytes / GIB:.1f} GiB kept free for the CUDA context, "
                   f"NCCL and the allocator")
    gap = getattr(result, "gap", 0.0)
    status = result.status if result.status == "OPTIMAL" else (
        f"{result.status} (the best plan is at most {gap:.1%} slower than the optimum)")
    footer = (f"solver {status}: {result.candidates} candidates, "
              f"{result.wall_s:.2f} s; Pareto front (step time vs memory): "
              f"{len(result.pareto)} plans")
    legend = ["'=': the same choice as rank 1"] if len(rows) > 1 else []
    return "\n".join([header, "", table, *legend, "", footer])


def layers_summary(layers) -> str:
    """Stage layer counts run-length encoded: ``(12, 12, 13, 13)`` -> ``2x12 + 2x13``."""
    parts, runs = [], []
    for n in layers:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    for n, count in runs:
        parts.append(str(n) if count == 1 else f"{count}x{n}")
    return " + ".join(parts)


_IDENTITY = ("tp", "pp", "dp", "cp", "exchange", "ep", "sp", "zero", "offload", "recompute",
             "mb", "vpp", "layers", "mesh")


def _mark_differences(rows: list[dict]) -> None:
    """Runner-ups show only what differs from the best plan ('=' where a choice is the same),
    so plans that differ in one choice read apart at a glance."""
    if len(rows) < 2:
        return
    first = rows[0]
    for row in rows[1:]:
        for key in _IDENTITY:
            if key in row and row[key] == first[key]:
                row[key] = "="
