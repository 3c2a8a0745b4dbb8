"""Collective calls each framework issues per micro-batch and per step, and their fixed costs.

Two costs are charged per call. Its network latency (``collectives.call_latency_s``: the ring's
steps times their hop latencies, so an all-gather over 768 ranks pays ~770 hops): a call issued
when its data is needed waits on the network, so ``timing.py`` adds it to the stage's time
outright, except where the framework issues the call ahead of use (FSDP2's prefetched blocks,
DeepSpeed ZeRO-3's next module: ``timing.prefetches_blocks``, ``timing.deepspeed_zero3_traffic``).
And
``Calibration.collective_call_s`` per one-hop step (``latency_steps``), the host cost of a
call; on NCCL the value is 0, on gloo over loopback it is what a refit finds (``meshplan
validate --refit``). The counts follow what each framework really issues: TP/SP collectives per
layer, pipeline sends, ZeRO-2/3 gathers and reduce-scatters (DeepSpeed: one all-gather per
partitioned parameter tensor in every forward, recompute and backward pass and one
reduce-scatter per gradient; FSDP2: one per wrapped block),
and the gradient buckets of ZeRO 0/1 (DDP ``bucket_cap_mb``, Megatron's distributed optimizer
buckets, DeepSpeed's ``reduce_bucket_size``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from meshplan.costmodel import collectives as coll
from meshplan.costmodel.calibration import Calibration
from meshplan.costmodel.config import ParallelConfig
from meshplan.costmodel.frameworks import DS_PERSISTENCE_THRESHOLD
from meshplan.costmodel.memory import stage_layer_range
from meshplan.costmodel.model import ModelSpec

DDP_BUCKET_BYTES = 25 * 2**20
"""Gradient bucket of ``DistributedDataParallel`` (``bucket_cap_mb=25``): one all-reduce per
bucket and step."""
MEGATRON_MIN_BUCKET_PARAMS = 40_000_000
"""Megatron-LM's distributed optimizer / DDP bucket: ``max(40M, 1M x dp)`` parameters when
``--ddp-bucket-size`` is not given (megatron/core/distributed/distributed_data_parallel.py)."""
MEGATRON_BUCKET_PARAMS_PER_RANK = 1_000_000
DEEPSPEED_BUCKET_ELEMENTS = 500_000_000
"""DeepSpeed's ``reduce_bucket_size`` and ``allgather_bucket_size`` defaults (elements)."""
LOSS_REDUCTION_CALLS = 1
"""All-reduces of the logged loss over all ranks, once per step (runtime/train.py)."""


@functools.lru_cache(maxsize=4096)
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


def zero3_fetch_batches(model: ModelSpec, config: ParallelConfig
                        ) -> tuple[tuple[float, int], ...]:
    """DeepSpeed ZeRO-3's fetch batches of one transformer layer, in forward order, as
    (parameters per TP shard, gathered tensors): one per linear module (fused QKV, attention
    output, the MLP matrices: Megatron-style GPT layers and HF Llama layers alike hold each in
    its own module), with its bias where that has at least ``DS_PERSISTENCE_THRESHOLD``
    elements. Tensors below the threshold (norms, and the biases of every catalog model) are
    never partitioned (``stage3_param_persistence_threshold``, DeepSpeed 0.3.13 and later), so
    they are never gathered. A module's parameters are fetched together when it runs
    (``PartitionedParameterCoordinator.fetch_sub_module``)."""
    h, q, kv = model.hidden_size, model.q_size, model.kv_size
    f = model.ffn_hidden_size
    up = [f] * (2 if model.activation == "swiglu" else 1)
    biases = [q + 2 * kv, h, *up, h] if model.linear_bias else [
        q + 2 * kv if model.qkv_bias else 0, 0, *[0] * len(up), 0]
    weights = [h * (q + 2 * kv), q * h, *[h * width for width in up], f * h]
    batches = []
    for weight, bias in zip(weights, biases):
        gathered_bias = bias >= DS_PERSISTENCE_THRESHOLD
        batches.append(((weight + (bias if gathered_bias else 0)) / config.tp,
                        1 + int(gathered_bias)))
    return tuple(batches)


def zero3_gather_passes(framework: str, config: ParallelConfig, recompute: str) -> int:
    """Times ZeRO-3 gathers each parameter per micro-batch.

    DeepSpeed fetches a submodule's parameters in every pass that runs it: forward, the
    recomputed forward of full activation checkpointing, backward (its pre-forward and
    pre-backward hooks, ``PartitionedParameterCoordinator``). FSDP2 gathers once in forward
    and once in backward when parameters are resharded after forward (pp = 1); the recomputed
    forward runs inside the backward, on the parameters gathered for it.
    """
    if framework == "deepspeed":
        return 3 if recompute == "full" else 2
    return 2 if config.pp == 1 else 1


def fsdp2_syncs_once_per_step(framework: str, config: ParallelConfig) -> bool:
    """Whether the stage's FSDP2 all-gathers and reduce-scatters run once per step rather than
    per micro-batch: ZeRO-2/3 under a pipeline in the frameworks that build it from FSDP2 and
    ``torch.distributed.pipelining`` (meshplan's runtime and torchtitan, both with
    ``reshard_after_forward=False`` in a pipeline stage). The pipeline stage turns gradient
    sync and resharding off for every micro-batch's backward
    (``PipelineStage.backward_maybe_with_nosync``: ``set_requires_gradient_sync(False)``,
    ``set_reshard_after_backward(False)``) and, after the last one, runs every FSDP group's
    ``post_backward`` itself (``perform_reduce_grad``; torch 2.5-2.6 did it inside the last
    backward call): one reduce-scatter per group and step, after all the stage's compute,
    and one all-gather per group, in the first micro-batch's forward. Counted on the CPU with
    torch 2.13 (pp 2 x dp 2, FSDP2 blocks, 4 micro-batches of 1F1B): 3 reduce-scatters and 3
    all-gathers per step for 3 blocks, where per micro-batch syncing would issue 12 of each.
    Meanwhile each micro-batch's 16-bit gradients are added to fp32 accumulators
    (``timing.FSDP2_ACCUMULATE_BYTES``)."""
    return (framework in ("meshplan", "torchtitan") and config.pp > 1
            and config.zero_stage >= 2 and config.dp * config.cp > 1)


def fsdp2_groups(layers: int, root: float) -> int:
    """FSDP2 groups of a stage: one per transformer block, plus the root group where the
    stage holds something outside the blocks (``root`` > 0: the embedding, final norm and
    head, by parameter count or by how many of the two ends the stage is)."""
    return layers + (1 if root > 0 else 0)


def collective_calls_per_microbatch(model: ModelSpec, config: ParallelConfig, stage: int, *,
                                    framework: str, recompute: str) -> CollectiveCalls:
    """Collective calls of one micro-batch on a rank of ``stage``, counted as the meshplan
    runtime issues them (torch 2.13, gloo; checked with ``torch.profiler`` on the CPU) and,
    for ZeRO-2/3, as the framework does.

    TP: ``tp_calls_per_layer`` per layer, plus the vocabulary-parallel embedding (forward
    all-reduce; with SP a reduce-scatter and its backward all-gather) and LM head (backward
    all-reduce of its input gradient; with SP an all-gather and its backward reduce-scatter).
    PP: one blocking call per pipeline neighbour and virtual chunk (torch's 1F1B batches each
    send with the receive of the opposite direction in one ``batch_isend_irecv``, so an end
    stage waits once per micro-batch, a middle stage twice). ZeRO-2/3, FSDP2 (meshplan,
    torchtitan, and Megatron-FSDP): one group per block plus a root group holding the
    embedding / head; every group all-gathers its parameters ``zero3_gather_passes`` times
    (ZeRO-2: once) and reduce-scatters its gradients once. DeepSpeed ZeRO-3 all-gathers each
    partitioned parameter tensor on its own (``partition_parameters.Init._all_gather`` launches
    one ``_allgather_param`` per parameter), the tensors of ``zero3_fetch_batches`` per layer
    (one per traced layer) and the embedding or head on an end stage, in each pass, and
    reduce-scatters each one's gradient on its own (``_reduce_scatter_gradients``: one
    ``reduce_scatter`` per parameter, DeepSpeed 0.3.13). FSDP2 inside a pipeline stage issues
    none per micro-batch (``fsdp2_syncs_once_per_step``; ``timing.dp_step_s`` charges its
    once-per-step calls). Not counted here: meshplan's ZeRO-1 per-parameter broadcasts
    (``ZeroRedundancyOptimizer``, once per step, in the optimizer step:
    ``timing.zero1_broadcast_s``) and ``replicate``'s gradient all-reduces under TP.
    """
    layer_range = stage_layer_range(model, config, stage)
    layers = len(layer_range)
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
    if config.zero_stage >= 2 and config.dp * config.cp > 1 \
            and not fsdp2_syncs_once_per_step(framework, config):
        passes = zero3_gather_passes(framework, config, recompute) \
            if config.zero_stage == 3 else 1
        if framework == "deepspeed" and config.zero_stage == 3:
            per_layer = 1 if model.is_traced else sum(
                tensors for _, tensors in zero3_fetch_batches(model, config))
            tensors = layers * per_layer + edges
            calls.update(zero_all_gather=tensors * passes, zero_reduce_scatter=tensors)
        else:
            groups = fsdp2_groups(layers, edges)
            calls.update(zero_all_gather=groups * passes, zero_reduce_scatter=groups)
    return CollectiveCalls(**calls)


def zero_call_latency_s(calls: CollectiveCalls, link: coll.GroupLink) -> float:
    """Network latency of the ZeRO-2/3 calls of one micro-batch over the data-parallel group
    ``link``: every call pays its ring's hop latencies (``collectives.call_latency_s``)."""
    return (calls.zero_all_gather * coll.call_latency_s("all_gather", link)
            + calls.zero_reduce_scatter * coll.call_latency_s("reduce_scatter", link))


def gradient_bucketing(framework: str, config: ParallelConfig, *, params: float,
                       grad_bytes: float) -> tuple[float, float]:
    """(amount, bucket) of a ZeRO 0/1 gradient reduction of ``params`` parameters
    (``grad_bytes`` in all): DDP's ``bucket_cap_mb`` in bytes (meshplan, torchtitan), Megatron's
    ``max(40M, 1M x dp)``-parameter buckets, DeepSpeed's ``reduce_bucket_size`` elements; the
    reduction issues ``buckets(amount, bucket)`` calls per step."""
    if framework == "megatron":
        return params, max(MEGATRON_MIN_BUCKET_PARAMS,
                           MEGATRON_BUCKET_PARAMS_PER_RANK * config.dp * config.cp)
    if framework == "deepspeed":
        return params, DEEPSPEED_BUCKET_ELEMENTS
    return grad_bytes, DDP_BUCKET_BYTES


def buckets(amount: float, bucket: float) -> int:
    """Calls that reduce ``amount`` in buckets of ``bucket``: at least one."""
    return max(1, math.ceil(amount / bucket))


def gradient_buckets(framework: str, config: ParallelConfig, *, params: float,
                     grad_bytes: float) -> int:
    """Calls of a ZeRO 0/1 gradient reduction per step (``gradient_bucketing``)."""
    return buckets(*gradient_bucketing(framework, config, params=params, grad_bytes=grad_bytes))


def call_overhead_s(calls: CollectiveCalls, config: ParallelConfig,
                    calibration: Calibration, gpu_key: str = "default"
                    ) -> tuple[float, float, float]:
    """(tp, pp, zero) seconds of the host cost per latency step of each call
    (``Calibration.call_s``: the device's ``collective_call_s`` plus the calibration's)."""
    call_s, tp, dp = calibration.call_s(gpu_key), config.tp, config.dp * config.cp
    tp_s = call_s * (calls.tp_all_reduce * latency_steps("all_reduce", tp)
                     + calls.tp_all_gather * latency_steps("all_gather", tp)
                     + calls.tp_reduce_scatter * latency_steps("reduce_scatter", tp))
    pp_s = call_s * calls.pp_send_recv * latency_steps("send_recv", 2)
    zero_s = call_s * (calls.zero_all_gather * latency_steps("all_gather", dp)
                       + calls.zero_reduce_scatter * latency_steps("reduce_scatter", dp))
    return tp_s, pp_s, zero_s


def ddp_buckets(grad_bytes: float) -> int:
    """All-reduce calls of DDP's gradient reduction: one per ``DDP_BUCKET_BYTES`` bucket."""
    return buckets(grad_bytes, DDP_BUCKET_BYTES)
