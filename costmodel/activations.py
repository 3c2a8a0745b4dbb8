"""Activation bytes saved for backward, per layer and per pipeline stage.

The per-layer count follows Korthikanti et al. 2022 (arXiv:2205.05198) Sec. 4 and Table 2,
generalised to GQA (K and V of width ``kv``), SwiGLU (three ffn-wide tensors), models without
dropout, context parallelism and fused (flash) attention. With b sequences of s tokens per
micro-batch, ``T = b s / cp`` tokens on a rank, 2-byte activations and 1-byte dropout masks:

* sequence-split tensors (replicated over TP unless sequence parallel): the inputs of both
  norms (4Th), of the QKV and first MLP matmul (2Th + 2Th) and two dropout masks (2Th);
* tensor-split tensors (divided by tp): Q, K, V and the attention output (2T(2q + 2kv)) and
  the MLP's ffn-wide tensors (GeLU 4Tf, SwiGLU 6Tf);
* the attention core: eager attention stores softmax output, dropout mask and dropout output
  (5 a s T bytes with dropout, 2 a s T without); fused attention stores only the fp32
  log-sum-exp (4 a T).

For a GPT layer (q = kv = h, f = 4h, dropout, eager) this is Table 2: ``sbh(34 + 5as/h)`` with
no parallelism, ``sbh(10 + 24/t + 5as/(ht))`` with TP, ``sbh/t (34 + 5as/h)`` with TP+SP;
selective recomputation drops the attention core; full recomputation keeps the layer input,
``2sbh`` (divided by t under SP).
"""

from __future__ import annotations

from meshplan.costmodel.config import ParallelConfig
from meshplan.costmodel.model import ModelSpec

MASK_BYTES = 1
"""Bytes per element of a dropout mask (torch.bool)."""
LOGIT_BYTES = 4
"""Logits and their softmax are kept in fp32 for the loss (Megatron's vocab-parallel CE)."""
FP32_BYTES = 4
"""Norm statistics are kept in fp32 whatever the activation dtype."""
TOKEN_ID_BYTES = 8
"""int64 token ids kept by the embedding for its backward."""


def tokens_per_microbatch(config: ParallelConfig) -> int:
    """Tokens one rank processes per micro-batch: ``b s / cp`` (``ParallelConfig`` checks that
    cp divides s). Activations, compute and the per-micro-batch traffic all scale with it."""
    return config.micro_batch_size * config.seq_len // config.cp


def layer_activation_bytes(model: ModelSpec, config: ParallelConfig, *, recompute: str,
                           moe: bool = False, eager: bool = False,
                           rope_tables: bool = True, autocast: bool = False,
                           fused_norm: bool = True, compiled: bool = False,
                           float8_inputs: bool = False) -> float:
    """Bytes one transformer layer keeps for backward for one micro-batch on one rank.

    ``eager``: unfused PyTorch modules (meshplan's runtime) also keep, per layer, SiLU's output
    beside its input (SwiGLU), each RMSNorm's normalised input beside the input itself (RMSNorm
    decomposes into pow, mean, rsqrt and two multiplies), each norm's fp32 statistics per token
    (RMSNorm its reciprocal RMS, LayerNorm its mean and reciprocal deviation), RoPE's cos and
    sin tables, and with eager (unfused) attention a second copy of the attention output (the
    head-merging reshape copies it for the output projection; a fused kernel returns it laid
    out so that the reshape is a view); under SP the inputs of the QKV and first MLP matmuls
    are kept all-gathered, h wide. Reconciled term by term with a trace of the runtime's
    layers in tests/costmodel/test_tracing.py. ``rope_tables`` False: the RoPE table is one
    buffer of the model shared by all layers (torchtitan's ``freqs_cis``), not per layer.

    ``autocast`` (with ``eager``): the layer runs under ``torch.autocast`` over fp32 weights,
    as meshplan's runtime runs a 16-bit plan without FSDP2 (``runtime/train.py``). The
    embedding's output is fp32 and every residual add promotes to fp32, so the block input and
    the residual between attention and MLP are kept in fp32 (by the norms that read them); the
    norms run in fp32 and autocast casts their output to the compute dtype once per consumer
    matmul (casts of activations are not cached, only of weights): three copies for ``wq``,
    ``wk``, ``wv`` and one per up projection (two for SwiGLU), over the whole sequence (under
    SP the gathered output is cast, and the casts replace the eager gathered inputs). These
    h-wide tensors replace the eager ones; the rest is as ``eager``. With ``recompute="full"`` the stored input is
    fp32. Reconciled tensor by tensor with the runtime's step on an H200 (CUDA's fused
    RMSNorm; ``benchmarks/gpu_memory_breakdown.py``, Llama-3.2-1B, 2 x 2048 tokens: 441.0 MiB
    per layer measured and predicted). ``fused_norm`` False (the CPU, where RMSNorm decomposes
    into pow, mean, rsqrt and two multiplies): each RMSNorm also keeps its fp32 normalised
    input.

    ``compiled``: a block under ``torch.compile`` (torchtitan's ``compile``). The compiled
    graph's forward/backward partition (AOT autograd's min-cut rematerialisation) keeps each
    matmul's input and what the fused backward kernels read, and rebuilds the element-wise
    rest. It keeps the block input, the two norms' outputs (whole: under SP they are the
    all-gathered inputs of the column-parallel matmuls, and the partitioner does not run a
    collective again) with their per-token statistics, q, k and v, the attention output as the attention
    kernel returned it with its log-sum-exp and as the output projection reads it, and the
    MLP's three ffn-wide tensors (both up projections and the gate product, the down
    projection's input). The residual between attention and MLP is not kept: the MLP norm's
    backward runs from its output and statistics. None of ``eager``'s fp32 and RoPE
    intermediates. Measured on torchtitan 0.2.2's block under torch 2.13 on this CPU
    (``benchmarks/torchtitan_saved_tensors.py --policy none --compile``, the tensors the
    compiled graph saves: h 256, ffn 704, 4 x 256 tokens, fp32): 14,966,784 bytes beyond the
    block input, what this counts. With float8 linears (torchao's, as torchtitan converts
    them) the partition keeps neither norm output nor one of the three ffn-wide tensors: it
    rebuilds them, and their float8 casts, in backward from what it keeps. Measured the same
    way on the tiny block in bf16 (8 x 64 tokens, no TP): 946,176 bytes kept without float8,
    634,922 with, 2 h-wide and 1 ffn-wide bf16 tensor fewer (311,296 less 42 bytes of
    scales). Under float8 TP (not measured: torch 2.13 does not compile the TP block on this
    CPU) the count stays as without float8.

    Per-head query and key norms (``ModelSpec.qk_norm``) add ``qk_norm_bytes`` wherever the
    layer keeps its tensors.

    ``float8_inputs`` (Megatron-LM's float8 training): Transformer Engine's linears keep their
    inputs as they cast them for the float8 GEMMs, one byte per element instead of the
    compute dtype's two: the QKV and first MLP matmuls' inputs (the norms' outputs, kept
    sequence-split under SP), the output projection's input and the down projection's.
    """
    t, act = config.tp, config.bytes_per_activation
    tokens = tokens_per_microbatch(config)
    seq_div = t if config.sp else 1
    h = model.hidden_size
    if recompute == "full":
        return (FP32_BYTES if autocast and eager else act) * tokens * h / seq_div
    dropout_masks = 2 * MASK_BYTES * tokens * h if model.dropout else 0
    if compiled:
        stats = 1 if model.norm == "rmsnorm" else 2
        seq_split = act * tokens * h + dropout_masks  # the block input
        attention = act * tokens * (3 * model.q_size + 2 * model.kv_size)
        mlp = _mlp_activation_bytes(model, config, tokens=tokens, moe=moe)
        total = (seq_split / seq_div + 2 * stats * FP32_BYTES * tokens
                 + 2 * act * tokens * h  # the norms' outputs, whole (gathered under SP)
                 + (attention + mlp) / t + qk_norm_bytes(model, config))
        if config.float8 and t == 1 and not moe:
            total -= act * tokens * (2 * h + model.ffn_hidden_size)  # (docstring: float8)
        if recompute == "none":
            total += attention_core_bytes(model, config)
        return total
    seq_split = 4 * act * tokens * h + dropout_masks
    casts = 0.0
    attention = act * tokens * (2 * model.q_size + 2 * model.kv_size)
    mlp = _mlp_activation_bytes(model, config, tokens=tokens, moe=moe)
    if eager:
        if not config.flash_attention:
            attention += act * tokens * model.q_size
        stats = 1 if model.norm == "rmsnorm" else 2
        seq_split += 2 * stats * FP32_BYTES * tokens
        if model.position_embedding == "rope" and rope_tables:
            seq_split += 2 * act * config.seq_len * model.head_size * seq_div
        if model.activation == "swiglu":
            f = model.expert_ffn_size * model.moe_top_k if moe else model.ffn_hidden_size
            mlp += act * tokens * f
        if autocast:
            ups = 2 if model.activation == "swiglu" else 1
            seq_split += (2 * FP32_BYTES - 4 * act) * tokens * h  # the fp32 residuals
            # per consumer matmul, of the whole sequence (under SP, of the gathered output)
            casts = (3 + ups) * act * tokens * h
            if model.norm == "rmsnorm" and not fused_norm:
                seq_split += 2 * FP32_BYTES * tokens * h
        elif model.norm == "rmsnorm" and not fused_norm:
            # torch.rms_norm's composite keeps each norm's normalised input; from a 16-bit
            # input it upcasts first and keeps the fp32 copy and an fp32 normalised input
            # in place of the input and a 16-bit one (module doc: ``fused_norm``)
            seq_split += 2 * composite_rms_norm_bytes(act) * tokens * h
    total = (seq_split / seq_div + (attention + mlp) / t + casts + qk_norm_bytes(
        model, config, normalised_copy=eager and model.norm == "rmsnorm" and not fused_norm,
        autocast=eager and autocast))
    if float8_inputs and not eager and not moe:
        ffn = model.ffn_hidden_size
        total -= (act - 1) * tokens * (2 * h / seq_div + (model.q_size + ffn) / t)
    if eager and config.sp and t > 1 and not autocast:
        # DTensor's SP -> TP all-gather hands the QKV and first MLP matmuls a gathered input,
        # which autograd keeps whole (Megatron keeps the sequence shard and gathers again).
        total += 2 * act * tokens * h * (1 - 1 / t)
    if recompute == "none":
        total += attention_core_bytes(model, config)
    return total


def qk_norm_bytes(model: ModelSpec, config: ParallelConfig, *,
                  normalised_copy: bool = False, autocast: bool = False) -> float:
    """What a layer's query and key norms (``ModelSpec.qk_norm``) keep for backward on one
    rank for one micro-batch, where the layer keeps its tensors (no full recomputation): each
    norm's input, the projection's output before the norm (q and kv wide, divided by tp, in the
    activation dtype), and its fp32 statistics, one per head and token (two for LayerNorm),
    as a fused norm kernel keeps them. RoPE and attention then keep the normalised q and k,
    which ``layer_activation_bytes`` counts as Q and K. Per-op policies, which keep matmul
    outputs and rebuild the norms from them, add nothing (``op_policy_layer_bytes``).

    ``normalised_copy``: an eager RMSNorm outside autocast also keeps its normalised input
    (``x * rstd``, for the weight's gradient), as the layer's own norms do
    (``layer_activation_bytes``). Measured with meshplan's runtime on this CPU (tiny with
    query and key norms, fp32, 2 x 64 tokens, no recomputation): 389 KiB above the same plan
    without them over 4 layers, 97 KiB a layer, what both copies and the statistics make
    (2 x 48 + 3 KiB); without the copy the model had 51.

    ``autocast`` (meshplan's runtime on a 16-bit plan without FSDP2): the norms get the
    projections' 16-bit outputs with their fp32 weights, and ``torch.rms_norm`` with mixed
    dtypes cannot take the fused kernel on any device ("Cannot dispatch to fused
    implementation", aten layer_norm.cpp); its composite computes in fp32 and keeps the fp32
    input and the fp32 normalised input. Measured the same way in bf16
    (``MESHPLAN_CPU_PLAN_DTYPE=1``): 398 KiB above the plan without the norms, 99.5 KiB a
    layer, 2 x 48 + 3 (the model had 27.6 before)."""
    if not model.qk_norm:
        return 0.0
    tokens = tokens_per_microbatch(config)
    stats = 1 if model.norm == "rmsnorm" else 2
    heads = model.num_heads + model.kv_heads
    element = FP32_BYTES if autocast else config.bytes_per_activation
    copies = 2 if normalised_copy or autocast else 1
    return tokens * (copies * element * (model.q_size + model.kv_size)
                     + stats * FP32_BYTES * heads) / config.tp


def matmul_output_bytes(model: ModelSpec, config: ParallelConfig, *,
                        moe: bool = False) -> tuple[float, ...]:
    """Bytes of each matmul output of one layer and micro-batch on one rank, in forward order.

    A Llama/GPT block runs ``wq``, ``wk``, ``wv`` (column-parallel: q, kv and kv wide over tp),
    ``wo`` (row-parallel: a full h-wide output per token, partial sums before the TP
    reduction), then ``w1`` and, for SwiGLU, ``w3`` (f wide over tp) and ``w2`` (h wide, like
    ``wo``). MoE layers count the routed tokens' expert matmuls (``top_k`` tokens each).
    The order matters to torchtitan's per-op policy, which keeps every other one.
    """
    act, t = config.bytes_per_activation, config.tp
    tokens = tokens_per_microbatch(config)
    h = model.hidden_size
    f, ffn_tokens = ((model.expert_ffn_size, tokens * model.moe_top_k) if moe
                     else (model.ffn_hidden_size, tokens))
    attention = (act * tokens * model.q_size / t, act * tokens * model.kv_size / t,
                 act * tokens * model.kv_size / t, act * tokens * h)
    up = (act * ffn_tokens * f / t,) * (2 if model.activation == "swiglu" else 1)
    return attention + up + (act * ffn_tokens * h,)


def op_policy_layer_bytes(model: ModelSpec, config: ParallelConfig, *, policy: str,
                          moe: bool = False, saves_attention: bool = True,
                          autocast: bool = False, compiled: bool = False) -> float:
    """Bytes one layer keeps for backward under a per-op selective checkpointing policy.

    Both policies wrap each block in ``checkpoint_wrapper`` with
    ``create_selective_checkpoint_contexts``: the block input (``b s h / cp``, divided by tp
    under SP) is kept to restart the recomputation, the outputs of the ops the policy saves are
    kept, everything else (norms, RoPE, activation function, residual adds) is rebuilt in
    backward.

    * ``torchtitan`` (torchtitan 0.2.2 ``distributed/activation_checkpoint.py``
      ``_apply_op_sac`` with ``models/llama3/infra/parallelize.py`` ``_op_sac_save_list``):
      every odd-numbered ``aten.mm`` of the block (``wq``, ``wv``, ``w1``, ``w2``; the
      even ones are recomputed), the fused attention outputs (output, and the fp32
      log-sum-exp per head and query) and, under SP, the reduce-scatter outputs of ``wo`` and
      ``w2`` (h wide, sequence-split). Eager (math) attention also returns, and so keeps, its
      softmax probabilities (``attention_core_bytes``). ``saves_attention`` False: the
      attention op is not in the list, as on CPU, where SDPA runs
      ``_scaled_dot_product_flash_attention_for_cpu``; it is recomputed.
    * ``meshplan`` (runtime/parallelize.py ``_SAVED_OPS``): every matmul output and every TP
      collective output (under SP the two all-gathered block inputs, h wide, and the two
      reduce-scatter outputs; without SP the two all-reduce outputs); the attention core is
      recomputed. Under TP that can keep more than no recomputation does (the row-parallel
      outputs and collective outputs are tensors plain autograd frees).

    ``autocast``: the block input is fp32 (``layer_activation_bytes``), and so are the
    all-gathered norm outputs under SP (the gather runs before the matmul's cast).

    ``compiled`` (torchtitan's policy under ``torch.compile`` of each block): the policy tags
    the graph's nodes and AOT autograd's partition saves a must-save node only where the
    backward or the recomputation reads it. Nothing reads the block's last matmul output (the
    down projection's, and under SP its reduce-scatter output): it only feeds the residual
    add, whose backward reads nothing. Eager SAC stores every must-save output as it is made,
    so it keeps it. Measured on torchtitan 0.2.2's block under torch 2.13 on this CPU
    (``benchmarks/torchtitan_saved_tensors.py --policy op [--compile]``, h 256, ffn 704,
    4 x 256 tokens, fp32): 5,505,024 bytes eager, 4,461,504 compiled, the difference one
    h-wide output less 5 KB. Dense blocks only (an MoE block's routed output is combined
    before the residual add).
    """
    act, t = config.bytes_per_activation, config.tp
    tokens = tokens_per_microbatch(config)
    h = model.hidden_size
    seq_div = t if config.sp else 1
    matmuls = matmul_output_bytes(model, config, moe=moe)
    total = (FP32_BYTES if autocast else act) * tokens * h / seq_div
    if policy == "torchtitan":
        saved = matmuls[0::2]
        # the down projection is saved (an odd-numbered mm) when the block has an odd count
        drops_last = compiled and not moe and len(matmuls) % 2 == 1
        total += sum(saved[:-1] if drops_last else saved)
        if saves_attention:
            total += act * tokens * model.q_size / t + attention_core_bytes(model, config)
        if t > 1 and config.sp:
            total += (1 if compiled and not moe else 2) * act * tokens * h / t
        return total
    if policy == "meshplan":
        total += sum(matmuls)
        if t > 1 and config.sp:  # under autocast the gathered norm outputs are fp32
            gathered = FP32_BYTES if autocast else act
            total += 2 * tokens * h * (gathered + act / t)
        elif t > 1:
            total += 2 * act * tokens * h
        return total
    raise ValueError(f"policy must be torchtitan or meshplan, got {policy!r}")


def _mlp_activation_bytes(model: ModelSpec, config: ParallelConfig, *, tokens: int,
                          moe: bool) -> float:
    """ffn-wide tensors of the MLP (before dividing by tp); MoE adds routing buffers."""
    act = config.bytes_per_activation
    per_token_tensors = 3 if model.activation == "swiglu" else 2
    if not moe:
        return act * tokens * model.ffn_hidden_size * per_token_tensors
    routed = tokens * model.moe_top_k
    experts = act * routed * model.expert_ffn_size * per_token_tensors
    # Router logits (fp32) and the permuted token copies sent to and back from the experts;
    # these are not split over TP, so undo the caller's division by tp.
    routing = 4 * tokens * model.num_experts + 2 * act * routed * model.hidden_size
    return experts + routing * config.tp


def attention_core_bytes(model: ModelSpec, config: ParallelConfig) -> float:
    """Attention-core tensors of one layer and micro-batch on one rank (dropped by selective).

    Eager: softmax output (+ dropout mask and output) of the a x (s/cp) x s score matrix per
    sequence. Fused: the fp32 log-sum-exp per head and query.
    """
    queries = tokens_per_microbatch(config)
    heads = model.num_heads / config.tp
    if config.flash_attention:
        return 4.0 * heads * queries
    act = config.bytes_per_activation
    per_score = act + (MASK_BYTES + act if model.dropout else 0)
    return per_score * heads * queries * config.seq_len


def embedding_activation_bytes(model: ModelSpec, config: ParallelConfig) -> float:
    """First stage, per micro-batch in flight: token ids and the embedding dropout mask.

    Megatron-LM's theoretical memory counts ``8 s b`` and ``s b h`` here, divided by tp.
    """
    tokens = tokens_per_microbatch(config)
    mask = MASK_BYTES * tokens * model.hidden_size if model.dropout else 0
    return (TOKEN_ID_BYTES * tokens + mask) / config.tp


def head_activation_bytes(model: ModelSpec, config: ParallelConfig, *,
                          logit_copies: float, vocab_parallel: bool = True,
                          gathered_head_input: bool = False,
                          composite_norm: bool = False) -> float:
    """Last stage, one micro-batch: final-norm and LM-head inputs plus the logits.

    Megatron-LM counts ``4 s b h (1 + V/h)``: two 2-byte h-wide tensors and fp32 logits over
    the vocabulary-parallel shard; ``logit_copies`` says how many fp32-sized logit tensors the
    framework's loss keeps alive (1 for Megatron's fused vocab-parallel cross entropy), and
    ``vocab_parallel`` False means the logits are gathered to the full vocabulary first.
    ``gathered_head_input`` (torchtitan and meshplan's runtime under SP: their LM head is
    ``ColwiseParallel`` with ``input_layouts=Shard(1)``): the LM head's input is the
    all-gathered final-norm output, kept whole for the head's weight gradient, while the norm's
    input stays a sequence shard.

    ``composite_norm`` (torchtitan on the CPU, whose torch has no CPU kernel for
    ``_fused_rms_norm``): the final RMSNorm runs torch's composite, which keeps its input
    upcast to fp32 (the input itself when it is fp32), the fp32 normalised input and the fp32
    reciprocal RMS per token beside its output, in place of the input: ``(8 - a) h + 4`` bytes
    a token more, ``a`` the activation dtype's bytes (the blocks' norms:
    ``layer_activation_bytes``'s ``fused_norm``). Measured on torchtitan 0.2.2's bf16 step on
    this CPU (tiny, FSDP 2, blocks compiled, full AC, 32 x 64 tokens): at the peak, in the
    loss's backward, the final norm holds 524,288 + 524,288 + 8,192 bytes of fp32 and the
    262,144-byte bf16 output, where the model had counted the bf16 input.
    """
    tokens = tokens_per_microbatch(config)
    act = config.bytes_per_activation
    shards = config.tp if config.sp else 1
    h_part = 2 * act * tokens * model.hidden_size / shards
    if gathered_head_input:
        h_part = act * tokens * model.hidden_size * (1 + 1 / shards)
    if composite_norm:
        h_part += composite_final_norm_bytes(model, config)
    return h_part + logit_bytes(model, config, copies=logit_copies,
                                vocab_parallel=vocab_parallel)


def composite_rms_norm_bytes(act: int) -> int:
    """Bytes an element of its input that torch's composite RMSNorm (the CPU's: no
    ``_fused_rms_norm`` kernel there) keeps beyond that input: the input upcast to fp32 (the
    input itself when it is fp32) and the fp32 normalised input, in place of the input of
    ``act`` bytes: ``8 - act``. Its per-token statistics are counted apart."""
    return 2 * FP32_BYTES - act


def composite_final_norm_bytes(model: ModelSpec, config: ParallelConfig) -> float:
    """What the final RMSNorm keeps beyond its input when it runs torch's composite
    (``head_activation_bytes``'s ``composite_norm``): ``(8 - a) h + 4`` bytes a token of its
    sequence shard, ``a`` the activation dtype's bytes; 0 for LayerNorm. Its backward runs
    right after the loss's, so no block's backward sees these bytes."""
    if model.norm != "rmsnorm":
        return 0.0
    shards = config.tp if config.sp else 1
    return (composite_rms_norm_bytes(config.bytes_per_activation) * model.hidden_size
            + FP32_BYTES) * tokens_per_microbatch(config) / shards


def logit_bytes(model: ModelSpec, config: ParallelConfig, *, copies: float,
                vocab_parallel: bool = True, element_bytes: int = LOGIT_BYTES) -> float:
    """``copies`` tensors of one micro-batch's logits on one rank, ``element_bytes`` each
    (fp32 by default), over the vocabulary shard (``vocab_parallel``) or the whole vocabulary."""
    shards = config.tp if vocab_parallel else 1
    return copies * element_bytes * tokens_per_microbatch(config) * model.vocab_rows / shards


def backward_workspace_bytes(model: ModelSpec, config: ParallelConfig, *,
                             weight_grad_bytes: int, accumulating: bool) -> float:
    """Bytes one layer's eager PyTorch backward holds above the stored activations.

    Two ffn-wide activation gradients (b s f / (cp t) each, in the activation dtype) and, when
    gradients accumulate into an existing ``.grad``, the fresh gradient of the largest weight
    (h x f / t, ``weight_grad_bytes`` each) before it is added. Measured on meshplan's runtime
    layers with its live-tensor tracker (peak over stored, with gradients present): tiny 180 KB
    (model 225 KB), GPT-3 125M 10.2 MB (11.0), Llama 3.2 1B 69.2 MB (71.3), 64 tokens each.
    """
    f = model.ffn_hidden_size
    activation_grads = 2 * config.bytes_per_activation * tokens_per_microbatch(config) * f
    weight = weight_grad_bytes * model.hidden_size * f if accumulating else 0.0
    return (activation_grads + weight) / config.tp


FLOAT8_EAGER_CAST_BYTES = 9
"""Bytes per element an eager tensorwise float8 cast holds while it runs (torchao's
``hp_tensor_to_float8_dynamic``, as torchtitan's float8 linears cast their inputs and, in
backward, their output gradients): the input upcast and scaled (``tensor.to(torch.float32) *
scale``, 4), clamped to the float8 range (``to_fp8_saturated``, 4, the scaled copy still
referenced) and cast (1). Under ``torch.compile`` the cast is one fused kernel."""


def float8_cast_workspace_bytes(model: ModelSpec, config: ParallelConfig) -> float:
    """Bytes an eager float8 block backward holds above ``backward_workspace_bytes``: the
    SwiGLU's second ffn-wide gradient (``b s f / (cp t)``) is, at the peak, the output
    gradient of an up projection being cast to float8 (``FLOAT8_EAGER_CAST_BYTES`` per element
    in place of the activation dtype's). 0 without float8 or under compile. Measured on
    torchtitan 0.2.2's float8 path (torchao, FSDP float8 all-gather, bf16) on this CPU, one
    rank of a fake group (``benchmarks/gpu_torchtitan_memory.py``'s ``run_rank``; tiny shapes,
    8 x 64 tokens, full AC): at the peak the fp32 scaled and clamped copies and the float8 result
    of a 512 x 176 gradient (811 KiB) beside the recomputed block; the peak 595 KiB above the
    same plan in bf16, where the model had it 92 KiB below."""
    if not config.float8 or config.compile != "none" or model.is_moe:
        return 0.0
    return ((FLOAT8_EAGER_CAST_BYTES - config.bytes_per_activation)
            * tokens_per_microbatch(config) * model.ffn_hidden_size / config.tp)


FLOAT8_BYTES = 1
"""Bytes of a float8 element."""


def float8_compiled_backward_bytes(model: ModelSpec, config: ParallelConfig, *,
                                   recompute: str) -> float:
    """Bytes a compiled float8 block's backward holds above what its saved tensors and the
    bf16 block's backward workspace count (``--compile`` with ``--float8``, no TP, dense; 0
    otherwise). Its forward/backward partition keeps neither norm output nor one ffn-wide
    tensor (``layer_activation_bytes``'s ``compiled``): the backward rebuilds them
    (``a (2 h + f)`` bytes a token, ``a`` the activation dtype's bytes; under full or no
    recomputation, ``recompute``, the modes that saving is counted for), and where the bf16
    block's backward holds six ffn-wide tensors in the activation dtype, the float8 one holds
    four, an fp32 upcast and four float8 copies (the casts of the MLP's inputs and output
    gradients, one per layout each ``torch._scaled_mm`` operand needs): ``(8 - 2 a) f`` more.
    Its h-wide tensors are as many bytes (three in the activation dtype and four float8 copies
    where the bf16 block holds five).

    Measured on torchtitan 0.2.2's float8 step on this CPU (tiny, FSDP 2, blocks compiled,
    full AC, 8 x 64 tokens, one rank of a fake group; the live allocations at the peak, in the
    first block's compiled backward, replayed from the profiler's allocation events by
    ``benchmarks/torchtitan_cpu_mixed_memory.py --live PLAN --within
    CompiledFunctionBackward``): the compiled backward holds 4 x 180,224 + 360,448 + 4 x
    90,112 bytes ffn-wide and 3 x 65,536 + 4 x 32,768 h-wide, 337,968 bytes more than the bf16
    step's in its block's backward (6 x 180,224 and 5 x 65,536), where the model had it
    311,296 bytes less."""
    if (not config.float8 or config.compile == "none" or config.tp != 1 or model.is_moe
            or recompute not in ("none", "full")):  # where the partition's saving is counted
        return 0.0
    a = config.bytes_per_activation
    f = model.ffn_hidden_size
    rebuilt = a * (2 * model.hidden_size + f)
    casts = (4 * FLOAT8_BYTES + FP32_BYTES - 2 * a) * f
    return (rebuilt + casts) * tokens_per_microbatch(config)


def hidden_state_bytes(model: ModelSpec, config: ParallelConfig) -> float:
    """Bytes of one micro-batch's whole hidden state on a rank (``b s h / cp`` elements in the
    activation dtype): what an SP collective gathers or scatters, a TP all-reduce reduces."""
    return config.bytes_per_activation * tokens_per_microbatch(config) * model.hidden_size


def sp_input_grad_scatter_bytes(model: ModelSpec, config: ParallelConfig) -> float:
    """Bytes a block's backward holds above its stored and recomputed activations while it
    reduce-scatters the gradient of a sequence-parallel all-gather's output (DTensor's SP, as
    torchtitan shards it; 0 without SP): the whole-sequence gradient of the gathered input
    (``b s h / cp``, in the activation dtype, not divided by TP), the copy torch's functional
    reduce-scatter makes of it to lay the sequence chunks along dim 0 (``torch.cat``, whatever
    the micro-batch; ``timing.sp_reorder_copies_s`` prices its time), and the scattered
    result (``b s h / (cp t)``). The MLP's input is the first such gradient a block's
    backward reaches, with the whole recomputed block still alive; beside the SwiGLU's two
    ffn-wide gradients (``backward_workspace_bytes``, ``2 f / t`` per token) it is the
    larger once ``2 t h + h`` exceeds ``2 f``: from TP 4 on for Llama shapes (f = 3.25-3.5 h)
    and the tiny model (f = 2.75 h). Measured on torchtitan 0.2.2's code path on this CPU
    (``benchmarks/torchtitan_cpu_memory.py``, width 64, ffn 176, 64 x 64 tokens, full AC):
    the peak falls inside that reduce-scatter, holding the gradient (1 MiB), its copy (1 MiB)
    and the scattered shard beside the recomputed block, whose SwiGLU tensors torchtitan's MLP
    still holds there."""
    if not config.sp or config.tp == 1:
        return 0.0
    whole = hidden_state_bytes(model, config)
    return 2 * whole + whole / config.tp


def in_flight_microbatches(config: ParallelConfig, stage: int) -> float:
    """Micro-batches whose activations stage ``stage`` holds at its peak, in whole-stage units.

    1F1B: stage i of p holds min(p - i, m) (Narayanan et al. 2021 Sec. 2.2). Interleaved with v
    chunks: min(2(p - i - 1) + (v - 1) p + 1, m v) chunk-micro-batches of 1/v of the stage's
    layers, which for i = 0 is Megatron's ``p (1 + (p-1)/(p v))`` penalty.
    """
    p, v, m = config.pp, config.vpp, config.grad_accum_steps
    if v == 1:
        return float(min(p - stage, m))
    chunks = min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v)
    return chunks / v
