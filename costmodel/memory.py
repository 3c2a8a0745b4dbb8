"""Memory per pipeline stage on one rank: model states, activations, buffers; allocated and reserved.

Ranks of one stage hold the same amounts (TP, CP and DP ranks are symmetric); stages differ by
their layer count, the embedding on the first stage, the LM head and logits on the last, and the
micro-batches in flight under the pipeline schedule.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import Counter
from dataclasses import dataclass

from meshplan.costmodel import activations as act
from meshplan.costmodel import traced
from meshplan.costmodel.eager import float8_weight_elements
from meshplan.costmodel.calibration import Calibration
from meshplan.costmodel.config import CPU_DEVICE_KEY, ParallelConfig
from meshplan.costmodel.frameworks import (DS_PERSISTENCE_THRESHOLD, DTENSOR_TP_FRAMEWORKS,
                                  PIPELINING_FRAMEWORKS, StateBytes,
                                  deepspeed_host_bytes_per_node,
                                  deepspeed_zero3_extra_buffer_bytes, eager_autograd,
                                  framework_buffer_bytes, kept_stage_output_copies, logit_copies,
                                  meshplan_zero3_block_backward_bytes, model_state_bytes,
                                  optimizer_workspace_bytes, pipeline_recv_buffer_bytes,
                                  pipeline_send_in_flight_bytes, pipelined_fsdp_peak,
                                  pipelined_fsdp_reduce_scatter_bytes, torchtitan_cached_bytes,
                                  vocab_parallel_loss)
from meshplan.costmodel.hardware import ClusterSpec
from meshplan.costmodel.model import ModelSpec


@dataclass(frozen=True)
class StageParams:
    """Parameters one rank of a stage holds before ZeRO sharding."""

    dense: float
    """Replicated over dp * cp (attention, dense MLPs, norms, embeddings)."""
    expert: float
    """Expert MLP weights, replicated over dp * cp / ep."""
    largest_layer: float
    """The largest block gathered at once under ZeRO-3 (per TP shard)."""
    largest_block: float = 0.0
    """The largest transformer layer (per TP shard), embeddings and head left out; 0: as
    ``largest_layer``."""
    head: float = 0.0
    """Final norm and LM head (per TP shard) on the last stage, 0 elsewhere."""
    root: float = 0.0
    """Parameters outside the transformer blocks (per TP shard): embedding on the first
    stage, final norm and LM head (or the tied embedding's copy) on the last."""
    root_grad_early: float = 0.0
    """Those of ``root`` whose gradients backward computes first (the last stage's norm and
    head, and the word embedding itself when tied to the head on one stage)."""
    layers: int = 0
    """Transformer layers of the stage."""
    tensors: int = 0
    """Parameter tensors of the stage (a tied weight once): ZeRO-1 in meshplan's runtime
    broadcasts each one on its own after the optimizer step (``timing.zero1_broadcast_s``).
    0: not counted (a traced model's traced before meshplan counted them)."""


@dataclass(frozen=True)
class StageMemory:
    """Bytes on one rank of pipeline stage ``stage``."""

    stage: int
    layers: int
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    buffers_bytes: float
    offloaded_bytes: float
    peak_bytes: float
    reserved_bytes: float

    @property
    def model_states_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


def stage_layer_range(model: ModelSpec, config: ParallelConfig, stage: int) -> range:
    layers = config.stage_layers(model.num_layers)
    start = sum(layers[:stage])
    return range(start, start + layers[stage])


def stage_float8_weight_elements(model: ModelSpec, config: ParallelConfig, stage: int) -> float:
    """Weight elements of the float8 linears of ``stage``'s layers on one rank
    (``eager.float8_weight_elements`` layer by layer)."""
    return sum(float8_weight_elements(model, config, moe=model.is_moe and model.is_moe_layer(i))
               for i in stage_layer_range(model, config, stage))


def layer_rank_params(model: ModelSpec, config: ParallelConfig, *, moe: bool) -> float:
    """Parameters of one layer on one rank: split over tp, expert weights over tp * ep."""
    if not moe:
        return model.dense_layer_params / config.tp
    experts = model.num_experts * model.mlp_params(model.expert_ffn_size)
    return (model.moe_layer_params - experts) / config.tp + experts / (config.tp * config.ep)


def stage_params(model: ModelSpec, config: ParallelConfig, stage: int) -> StageParams:
    """Parameters per rank of ``stage``: its layers, plus embedding (first) and head (last).

    With tied embeddings and pp > 1 the last stage keeps its own copy of the word embedding for
    the LM head, as Megatron-LM does. Everything is split over tp; expert weights over tp * ep.
    """
    layers = stage_layer_range(model, config, stage)
    if model.is_traced:  # every layer is in the graph; the largest is taken model-wide
        return StageParams(dense=float(sum(model.layer_params(i) for i in layers)), expert=0.0,
                           largest_layer=float(traced.largest_layer_params(model)),
                           layers=len(layers),
                           tensors=sum(model.traced[i].tensors for i in layers))
    key = (id(model), config.tp, config.ep, config.pp, stage == 0, stage == config.pp - 1,
           layers.start, layers.stop)
    hit = _STAGE_PARAMS.get(key)
    if hit is not None and hit[0] is model:
        return hit[1]
    if len(_STAGE_PARAMS) > 65536:
        _STAGE_PARAMS.clear()
    value = _stage_params(model, config, stage, layers)
    _STAGE_PARAMS[key] = (model, value)
    return value


_STAGE_PARAMS: dict[tuple, tuple[ModelSpec, StageParams]] = {}
"""``stage_params`` of analytic models by (id of the model, tp, ep, pp, first stage, last
stage, layer range): all it depends on (the entry keeps its model alive, as ``_LAYER_BYTES``)."""


def _stage_params(model: ModelSpec, config: ParallelConfig, stage: int,
                  layers: range) -> StageParams:
    t = config.tp
    expert_one = model.mlp_params(model.expert_ffn_size) if model.is_moe else 0
    # MoE layers are the indices i with (i + 1) % freq == 0 (``ModelSpec.is_moe_layer``)
    freq = model.moe_layer_freq
    moe = layers.stop // freq - layers.start // freq if model.is_moe else 0
    plain = len(layers) - moe
    experts = model.num_experts * expert_one
    dense = float(plain * model.dense_layer_params + moe * (model.moe_layer_params - experts))
    expert = float(moe * experts)
    largest = 0.0
    if moe:
        largest = layer_rank_params(model, config, moe=True)
    if plain:
        largest = max(largest, layer_rank_params(model, config, moe=False))
    block = largest
    head = root = early = 0.0
    word = model.vocab_rows * model.hidden_size
    if stage == 0:
        dense += model.embedding_params
        root += model.embedding_params
        largest = max(largest, word / t)
    if stage == config.pp - 1:
        dense += model.head_params
        root += model.head_params
        early += model.head_params
        if model.tied_embeddings:
            early += word
            if config.pp > 1:
                dense += word
                root += word
        largest = max(largest, word / t)
        head = model.head_params / t
    tensors = plain * layer_param_tensors(model, moe=False) \
        + moe * layer_param_tensors(model, moe=True) \
        + root_param_tensors(model, first=stage == 0, last=stage == config.pp - 1)
    return StageParams(dense=dense / t, expert=expert / (t * config.ep), largest_layer=largest,
                       largest_block=block, head=head, root=root / t,
                       root_grad_early=early / t, layers=len(layers), tensors=tensors)


def layer_param_tensors(model: ModelSpec, *, moe: bool) -> int:
    """Parameter tensors of one decoder layer, as meshplan's runtime builds it
    (``runtime/model.py``; the same count on every TP rank): the q, k, v and output
    projections, the query and key norms (``qk_norm``), two norms (a LayerNorm's weight and
    bias), the MLP's two or three (SwiGLU) projections, and biases where the model has them;
    an MoE layer's router and each expert's MLP instead of the MLP."""
    linears = 4 + (3 if model.activation == "swiglu" else 2)
    biases = 0
    if model.linear_bias:
        biases = linears
    elif model.qkv_bias:
        biases = 3
    norm = 2 if model.norm == "layernorm" else 1
    qk_norms = 2 if model.qk_norm else 0
    tensors = linears + biases + 2 * norm + qk_norms
    if moe:
        mlp = (3 if model.activation == "swiglu" else 2) * (2 if model.linear_bias else 1)
        tensors += 1 + model.num_experts * mlp - mlp
    return tensors


def root_param_tensors(model: ModelSpec, *, first: bool, last: bool) -> int:
    """Parameter tensors outside the decoder layers on a stage: the word embedding, learned
    positions and embedding norm on the first, the final norm and LM head on the last (a head
    tied to the embedding on the same stage is that tensor)."""
    norm = 2 if model.norm == "layernorm" else 1
    tensors = 0
    if first:
        tensors += 1 + int(model.position_embedding == "learned") \
            + (norm if model.embedding_norm else 0)
    if last:
        tensors += norm + (0 if model.tied_embeddings and first else 1)
    return tensors


def persistent_layer_params(model: ModelSpec) -> int:
    """Parameters of one dense layer held by tensors under DeepSpeed's persistence threshold
    (``DS_PERSISTENCE_THRESHOLD`` elements): its norms' weights and biases (the query and key
    norms' too, ``ModelSpec.qk_norm``) and, with biases,
    the projections' biases (QKV, attention output, MLP)."""
    h, q, kv, f = model.hidden_size, model.q_size, model.kv_size, model.ffn_hidden_size
    norm_tensors = [h] * (4 if model.norm == "layernorm" else 2)
    norm_tensors += [model.head_size] * (model.qk_norm_params // model.head_size)
    biases = []
    if model.linear_bias:
        up = 2 if model.activation == "swiglu" else 1
        biases = [q + 2 * kv, h, up * f, h]
    elif model.qkv_bias:
        biases = [q + 2 * kv]
    return sum(n for n in norm_tensors + biases if n < DS_PERSISTENCE_THRESHOLD)


def stage_boundary_bytes(model: ModelSpec, config: ParallelConfig, framework: str) -> float:
    """One micro-batch's hidden states at a pipeline stage boundary on one rank,
    sequence-split under SP (fp32 under the runtime's autocast, whose residual stream is
    fp32: ``runtime_autocast``)."""
    element = act.FP32_BYTES if runtime_autocast(framework, config) else \
        config.bytes_per_activation
    return (element * act.tokens_per_microbatch(config)
            * model.hidden_size / (config.tp if config.sp else 1))


def stage_recv_buffer_bytes(model: ModelSpec, config: ParallelConfig, stage: int,
                            framework: str, *, device_key: str = "") -> float:
    """Pipeline communication buffers of ``stage``: the receive buffers
    (``frameworks.pipeline_recv_buffer_bytes``) and the send in flight
    (``frameworks.pipeline_send_in_flight_bytes``) of boundary tensors
    (``stage_boundary_bytes``)."""
    boundary = stage_boundary_bytes(model, config, framework)
    return (pipeline_recv_buffer_bytes(framework, boundary_bytes=boundary,
                                       micro_batches=config.grad_accum_steps, stage=stage,
                                       stages=config.pp, vpp=config.vpp)
            + pipeline_send_in_flight_bytes(framework, boundary_bytes=boundary,
                                            stages=config.pp,
                                            micro_batches=config.grad_accum_steps,
                                            stage=stage, vpp=config.vpp,
                                            gloo=device_key == CPU_DEVICE_KEY))


def stage_states(model: ModelSpec, config: ParallelConfig, stage: int,
                 framework: str) -> tuple[StateBytes, StageParams]:
    params = stage_params(model, config, stage)
    fp32 = config.dtype == "fp32"
    shard = config.dp * config.cp
    states = model_state_bytes(framework, params=params.dense, shard=shard,
                               zero_stage=config.zero_stage, offload=config.offload, fp32=fp32)
    if params.expert:
        states = states + model_state_bytes(
            framework, params=params.expert, shard=max(1, shard // config.ep),
            zero_stage=config.zero_stage, offload=config.offload, fp32=fp32)
    return states, params


def stage_activation_bytes(model: ModelSpec, config: ParallelConfig, stage: int,
                           framework: str, *, device_key: str = "") -> float:
    """Peak activation bytes of ``stage``: in-flight micro-batches of its layers and extras.
    ``device_key``: the GPU catalog key (some policies differ on the ``cpu`` pseudo-device)."""
    mode = config.stage_recompute(stage)
    layer_range = stage_layer_range(model, config, stage)
    if model.is_traced:
        total = (act.in_flight_microbatches(config, stage)
                 * traced.stage_saved_bytes(model, config, layer_range, mode))
        if stage == config.pp - 1:
            total += traced.extra_saved_bytes(model, config)
        return total
    kinds: dict[tuple[str, bool], float] = {}  # each kind of layer's bytes, computed once

    def layer(mode: str, moe: bool) -> float:
        if (mode, moe) not in kinds:
            kinds[mode, moe] = _layer_bytes(model, config, framework, mode, moe=moe,
                                            device_key=device_key)
        return kinds[mode, moe]

    modes = layer_modes(config, framework, stage, len(layer_range))
    if not model.is_moe and len(set(modes)) == 1:  # layers alike: the same additions, in order
        per_mb = sum([layer(modes[0], False)] * len(modes))
    else:
        per_mb = sum(layer(layer_mode, model.is_moe_layer(i))
                     for i, layer_mode in zip(layer_range, modes))
    in_flight = act.in_flight_microbatches(config, stage)
    total = in_flight * (per_mb - received_input_bytes(model, config, stage, framework))
    if stage == 0:
        total += in_flight * act.embedding_activation_bytes(model, config)
    if stage == config.pp - 1:
        total += last_stage_head_bytes(model, config, framework, device_key=device_key)
    return total


def received_input_bytes(model: ModelSpec, config: ParallelConfig, stage: int,
                         framework: str) -> float:
    """Bytes of one whole-stage micro-batch's activations that are the pipeline's receive
    buffers (``frameworks.pipeline_recv_buffer_bytes``, counted there for the whole step).

    ``torch.distributed.pipelining`` hands a chunk's receive buffer itself to its first block
    as the input (``PipelineStage._retrieve_recv_activations``), so what that block saves of
    its input (a recomputed block's checkpointed input, or its first norm's input) is the
    buffer's storage: one boundary tensor (``stage_boundary_bytes``) per chunk of the stage
    that receives, i.e. every chunk but the pipeline's first. Seen in the live tensors at the
    peaks of torchtitan's code path on this CPU (pp 4, 16 blocks, full AC,
    ``benchmarks/torchtitan_cpu_pp_memory.py``): rank 1 under 1F1B holds three micro-batches'
    saved inputs of its blocks 2-4 and no copy of block 1's beside the receive buffers."""
    if framework not in PIPELINING_FRAMEWORKS or config.pp == 1:
        return 0.0
    receiving = config.vpp - (1 if stage == 0 else 0)
    return receiving * stage_boundary_bytes(model, config, framework)


def loss_logit_copies(framework: str, config: ParallelConfig) -> float:
    """``frameworks.logit_copies`` for the plan: its dtype, whether torchtitan compiles the
    loss or a fused cross-entropy kernel runs it (``cross_entropy_fusion``), and whether it
    runs under tensor parallelism (torchtitan's loss parallelism)."""
    return logit_copies(framework, config.dtype == "fp32",
                        compiled_loss=config.fused_loss_kernel, loss_parallel=config.tp > 1)


def last_stage_head_bytes(model: ModelSpec, config: ParallelConfig, framework: str, *,
                          device_key: str = "") -> float:
    """What the last stage holds for the LM head and the loss beyond its layers' activations:
    the head's inputs and the framework's loss copies of the logits
    (``activations.head_activation_bytes``; torchtitan's compiled loss and loss parallelism,
    and the all-gathered head input under SP, ``frameworks.DTENSOR_TP_FRAMEWORKS``), and the stage
    outputs the pipeline schedule keeps. ``device_key``: on the ``cpu`` pseudo-device
    torchtitan's final norm runs torch's composite RMSNorm (``activations.
    head_activation_bytes``'s ``composite_norm``)."""
    head = act.head_activation_bytes(
        model, config, logit_copies=loss_logit_copies(framework, config),
        vocab_parallel=vocab_parallel_loss(framework),
        gathered_head_input=(framework in DTENSOR_TP_FRAMEWORKS and config.sp
                             and config.tp > 1),
        composite_norm=framework == "torchtitan" and device_key == CPU_DEVICE_KEY)
    return head + act.logit_bytes(model, config,
                                  copies=kept_stage_output_copies(framework, config.pp),
                                  vocab_parallel=vocab_parallel_loss(framework),
                                  element_bytes=config.bytes_per_activation)


def layer_modes(config: ParallelConfig, framework: str, stage: int, layers: int) -> list[str]:
    """What each of the stage's ``layers`` blocks does for backward: ``none``, ``full``,
    ``selective`` or ``op`` (a per-op policy, ``activations.op_policy_layer_bytes``).

    Selective means each framework's own policy: Korthikanti et al. 2022's attention-core
    recomputation for Megatron-LM and DeepSpeed (Megatron-DeepSpeed's ``selective``
    granularity; under fused attention only the log-sum-exp is left to drop, so it is nearly
    ``none``; DeepSpeed's own ``deepspeed.checkpointing`` recomputes whole layers, ``full``,
    and its ``partition_activations`` / ``cpu_checkpointing`` options are not modelled); torchtitan's ``selective_ac``, its per-op policy or every Nth block fully
    recomputed and the others kept whole (torchtitan 0.2.2 ``_apply_layer_sac``: a counter over
    the blocks the rank wraps, block k (from 1) recomputed when N divides k); meshplan's
    runtime's per-op policy.
    """
    mode = config.stage_recompute(stage)
    if mode != "selective" or framework not in ("torchtitan", "meshplan"):
        return [mode] * layers
    every = config.selective_every_n_layers if framework == "torchtitan" else 0
    if not every:
        return ["op"] * layers
    return ["full" if (k + 1) % every == 0 else "none" for k in range(layers)]


LAYER_FIELDS = ("tp", "cp", "sp", "micro_batch_size", "seq_len", "flash_attention", "dtype",
                "compile", "float8")
"""The ``ParallelConfig`` fields one layer's activation bytes depend on: ``activations``'
per-layer functions read no other (tests/costmodel/test_memory_caches.py checks it)."""
_layer_fields = operator.itemgetter(*LAYER_FIELDS)
_LAYER_BYTES: dict[tuple, tuple[ModelSpec, float]] = {}
"""``_layer_bytes`` by (id of the model, framework, mode, moe, device, ``LAYER_FIELDS``); each
entry keeps its model alive so that the id is not reused while the entry exists (models are
not changed after they are made)."""


def _layer_bytes(model: ModelSpec, config: ParallelConfig, framework: str, mode: str, *,
                 moe: bool, device_key: str = "") -> float:
    """One layer's stored bytes for one micro-batch under ``mode`` (cached: the planner asks
    for the same few layers across thousands of stage probes)."""
    autocast = runtime_autocast(framework, config)
    return _per_layer(model, config, (framework, mode, moe, device_key, autocast),
                      lambda: _uncached_layer_bytes(model, config, framework, mode, moe=moe,
                                                    device_key=device_key, autocast=autocast))


def _stored_input_bytes(model: ModelSpec, config: ParallelConfig, framework: str) -> float:
    """What a fully recomputed layer keeps: its input (cached as ``_layer_bytes``)."""
    autocast = runtime_autocast(framework, config)
    return _per_layer(model, config, ("input", autocast),
                      lambda: act.layer_activation_bytes(model, config, recompute="full",
                                                         eager=autocast, autocast=autocast))


GLOO_HELD_GATHERS = 3
"""Sequence-parallel activations (an all-gather's whole-sequence output, or what a matmul
made of it) that meshplan's runtime on the CPU (gloo) can still hold at a peak after its
forward moved on: a completed collective's work object keeps its output until gloo's thread
releases it, so whether they are alive depends on timing. Measured with the live-tensor
tracker (tiny, tp 2 with SP, bf16 autocast, 2 ranks): most runs' peaks hold none of them, about
one rank in four holds two all-gather outputs and one matmul output more (98,304 bytes:
3 x 2 x 64 x 64 fp32), 5.9 % above the prediction without this allowance."""


def gloo_held_gather_bytes(model: ModelSpec, config: ParallelConfig, framework: str,
                           device_key: str) -> float:
    """``GLOO_HELD_GATHERS`` whole-sequence activations (fp32 under autocast, whose norms'
    outputs are gathered, else the compute dtype) for meshplan's runtime on the CPU under
    tensor parallelism with SP; 0 otherwise (the peak counts them: a timing the plan cannot
    choose should not exceed it)."""
    if framework != "meshplan" or device_key != CPU_DEVICE_KEY or config.tp == 1 \
            or not config.sp:
        return 0.0
    element = 4 if runtime_autocast(framework, config) else config.bytes_per_activation
    return GLOO_HELD_GATHERS * act.tokens_per_microbatch(config) * model.hidden_size * element


def runtime_autocast(framework: str, config: ParallelConfig) -> bool:
    """Whether meshplan's runtime runs this plan under ``torch.autocast`` over fp32 weights:
    a 16-bit plan without FSDP2 (ZeRO 0-1 and no parameter offload; ``runtime/train.py``
    ``build_rank_model``). FSDP2 plans hold 16-bit parameters instead."""
    return (framework == "meshplan" and config.dtype != "fp32" and config.zero_stage <= 1
            and config.offload != "optimizer+params")


def autocast_weight_bytes(model: ModelSpec, config: ParallelConfig, stage: int,
                          params: StageParams) -> float:
    """Compute-dtype copies of the stage's weights that ``torch.autocast`` keeps in its cast
    cache while its context is open: every weight a matmul reads (the blocks' and the LM
    head's; the word embedding only where it is also the head), cast once per context.

    Measured on an H200 (``benchmarks/gpu_memory_breakdown.py``, Llama-3.2-1B under the
    runtime's step): 2,357 MiB of bf16 weight copies alive at the loss under full and
    selective recomputation, all 1.24 B parameters at 2 bytes (its embedding is the tied
    head)."""
    cast = params.dense + params.expert
    if stage == 0 and not model.is_traced:
        cast -= model.embedding_params / config.tp
        if stage == config.pp - 1 and model.tied_embeddings:
            cast += model.vocab_rows * model.hidden_size / config.tp
    return config.bytes_per_activation * cast


def recompute_cast_bytes(model: ModelSpec, config: ParallelConfig, stage: int) -> float:
    """What a recomputed block adds to its own backward under meshplan's runtime's
    ``torch.autocast``: compute-dtype copies of its weights, cast again by the recomputation
    (which runs in backward, outside the forward's cast cache) and saved by its matmuls until
    the block's backward is done; one block's worth (its largest kind), 0 when no block of the
    stage recomputes.

    Measured with the runtime's live-tensor tracker (tiny Llama, pp 2, bf16 on the CPU, first
    stage, peak inside a block's backward): 81,920 bytes of bf16 weight copies made by the
    recomputation beside the forward's cast cache, under full recomputation and under the
    per-op selective policy alike; one block's linear weights are 92,160 bytes."""
    layers = stage_layer_range(model, config, stage)
    if all(mode == "none" for mode in layer_modes(config, "meshplan", stage, len(layers))):
        return 0.0
    moe = model.is_moe and any(model.is_moe_layer(i) for i in layers)
    return config.bytes_per_activation * layer_rank_params(model, config, moe=moe)


def _per_layer(model: ModelSpec, config: ParallelConfig, tag: tuple, compute) -> float:
    """``compute()``, cached by the model, ``tag`` and the config's ``LAYER_FIELDS``."""
    key = (id(model), tag, _layer_fields(config.__dict__))
    hit = _LAYER_BYTES.get(key)
    if hit is not None and hit[0] is model:
        return hit[1]
    if len(_LAYER_BYTES) > 65536:
        _LAYER_BYTES.clear()
    value = compute()
    _LAYER_BYTES[key] = (model, value)
    return value


def _uncached_layer_bytes(model: ModelSpec, config: ParallelConfig, framework: str, mode: str,
                          *, moe: bool, device_key: str = "", autocast: bool = False) -> float:
    compiled = framework == "torchtitan" and config.compile != "none"
    if mode == "op":
        return act.op_policy_layer_bytes(
            model, config, moe=moe, policy=framework,
            saves_attention=framework != "torchtitan" or device_key != CPU_DEVICE_KEY,
            autocast=autocast, compiled=compiled)
    return act.layer_activation_bytes(model, config, recompute=mode, moe=moe,
                                      eager=eager_autograd(framework),
                                      rope_tables=framework != "torchtitan", autocast=autocast,
                                      fused_norm=device_key != CPU_DEVICE_KEY,
                                      compiled=compiled,
                                      float8_inputs=framework == "megatron" and config.float8)


def recompute_workspace_bytes(model: ModelSpec, config: ParallelConfig, stage: int, *,
                              framework: str = "megatron", device_key: str = "") -> float:
    """Activations rebuilt by recomputation during one layer's backward, on top of those stored.

    Full: the layer's whole activations less its stored input (the recomputation starts from
    that same tensor). Selective: the attention core (Korthikanti), or under a per-op policy
    what the policy does not keep. None: nothing. Counted as a buffer, not as stored
    activations (Megatron-LM's and Korthikanti's counts leave it out).
    """
    mode = config.stage_recompute(stage)
    if model.is_traced:
        return traced.recompute_workspace_bytes(model, config, mode,
                                                stage_layer_range(model, config, stage))
    layer_range = stage_layer_range(model, config, stage)
    modes = set(layer_modes(config, framework, stage, len(layer_range)))
    moe = model.is_moe and any(model.is_moe_layer(i) for i in layer_range)
    whole = _layer_bytes(model, config, framework, "none", moe=moe, device_key=device_key)
    if "full" in modes:
        return whole - _stored_input_bytes(model, config, framework)
    if "op" in modes:
        return max(0.0, whole - _layer_bytes(model, config, framework, "op", moe=moe,
                                             device_key=device_key))
    if "selective" in modes:
        return act.attention_core_bytes(model, config)
    return 0.0


def stage_memory(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, stage: int, *,
                 framework: str, calibration: Calibration) -> StageMemory:
    """Allocated peak and reserved bytes on one rank of ``stage``.

    The peak is the larger of two phases on top of the model states and the buffers that stay
    allocated (DDP's gradient buckets): forward/backward (activations, gather buffers, the
    recomputation workspace) and the optimizer step (its temporaries; activations are freed).

    On the CPU device the "device" is host memory: what a plan offloads stays in the memory
    its peak is counted in, so the offloaded states add to the peak and to reserved there.
    Measured (meshplan's runtime, tiny, fp32, one process, ``gpu_runtime.py --dry-run``):
    optimizer offload 7,181,040 B, ZeRO-3 with parameters offloaded 5,866,736 B, against
    3,731,968 and 2,742,272 predicted without the offloaded states.
    """
    memory = _stage_memory(model, cluster, config, stage, framework=framework,
                           calibration=calibration)
    if cluster.gpu.key != CPU_DEVICE_KEY or not memory.offloaded_bytes:
        return memory
    return dataclasses.replace(memory, peak_bytes=memory.peak_bytes + memory.offloaded_bytes,
                               reserved_bytes=memory.reserved_bytes + memory.offloaded_bytes)


def _stage_memory(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, stage: int,
                  *, framework: str, calibration: Calibration) -> StageMemory:
    """``stage_memory`` on a GPU (device memory apart from what is offloaded)."""
    compute_bytes = config.bytes_per_activation  # the compute dtype's
    states, params = stage_states(model, config, stage, framework)
    activations = stage_activation_bytes(model, config, stage, framework,
                                         device_key=cluster.gpu.key)
    if framework == "torchtitan" and not model.is_traced:
        return _torchtitan_stage_memory(model, config, stage, calibration=calibration,
                                        states=states, params=params, activations=activations,
                                        device_key=cluster.gpu.key)
    buffers = framework_buffer_bytes(
        framework, zero_stage=config.zero_stage, stage_params=params.dense + params.expert,
        largest_layer_params=params.largest_layer, fp32=config.dtype == "fp32",
        data_parallel=config.dp * config.cp > 1, largest_block_params=params.largest_block,
        kept_gathered_params=params.root if framework == "meshplan" else params.head,
        early_root_grad_params=params.root_grad_early, pipelined=config.pp > 1)
    if framework == "deepspeed" and config.zero_stage == 3:
        buffers += deepspeed_zero3_extra_buffer_bytes(
            largest_layer_params=params.largest_layer,
            persistent_params=persistent_layer_params(model) * params.layers,
            compute_bytes=compute_bytes)
    persistent = buffers if framework in ("meshplan", "torchtitan") and \
        config.zero_stage <= 1 else 0.0
    if framework == "megatron" and config.float8:
        # Transformer Engine keeps each float8 linear's weight cast in both layouts (1 byte
        # each) from a step's first micro-batch to its end (``timing.te_weight_cast_s``)
        cache = 2 * stage_float8_weight_elements(model, config, stage)
        buffers += cache
        persistent += cache
    buffers += gloo_held_gather_bytes(model, config, framework, cluster.gpu.key)
    recv = stage_recv_buffer_bytes(model, config, stage, framework,
                                   device_key=cluster.gpu.key)
    gathered = buffers + recv  # gather and gradient buffers with the pipeline's
    buffers += recv
    persistent += recv
    workspace = (recompute_workspace_bytes(model, config, stage, framework=framework,
                                           device_key=cluster.gpu.key)
                 if framework != "ideal" else 0.0)
    buffers += workspace
    optimizer_params = 0.0 if config.offload != "none" else (
        params.dense / (config.dp * config.cp if config.zero_stage >= 1 else 1)
        + params.expert / (max(1, config.dp * config.cp // config.ep)
                           if config.zero_stage >= 1 else 1))
    step_workspace = optimizer_workspace_bytes(framework, optimizer_params=optimizer_params)
    # pipelined FSDP: the peak backward's activations, accumulators and gathered chunks
    pipelined_fsdp = framework == "meshplan" and config.pp > 1 and config.zero_stage >= 2
    unheld = 0.0
    if pipelined_fsdp and not model.is_traced:
        stage_total = params.dense + params.expert
        activations, unheld, unsent = _pipelined_fsdp_peak(
            model, config, stage, framework, activations=activations,
            accumulators=act.FP32_BYTES * stage_total,
            block_accumulators=act.FP32_BYTES * params.largest_block,
            gathered=compute_bytes * stage_total,
            sharded_grads=states.grads, device_key=cluster.gpu.key)
        unheld += unsent
    # a block's backward: the loss is freed
    in_block = activations + buffers - persistent - unheld
    # meshplan's runtime holds the loss only on the last stage, before any block there
    # recomputes: its loss and head phases leave the recomputation workspace out
    loss_stage = framework == "meshplan" and not model.is_traced and stage == config.pp - 1
    before_blocks = (activations + buffers - persistent - unheld
                     - (workspace if loss_stage else 0.0))
    if loss_stage and config.zero_stage == 3 and config.pp == 1:
        # the second gathered block and a block's gradients come with the blocks' backward
        before_blocks -= meshplan_zero3_block_backward_bytes(
            compute_bytes=compute_bytes, largest_block_params=params.largest_block)
    phases = [before_blocks]
    # under a pipeline FSDP creates the sharded gradients only in the reduce-scatter after the
    # last micro-batch's backward, and the step sets them to None, so they are not allocated
    # through forward and backward (measured: ``pipelined_fsdp_reduce_scatter_bytes``)
    if framework == "meshplan" and not model.is_traced:
        in_block += _block_backward_bytes(model, config, stage)
        phases.append(before_blocks + _head_backward_bytes(model, config, stage, params))
    phases.append(in_block)
    if runtime_autocast(framework, config) and not model.is_traced:
        phases = _autocast_phases(model, config, stage, params, phases,
                                  loss_forward=activations + buffers - workspace - persistent)
    if pipelined_fsdp:
        phases.append(gathered - persistent + pipelined_fsdp_reduce_scatter_bytes(
            largest_group_params=max(params.root, params.largest_block),
            shard=config.dp * config.cp))
    live_grads = 0.0 if pipelined_fsdp else states.grads
    peak = max(states.params + live_grads + states.optimizer + persistent + max(phases),
               states.params + states.grads + states.optimizer + persistent + step_workspace)
    comm = calibration.communicator_bytes if config.world_size > 1 else 0.0
    reserved = peak * (1 + calibration.allocator_fragmentation) + comm
    return StageMemory(stage=stage, layers=len(stage_layer_range(model, config, stage)),
                       params_bytes=states.params, grads_bytes=states.grads,
                       optimizer_bytes=states.optimizer, activations_bytes=activations,
                       buffers_bytes=buffers, offloaded_bytes=states.offloaded,
                       peak_bytes=peak, reserved_bytes=reserved)


def _autocast_phases(model: ModelSpec, config: ParallelConfig, stage: int, params: StageParams,
                     phases: list[float], *, loss_forward: float) -> list[float]:
    """The forward/backward phases of meshplan's runtime under ``torch.autocast``.

    The cast cache (``autocast_weight_bytes``) lives while the autocast context is open. A
    pipeline schedule runs whole under one context, so every phase holds it. Without a
    pipeline the context closes after each micro-batch's loss: the loss's forward holds the
    cache, with the logits in the compute dtype, their fp32 upcast and the log-softmax (one
    fp32 copy fewer, counted in compute-dtype bytes, than the three at the loss's backward);
    in backward only recomputation without checkpoints keeps the copies (each matmul saved
    its weight's), so ``none`` holds them throughout. Measured on an H200
    (``benchmarks/gpu_memory_breakdown.py``, Llama-3.2-1B, 2 x 2048 tokens, 4 micro-batches):
    peaks of 34,331 (none), 29,728 (selective) and 26,784 MiB (full), at the loss's backward,
    the loss and the loss. ``loss_forward``: the stored activations with the loss's three
    copies and the buffers other than the recomputation workspace (nothing is recomputed
    yet)."""
    cast = autocast_weight_bytes(model, config, stage, params)
    if config.pp > 1 or config.stage_recompute(stage) == "none":
        return [phase + cast for phase in phases]
    # one stage: it holds the loss
    shards = dict(vocab_parallel=vocab_parallel_loss("meshplan"))
    at_forward = act.logit_bytes(model, config, copies=2.0, **shards) + act.logit_bytes(
        model, config, copies=1.0, element_bytes=config.bytes_per_activation, **shards)
    at_backward = act.logit_bytes(model, config, copies=logit_copies("meshplan", fp32=False),
                                  **shards)
    return [*phases, loss_forward - at_backward + at_forward + cast]


def _block_backward_bytes(model: ModelSpec, config: ParallelConfig, stage: int) -> float:
    """What a block's backward adds once the loss's logits are freed: the backward workspace
    (``activations.backward_workspace_bytes``) and, under autocast, the recomputation's weight
    casts (``recompute_cast_bytes``), less the loss's logit copies on the last stage (whose
    loss phase ``stage_memory`` counts on its own, without the recomputation workspace: the
    loss is freed before a block of the stage recomputes). Under SP the runtime's MLP has
    freed its ffn-wide tensors by the time it reduce-scatters its input's gradient (measured
    at TP 4, 32 x 64 tokens, a 64-row vocabulary so that a block sets the peak, full
    recomputation: 4.65 MB live there against the 5.94 MB peak in the recomputed forward),
    so torchtitan's ``activations.sp_input_grad_scatter_bytes`` moment does not set its
    peak."""
    fp32 = config.dtype == "fp32"
    workspace = act.backward_workspace_bytes(model, config,
                                             weight_grad_bytes=_weight_grad_bytes(config),
                                             accumulating=config.grad_accum_steps > 1)
    if runtime_autocast("meshplan", config):
        workspace += recompute_cast_bytes(model, config, stage)
    if stage == config.pp - 1:  # the loss phase is its own (``stage_memory``)
        return workspace - act.logit_bytes(model, config, copies=logit_copies("meshplan", fp32),
                                           vocab_parallel=vocab_parallel_loss("meshplan"))
    return workspace


def _head_backward_bytes(model: ModelSpec, config: ParallelConfig, stage: int,
                         params: StageParams) -> float:
    """What the LM head's backward adds over the loss phase on the last stage when gradients
    accumulate (later micro-batches of a step): the head's fresh weight gradient, before it is
    added to the ``.grad`` of the earlier ones, and the gradient of the head's input (the
    whole hidden width, before TP reduces it), while of the loss's logit copies only the
    logits' gradient is left. Negative (never the peak) when the logits outweigh the head, as
    in small models. Measured with the runtime's live-tensor tracker at the last stage of
    pp2 x dp4 ZeRO-3 (a 0.32 B Llama shape, ``benchmarks/large_cpu_rss.py``): two 32000 x 1536
    fp32 head gradients and a 128 x 1536 input gradient alive at the peak, beside the logits
    and their gradient: 1989.6 MiB measured, 1989.6 predicted."""
    if stage != config.pp - 1 or config.grad_accum_steps <= 1:
        return -float("inf")
    freed = act.logit_bytes(model, config, copies=logit_copies("meshplan",
                                                               config.dtype == "fp32") - 1,
                            vocab_parallel=vocab_parallel_loss("meshplan"))
    input_grad = config.bytes_per_activation * act.tokens_per_microbatch(config) \
        * model.hidden_size
    return _weight_grad_bytes(config) * params.head + input_grad - freed


def _weight_grad_bytes(config: ParallelConfig) -> int:
    """Bytes per element of a weight gradient in meshplan's runtime: fp32 unless FSDP holds
    the unsharded weights in a 16-bit compute dtype (DDP keeps fp32 weights under autocast)."""
    return 4 if config.dtype == "fp32" or config.zero_stage <= 1 else 2


def _pipelined_fsdp_peak(model: ModelSpec, config: ParallelConfig, stage: int, framework: str, *,
                      activations: float, accumulators: float, block_accumulators: float,
                      gathered: float, sharded_grads: float,
                      device_key: str) -> tuple[float, float, float]:
    """(activations, buffer bytes not held, send bytes not yet issued) at the peak backward of
    a pipelined FSDP stage (``frameworks.pipelined_fsdp_peak``; 1F1B or interleaved).

    The buffers count the whole stage's fp32 gradient ``accumulators`` and its ``gathered``
    parameters through backward; at the peak, chunks whose first backward has not come have
    no accumulators yet (a chunk's first backward starts with one block's,
    ``block_accumulators``), and chunks past their last backward are resharded and reduced,
    their part of both freed and their part of the ``sharded_grads`` allocated. On gloo (the
    CPU) the sends the interleaved schedule holds to its end (``stage_recv_buffer_bytes``
    counts all of them) pile up as it goes. ``activations``: the stage's at the warmup count
    (``stage_activation_bytes``), whose in-flight part is rescaled."""
    head = (last_stage_head_bytes(model, config, framework, device_key=device_key)
            if stage == config.pp - 1 else 0.0)
    per_microbatch = (activations - head) / act.in_flight_microbatches(config, stage)
    vpp = config.vpp
    gloo = device_key == CPU_DEVICE_KEY and vpp > 1  # 1F1B waits on each send before the next
    boundary = stage_boundary_bytes(model, config, framework)
    peak = pipelined_fsdp_peak(
        config.pp, vpp, config.grad_accum_steps, stage,
        chunk_microbatch_bytes=per_microbatch / vpp, chunk_accumulator_bytes=accumulators / vpp,
        chunk_gathered_bytes=gathered / vpp, chunk_sharded_grad_bytes=sharded_grads / vpp,
        block_accumulator_bytes=block_accumulators, send_bytes=boundary if gloo else 0.0)
    unheld = ((1 - peak.accumulating) * accumulators + peak.finished * gathered
              - peak.finished * sharded_grads)
    all_sends = pipeline_send_in_flight_bytes(
        framework, boundary_bytes=boundary, stages=config.pp,
        micro_batches=config.grad_accum_steps, stage=stage, vpp=vpp, gloo=gloo)
    unsent = all_sends - peak.sends * boundary if gloo else 0.0
    return peak.live * per_microbatch + head, unheld, unsent


def _backward_sharded_grads_bytes(model: ModelSpec, config: ParallelConfig, stage: int, *,
                                  states: StateBytes, params: StageParams, device_key: str,
                                  dropped_prefetch: float) -> float:
    """What a later block's backward holds above the first one's under FSDP2 with one
    micro-batch (torchtitan, pp 1): each block's reduce-scatter leaves its sharded fp32
    gradient behind (the step's ``zero_grad`` set none before backward), after the LM head
    group's, while each finished block releases what it stored. Block ``j`` of the backward
    (0: the first) holds ``head + j (g - a)`` more, ``g`` a block's sharded gradient and ``a``
    a layer's stored bytes, and the last block one prefetched block less (it prefetches the
    embedding): the most over the blocks, 0 where the first one holds most (a layer stores
    more than its sharded gradient: no recomputation, per-op, or long sequences; a layer's
    stored bytes are the stage's mean where layers recompute differently). Measured on
    torchtitan's compiled step on this CPU (tiny, FSDP 2, full AC, bf16 and fp32, one rank of a
    fake group, ``benchmarks/torchtitan_cpu_mixed_memory.py``): the peak falls in the second
    to last block's backward, beside the head group's and two blocks' sharded gradients."""
    layers = len(stage_layer_range(model, config, stage))
    if layers < 2 or not states.grads:
        return 0.0
    total = params.dense + params.expert
    block = states.grads * params.largest_block / total
    head = states.grads * params.head / total
    counts = Counter(layer_modes(config, "torchtitan", stage, layers))
    stored = sum(count * _layer_bytes(model, config, "torchtitan", mode, moe=False,
                                      device_key=device_key)
                 for mode, count in counts.items()) / layers
    step = block - stored
    later = max((layers - 2) * step, (layers - 1) * step - dropped_prefetch)
    return max(0.0, head + later)


def _torchtitan_stage_memory(model: ModelSpec, config: ParallelConfig, stage: int, *,
                             calibration: Calibration, states: StateBytes, params: StageParams,
                             activations: float, device_key: str) -> StageMemory:
    """torchtitan's train step, phase by phase (torchtitan 0.2.2 train.py and apply_fsdp).

    Each step starts with ``optimizer.zero_grad()`` (gradients set to None), so with a single
    micro-batch no gradient exists before backward. Forward/backward peaks at one of:

    * the loss backward (last stage): every stored activation and the loss's logit copies, with
      the ``[norm, output]`` group still gathered and the last block prefetched (or, without
      resharding, the whole stage gathered);
    * a block's backward, in its MLP's backward: the stored activations less the loss's, what
      its recomputation rebuilt, the two ffn-wide gradients of the SwiGLU backward
      (``activations.backward_workspace_bytes``), the block's gathered parameters and the
      next block's prefetched ones, the down projection's fresh gradient, and the previous
      block's fp32 reduce-scatter input, still in flight on the reduce-scatter stream; or,
      under sequence parallelism, where the MLP's backward reduce-scatters its gathered
      input's whole-sequence gradient and the copy torch makes of it, whichever of the two
      holds more (``activations.sp_input_grad_scatter_bytes``: the latter from TP 4 on);
    * the end of a block's backward: the stored activations less the loss's and the block's
      gather and gradient buffers (``torchtitan_fsdp_buffer_bytes``), what its recomputation
      rebuilt freed again.

    Measured on torchtitan's own code path on the CPU (``benchmarks/torchtitan_cpu_memory.py``):
    the peak falls in the SwiGLU backward, with six ffn-wide tensors alive (the four the MLP
    saved, less the down projection's input, plus its output gradient and the two products'
    gradients); counting only the end-of-block buffers there under-predicted by 6-9 % once
    the activations outweigh the parameters (4 ranks, 8 x 64 tokens).

    Under a pipeline each chunk's fp32 gradient accumulators exist from its first backward
    on, and the peak is the backward where they and the live activations are largest
    together (``frameworks.pipelined_fsdp_peak``, walking torch's order of the rank's
    forwards and backwards), not the warmup count beside the whole stage's accumulators.

    The optimizer step (fused AdamW, in place) holds parameters, gradients and Adam states.
    Reserved adds blocks the CUDA caching allocator keeps but cannot reuse at that peak
    (``torchtitan_cached_bytes``), then the allocator's fragmentation and the communicator.
    """
    fp32 = config.dtype == "fp32"
    compute_bytes = config.bytes_per_activation  # the compute dtype's
    buffers = framework_buffer_bytes(
        "torchtitan", zero_stage=config.zero_stage, stage_params=params.dense + params.expert,
        largest_layer_params=params.largest_layer, fp32=fp32,
        data_parallel=config.dp * config.cp > 1, largest_block_params=params.largest_block,
        kept_gathered_params=params.head, pipelined=config.pp > 1, float8_blocks=config.float8,
        float8_head=config.float8_head, reduce_bytes=config.grad_reduce_bytes)
    block_bytes = 1 if config.float8 else compute_bytes  # a gathered block's parameter
    head_bytes = 1 if config.float8_head else compute_bytes  # the gathered LM head's
    workspace = recompute_workspace_bytes(model, config, stage, framework="torchtitan",
                                          device_key=device_key)
    last = stage == config.pp - 1
    # what the loss phase alone holds: the logits' copies and, on the CPU, the final norm's
    # composite (its backward runs before any block's)
    loss = act.logit_bytes(model, config, copies=loss_logit_copies("torchtitan", config)) \
        + (act.composite_final_norm_bytes(model, config) if device_key == CPU_DEVICE_KEY
           else 0.0) if last else 0.0
    if config.zero_stage <= 1:  # DDP: buckets stay allocated, nothing is gathered
        at_loss = in_block = buffers
    elif config.zero_stage == 3 and config.pp == 1:
        at_loss = head_bytes * params.head + block_bytes * params.largest_block
        in_block = buffers
    else:
        at_loss = compute_bytes * (params.dense + params.expert)
        if config.pp > 1:  # the stage's gradient accumulators (torchtitan_fsdp_buffer_bytes)
            at_loss += config.grad_reduce_bytes * (params.dense + params.expert)
        in_block = buffers
    recv = stage_recv_buffer_bytes(model, config, stage, "torchtitan", device_key=device_key)
    # gradients accumulated over micro-batches in the sharded .grad (FSDP2 syncs every
    # micro-batch); under PP the schedule turns the sync off until the last micro-batch's
    # backward, after zero_grad, so no sharded gradient exists before it (the fp32 accumulators
    # are in the buffers: torchtitan_fsdp_buffer_bytes, pipelined), as benchmarks/
    # torchtitan_cpu_pp_memory.py measured on torchtitan's own code path
    pipelined_fsdp = config.pp > 1 and config.zero_stage >= 2
    unsent = 0.0  # gloo's sends not yet issued at the peak
    if pipelined_fsdp:
        stage_total = params.dense + params.expert
        activations, unheld, unsent = _pipelined_fsdp_peak(
            model, config, stage, "torchtitan", activations=activations,
            accumulators=config.grad_reduce_bytes * stage_total,
            block_accumulators=config.grad_reduce_bytes * params.largest_block,
            gathered=compute_bytes * stage_total, sharded_grads=states.grads,
            device_key=device_key)
        buffers, in_block, at_loss = buffers - unheld, in_block - unheld, at_loss - unheld
    live_grads = states.grads if config.grad_accum_steps > 1 and not pipelined_fsdp else 0.0
    swiglu_grads = act.backward_workspace_bytes(model, config, weight_grad_bytes=compute_bytes,
                                                accumulating=False) \
        + act.float8_cast_workspace_bytes(model, config) \
        + act.float8_compiled_backward_bytes(model, config, recompute=config.stage_recompute(stage))
    if config.zero_stage == 3 and config.pp == 1:
        mid_block = (2 * block_bytes * params.largest_block
                     + compute_bytes * model.hidden_size * model.ffn_hidden_size / config.tp
                     + config.grad_reduce_bytes * params.largest_block)
        if not live_grads:  # one micro-batch: the sharded gradients appear during backward
            mid_block += _backward_sharded_grads_bytes(
                model, config, stage, states=states, params=params, device_key=device_key,
                dropped_prefetch=block_bytes * params.largest_block
                - compute_bytes * (params.root - params.head))
    else:  # the buffers stay whole through the block (DDP buckets, a gathered stage)
        mid_block = in_block
    forward_backward = states.params + states.optimizer + live_grads + recv - unsent + max(
        activations + at_loss if last else 0.0,
        activations - loss + mid_block + workspace
        + max(swiglu_grads, act.sp_input_grad_scatter_bytes(model, config)),
        activations - loss + in_block)
    step = states.params + states.grads + states.optimizer + recv + (
        buffers if config.zero_stage <= 1 else 0.0)
    peak = max(forward_backward, step)
    # ``del pred`` frees the logits before backward, unless a compiled loss keeps them for its
    # own backward (``COMPILED_LOSS_LOGIT_COPIES`` counts them live there)
    frees_logits = last and not fp32 and config.compile != "model+loss"
    cached = torchtitan_cached_bytes(
        freed_grads=states.grads - live_grads, freed_logits=act.logit_bytes(
            model, config, copies=1, element_bytes=compute_bytes) if frees_logits else 0.0,
        fsdp=config.zero_stage >= 2, compute_bytes=compute_bytes,
        largest_gather_params=params.largest_layer, largest_block_params=params.largest_block,
        head_params=params.head, gathered_block_bytes=block_bytes,
        gathered_head_bytes=head_bytes, reduce_bytes=config.grad_reduce_bytes)
    comm = calibration.communicator_bytes if config.world_size > 1 else 0.0
    reserved = max(forward_backward + cached, step) * (1 + calibration.allocator_fragmentation) \
        + comm
    return StageMemory(stage=stage, layers=len(stage_layer_range(model, config, stage)),
                       params_bytes=states.params, grads_bytes=states.grads,
                       optimizer_bytes=states.optimizer, activations_bytes=activations,
                       buffers_bytes=buffers + workspace + recv,
                       offloaded_bytes=states.offloaded,
                       peak_bytes=peak, reserved_bytes=reserved)


def host_bytes_per_node(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig,
                        stages: list[StageMemory], *, framework: str) -> float:
    """Host (or NVMe) bytes per node for offloaded states.

    DeepSpeed: what its estimators ask for (``deepspeed_host_bytes_per_node``, with zero.Init).
    Others: the largest stage's offloaded states times the GPUs of a node.
    """
    if framework == "deepspeed" and config.offload != "none":
        largest = max(stage_params(model, config, s).largest_layer for s in range(config.pp))
        return deepspeed_host_bytes_per_node(
            total_params=model.num_params, zero_stage=config.zero_stage, offload=config.offload,
            gpus_per_node=cluster.gpus_per_node, nodes=cluster.nodes,
            largest_layer_params=largest)
    return max(s.offloaded_bytes for s in stages) * min(cluster.gpus_per_node, cluster.num_gpus)
