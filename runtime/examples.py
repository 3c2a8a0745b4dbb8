"""Example user modules for ``--model package.module:callable`` (``costmodel.factory``).

``hybrid`` is a small model whose layers are not alike, the case a per-layer trace exists for:
an embedding, a wide first block (4x the MLP width), then blocks that alternate between a full
transformer block and an MLP-only block, a final norm and an LM head. Its top-level layers form
a chain (each takes the previous one's output), so the runtime can cut it into pipeline stages
anywhere (``runtime.chain``). ``meshplan_inputs`` and ``meshplan_loss`` follow the protocol of
``costmodel.factory``.

Try: ``meshplan plan --model meshplan.runtime.examples:hybrid --cluster cpu --global-batch 8``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from meshplan.costmodel.model import ModelSpec
from meshplan.runtime.model import Block, FeedForward, _norm

HYBRID_SPEC = ModelSpec(name="hybrid-block", num_layers=1, hidden_size=64, num_heads=4,
                        ffn_hidden_size=128, vocab_size=256, seq_len=64, activation="swiglu",
                        norm="rmsnorm", position_embedding="rope", linear_bias=False,
                        tied_embeddings=False)
"""Width and heads of the hybrid model's transformer blocks."""


class MlpBlock(nn.Module):
    """Pre-norm MLP-only residual block: ``x + mlp(norm(x))``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.norm = _norm(spec)
        self.feed_forward = FeedForward(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.feed_forward(self.norm(x))


class Hybrid(nn.Module):
    """Embedding, wide block, alternating transformer / MLP-only blocks, norm, head."""

    meshplan_seq_len = 64

    def __init__(self, *, blocks: int = 6, spec: ModelSpec = HYBRID_SPEC) -> None:
        super().__init__()
        wide = dataclasses.replace(spec, ffn_hidden_size=4 * spec.ffn_hidden_size)
        units: list[nn.Module] = [nn.Embedding(spec.vocab_size, spec.hidden_size), Block(wide)]
        units += [Block(spec) if i % 2 == 0 else MlpBlock(spec) for i in range(blocks)]
        units += [_norm(spec), nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)]
        self.layers = nn.Sequential(*units)
        self.vocab_size = spec.vocab_size

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.layers(tokens)

    def meshplan_inputs(self, batch_size: int, seq_len: int) -> tuple[torch.Tensor, ...]:
        return (torch.zeros((batch_size, seq_len), dtype=torch.long),)

    @staticmethod
    def meshplan_loss(logits: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token cross entropy in fp32 (targets default to zeros when tracing)."""
        flat = logits.float().reshape(-1, logits.shape[-1])
        if targets is None:
            targets = torch.zeros(flat.shape[0], dtype=torch.long, device=logits.device)
        return F.cross_entropy(flat, targets.reshape(-1))


def hybrid() -> Hybrid:
    """The example factory: ``--model meshplan.runtime.examples:hybrid``."""
    return Hybrid()


class SideInput(nn.Module):
    """Token and position embeddings both read from the input, then blocks, norm and head:
    its top-level layers do not form a chain, so the runtime runs it on one pipeline stage
    (``chain.Whole``)."""

    meshplan_seq_len = 64

    def __init__(self, *, blocks: int = 3, spec: ModelSpec = HYBRID_SPEC) -> None:
        super().__init__()
        self.tok = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.pos = nn.Embedding(spec.seq_len, spec.hidden_size)
        self.blocks = nn.ModuleList([MlpBlock(spec) for _ in range(blocks)])
        self.norm = _norm(spec)
        self.head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.vocab_size = spec.vocab_size

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    meshplan_inputs = Hybrid.meshplan_inputs
    meshplan_loss = staticmethod(Hybrid.meshplan_loss)


def side_input() -> SideInput:
    """``--model meshplan.runtime.examples:side_input``: a module that is not a chain."""
    return SideInput()
