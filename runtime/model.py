"""A Llama/GPT-style decoder built from a ``ModelSpec``, shaped so TP and PP can split it.

Structure (names follow torchtitan's Llama, so the tensor-parallel plan in ``parallelize.py``
addresses modules by the same names)::

    Decoder
      tok_embeddings  nn.Embedding(vocab_rows, h)             first pipeline stage only
      pos_embeddings  nn.Embedding(seq_len, h)                learned positions, first stage
      embedding_norm  norm                                     BLOOM-style, first stage
      layers          nn.ModuleDict {"<global index>": Block}  this stage's blocks
      norm            final norm                               last stage only
      output          nn.Linear(h, vocab_rows)                 last stage (weight tied if asked)

    Block: x + attention(attention_norm(x)), then h + feed_forward(ffn_norm(h))
    Attention: wq, wk, wv (GQA: kv_heads), q_norm and k_norm (``qk_norm``: an RMSNorm over
               each head's query and key, Qwen3), RoPE,
               F.scaled_dot_product_attention(is_causal, or a banded mask under a sliding
               window), wo
    FeedForward: gelu  w2(gelu(w1 x));  swiglu  w2(silu(w1 x) * w3 x)

``layers`` keeps *global* layer indices as keys, so a pipeline stage holding layers 3..5 has
parameters named ``layers.3...``; initialisation seeds each parameter from its global name
(``init_weights``), which is what makes every parallel layout start from the same weights as a
single process. MoE layers are not built (``build_decoder`` refuses MoE specs), and
``ModelSpec.dropout`` is ignored (no dropout, so runs are deterministic).

torch APIs: ``torch.nn.functional.scaled_dot_product_attention`` (``enable_gqa``),
``torch.nn.RMSNorm``, ``torch.nn.LayerNorm``.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from meshplan.costmodel.model import ModelSpec

INIT_STD = 0.02
"""Standard deviation of weight initialisation (GPT-2 / Megatron ``init_method_std``)."""


def _norm(spec: ModelSpec) -> nn.Module:
    if spec.norm == "rmsnorm":
        return nn.RMSNorm(spec.hidden_size, eps=spec.norm_eps)
    return nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)


def rope_cos_sin(seq_len: int, head_dim: int, *, device: torch.device, dtype: torch.dtype,
                 theta: float = 10000.0,
                 spec: ModelSpec | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of rotary embeddings, each ``[seq_len, head_dim]``.

    Frequencies ``theta^(-2i/d)`` for i < d/2 (Su et al. 2021, arXiv:2104.09864, Eq. 15; the
    base ``theta`` is the spec's ``rope_theta``), rescaled by the spec's RoPE scaling
    (``scaled_frequencies``), duplicated to the full head width for the rotate-half
    formulation (HF Llama).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                             device=device) / head_dim))
    if spec is not None:
        inv_freq = scaled_frequencies(inv_freq, spec)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def scaled_frequencies(inv_freq: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """RoPE frequencies under the spec's scaling.

    ``linear`` (position interpolation, Chen et al. 2023, arXiv:2306.15595): every frequency
    divided by ``rope_factor``. ``llama3`` (Llama 3.1, Meta's reference ``apply_scaling``):
    wavelengths ``2 pi / f`` above ``original / low_freq_factor`` divided by the factor, below
    ``original / high_freq_factor`` kept, and in between interpolated with weight
    ``(original / wavelength - low) / (high - low)`` towards the unscaled frequency.
    """
    kind = spec.rope_scaling
    if kind == "":
        return inv_freq
    if kind == "linear":
        return inv_freq / spec.rope_factor
    if kind != "llama3":
        raise ValueError(f"RoPE scaling {kind!r} is not implemented by the runtime")
    low, high = spec.rope_low_freq_factor, spec.rope_high_freq_factor
    original = spec.rope_original_max_len
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / spec.rope_factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / spec.rope_factor + smooth * scaled
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(medium, blended, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[b, heads, s, d]`` by position: x cos + rotate_half(x) sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


MIXED_NORM_WARNING = "Mismatch dtype between input and weight"
"""The start of the warning torch's ``rms_norm`` gives when a 16-bit input meets an fp32
weight (under autocast the query and key norms get the projections' 16-bit outputs) and it
computes with its composite instead of its fused kernel: the query and key norms silence it,
which every worker of a Qwen3-style run printed. The cost model prices that composite
(``activations.qk_norm_bytes``)."""


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads.

    Head counts are inferred from the projection widths at run time, so after a column-wise
    tensor-parallel split of ``wq``/``wk``/``wv`` each rank runs its local heads unchanged.
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        qkv_bias = spec.linear_bias or spec.qkv_bias
        self.head_dim = spec.head_size
        self.use_rope = spec.position_embedding == "rope"
        self.rope_theta = spec.rope_theta
        self.spec = spec  # RoPE scaling (``scaled_frequencies``)
        if spec.position_embedding == "alibi":
            raise ValueError("position_embedding 'alibi' is not implemented by the runtime; "
                             "use 'rope' or 'learned'")
        self.wq = nn.Linear(spec.hidden_size, spec.q_size, bias=qkv_bias)
        self.wk = nn.Linear(spec.hidden_size, spec.kv_size, bias=qkv_bias)
        self.wv = nn.Linear(spec.hidden_size, spec.kv_size, bias=qkv_bias)
        self.wo = nn.Linear(spec.q_size, spec.hidden_size, bias=spec.linear_bias)
        # Qwen3's per-head query and key norms (transformers' Qwen3Attention: RMSNorm over
        # head_dim of the projections split into heads, before RoPE)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=spec.norm_eps) if spec.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=spec.norm_eps) if spec.qk_norm else None
        self.window = spec.sliding_window

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[b, s, heads x d]`` -> ``[b, s, heads, d]``."""
        batch, seq, width = x.shape
        return x.view(batch, seq, width // self.head_dim, self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._heads(self.wq(x)), self._heads(self.wk(x)), self._heads(self.wv(x))
        if self.q_norm is not None:
            with warnings.catch_warnings():  # (``MIXED_NORM_WARNING``)
                warnings.filterwarnings("ignore", message=MIXED_NORM_WARNING)
                q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.use_rope:
            cos, sin = rope_cos_sin(q.shape[2], self.head_dim, device=q.device, dtype=q.dtype,
                                    theta=self.rope_theta, spec=self.spec)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention_core(q, k, v, window=self.window)
        batch, heads, seq, dim = out.shape
        return self.wo(out.transpose(1, 2).reshape(batch, seq, heads * dim))


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                   window: int | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) v via ``F.scaled_dot_product_attention``; with
    a ``window`` shorter than the sequence, query i sees keys i - window + 1 .. i."""
    gqa = q.shape[1] != k.shape[1]
    seq = q.shape[2]
    if window is None or window >= seq:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    position = torch.arange(seq, device=q.device)
    behind = position[:, None] - position[None, :]  # query row minus key column
    mask = (behind >= 0) & (behind < window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class FeedForward(nn.Module):
    """MLP: ``w2(gelu(w1 x))``, or SwiGLU ``w2(silu(w1 x) * w3 x)`` (Shazeer 2020,
    arXiv:2002.05202)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        bias = spec.linear_bias
        self.swiglu = spec.activation == "swiglu"
        self.w1 = nn.Linear(spec.hidden_size, spec.ffn_hidden_size, bias=bias)
        self.w3 = nn.Linear(spec.hidden_size, spec.ffn_hidden_size, bias=bias) \
            if self.swiglu else None
        self.w2 = nn.Linear(spec.ffn_hidden_size, spec.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    """Pre-norm transformer block (GPT-2 / Llama)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.attention_norm = _norm(spec)
        self.attention = Attention(spec)
        self.ffn_norm = _norm(spec)
        self.feed_forward = FeedForward(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(nn.Module):
    """The blocks ``layer_ids`` of a decoder, with the embedding if ``first`` and head if ``last``.

    With ``first`` the input is token ids ``[b, s]``; otherwise hidden states ``[b, s, h]``.
    With ``last`` the output is logits ``[b, s, vocab_rows]``; otherwise hidden states.
    """

    def __init__(self, spec: ModelSpec, *, layer_ids: Sequence[int], first: bool,
                 last: bool) -> None:
        super().__init__()
        h = spec.hidden_size
        learned = spec.position_embedding == "learned"
        self.tok_embeddings = nn.Embedding(spec.vocab_rows, h) if first else None
        self.pos_embeddings = nn.Embedding(spec.seq_len, h) if first and learned else None
        self.embedding_norm = _norm(spec) if first and spec.embedding_norm else None
        self.layers = nn.ModuleDict({str(i): Block(spec) for i in layer_ids})
        self.norm = _norm(spec) if last else None
        self.output = nn.Linear(h, spec.vocab_rows, bias=False) if last else None
        self.tied_copy = last and not first and spec.tied_embeddings
        """The LM head is this stage's copy of the first stage's word embedding: initialised
        alike, its gradient summed with the embedding's (``train.sync_tied_grads``), so the
        two stay equal (Megatron's embedding group, Shoeybi et al. 2019)."""
        if last and first and spec.tied_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        if self.pos_embeddings is not None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            x = x + self.pos_embeddings(positions).unsqueeze(0)
        if self.embedding_norm is not None:
            x = self.embedding_norm(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            x = self.embed(x)
        for block in self.layers.values():
            x = block(x)
        if self.output is not None:
            x = self.output(self.norm(x))
        return x


def build_decoder(spec: ModelSpec, *, layer_ids: Sequence[int] | None = None,
                  first: bool = True, last: bool = True, seed: int = 0,
                  device: torch.device | str = "cpu") -> Decoder:
    """A ``Decoder`` for ``spec`` (all layers by default) initialised by ``init_weights``;
    on ``device="meta"`` its parameters have shapes only (``materialize.py`` fills them)."""
    if spec.is_moe:
        raise ValueError(f"{spec.name} is an MoE model ({spec.num_experts} experts); the "
                         "runtime builds dense decoders only")
    ids = range(spec.num_layers) if layer_ids is None else layer_ids
    if torch.device(device).type == "meta":
        with torch.device("meta"):
            return Decoder(spec, layer_ids=list(ids), first=first, last=last)
    model = Decoder(spec, layer_ids=list(ids), first=first, last=last)
    init_weights(model, num_layers=spec.num_layers, seed=seed)
    return model.to(device)


def _name_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from the run seed and a parameter's global name (layout-free)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def initial_value(name: str, shape: Sequence[int], *, num_layers: int, seed: int,
                  tied_copy: bool = False) -> torch.Tensor:
    """The initial fp32 value of the decoder's parameter ``name`` (global layer index; whole
    tensor, ``shape``), drawn on the CPU from a generator seeded by (``seed``, its name).

    Weights ~ N(0, 0.02); output projections (``wo``, ``w2``) ~ N(0, 0.02 / sqrt(2 l)) (GPT-2,
    Radford et al. 2019, Sec. 2.3); biases 0; norm weights 1. A parameter gets the same values
    whichever stage, rank or device holds it; ``tied_copy``: the LM head that copies the first
    stage's word embedding (drawn alike).
    """
    if tied_copy and name == "output.weight":
        name = "tok_embeddings.weight"
    leaf = name.rsplit(".", 2)
    if "norm" in name:
        return torch.full(tuple(shape), 1.0 if leaf[-1] == "weight" else 0.0)
    if leaf[-1] == "bias":
        return torch.zeros(tuple(shape))
    std = INIT_STD / math.sqrt(2 * num_layers) if leaf[-2] in ("wo", "w2") else INIT_STD
    gen = torch.Generator().manual_seed(_name_seed(seed, name))
    return torch.empty(tuple(shape), dtype=torch.float32).normal_(0.0, std, generator=gen)


@torch.no_grad()
def init_weights(model: nn.Module, *, num_layers: int, seed: int) -> None:
    """Give every parameter of ``model`` (a whole, unsharded ``Decoder``) its
    ``initial_value``."""
    tied_copy = getattr(model, "tied_copy", False)
    for name, param in model.named_parameters():
        param.copy_(initial_value(name, param.shape, num_layers=num_layers, seed=seed,
                                  tied_copy=tied_copy))
