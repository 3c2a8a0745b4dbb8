"""What each training framework really allocates for parameters, gradients and optimizer states.

Bytes per parameter on one rank, given the ZeRO stage and the shard degree N (the data-parallel
group the states are split over). All assume mixed-precision Adam unless the compute dtype is
fp32, where there are no low-precision copies.

* ``ideal``: the ZeRO paper's accounting (Rajbhandari et al. 2020, arXiv:1910.02054, Sec. 3.1
  and Table 1): 2 (fp16 params) + 2 (fp16 grads) + K=12 (fp32 params, momentum, variance).
  Stage 1 shards the 12, stage 2 also the grads, stage 3 also the params.
* ``megatron``: Megatron-LM keeps bf16 params (2), fp32 main gradients (4) and fp32 master
  params + Adam (12): 18 bytes, ``6 + 12/N`` with the distributed optimizer (Megatron-LM
  ``theoretical_memory_usage.py``). Stages 2 and 3 follow Megatron-FSDP's sharding.
* ``deepspeed``: DeepSpeed ZeRO 1/2 keep fp16 params (2) and fp16 grads (2) plus an fp32
  gradient partition (4) and fp32 master + Adam (12); ZeRO-2 is ``2 + 18/N`` and ZeRO-3
  ``18/N`` plus 4 bytes per parameter of the largest layer, as DeepSpeed 0.19's
  ``estimate_zero2/3_model_states_mem_needs`` compute. Stage 0 (BF16_Optimizer) keeps fp32
  gradient accumulators.
* ``torchtitan`` / ``meshplan``: FSDP2 holds fp32 sharded parameters (4), fp32 gradients (4)
  and Adam moments (8) = 16/N, gathering bf16 copies on the fly; stages 0/1 run DDP
  (replicated fp32 params and grads, a gradient-bucket copy) with the optimizer state sharded
  at stage 1 (ZeroRedundancyOptimizer).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

ADAM_STATE_BYTES = 8
"""Adam momentum and variance, fp32."""
FP32_BYTES = 4
DS_BUFFER_FACTOR = 1.5
"""``additional_buffer_factor`` default of DeepSpeed's estimators (host memory)."""
DS_BUCKET_ELEMENTS = 500_000_000
"""DeepSpeed's default ``reduce_bucket_size`` (elements); with ``contiguous_gradients`` ZeRO-1/2
allocate one gradient buffer of that size up front, whatever the model size."""


TORCHTITAN_LOGIT_COPIES = 3.0
"""fp32 vocabulary tensors alive at torchtitan's loss backward (and meshplan's runtime's, whose
``train.lm_loss`` is the same). torchtitan's ``cross_entropy_loss`` (components/loss.py) is
``F.cross_entropy(pred.float(), ...)``, i.e. log_softmax + nll_loss, and train.py deletes
``pred`` before ``loss.backward()``. Forward holds the logits in compute dtype, the fp32 upcast
and the saved log-softmax (2.5 copies in bf16); backward holds the saved log-softmax,
nll_loss's dense fp32 gradient and log_softmax_backward's result: 3. Measured on CPU with
torchtitan's own step (benchmarks/torchtitan_cpu_memory.py)."""


DS_PREFETCH_BUCKET_ELEMENTS = 50_000_000
"""DeepSpeed's default ``stage3_prefetch_bucket_size`` (elements gathered ahead of use)."""
DS_PERSISTENCE_THRESHOLD = 100_000
"""DeepSpeed's default ``stage3_param_persistence_threshold``: parameters with fewer
elements are never partitioned and stay gathered on every rank."""


@dataclass(frozen=True)
class StateBytes:
    """Bytes of model states on one rank (device) and what was moved off it (host)."""

    params: float
    grads: float
    optimizer: float
    offloaded: float

    def __add__(self, other: "StateBytes") -> "StateBytes":
        return StateBytes(self.params + other.params, self.grads + other.grads,
                          self.optimizer + other.optimizer, self.offloaded + other.offloaded)


def _per_param(framework: str, zero_stage: int, shard: int, fp32: bool) -> tuple[float, ...]:
    """(params, grads, optimizer) bytes per parameter on one rank, before offload."""
    n = float(shard)
    if fp32:  # no low-precision copies: params, grads, Adam moments
        p, g, o = FP32_BYTES, FP32_BYTES, ADAM_STATE_BYTES
        return (p / n if zero_stage == 3 else p, g / n if zero_stage >= 2 else g,
                o / n if zero_stage >= 1 else o)
    if framework == "ideal":
        return (2 / n if zero_stage == 3 else 2, 2 / n if zero_stage >= 2 else 2,
                12 / n if zero_stage >= 1 else 12)
    if framework == "megatron":
        return (2 / n if zero_stage == 3 else 2, 4 / n if zero_stage >= 2 else 4,
                12 / n if zero_stage >= 1 else 12)
    if framework == "deepspeed":
        return {0: (2, 6, 12), 1: (2, 2 + 4 / n, 12 / n), 2: (2, 6 / n, 12 / n),
                3: (2 / n, 4 / n, 12 / n)}[zero_stage]
    # meshplan, torchtitan: fp32 master params are the module's own parameters.
    if zero_stage >= 2:
        return (4 / n, 4 / n, 8 / n)
    return (4, 4, 8 / n if zero_stage == 1 else 8)


def model_state_bytes(framework: str, *, params: float, shard: int, zero_stage: int,
                      offload: str, fp32: bool = False) -> StateBytes:
    """Model-state bytes on one rank holding ``params`` parameters, states sharded ``shard`` ways.

    ``offload`` ``optimizer`` moves the optimizer states (and, for DeepSpeed and ``ideal``, the
    gradients) to the host; ``optimizer+params`` also the (ZeRO-3 sharded) parameters and the
    gradients.
    """
    p, g, o = (params * x for x in _per_param(framework, zero_stage, shard, fp32))
    offloaded = 0.0
    if offload == "optimizer" and framework == "meshplan":
        # HostOffloadAdamW (runtime/optim.py) also keeps an fp32 master copy of every
        # parameter it steps and a landing buffer for its fp32 gradient in host memory: 8
        # bytes per parameter it steps, as many as the two moments
        offloaded += o
    if offload in ("optimizer", "optimizer+params"):
        offloaded += o
        o = 0.0
        if framework == "deepspeed":
            # DeepSpeed keeps only fp16 params on the GPU (ZeRO-2: 2 bytes/param, ZeRO-3: 2/N).
            moved = g - (params * 2 if zero_stage <= 1 else 0)
            offloaded += moved
            g -= moved
        elif framework == "ideal" or offload == "optimizer+params":
            # ZeRO-Offload moves gradients with the optimizer (Ren et al. 2021,
            # arXiv:2101.06840, Sec. 4); FSDP2's CPUOffloadPolicy moves parameters, gradients
            # and optimizer states together.
            offloaded += g
            g = 0.0
    if offload == "optimizer+params":
        offloaded += p
        p = 0.0
    return StateBytes(p, g, o, offloaded)


def framework_buffer_bytes(framework: str, *, zero_stage: int, stage_params: float,
                           largest_layer_params: float, fp32: bool = False,
                           data_parallel: bool = True, largest_block_params: float = 0.0,
                           kept_gathered_params: float = 0.0,
                           early_root_grad_params: float = 0.0,
                           pipelined: bool = False, float8_blocks: bool = False,
                           float8_head: bool = False, reduce_bytes: int = FP32_BYTES) -> float:
    """Communication and gather buffers on one rank (bytes).

    ``stage_params``: parameters this rank holds before sharding; ``largest_layer_params``:
    the largest module the framework gathers at once (per TP shard); ``data_parallel``: False
    when there is a single replica (no DDP buckets, nothing to reduce). torchtitan's FSDP2 also
    takes ``largest_block_params`` (the largest transformer block), ``kept_gathered_params``
    (modules never resharded after forward: its ``[norm, output]`` group on the last stage)
    ``pipelined``, ``float8_blocks``, ``float8_head`` and ``reduce_bytes`` (see
    ``torchtitan_fsdp_buffer_bytes``).
    meshplan's
    runtime takes
    ``kept_gathered_params`` (its root group: everything outside the blocks) and
    ``early_root_grad_params`` (see the ZeRO-3 branch).
    """
    compute_bytes = 4 if fp32 else 2
    if framework == "ideal":
        return 0.0
    if framework == "deepspeed":
        if zero_stage == 3:  # DeepSpeed's estimator: fp16 param + fp16 grad of the largest layer
            return 4.0 * largest_layer_params
        if zero_stage in (1, 2):  # the contiguous reduce bucket (ipg buffer), allocated whole
            return compute_bytes * DS_BUCKET_ELEMENTS
        return 0.0
    if framework == "megatron":
        if zero_stage == 3:
            return 2 * compute_bytes * largest_layer_params
        return 0.0
    if framework == "torchtitan" and zero_stage >= 2:
        return torchtitan_fsdp_buffer_bytes(
            reshard_after_forward=zero_stage == 3 and not pipelined, pipelined=pipelined,
            stage_params=stage_params,
            largest_block_params=largest_block_params or largest_layer_params,
            kept_gathered_params=kept_gathered_params, compute_bytes=compute_bytes,
            gathered_block_bytes=1 if float8_blocks else compute_bytes,
            gathered_head_bytes=1 if float8_head else compute_bytes, reduce_bytes=reduce_bytes)
    # meshplan / torchtitan
    if zero_stage <= 1:  # DDP gradient buckets: one more copy of the gradients
        return FP32_BYTES * stage_params if data_parallel else 0.0
    if pipelined:
        # FSDP under torch.distributed.pipelining (torch 2.13 stage.py,
        # ``backward_maybe_with_nosync``): every micro-batch's backward runs without
        # resharding and without gradient sync, and the stage reshards and reduce-scatters
        # once after its last one. So the stage's gathered parameters (compute dtype) and its
        # unsharded gradients (fp32, FSDP's reduce dtype) stay allocated through backward,
        # under ZeRO-2 and ZeRO-3 alike. Measured (benchmarks/large_cpu_rss.py, pp2 x dp4
        # ZeRO-3 on 8 CPU processes, fp32): from 2 to 4 blocks a stage of a 0.2-0.3 B Llama
        # shape the first step's live-tensor peak grew by 8.7 bytes per stage parameter
        # (1 of sharded parameters, no Adam state yet, plus these 4 + 4); after 3 steps the
        # 0.32 B model's stages peaked at 0.964 and 1.001 of this model's prediction.
        return (compute_bytes + FP32_BYTES) * stage_params
    if zero_stage == 2:  # unsharded params live from forward to backward
        return compute_bytes * stage_params
    if framework == "meshplan" and kept_gathered_params:
        # ZeRO-3 in meshplan's runtime (runtime/parallelize.py ``_fsdp``): every block is its
        # own FSDP2 group and the root group (embedding, final norm, head) is never resharded
        # after forward, so it stays gathered through the step; its gradients are
        # reduce-scattered in its post-backward hook, after the embedding's backward, so the
        # head's (computed first) stay unsharded, in the compute dtype, through the blocks'
        # backward. At a block's backward: the root, the head's gradients, the block and the
        # prefetched next block gathered, the block's unsharded gradients in fp32. Measured
        # (benchmarks/large_cpu_rss.py, dp8 ZeRO-3, a 0.32 B Llama shape on 8 CPU processes):
        # live-tensor peak 1572 MiB against 1355 MiB when the embedding was counted as the
        # largest gathered block instead.
        return (compute_bytes * (kept_gathered_params + early_root_grad_params
                                 + largest_block_params)
                + meshplan_zero3_block_backward_bytes(
                    compute_bytes=compute_bytes, largest_block_params=largest_block_params))
    # ZeRO-3: current + prefetched block in compute dtype, one block of unsharded fp32 grads
    return (2 * compute_bytes + FP32_BYTES) * largest_layer_params


def meshplan_zero3_block_backward_bytes(*, compute_bytes: int,
                                        largest_block_params: float) -> float:
    """The part of meshplan's ZeRO-3 buffers (``framework_buffer_bytes``) that exists only once
    a block's backward runs: the next block prefetched (compute dtype) beside the one being
    differentiated, and the block's unsharded fp32 gradients. Before, at the loss and the LM
    head's backward, the root group is gathered, the head's fresh gradients exist and one
    block is gathered: FSDP2's pre-backward hook of the root prefetches the last block
    (``_backward_prefetch``), every other block was resharded after its forward. Measured with
    the runtime's live-tensor tracker on this CPU (the storages at the peak listed by the op
    that made them): tiny, dp 2 ZeRO-3, fp32, no block's gathered parameters at the loss and
    the peak in the last block's backward, 7 % below a prediction that put all of these
    beside the loss's logits; tp 2 x dp 2 ZeRO-3, the loss's peak with one block's all-gather
    buffer in flight in some runs."""
    return (compute_bytes + FP32_BYTES) * largest_block_params


def deepspeed_zero3_extra_buffer_bytes(*, largest_layer_params: float,
                                       persistent_params: float, compute_bytes: int) -> float:
    """ZeRO-3 device buffers that DeepSpeed's estimator (``framework_buffer_bytes``: the
    largest layer's fp16 parameters and gradients) leaves out, at DeepSpeed 0.19's defaults:

    * the contiguous gradient (IPG) bucket, ``reduce_bucket_size`` = 5e8 elements in the
      gradient dtype, allocated whole at start-up when ``contiguous_gradients`` is on
      (runtime/zero/stage3.py, ``bucket.buffer = torch.empty(self.reduce_bucket_size, ...)``);
    * the prefetched parameters, up to ``stage3_prefetch_bucket_size`` = 5e7 elements (or one
      more largest layer, whichever is less) gathered while the current module computes;
    * ``persistent_params``: parameters under ``stage3_param_persistence_threshold`` (1e5
      elements: norms and biases) that stay gathered (parameter_offload.py).
    """
    prefetch = min(DS_PREFETCH_BUCKET_ELEMENTS, largest_layer_params)
    return compute_bytes * (DS_BUCKET_ELEMENTS + prefetch + persistent_params)


PIPELINING_FRAMEWORKS = ("meshplan", "torchtitan")
"""Frameworks whose pipelines are torch.distributed.pipelining's stages and schedules
(receive buffers kept for the step, the stage input handed to the first block, FSDP2 inside)."""


def pipeline_recv_buffer_bytes(framework: str, *, boundary_bytes: float, micro_batches: int,
                               stage: int, stages: int, vpp: int = 1) -> float:
    """Receive buffers torch.distributed.pipelining keeps for the whole run (bytes per rank).

    ``PipelineStage._prepare_forward_infra`` allocates one activation receive buffer per
    micro-batch for every stage but the first, and ``_prepare_backward_infra`` one gradient
    receive buffer per micro-batch for every stage but the last (torch
    distributed/pipelining/stage.py); a rank holding ``vpp`` chunks (virtual stages
    ``stage + k * stages``) has them per chunk. ``boundary_bytes``: one micro-batch's hidden
    states at a stage boundary. meshplan's runtime and torchtitan use these schedules;
    Megatron-LM and DeepSpeed allocate receive tensors per transfer.
    """
    if framework not in PIPELINING_FRAMEWORKS or stages == 1:
        return 0.0
    last = stages * vpp - 1
    chunks = [stage + k * stages for k in range(vpp)]
    directions = sum((j > 0) + (j < last) for j in chunks)
    return directions * micro_batches * boundary_bytes


def pipeline_send_in_flight_bytes(framework: str, *, boundary_bytes: float, stages: int,
                                  micro_batches: int = 1, stage: int = 0, vpp: int = 1,
                                  gloo: bool = False) -> float:
    """Boundary tensors of sends still held at a stage's peak (bytes per rank).

    A send of ``torch.distributed.pipelining`` keeps its tensor referenced until the schedule
    waits on it. The single-stage schedules (1F1B) wait lazily, each send before the next, so
    the stage's output (first stage) or its input gradient (last stage) of the previous
    micro-batch is still alive at the peak. Measured with the runtime's live-tensor tracker at
    the peaks of pp2 x dp4 ZeRO-3 (a 0.32 B Llama shape on 8 CPU processes,
    ``benchmarks/large_cpu_rss.py``): one 128 x 1536 fp32 tensor on each stage beside the
    receive buffers, the first stage's a block output and the last stage's a residual
    gradient.

    The interleaved schedule (``ScheduleInterleaved1F1B``, a ``_PipelineScheduleRuntime`` in
    torch distributed/pipelining/schedules.py) keeps every send's work in a list it waits on
    only when the step ends. What a work holds then depends on the backend: ``gloo``'s send
    work keeps its tensor until the work is destroyed, so on the CPU each chunk's sends of all
    ``micro_batches`` stay referenced, one per micro-batch and direction as the receive buffers
    (``pipeline_recv_buffer_bytes``; torchtitan's and meshplan's interleaved steps on this CPU,
    ``benchmarks/torchtitan_cpu_pp_memory.py`` and ``benchmarks/runtime_cpu.py``, grow by both
    per micro-batch); NCCL's watchdog hands a completed work's stashed tensors back to be
    freed without a ``wait()`` (ProcessGroupNCCL.hpp, ``shelvesToUnstash_``), so on GPUs a
    send lives about as long as under 1F1B."""
    if framework not in PIPELINING_FRAMEWORKS or stages == 1:
        return 0.0
    if vpp == 1 or not gloo:
        return boundary_bytes
    return pipeline_recv_buffer_bytes(framework, boundary_bytes=boundary_bytes,
                                      micro_batches=micro_batches, stage=stage, stages=stages,
                                      vpp=vpp)


def torch_1f1b_order(pp: int, micro_batches: int,
                     rank: int) -> tuple[tuple[bool, int], ...]:
    """The computations pipeline rank ``rank`` runs in one step of torch.distributed.pipelining's
    ``Schedule1F1B`` (torchtitan's and meshplan's single-chunk schedule), in order, as
    ``torch_interleaved_order`` writes them (chunk 0): ``Schedule1F1B._step_microbatches`` runs
    ``min(micro_batches, pp - rank)`` forwards, then a backward and a forward while forwards
    remain, then the remaining backwards."""
    warmup = min(micro_batches, pp - rank)
    order: list[tuple[bool, int]] = [(False, 0)] * warmup
    for done in range(micro_batches):
        order.append((True, 0))
        if warmup + done < micro_batches:
            order.append((False, 0))
    return tuple(order)


def torch_interleaved_order(pp: int, vpp: int, micro_batches: int,
                            rank: int) -> tuple[tuple[bool, int], ...]:
    """The computations pipeline rank ``rank`` runs in one step of torch.distributed.pipelining's
    ``ScheduleInterleaved1F1B`` (torchtitan's and meshplan's interleaved schedule), in order:
    (backward?, local chunk). As torch's ``_calculate_single_rank_operations`` with
    ``_get_1f1b_rank_ops`` (torch distributed/pipelining/schedules.py) orders them: micro-batches
    go round in rounds of ``micro_batches / max(1, micro_batches // pp)``; the warmup runs
    ``min((vpp - 1) x round + 2 (pp - 1 - rank), vpp x micro_batches)`` forwards, chunk
    ``(step // round) % vpp``; then a forward and a backward per step, the backward's chunk
    counting down from the last (``vpp - 1 - ((step - warmup) // round) % vpp``); then the
    remaining backwards."""
    rounds = max(1, micro_batches // pp)
    per_round = micro_batches // rounds
    total = vpp * micro_batches
    warmup = min((vpp - 1) * per_round + 2 * (pp - 1 - rank), total)
    steady = total - warmup
    order: list[tuple[bool, int]] = []
    for step in range(warmup + steady + warmup):
        forward = (False, (step // per_round) % vpp)
        backward = (True, vpp - 1 - ((step - warmup) // per_round) % vpp)
        if step < warmup:
            order.append(forward)
        elif step < warmup + steady:
            order += [forward, backward]
        else:
            order.append(backward)
    return tuple(order)


@dataclass(frozen=True)
class PipelinePeak:
    """What a pipelined FSDP stage holds at its peak backward (``pipelined_fsdp_peak``), each
    as a fraction of the whole stage's bytes of its kind, apart from ``sends``.

    ``live``: micro-batches of the whole stage whose activations are live (chunk-micro-batches
    / vpp); ``accumulating``: chunks whose fp32 gradient accumulators are allocated (from their
    first backward to their last); ``finished``: chunks past their last backward, resharded
    (their gathered parameters freed) with their gradients reduce-scattered into sharded
    gradients; ``sends``: boundary tensors of sends held (gloo)."""
    live: float
    accumulating: float
    finished: float
    sends: int


@functools.lru_cache(maxsize=4096)
def _peak_moments(pp: int, vpp: int, micro_batches: int, rank: int,
                  sends_weigh: bool) -> tuple[tuple[int, int, bool, int, int], ...]:
    """The moments of one rank's step at which a pipelined FSDP stage can peak, in step
    order: (live chunk-micro-batches, chunks with all their accumulators, whether one more
    chunk holds only its first block's, finished chunks, sends issued), at each backward's
    start and, for a chunk's first backward, its end (that micro-batch's activations freed,
    the chunk's accumulators whole). What ``pipelined_fsdp_peak`` weighs is linear in these
    with non-negative weights, so a moment no larger in any of them than an earlier one with
    the same finished count and first-block flag can never be the first maximum, and is
    dropped (the steady phase and cooldown mostly repeat or shrink the warmup's); the sends
    count only where they weigh (``sends_weigh``: gloo)."""
    last = pp * vpp - 1
    live, started, done = [0] * vpp, [False] * vpp, [0] * vpp
    sends = 0
    moments: list[tuple[int, int, bool, int, int]] = []
    order = (torch_1f1b_order(pp, micro_batches, rank) if vpp == 1
             else torch_interleaved_order(pp, vpp, micro_batches, rank))
    for backward, chunk in order:
        virtual = rank + chunk * pp
        if not backward:
            live[chunk] += 1
            sends += virtual < last
            continue
        finished = sum(d == micro_batches for d in done)
        others = sum(started) - finished - started[chunk]
        if started[chunk]:
            moments.append((sum(live), others + 1, False, finished, sends))
        else:
            moments.append((sum(live), others, True, finished, sends))
            moments.append((sum(live) - 1, others + 1, False, finished, sends))
        started[chunk] = True
        live[chunk] -= 1
        done[chunk] += 1
        sends += virtual > 0
    kept: list[tuple[int, int, bool, int, int]] = []
    for moment in moments:
        units, full, first, finished, count = moment
        if not any(k[2] == first and k[3] == finished and k[0] >= units and k[1] >= full
                   and (k[4] >= count or not sends_weigh) for k in kept):
            kept.append(moment)
    return tuple(kept)


def pipelined_fsdp_peak(pp: int, vpp: int, micro_batches: int, rank: int, *,
                        chunk_microbatch_bytes: float, chunk_accumulator_bytes: float,
                        chunk_gathered_bytes: float = 0.0,
                        chunk_sharded_grad_bytes: float = 0.0,
                        block_accumulator_bytes: float | None = None,
                        send_bytes: float = 0.0) -> PipelinePeak:
    """Where a pipelined FSDP stage peaks (torchtitan's and meshplan's runtime's: both run
    torch's schedules over FSDP2), walking ``torch_interleaved_order`` (``torch_1f1b_order``
    for ``vpp`` 1): the backward at which what the rank holds is largest.

    Under ``torch.distributed.pipelining`` FSDP2 accumulates each chunk's unsharded gradients
    in fp32 from that chunk's first backward (``chunk_accumulator_bytes``;
    ``torchtitan_fsdp_buffer_bytes``, pipelined), while each chunk-micro-batch's activations
    (``chunk_microbatch_bytes``) live from its forward to its backward. Right after a chunk's
    last backward torch's schedule reduces its gradients and reshards it (the ``REDUCE_GRAD``
    action ``_add_reduce_grad`` places there, and the ``RESHARD`` of ``_add_unshard_reshard``,
    torch distributed/pipelining/schedules.py): its gathered parameters
    (``chunk_gathered_bytes``) and accumulators are freed, its sharded gradients
    (``chunk_sharded_grad_bytes``) stay to the step's end. When every forward of the step
    comes before the first backward (micro-batches = pp, the usual torchtitan set-up), the
    later chunks' accumulators arrive after the first chunk's backwards have freed part of
    the activations; with a steady phase the peak stays at the warmup count plus one, with
    every chunk's accumulators.

    ``send_bytes`` (one boundary tensor; non-zero on gloo, whose send works keep their tensors
    until the step ends, ``pipeline_send_in_flight_bytes``) counts the sends issued before
    each backward: each forward of a chunk but the pipeline's last virtual stage sends its
    output, each backward of a chunk but the first its input gradient. Late in the step,
    where most sends are held, few activations are left. Measured on torchtitan's code path
    on this CPU (pp 4 x vpp 2, 4 micro-batches, full AC, ``benchmarks/
    torchtitan_cpu_pp_memory.py`` with the live tensors listed at the peak): rank 1 peaks in
    its last backward, with all 8 forward sends and 7 gradient sends held, one micro-batch's
    activations, chunk 1 gathered with its accumulators and chunk 5 reduced to its
    gradients.

    ``block_accumulator_bytes`` (None: as ``chunk_accumulator_bytes``): FSDP2 creates a block's
    fp32 accumulator in that block's post-backward hook (``to_accumulated_grad_if_needed``), so
    a chunk's first backward starts with all its activations live and the accumulators of the
    one block it differentiates first, and ends with that micro-batch's activations freed and
    the whole chunk's accumulators allocated; both ends are candidates. Measured with
    meshplan's runtime on this CPU (tiny, pp 2 x dp 2 ZeRO-3, no recomputation, the storages
    at the peak listed by the op that made them): stage 0 peaks at the start of its first
    backward, both micro-batches' activations live beside one weight gradient."""
    block = chunk_accumulator_bytes if block_accumulator_bytes is None \
        else min(block_accumulator_bytes, chunk_accumulator_bytes)
    block_share = block / chunk_accumulator_bytes if chunk_accumulator_bytes else 1.0
    best, at = -1.0, PipelinePeak(0.0, 0.0, 0.0, 0)
    for units, full, first, finished, sends in _peak_moments(pp, vpp, micro_batches, rank,
                                                            send_bytes > 0):
        accumulating = full + (block_share if first else 0.0)
        held = (units * chunk_microbatch_bytes + accumulating * chunk_accumulator_bytes
                + (vpp - finished) * chunk_gathered_bytes
                + finished * chunk_sharded_grad_bytes + sends * send_bytes)
        if held > best:
            best, at = held, PipelinePeak(units / vpp, accumulating / vpp, finished / vpp,
                                          sends)
    return at


def pipelined_fsdp_reduce_scatter_bytes(*, largest_group_params: float, shard: int) -> float:
    """The reduce-scatter that ends a pipelined FSDP stage's backward (bytes on one rank).

    Under ``torch.distributed.pipelining`` FSDP reduce-scatters the stage's groups once, after
    the last micro-batch's backward (``framework_buffer_bytes``, pipelined branch). For each
    group it copies the unsharded gradients into a flat fp32 reduce-scatter input and receives
    the rank's shard (torch ``_fsdp_collectives.foreach_reduce``), while the gathered
    parameters and every unsharded gradient are still allocated: the largest group (the
    embedding or the head, usually) sets the peak of this phase, with no activation left.
    Measured at the first stage of pp2 x dp4 ZeRO-3 (``benchmarks/large_cpu_rss.py``): its
    live-tensor peak falls here, with the embedding's gradient in the reduce-scatter input and
    its quarter in the output."""
    return FP32_BYTES * largest_group_params * (1 + 1 / shard)


def torchtitan_fsdp_buffer_bytes(*, reshard_after_forward: bool, stage_params: float,
                                 pipelined: bool = False,
                                 largest_block_params: float, kept_gathered_params: float,
                                 compute_bytes: int, gathered_block_bytes: int = 0,
                                 gathered_head_bytes: int = 0,
                                 reduce_bytes: int = FP32_BYTES) -> float:
    """FSDP2 buffers of torchtitan 0.2.2 at the backward peak (bytes on one rank).

    torchtitan's ``apply_fsdp`` (models/llama3/infra/parallelize.py) calls ``fully_shard`` on
    the token embedding, on every transformer block and on the ``[norm, output]`` pair, with
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` and
    ``reshard_after_forward = not pp`` (the pair: never, since it is the first module
    backward needs). In a block's backward FSDP2 holds its gathered parameters, the next
    block's prefetched ones (both in the compute dtype), the block's unsharded gradients in
    the compute dtype and their fp32 copy, the reduce-scatter input:
    ``(3 c + 4) x block``. Not resharding after forward (under PP, or ZeRO-2 here) keeps the
    whole stage gathered instead of the two blocks: ``c x stage + (c + 4) x block``. The
    embedding is gathered again only at the very end of backward, when no activations are
    left, so it does not add to the peak. ``gathered_block_bytes``: bytes of a gathered block
    parameter (0: ``compute_bytes``); 1 under float8 training, whose FSDP all-gather moves the
    blocks' linear weights already cast to float8 and hands them to the forward as they are
    (torchao's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``); gradients stay bf16.
    ``gathered_head_bytes``: the same for the kept ``[norm, output]`` group (1 when the LM head
    is a float8 linear too, ``ParallelConfig.float8_head``).

    ``pipelined``: under ``torch.distributed.pipelining`` (torchtitan's PP, as meshplan's
    runtime: ``PipelineStage.backward_maybe_with_nosync`` runs every micro-batch's backward
    without resharding or gradient sync, and the schedule reduces once after the last), FSDP2
    keeps each parameter's unsharded gradient upcast to the fp32 reduce dtype
    (``FSDPParam.to_accumulated_grad_if_needed``) and adds every later micro-batch's into it:
    the whole stage's fp32 gradients, beside its gathered parameters and the block's fresh
    compute-dtype gradient.

    ``reduce_bytes``: bytes per element of the reduce dtype (``ParallelConfig.grad_reduce_dtype``;
    fp32 above): in the compute dtype the reduce-scatter input is a compute-dtype copy of the
    unsharded gradients, and under a pipeline they accumulate in the compute dtype.
    """
    block = gathered_block_bytes or compute_bytes
    head = gathered_head_bytes or compute_bytes
    grads = (compute_bytes + reduce_bytes) * largest_block_params
    if pipelined:  # counted in bf16 even under float8
        return (compute_bytes + reduce_bytes) * stage_params + compute_bytes * largest_block_params
    if not reshard_after_forward:
        return compute_bytes * stage_params + grads  # counted in bf16 even under float8
    return 2 * block * largest_block_params + grads + head * kept_gathered_params


def torchtitan_cached_bytes(*, freed_grads: float, freed_logits: float, fsdp: bool,
                            compute_bytes: int, largest_gather_params: float,
                            largest_block_params: float, head_params: float,
                            gathered_block_bytes: int = 0, gathered_head_bytes: int = 0,
                            reduce_bytes: int = FP32_BYTES) -> float:
    """Bytes the CUDA caching allocator keeps reserved but cannot use at torchtitan's forward /
    backward peak (on top of the allocated peak).

    * ``freed_grads``: the sharded gradients freed by ``zero_grad`` at the start of the step.
      Their blocks (one per parameter shard) are far smaller than the activation tensors that
      follow and stay cached.
    * ``freed_logits``: the compute-dtype logits freed by ``del pred``; none of the three fp32
      tensors of the loss backward fits in that block, so the third takes a new segment.
    * FSDP2 all-gathers on its own all-gather stream and reduce-scatters on its own
      reduce-scatter stream (torch ``_fsdp_param_group.py``), and the allocator only reuses a
      block on the stream it was allocated on. The all-gather pool holds the gather outputs in
      flight at the loss backward (the ``[norm, output]`` group and the prefetched last block,
      compute dtype); the reduce-scatter pool the largest reduce-scatter input (fp32 unless
      ``reduce_bytes`` says otherwise), that of the largest gathered group (the embedding or
      the head). ``gathered_block_bytes``, ``gathered_head_bytes`` and ``reduce_bytes`` as in
      ``torchtitan_fsdp_buffer_bytes``.
    """
    cached = freed_grads + freed_logits
    if fsdp:
        cached += (gathered_head_bytes or compute_bytes) * head_params \
            + (gathered_block_bytes or compute_bytes) * largest_block_params
        cached += reduce_bytes * largest_gather_params
    return cached


def eager_autograd(framework: str) -> bool:
    """Whether the framework runs unfused PyTorch modules, which keep a few more tensors for
    backward than Megatron's fused kernels (see ``activations.layer_activation_bytes``):
    meshplan's runtime and torchtitan (``nn.RMSNorm``, complex RoPE, SwiGLU as three linears
    and ``F.silu`` in its llama3 model)."""
    return framework in ("meshplan", "torchtitan")


DTENSOR_TP_FRAMEWORKS = ("torchtitan", "meshplan")
"""Frameworks whose tensor parallelism is DTensor's (``parallelize_module``): every TP
collective is waited for (``timing.tp_comm_parts_s``), and under SP the LM head is
``ColwiseParallel`` with a sequence-sharded input, keeping its all-gathered input whole for
its weight gradient (torchtitan's ``output`` plan; meshplan's ``runtime/parallelize.py``
``_edge_plan``; ``memory.last_stage_head_bytes``)."""


def eager_kernels(framework: str) -> bool:
    """Whether the framework launches its GEMMs and element-wise kernels from eager PyTorch
    modules (FSDP-style trainers: torchtitan without compile, Composer/llm-foundry, meshplan's
    runtime) rather than Megatron-LM's or DeepSpeed-Megatron's fused kernels; such GEMMs get
    ``DeviceCalibration.eager_matmul_efficiency``."""
    return framework in ("meshplan", "torchtitan")


def min_micro_batches(framework: str, pp: int) -> int:
    """The fewest micro-batches per step the framework's pipeline schedules run with.

    ``torch.distributed.pipelining``'s ``Schedule1F1B`` and ``ScheduleInterleaved1F1B``
    (meshplan's runtime and torchtitan) raise ValueError below ``pp`` micro-batches
    (schedules.py, torch 2.13); Megatron-LM's and DeepSpeed's 1F1B shorten the warm-up
    instead (any count)."""
    return pp if pp > 1 and framework in PIPELINING_FRAMEWORKS else 1


def per_stage_recompute(framework: str) -> bool:
    """Whether the framework recomputes each pipeline stage in its own mode: meshplan's runtime
    (its plan's per-stage list) and the ``ideal`` accounting. Megatron-LM
    (``--recompute-granularity``, ``--recompute-method`` and ``--recompute-num-layers`` apply
    to every stage), torchtitan (one ``[activation_checkpoint]`` section for every model part)
    and DeepSpeed (one ``activation_checkpointing`` section) take one mode for the whole model,
    so the planner gives every stage the same one there (``planner.tables``)."""
    return framework in ("meshplan", "ideal")


def vocab_parallel_loss(framework: str) -> bool:
    """Whether the loss runs on vocabulary-sharded logits (Megatron's vocab-parallel cross
    entropy, torchtitan's loss_parallel); meshplan's runtime gathers the logits first."""
    return framework != "meshplan"


def kept_stage_output_copies(framework: str, pp: int) -> float:
    """Logit tensors (compute dtype) the last pipeline stage keeps beside its loss's own.

    ``torch.distributed.pipelining`` (meshplan's runtime and torchtitan) stores each
    micro-batch's stage output in the stage's forward cache and drops it only after that
    micro-batch's backward (stage.py, ``backward_one_chunk``, torch 2.13), so under pp > 1 the
    last stage's logits stay alive through the loss and block backward, where a step without
    a pipeline frees them with the loss's input. Measured on the CPU runtime
    (``benchmarks/runtime_cpu.py``): the last stages of pp2, pp2 x dp2 ZeRO-3 and pp2 x dp2 x
    tp2 ZeRO-3 held 4.8-10.6% more than predicted without it (1.4-2.1 logit tensors of
    2 x 64 x 256 fp32 each); with it pp2's last stage is at 1.012."""
    return 1.0 if pp > 1 and framework in PIPELINING_FRAMEWORKS else 0.0


def optimizer_workspace_bytes(framework: str, *, optimizer_params: float) -> float:
    """Temporary device bytes of the optimizer step over ``optimizer_params`` parameters.

    PyTorch's foreach AdamW (meshplan's runtime) allocates one fp32 tensor per parameter for
    sqrt(v) + eps before the in-place update (torch/optim/adam.py, ``_multi_tensor_adam``);
    torchtitan's default fused AdamW (``optimizer.implementation = "fused"``) and Megatron's
    and DeepSpeed's fused Adam kernels update in place.
    """
    if framework == "meshplan":
        return FP32_BYTES * optimizer_params
    return 0.0


COMPILED_LOSS_LOGIT_COPIES = 1.0
"""fp32-sized vocabulary tensors alive at torchtitan's compiled loss (``compile`` ``model+loss``)
in a 16-bit compute dtype: the compiled graph keeps the logits it reads again in backward, which
writes their gradient in the same dtype in one fused kernel; the fp32 upcast and the
log-softmax never reach memory. Two half-size copies. In fp32 the same two tensors are whole
copies (``logit_copies``). Measured on this CPU with the CPU allocator's running total (the
profiler's allocation events, ``benchmarks/torchtitan_cpu_memory.py``'s ``AllocatorPeak``):
``x @ W`` then torchtitan's ``cross_entropy_loss`` compiled, ``del pred``, backward, 512 x 32,000
logits: 1.0 fp32-sized copies in bf16, 2.0 in fp32 (uncompiled: 3.0 in both); torchtitan's
whole fp32 step at 4,096 vocabulary rows (8 x 64 tokens, one rank, the op policy and full
recomputation) peaks one fp32 logit copy lower with the loss compiled than without."""


TORCHTITAN_LOSS_PARALLEL_COPIES = 4.0
"""fp32 vocabulary tensors alive at torchtitan's loss backward under tensor parallelism, where
the loss runs in torch's ``loss_parallel`` context on vocabulary-sharded logits (torch
``distributed/tensor/parallel/loss.py``): its fused nll/log-softmax backward
``_nll_loss_and_log_softmax_backward`` keeps the saved log-softmax, fills a zero gradient,
then evaluates ``(grad_input + torch.exp(x)) * grad_output``, whose exponential and sum are
alive together: four (its forward peaks at three and a half: the bf16 logits, the fp32
upcast, the shifted logits and their exponential)."""


def logit_copies(framework: str, fp32: bool, *, compiled_loss: bool = False,
                 loss_parallel: bool = False) -> float:
    """fp32-sized vocabulary tensors alive at the loss (see activations.head_activation_bytes).

    Megatron's fused vocab-parallel cross entropy keeps one; DeepSpeed is counted at its
    forward (logits, fp32 upcast, log-softmax). torchtitan and meshplan's runtime both run
    ``F.cross_entropy(logits.float(), ...)`` and drop the logits before backward:
    ``TORCHTITAN_LOGIT_COPIES`` at the loss backward; ``COMPILED_LOSS_LOGIT_COPIES`` when
    torchtitan compiles its loss or the trainer calls a fused cross-entropy kernel
    (``compiled_loss``; ``ParallelConfig.cross_entropy_fusion``),
    ``TORCHTITAN_LOSS_PARALLEL_COPIES`` under tensor parallelism (``loss_parallel``, which
    torchtitan's loss then runs in, compiled or not).
    """
    if framework in ("megatron", "ideal"):
        return 1.0
    if framework == "deepspeed":  # logits in compute dtype, an fp32 upcast, the log-softmax
        return 2.0 if fp32 else 2.5
    if loss_parallel and framework == "torchtitan":
        return TORCHTITAN_LOSS_PARALLEL_COPIES
    if compiled_loss and framework == "torchtitan":
        return 2 * COMPILED_LOSS_LOGIT_COPIES if fp32 else COMPILED_LOSS_LOGIT_COPIES
    return TORCHTITAN_LOGIT_COPIES


def deepspeed_host_bytes_per_node(*, total_params: float, zero_stage: int, offload: str,
                                  gpus_per_node: int, nodes: int,
                                  largest_layer_params: float, zero_init: bool = True) -> float:
    """Host memory per node that DeepSpeed's estimators ask for (bytes).

    DeepSpeed 0.19 ``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_...``: with
    offload, ZeRO-2 needs ``P * max(4 * gpus, 16) * 1.5``; ZeRO-3 ``P * 18/nodes * 1.5``
    (params offloaded) or ``P * 16/nodes * 1.5`` (optimizer only) under ``zero.Init``; without
    offload ZeRO-2 needs ``P * 4 * gpus_per_node * 1.5`` to load the checkpoint and ZeRO-3 with
    ``zero.Init`` ``largest_layer * 4 * gpus_per_node * 1.5``. Without ``zero.Init`` ZeRO-3
    needs ``P * max(4 * gpus_per_node, 18 or 16 / nodes) * 1.5``.
    """
    factor = DS_BUFFER_FACTOR
    total_gpus = gpus_per_node * nodes
    if zero_stage < 3:
        if offload != "none":
            return total_params * max(4 * total_gpus, 16) * factor
        return total_params * 4 * gpus_per_node * factor
    if offload == "none":
        held = largest_layer_params if zero_init else total_params
        return held * 4 * gpus_per_node * factor
    per_param = 18 if offload == "optimizer+params" else 16
    if zero_init:
        return total_params * per_param / nodes * factor
    return total_params * max(4 * gpus_per_node, per_param / nodes) * factor


FLOAT8_FRAMEWORKS = ("torchtitan", "megatron")
"""Frameworks whose float8 training the cost model prices: torchtitan's torchao float8
linears, and Megatron-LM's Transformer Engine linears (``--fp8-recipe tensorwise``, per-tensor
current scaling, or delayed scaling; the weights cast on a step's first micro-batch and cached
for the rest: ``eager.te_float8_cast_bytes``). MoE experts are priced in bf16 under both
(TE's grouped expert linears run float8 too: not modelled)."""


CP_COMM_TYPES_BY_FRAMEWORK = {
    "megatron": ("auto", "p2p", "all_gather", "a2a"),
    "torchtitan": ("auto", "p2p"),
    "deepspeed": ("auto", "a2a"),
    "meshplan": ("auto", "p2p"),
}
"""The context-parallel exchanges (``ParallelConfig.cp_comm_type``) each framework runs:
Megatron-LM all of its ``--cp-comm-type`` values (but the hierarchical ``a2a+p2p``);
torchtitan torch's ring (``context_parallel``; its ``allgather`` and ``alltoall`` rotate
methods move the chunks differently but still attend and merge chunk by chunk); DeepSpeed its
Ulysses all-to-alls; meshplan's runtime no context parallelism (``layout``), ``p2p`` being
what a plan for it names."""


def cp_exchange(framework: str, cp_comm_type: str) -> str:
    """The exchange a configuration's context parallelism runs: ``cp_comm_type``, or for
    ``auto`` the framework's own (DeepSpeed: ``a2a``; the others: ``p2p``)."""
    if cp_comm_type != "auto":
        return cp_comm_type
    return "a2a" if framework == "deepspeed" else "p2p"


def check_framework_options(framework: str, *, compile_mode: str, float8: bool,
                            peak_flop_per_s: dict[str, float], gpu_key: str,
                            async_tp: bool = False, float8_head: bool = False,
                            tp_comm_overlap: bool = False,
                            cross_entropy_fusion: bool = False,
                            float8_recipe: str = "tensorwise",
                            grad_reduce_dtype: str = "fp32",
                            attention_kernel: str = "auto",
                            cp_comm_type: str = "auto") -> None:
    """Raise ValueError (one line) when the plan asks for what the framework's model does not
    cover: torch.compile, async TP and a float8 LM head are modelled as torchtitan runs them,
    Transformer Engine's TP overlap as Megatron-LM runs it, a fused cross entropy as
    Megatron-LM runs it and as FSDP trainers' fused kernels run it (torchtitan),
    float8 training of the blocks as torchtitan and Megatron-LM run it
    (``FLOAT8_FRAMEWORKS``), the Triton attention kernel as the FSDP trainers that call it run
    it (llm-foundry; torchtitan stands for them), each framework's own context-parallel
    exchanges (``CP_COMM_TYPES_BY_FRAMEWORK``), and float8 needs float8 tensor cores (an
    ``fp8`` peak in the GPU catalog: H100 and later)."""
    runs = CP_COMM_TYPES_BY_FRAMEWORK.get(framework, ("auto",))
    if cp_comm_type not in runs:
        raise ValueError(f"--cp-comm-type {cp_comm_type} is not an exchange --framework "
                         f"{framework} runs (it runs: {', '.join(runs)})")
    asked = [flag for flag, on in (("--compile", compile_mode != "none"),
                                   ("--float8-head", float8_head), ("--async-tp", async_tp),
                                   (f"--attention-kernel {attention_kernel}",
                                    attention_kernel != "auto"),
                                   (f"--grad-reduce-dtype {grad_reduce_dtype}",
                                    grad_reduce_dtype != "fp32"))
             if on]
    if asked and framework != "torchtitan":
        raise ValueError(f"{' and '.join(asked)} {'are' if len(asked) > 1 else 'is'} modelled "
                         f"for --framework torchtitan only, got --framework {framework}")
    megatron_only = ((tp_comm_overlap, "--tp-comm-overlap", " (under torchtitan, --async-tp)"),
                     (float8_recipe == "delayed", "--float8-recipe delayed (Transformer Engine's "
                      "delayed scaling)", ""))
    if cross_entropy_fusion and framework not in ("megatron", "torchtitan"):
        raise ValueError(f"--cross-entropy-fusion is modelled for --framework megatron and "
                         f"torchtitan only, got --framework {framework}")
    for on, flag, hint in megatron_only:
        if on and framework != "megatron":
            raise ValueError(f"{flag} is modelled for --framework megatron only{hint}, got "
                             f"--framework {framework}")
    if float8 and framework not in FLOAT8_FRAMEWORKS:
        raise ValueError(f"--float8 is modelled for --framework "
                         f"{' and '.join(FLOAT8_FRAMEWORKS)} only, got --framework {framework}")
    if float8 and "fp8" not in peak_flop_per_s:
        raise ValueError(f"--float8 needs float8 tensor cores; GPU {gpu_key!r} has none "
                         f"(its peaks: {', '.join(sorted(peak_flop_per_s))})")
