"""HBM traffic of the kernels an eager PyTorch trainer launches between its matmuls.

Megatron-LM fuses its element-wise work (bias-GeLU, bias-dropout-add, fused layer norm, fused
vocab-parallel cross entropy), and ``calibration.elementwise_traffic_factor`` was fitted on
its runs. Trainers that run unfused PyTorch modules (``frameworks.eager_kernels``:
torchtitan without ``torch.compile``, Composer/llm-foundry, meshplan's runtime) launch one
kernel per operator instead, and each kernel reads its inputs from HBM and writes its output
back. Their traffic is counted here operator by operator, from what each kernel reads and
writes, with no fitted factor; it runs at the device's calibrated memory bandwidth.

Counts are bytes per token (per logit for the loss) of one layer's forward on one rank.
Backward moves about ``timing.BACKWARD_FACTOR`` times as much (each gradient kernel reads the
saved input and the incoming gradient and writes the outgoing one).
"""

from __future__ import annotations

from meshplan.costmodel.config import ParallelConfig
from meshplan.costmodel.model import ModelSpec

FP32 = 4
"""Bytes of an fp32 element (RoPE's complex product, the loss's upcast logits)."""

RMSNORM_PASSES = 7
"""Tensor-sized reads and writes of an unfused RMSNorm (``torch.rms_norm``'s composite
form: ``pow`` reads and writes, ``mean`` reads, the ``rsqrt`` product reads and writes, the
weight product reads and writes; the per-token statistics are negligible). Counted op by op
(``benchmarks/eager_traffic.py``), torch's composite runs in fp32 (upcast, ``pow``, ``mean``,
two products, cast back: ~36-40 bytes per element forward, ~108 backward); charging that at
HBM speed puts torchtitan's published eager rows 6-13 % slow, so the count stays as fitted
with the eager GEMM efficiency (benchmarks/README.md, step-time accuracy)."""
LAYERNORM_PASSES = 2
"""A layer norm is one native kernel (``torch.native_layer_norm``): it reads its input and
writes its output."""
RESIDUAL_PASSES = 3
"""A residual add reads two tensors and writes one."""
ROPE_BYTES_PER_ELEMENT = 2 * FP32 + 2 * FP32
"""Per element of q or k, beyond reading it and writing the result in the activation dtype:
torchtitan's ``apply_rotary_emb`` (and meshplan's) upcasts to fp32 (writes 4 B), the complex
product reads and writes fp32 (4 + 4), and ``type_as`` reads fp32 back (4)."""
GELU_PASSES = 2
"""GeLU reads its input and writes its output."""
SWIGLU_PASSES = 5
"""SiLU (read, write) then the gate product (two reads, one write)."""

LOSS_BYTES_PER_LOGIT = 44
"""Bytes per logit of an unfused cross entropy on bf16 logits (``F.cross_entropy(
logits.float(), labels)``, as torchtitan's ``cross_entropy_loss``, llm-foundry under autocast
and meshplan's runtime compute it): forward, the fp32 upcast (read 2, write 4) and
``log_softmax`` (reads its input for the maximum and for the exponential sum, writes the
result: 12); backward, ``nll_loss_backward`` writes a dense zero-filled gradient (4),
``log_softmax_backward`` reads the gradient and the saved output, reduces the gradient and
writes its own (16), and the upcast's backward casts it back (read 4, write 2). The LM head's
matmuls read and write the bf16 logits themselves."""
LOSS_BYTES_PER_LOGIT_FP32 = 32
"""The same loss on fp32 logits: no upcast, no cast back."""


def layer_elementwise_bytes(model: ModelSpec, config: ParallelConfig, *, moe: bool = False,
                            tokens: float) -> float:
    """HBM bytes the element-wise kernels of one layer's forward move on one rank for
    ``tokens`` tokens.

    A decoder block runs two norms (``LAYERNORM_PASSES`` or ``RMSNORM_PASSES`` each), two
    residual adds, with RoPE the rotary products on q and k, the copy that lays the attention
    output out for the output projection (``transpose(1, 2).contiguous()`` after SDPA; a
    flash-attn kernel that returns (batch, seq, heads, dim) needs none, and MPT-style learned
    positions use it), and the MLP activation (``GELU_PASSES`` over the ffn width, or
    ``SWIGLU_PASSES``). Bias adds ride in the matmuls' epilogues (``addmm``). Norms and
    residuals are sequence-split under SP; attention and MLP widths are split over tp.
    """
    e = config.bytes_per_activation
    norm = RMSNORM_PASSES if model.norm == "rmsnorm" else LAYERNORM_PASSES
    activation = SWIGLU_PASSES if model.activation == "swiglu" else GELU_PASSES
    return _block_bytes(model, config, moe=moe, tokens=tokens,
                        norm_residual_passes=2 * norm + 2 * RESIDUAL_PASSES,
                        rope_bytes=2 * e + ROPE_BYTES_PER_ELEMENT, activation_passes=activation)


def _block_bytes(model: ModelSpec, config: ParallelConfig, *, moe: bool, tokens: float,
                 norm_residual_passes: float, rope_bytes: float,
                 activation_passes: float) -> float:
    """HBM bytes of one layer's element-wise kernels on one rank for ``tokens`` tokens, given
    the tensor passes of its norms and residual adds (h wide, sequence-split under SP), the
    bytes per element of q and k its rotary embedding moves, and the passes of its MLP
    activation (ffn wide); plus the head-merging copy after SDPA under RoPE."""
    e = config.bytes_per_activation
    t = config.tp
    seq_div = t if config.sp else 1
    per_token = norm_residual_passes * e * model.hidden_size / seq_div
    q, kv = model.q_size / t, model.kv_size / t
    if model.position_embedding == "rope":
        per_token += (q + kv) * rope_bytes
        per_token += 2 * e * q  # the head-merging copy after SDPA
    f = (model.expert_ffn_size * model.moe_top_k if moe else model.ffn_hidden_size) / t
    per_token += activation_passes * e * f
    return per_token * tokens


def loss_bytes(config: ParallelConfig, logits: float) -> float:
    """HBM bytes of an unfused cross entropy over ``logits`` logit elements (forward and
    backward, ``LOSS_BYTES_PER_LOGIT``)."""
    per_logit = LOSS_BYTES_PER_LOGIT_FP32 if config.bytes_per_activation == FP32 \
        else LOSS_BYTES_PER_LOGIT
    return per_logit * logits


# ----- torch.compile (ParallelConfig.compile) -----------------------------------------------
# torchtitan compiles each transformer block on its own (``apply_compile``: one
# ``torch.compile(block, fullgraph=True)`` per block), and in ``model+loss`` the loss function.
# Inductor fuses the element-wise operators between the extern kernels (matmuls, SDPA) into
# one kernel per region, which reads the region's inputs once and writes its outputs once.

FUSED_NORM_RESIDUAL_PASSES = 9
"""Tensor-sized reads and writes of a compiled block's two norms and two residual adds, in
three kernels (the block boundary ends a graph, so the last residual add cannot join the next
block's norm): the attention norm (reads x, writes its output: 2), the first residual add
fused with the MLP norm (reads x and the attention output, writes h and the normed h: 4), the
second residual add (reads h and the MLP output, writes the block output: 3). RMSNorm and
LayerNorm alike: the statistics stay in registers."""
FUSED_ROPE_PASSES = 2
"""A compiled rotary embedding reads q (or k) and writes it rotated; the fp32 upcast and the
complex product stay in registers."""
FUSED_SWIGLU_PASSES = 3
"""A compiled SwiGLU reads the gate and up projections and writes their product."""
FUSED_LOSS_BYTES_PER_LOGIT = 8
"""Bytes per logit of a compiled cross entropy on bf16 logits: forward reads the logits twice
(the maximum, then the exponential sum; the fp32 upcast stays in registers and only the
per-token log-sum-exp is written), backward reads them once more and writes their bf16
gradient (softmax minus the one-hot target) in the same kernel. A fused cross-entropy kernel
called by the trainer (``ParallelConfig.cross_entropy_fusion``: flash-attn's, as llm-foundry and
OLMo-core call it) makes the same passes."""


def compiled_layer_elementwise_bytes(model: ModelSpec, config: ParallelConfig, *,
                                     moe: bool = False, tokens: float) -> float:
    """``layer_elementwise_bytes`` for a compiled block: the same operators, each fused
    region's inputs read once and outputs written once (``FUSED_*``); the head-merging copy
    after SDPA and the MLP's GeLU are single kernels either way."""
    activation = FUSED_SWIGLU_PASSES if model.activation == "swiglu" else GELU_PASSES
    return _block_bytes(model, config, moe=moe, tokens=tokens,
                        norm_residual_passes=FUSED_NORM_RESIDUAL_PASSES,
                        rope_bytes=FUSED_ROPE_PASSES * config.bytes_per_activation,
                        activation_passes=activation)


# ----- float8 linears (ParallelConfig.float8) -----------------------------------------------
# torchao's Float8Linear with tensorwise dynamic scaling casts, per linear, its input and its
# weight to float8 for the forward GEMM and the incoming gradient for the backward GEMMs. The
# traffic per cast follows torchao's own roofline (torchao/testing/float8/roofline_utils.py,
# ``get_tensor_memory_traffic_ovhd_s``, recipe ``tensorwise``): a max-abs pass that reads the
# bf16 tensor (fused into the kernel that produced it when compiled), then a cast that reads
# it and writes float8 copies.

FLOAT8_INPUT_BYTES = 2 + 2 * 1
"""Per element of a linear's input (and of its output gradient): the cast reads bf16 and
writes float8 twice (row- and column-major, for the forward and the weight-gradient GEMMs)."""
FLOAT8_AMAX_BYTES = 2
"""Per element: the max-abs pass reading bf16 (activations and gradients: only when the
block is not compiled; weights: always)."""
FLOAT8_WEIGHT_BYTES = 2 + (2 + 1) + (2 + 1)
"""Per weight element and micro-batch: the max-abs pass, then a cast for the forward and one
for the backward, each reading bf16 and writing float8."""


def float8_cast_bytes(model: ModelSpec, config: ParallelConfig, *, moe: bool = False,
                      tokens: float, transformer_engine: bool = False) -> float:
    """HBM bytes of one layer's float8 casts on one rank for ``tokens`` tokens, forward and
    backward together: every float8 linear of the block casts its input, its weight and its
    output gradient. Those are the q, k, v and output projections and the MLP's matrices
    (TP-sharded widths); an MoE layer's experts are not ``nn.Linear`` modules (the linear
    converter leaves them, and the router, in bf16), so there only the projections count.
    torchao converts each ``nn.Linear`` on its own, so the block input is cast once for each of
    wq, wk and wv and the MLP input once for each of w1 and w3.

    ``transformer_engine``: Megatron-LM's Transformer Engine linears
    (``te_float8_cast_bytes``)."""
    if transformer_engine:
        return te_float8_cast_bytes(model, config, moe=moe, tokens=tokens)
    t = config.tp
    h = model.hidden_size
    q, kv = model.q_size / t, model.kv_size / t
    amax = 0 if config.compile != "none" else FLOAT8_AMAX_BYTES
    activation = FLOAT8_INPUT_BYTES + amax
    inputs = 3 * h + q  # x into q, k and v; the attention output into its projection
    grads = q + 2 * kv + h
    if not moe:
        mats = 3 if model.activation == "swiglu" else 2
        f = model.ffn_hidden_size / t
        inputs += (mats - 1) * h + f  # the MLP's input matrices, then its inner width
        grads += (mats - 1) * f + h
    weights = FLOAT8_WEIGHT_BYTES * float8_weight_elements(model, config, moe=moe)
    return activation * (inputs + grads) * tokens + weights


TE_FUSED_INPUT_BYTES = 1 + 2 * 1
"""Per element of a linear input that Transformer Engine's norm or activation kernel writes
in float8 itself under delayed scaling (``layernorm_fwd_fp8`` before ``linear_qkv`` and
``linear_fc1``, ``fp8_gelu`` / its gated forms before ``linear_fc2``): the float8 write (1),
then the transpose the weight-gradient GEMM reads (``fp8_transpose``: read 1, write 1). No
bf16 copy is read back for a cast."""
TE_FUSED_GRAD_BYTES = 2 * 1
"""Per element of ``linear_fc1``'s output gradient under delayed scaling: the activation's
backward writes it in float8 twice, row- and column-major
(``fp8_cast_transpose_bgrad_dgelu_fused``), where a bf16 gradient (2 bytes) would then be read
back (2) by a cast-transpose writing the two copies; the activation backward's own reads are
element-wise work of the block's."""


def te_float8_cast_bytes(model: ModelSpec, config: ParallelConfig, *, moe: bool = False,
                         tokens: float) -> float:
    """HBM bytes of one layer's float8 casts under Transformer Engine, as Megatron-core builds
    its block: one fused GEMM for q, k and v (``linear_qkv``, a ``TELayerNormColumnParallel
    Linear``) and one for the MLP's input matrices (``linear_fc1``, gate and up together), so
    each of those inputs is cast once; then ``linear_proj`` and ``linear_fc2``.

    Under TE's delayed scaling (``ParallelConfig.float8_recipe``; NeMo's default) the scale
    comes from an amax history the kernels update as they write, so the kernel that produces a
    linear's input can write it in float8: the norms before ``linear_qkv`` and ``linear_fc1``
    and the activation before ``linear_fc2`` (``TE_FUSED_INPUT_BYTES``), and the activation's
    backward writes ``linear_fc1``'s output gradient (``TE_FUSED_GRAD_BYTES``). The rest, the
    attention output into ``linear_proj`` and the output gradients of ``linear_qkv`` (from the
    attention backward), ``linear_proj`` and ``linear_fc2`` (from the residual stream), go
    through a standalone cast-transpose (``FLOAT8_INPUT_BYTES``). Under per-tensor current
    scaling (``--fp8-recipe tensorwise``, the recipe meshplan's Megatron-LM export asks for) a
    cast needs its tensor's max-abs first, so no producer can write float8 directly: every cast
    is standalone with its max-abs pass, as torchao's eager casts are.

    Weights are left out: Megatron-core marks a step's first micro-batch
    (``set_is_first_microbatch``), on which TE casts the weights and caches their float8
    copies for the step's other micro-batches, so they are cast once per step
    (``timing.te_weight_cast_s``)."""
    t = config.tp
    h = model.hidden_size
    q, kv = model.q_size / t, model.kv_size / t
    standalone = q + (q + 2 * kv) + h  # proj's input; qkv's and proj's output gradients
    fused_inputs, fused_grads = h, 0.0  # the first norm into linear_qkv
    if not moe:
        mats = 3 if model.activation == "swiglu" else 2
        f = model.ffn_hidden_size / t
        standalone += h  # linear_fc2's output gradient
        fused_inputs += h + f  # the second norm into linear_fc1, the activation into fc2
        fused_grads += (mats - 1) * f  # linear_fc1's output gradient
    if config.float8_recipe == "delayed":
        per_token = (FLOAT8_INPUT_BYTES * standalone + TE_FUSED_INPUT_BYTES * fused_inputs
                     + TE_FUSED_GRAD_BYTES * fused_grads)
    else:
        per_token = (FLOAT8_INPUT_BYTES + FLOAT8_AMAX_BYTES) * (standalone + fused_inputs
                                                                + fused_grads)
    return per_token * tokens


def float8_weight_elements(model: ModelSpec, config: ParallelConfig, *, moe: bool) -> float:
    """Weight elements of one layer's float8 linears on one rank (TP shards): the attention
    projections, and the MLP's matrices but in an MoE layer (``float8_cast_bytes``)."""
    t = config.tp
    h = model.hidden_size
    q, kv = model.q_size / t, model.kv_size / t
    weights = h * (2 * q + 2 * kv)
    if not moe:
        mats = 3 if model.activation == "swiglu" else 2
        weights += mats * h * model.ffn_hidden_size / t
    return weights


def float8_head_cast_bytes(model: ModelSpec, config: ParallelConfig, *, tokens: float) -> float:
    """HBM bytes of the LM head's float8 casts (``ParallelConfig.float8_head``) on one rank for
    ``tokens`` tokens, forward and backward: its input (the final norm's output, whole width,
    all-gathered under SP), its vocabulary-shard weight and the logits' gradient. The head is
    outside the compiled blocks, so its input and gradient casts keep their max-abs pass."""
    vocab = model.vocab_rows / config.tp
    activation = FLOAT8_INPUT_BYTES + FLOAT8_AMAX_BYTES
    return (activation * (model.hidden_size + vocab) * tokens
            + FLOAT8_WEIGHT_BYTES * vocab * model.hidden_size)
