"""Model FLOPs in the Megatron / Narayanan convention.

A matrix multiply of an (m x k) by a (k x n) matrix costs 2mkn FLOPs. Per token, a layer's
forward pass costs 2 x (its matmul weights) plus attention scores and values,
``2 * 2 * s * q`` for a full (non-causal) s x s score matrix, as Korthikanti et al. 2022
(arXiv:2205.05198) Eq. 7 counts it. The LM head costs ``2 h V``. Backward costs twice the
forward. Summed over a GPT layer (weights 12h^2, q = h) this is Korthikanti Eq. 7,
``72 B L s h^2 (1 + s/(6h) + V/(12 h L))``; Narayanan et al. 2021 Eq. 3 adds one more forward
of the layers for full recomputation. ``causal=True`` halves the score term, as Megatron-LM has
done since 2025-03 (commit 8873b55d6a). Norms, softmax, biases and the router are left out
(they are not matmuls).
"""

from __future__ import annotations

from meshplan.costmodel.model import ModelSpec


def layer_matmul_flop_per_token(model: ModelSpec, index: int) -> float:
    """Forward FLOPs per token of layer ``index``'s weight matmuls (projections and MLPs)."""
    weights = model.attention_matmul_params
    if model.is_moe_layer(index):
        weights += model.moe_top_k * model.mlp_matmul_params(model.expert_ffn_size)
        weights += model.hidden_size * model.num_experts  # router
    else:
        weights += model.mlp_matmul_params()
    return 2.0 * weights


def attention_flop_per_token(model: ModelSpec, *, seq_len: int, causal: bool = False) -> float:
    """Forward FLOPs per token of Q K^T and scores x V: ``2 * 2 * s * q`` (halved if causal)."""
    flop = 4.0 * seq_len * model.q_size
    return flop / 2 if causal else flop


def lm_head_flop_per_token(model: ModelSpec) -> float:
    """Forward FLOPs per token of the output projection: ``2 h V`` (padded vocabulary)."""
    return 2.0 * model.hidden_size * model.vocab_rows


def forward_flop_per_token(model: ModelSpec, *, seq_len: int, causal: bool = False) -> float:
    """Forward FLOPs per token of the whole model."""
    layers = sum(layer_matmul_flop_per_token(model, i) for i in range(model.num_layers))
    layers += model.num_layers * attention_flop_per_token(model, seq_len=seq_len, causal=causal)
    return layers + lm_head_flop_per_token(model)


def model_flop_per_step(model: ModelSpec, *, global_batch_size: int, seq_len: int,
                        causal: bool = False) -> float:
    """Model FLOPs of one training step (forward + backward, no recompute): 3x forward.

    Korthikanti et al. 2022 Eq. 7 with B = ``global_batch_size``, s = ``seq_len``.
    """
    tokens = global_batch_size * seq_len
    return 3.0 * tokens * forward_flop_per_token(model, seq_len=seq_len, causal=causal)


def hardware_flop_per_step(model: ModelSpec, *, global_batch_size: int, seq_len: int,
                           recompute: str, causal: bool = False) -> float:
    """FLOPs actually executed, counting recomputation.

    ``full`` adds one forward of the layers (Narayanan et al. 2021 Eq. 3: ``96 B s l h^2(...)``);
    ``selective`` adds one forward of the attention scores, ``4 B s^2 h`` per layer
    (``72 B L s h^2 (1 + 2s/(9h) + V/(12 h L))`` for GPT). Korthikanti et al. Eq. 8 prints
    ``1 + s/(3h)``, three such forwards; we count the one that runs, so we are 1.7-3.3% below
    Eq. 8 on its 175B and 22B runs (tests/costmodel/test_golden_flops.py).
    """
    tokens = global_batch_size * seq_len
    base = model_flop_per_step(model, global_batch_size=global_batch_size, seq_len=seq_len,
                               causal=causal)
    attention = model.num_layers * attention_flop_per_token(model, seq_len=seq_len,
                                                            causal=causal)
    if recompute == "full":
        layers = sum(layer_matmul_flop_per_token(model, i) for i in range(model.num_layers))
        return base + tokens * (layers + attention)
    if recompute == "selective":
        return base + tokens * attention
    return base
