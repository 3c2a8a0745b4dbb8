"""What each framework runs again in backward: full recomputation (with or without torch's
early stop), Korthikanti's selective recomputation, and the per-op policies of torchtitan and
meshplan's runtime, as shares of one layer's forward (``LayerForward``, from
``timing.layer_forward``)."""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.costmodel.config import ParallelConfig
from meshplan.costmodel.model import ModelSpec


@dataclass(frozen=True)
class LayerForward:
    """Forward seconds of one layer for one micro-batch, by kind of work."""

    gemm_s: float
    """The layer's matmuls (projections and MLP, with their per-call cost)."""
    core_s: float
    """The attention core (scores, softmax, context; fused or not)."""
    rest_s: float
    """Element-wise kernels (norms, RoPE, activation, residuals) and eager operator overhead."""
    recomputed_mm_fraction: float
    """Share of the GEMM FLOPs torchtitan's per-op policy does not save (``recompute_s``)."""
    last_mm_fraction: float
    """Share of the GEMM FLOPs in the block's last matmul (``w2``), which an early-stopping
    full recomputation skips (``recompute_s``)."""

    @property
    def total_s(self) -> float:
        return self.gemm_s + self.core_s + self.rest_s


def _mm_flops(model: ModelSpec, *, moe: bool) -> tuple[tuple[float, ...], float]:
    """(FLOPs per token of each ``aten.mm`` of a block in forward order, FLOPs per token of its
    grouped expert matmuls). Order as ``activations.matmul_output_bytes``: ``wq``, ``wk``,
    ``wv``, ``wo``, then ``w1``, ``w3`` (SwiGLU), ``w2``; an MoE block's router is its fifth
    mm and its experts run as grouped matmuls (``torch._grouped_mm``), which no policy saves."""
    h, q, kv = model.hidden_size, model.q_size, model.kv_size
    attention = (2.0 * h * q, 2.0 * h * kv, 2.0 * h * kv, 2.0 * q * h)
    mats = 3 if model.activation == "swiglu" else 2
    if moe:
        return attention + (2.0 * h * model.num_experts,), \
            2.0 * model.moe_top_k * mats * h * model.expert_ffn_size
    f = model.ffn_hidden_size
    up = (2.0 * h * f,) * (mats - 1)
    return attention + up + (2.0 * f * h,), 0.0


def torchtitan_recomputed_mm_fraction(model: ModelSpec, *, moe: bool) -> float:
    """Share of a block's matmul FLOPs torchtitan 0.2.2's per-op policy recomputes
    (``distributed/activation_checkpoint.py`` ``_apply_op_sac``: ``aten.mm`` is in the save
    list, but every second mm of the block, counted in forward order, is recomputed; grouped
    expert matmuls are not in the list)."""
    mms, grouped = _mm_flops(model, moe=moe)
    recomputed = sum(f for k, f in enumerate(mms, start=1) if k % 2 == 0) + grouped
    return recomputed / (sum(mms) + grouped)


def last_mm_fraction(model: ModelSpec, *, moe: bool) -> float:
    """Share of a block's matmul FLOPs in its last matmul (``w2``); 0 for an MoE block, whose
    experts end it."""
    if moe:
        return 0.0
    mms, grouped = _mm_flops(model, moe=False)
    return mms[-1] / (sum(mms) + grouped)


def stops_early(framework: str, config: ParallelConfig) -> bool:
    """Whether full recomputation stops early (``ParallelConfig.recompute_early_stop``):
    always under meshplan's runtime (``checkpoint_wrapper``, torch's non-reentrant
    checkpoint, whose ``early_stop`` defaults to True), under torchtitan when configured."""
    return framework == "meshplan" or (framework == "torchtitan" and config.recompute_early_stop)


def recompute_s(parts: LayerForward, mode: str, *, framework: str,
                saves_attention: bool = True, early_stop: bool = False) -> float:
    """Forward work one layer repeats in backward under ``mode`` (``memory.layer_modes``):
    ``full`` the whole forward (less the last matmul when it ``early_stop``s: backward
    needs that matmul's input, not its output, and the recomputation ends once the input is
    saved); ``selective`` the attention core (Korthikanti et al. 2022);
    ``op``, a per-op policy, what it does not save: under torchtitan's the unsaved matmuls
    (``LayerForward.recomputed_mm_fraction``) and every element-wise op (and the attention
    core where SDPA's op is not in its list, as on CPU); under meshplan's runtime
    (``_SAVED_OPS``: every matmul and TP collective output) the attention core and the
    element-wise ops."""
    if mode == "full":
        return parts.total_s - (parts.last_mm_fraction * parts.gemm_s if early_stop else 0.0)
    if mode == "selective":
        return parts.core_s
    if mode == "op":
        if framework == "torchtitan":
            return (parts.recomputed_mm_fraction * parts.gemm_s + parts.rest_s
                    + (0.0 if saves_attention else parts.core_s))
        return parts.core_s + parts.rest_s
    return 0.0
