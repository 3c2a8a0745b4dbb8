"""Collective calls the runtime issues per micro-batch, and their fixed host cost.

``Calibration.collective_call_s`` charges each call once per one-hop step of its algorithm
(``latency_steps``); on NCCL the value is 0, on gloo over loopback it is what a refit finds
(``meshplan validate --refit``). The counts follow what each framework really issues: TP/SP
collectives per layer, pipeline sends, ZeRO-2/3 (FSDP2) gathers and reduce-scatters per wrapped
block, DDP gradient buckets. ``timing.py`` adds the cost to each stage's time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshplan.costmodel import collectives as coll
from meshplan.costmodel.calibration import Calibration
from meshplan.costmodel.config import ParallelConfig
from meshplan.costmodel.memory import stage_layer_range
from meshplan.costmodel.model import ModelSpec

DDP_BUCKET_BYTES = 25 * 2**20
"""Gradient bucket of ``DistributedDataParallel`` (``bucket_cap_mb=25``): one all-reduce per
bucket and step."""
LOSS_REDUCTION_CALLS = 1
"""All-reduces of the logged loss over all ranks, once per step (runtime/train.py)."""


def latency_steps(op: str, n: int) -> float:
    """One-hop latency steps one call of ``op`` over ``n`` ranks pays in ``collective_call_s``.

    The fewest steps among ``collectives.algorithms(op, n)``, whatever the message size (the
    host cost of a call does not depend on its bytes): all-reduce ``2 log2 n`` (the double
    binary tree; the ring's ``2 (n-1)`` is never fewer), all-gather ``min(n-1, 2 log2 n)``,
    send/recv 1; 0 for one rank. A reduce-scatter pays an all-reduce's steps: gloo's costs as
    much as an all-reduce of the same input (2 ranks, 32 KiB on this CPU: 0.31 ms against
    0.28 ms, all-gather 0.21 ms).
    """
    if op not in CALL_OPS:
        raise ValueError(f"op must be one of {', '.join(CALL_OPS)}, got {op!r}")
    if n <= 1:
        return 0.0
    costed_as = "all_reduce" if op == "reduce_scatter" else op
    return min(a.latency_steps for a in coll.algorithms(costed_as, n))


CALL_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
"""Collectives whose calls ``collective_call_s`` charges (``collective_calls_per_microbatch``)."""


@dataclass(frozen=True, kw_only=True)
class CollectiveCalls:
    """Collective calls one micro-batch issues on one rank of a stage, by group and kind."""

    tp_all_reduce: int = 0
    tp_all_gather: int = 0
    tp_reduce_scatter: int = 0
    pp_send_recv: int = 0
    zero_all_gather: int = 0
    """ZeRO-2/3 (FSDP2) parameter all-gathers."""
    zero_reduce_scatter: int = 0
    """ZeRO-2/3 (FSDP2) gradient reduce-scatters."""


def tp_calls_per_layer(model: ModelSpec, config: ParallelConfig, framework: str, *,
                       recompute: str) -> tuple[int, int, int]:
    """(all-reduces, all-gathers, reduce-scatters) of one layer's TP/SP for one micro-batch.

    Megatron-LM fuses Q, K, V (and the MLP input projections) into one column-parallel GEMM: 2
    forward and 2 backward all-reduces, or with SP an all-gather and a reduce-scatter in place
    of each (Korthikanti et al. 2022, arXiv:2205.05198, Sec. 4.2.2). The meshplan runtime
    (``parallelize_module``, runtime/parallelize.py) keeps them apart: without SP each
    column-parallel linear (wq, wk, wv, w1 and SwiGLU's w3) all-reduces its own input gradient;
    with SP the gathered input's gradient is reduce-scattered once per sub-block, as in
    Megatron, plus one all-reduce per norm for its replicated weight's gradient. Full recompute
    repeats the forward calls; selective recompute keeps collective outputs (no extra call).
    """
    if config.tp == 1:
        return 0, 0, 0
    repeat = 2 if recompute == "full" else 1
    meshplan = framework == "meshplan"
    if config.sp:  # forward: gather before, scatter after each sub-block; backward: the duals
        return (2 if meshplan else 0), 2 * repeat + 2, 2 * repeat + 2
    mats = 3 if model.activation == "swiglu" else 2
    return 2 * repeat + (3 + mats - 1 if meshplan else 2), 0, 0


def collective_calls_per_microbatch(model: ModelSpec, config: ParallelConfig, stage: int, *,
                                    framework: str, recompute: str) -> CollectiveCalls:
    """Collective calls of one micro-batch on a rank of ``stage``, counted as the meshplan
    runtime issues them (torch 2.13, gloo; checked with ``torch.profiler`` on the CPU).

    TP: ``tp_calls_per_layer`` per layer, plus the vocabulary-parallel embedding (forward
    all-reduce; with SP a reduce-scatter and its backward all-gather) and LM head (backward
    all-reduce of its input gradient; with SP an all-gather and its backward reduce-scatter).
    PP: one blocking call per pipeline neighbour and virtual chunk (torch's 1F1B batches each
    send with the receive of the opposite direction in one ``batch_isend_irecv``, so an end
    stage waits once per micro-batch, a middle stage twice). ZeRO-2/3 (FSDP2, one group per
    block plus a root group holding the embedding / head): every group all-gathers its
    parameters once per micro-batch, twice under ZeRO-3 when they are resharded after forward
    (pp = 1, runtime/parallelize.py), and reduce-scatters its gradients once. Not counted:
    ZeRO-1's per-parameter broadcasts (``ZeroRedundancyOptimizer``, once per step) and
    ``replicate``'s gradient all-reduces under TP; they need the parameter tensor count.
    """
    layers = len(stage_layer_range(model, config, stage))
    edges = int(stage == 0) + int(stage == config.pp - 1)
    calls: dict[str, int] = {}
    if config.tp > 1:
        reduces, gathers, scatters = tp_calls_per_layer(model, config, framework,
                                                        recompute=recompute)
        calls.update(tp_all_reduce=layers * reduces + (0 if config.sp else edges),
                     tp_all_gather=layers * gathers + (edges if config.sp else 0),
                     tp_reduce_scatter=layers * scatters + (edges if config.sp else 0))
    if config.pp > 1:
        calls["pp_send_recv"] = config.vpp * (int(stage > 0) + int(stage < config.pp - 1))
    if config.zero_stage >= 2 and config.dp * config.cp > 1:
        groups = layers + (1 if edges else 0)
        calls.update(zero_all_gather=groups * (2 if config.zero_stage == 3 and config.pp == 1
                                               else 1),
                     zero_reduce_scatter=groups)
    return CollectiveCalls(**calls)


def call_overhead_s(calls: CollectiveCalls, config: ParallelConfig,
                    calibration: Calibration) -> tuple[float, float, float]:
    """(tp, pp, zero) seconds of ``collective_call_s`` per latency step of each call."""
    call_s, tp, dp = calibration.collective_call_s, config.tp, config.dp * config.cp
    tp_s = call_s * (calls.tp_all_reduce * latency_steps("all_reduce", tp)
                     + calls.tp_all_gather * latency_steps("all_gather", tp)
                     + calls.tp_reduce_scatter * latency_steps("reduce_scatter", tp))
    pp_s = call_s * calls.pp_send_recv * latency_steps("send_recv", 2)
    zero_s = call_s * (calls.zero_all_gather * latency_steps("all_gather", dp)
                       + calls.zero_reduce_scatter * latency_steps("reduce_scatter", dp))
    return tp_s, pp_s, zero_s


def ddp_buckets(grad_bytes: float) -> int:
    """All-reduce calls of DDP's gradient reduction: one per ``DDP_BUCKET_BYTES`` bucket."""
    return max(1, math.ceil(grad_bytes / DDP_BUCKET_BYTES))
