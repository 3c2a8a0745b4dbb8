"""Model description: ``ModelSpec`` for decoder-only transformers and its parameter counts.

A ``ModelSpec`` holds only architecture numbers. Counting follows the module structure of a
GPT/Llama decoder as Megatron-LM and the runtime build it:

* attention: Q, K, V and output projections (GQA shrinks K and V to ``num_kv_heads`` heads),
  and a head-wide norm of the queries and one of the keys with ``qk_norm`` (Qwen3);
* MLP: two matrices (GeLU) or three (SwiGLU), or ``num_experts`` such MLPs plus a router;
* two norms per layer, a final norm, the word embedding (padded vocabulary), an optional learned
  position embedding, an optional embedding norm (BLOOM) and an LM head unless tied.

Narayanan et al. 2021 (arXiv:2104.04473) Eq. 2, ``P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12lh))``,
is this count for a GPT model with biases, LayerNorm and learned positions, less the final
LayerNorm (2h parameters) which Eq. 2 leaves out.

A *traced* model (``ModelSpec.traced`` non-empty, built by ``costmodel.factory`` from any
``nn.Module``) is described layer by layer instead: every top-level layer of the module
(embedding, blocks, head, or a vision encoder in front) is one pipeline unit with its own
parameters, FLOPs and saved bytes, so layers need not be alike. Its architecture numbers are
placeholders (one head, so tensor parallelism is 1); the cost model reads the layers.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from meshplan.costmodel.jsonio import Limit, count

if TYPE_CHECKING:
    import networkx as nx

Activation = Literal["gelu", "swiglu"]
Norm = Literal["layernorm", "rmsnorm"]
PositionEmbedding = Literal["learned", "rope", "alibi"]

# ----- upper bounds on the architecture's counts ---------------------------------------------
# Generous but finite. The planner's work grows with these numbers (cost tables per layer and
# stage, loops over layers, divisor enumerations), so a typo such as ``num_layers: 10**30``
# would make it run for ever instead of failing; each bound sits far above any published
# model, so no real architecture is refused.
MAX_LAYERS = 4096
"""Transformer blocks: 4x DeepNet's 1,000 layers (Wang et al. 2022, arXiv:2203.00555), the
deepest transformer trained; LLMs stop near 128 (Llama 3.1 405B: 126)."""
MAX_HIDDEN_SIZE = 2**20
"""Model width (also per-head width): 1,048,576, 40x the widest published (Megatron-LM's 1T
model, 25,600; Narayanan et al. 2021 Table 1)."""
MAX_HEADS = 2**14
"""Attention heads (and key/value heads): 16,384, 100x the most published (160, ibid.)."""
MAX_FFN_HIDDEN_SIZE = 2**22
"""MLP inner width: 4,194,304, 40x the widest (4 x 25,600 = 102,400, ibid.)."""
MAX_VOCAB_SIZE = 2**24
"""Vocabulary rows: 16,777,216, 64x the largest tokenizers (Gemma's 256,000; BLOOM's
250,880)."""
MAX_SEQ_LEN = 2**24
"""Sequence length: 16,777,216 tokens, above the longest context claimed (10M, Llama 4
Scout)."""
MAX_EXPERTS = 2**20
"""MoE experts per layer: 1,048,576, PEER's "over a million" tiny experts (He 2024,
arXiv:2407.04153), the most published; Switch-C has 2,048."""
MODEL_LIMITS = {
    "num_layers": count(MAX_LAYERS, "MAX_LAYERS"),
    "hidden_size": count(MAX_HIDDEN_SIZE, "MAX_HIDDEN_SIZE"),
    "head_dim": count(MAX_HIDDEN_SIZE, "MAX_HIDDEN_SIZE"),
    "num_heads": count(MAX_HEADS, "MAX_HEADS"),
    "num_kv_heads": count(MAX_HEADS, "MAX_HEADS"),
    "ffn_hidden_size": count(MAX_FFN_HIDDEN_SIZE, "MAX_FFN_HIDDEN_SIZE"),
    "moe_ffn_hidden_size": count(MAX_FFN_HIDDEN_SIZE, "MAX_FFN_HIDDEN_SIZE"),
    "vocab_size": count(MAX_VOCAB_SIZE, "MAX_VOCAB_SIZE"),
    "padded_vocab_size": count(MAX_VOCAB_SIZE, "MAX_VOCAB_SIZE"),
    "seq_len": count(MAX_SEQ_LEN, "MAX_SEQ_LEN"),
    "moe_layer_freq": count(MAX_LAYERS, "MAX_LAYERS"),
    "num_experts": Limit(minimum=0, maximum=MAX_EXPERTS, name="MAX_EXPERTS"),
    "moe_top_k": Limit(minimum=0, maximum=MAX_EXPERTS, name="MAX_EXPERTS"),
}
"""The values each count field of ``ModelSpec`` may take, checked by ``__post_init__`` (the
upper bounds) and by the JSON readers (``costmodel.models``)."""

_ACTIVATIONS = ("gelu", "swiglu")
_NORMS = ("layernorm", "rmsnorm")
_POSITIONS = ("learned", "rope", "alibi")


@dataclass(frozen=True, kw_only=True)
class TracedLayer:
    """One top-level layer of a traced module, per sequence of the traced length."""

    name: str
    """Module path of the layer (``model.layers.3``)."""
    kind: int
    """Layers of one kind have equal costs (a repeated block); kinds number from 0."""
    params: int
    """Parameters the layer owns (a shared parameter counts once, in its first user)."""
    fwd_flop: float
    """Forward FLOPs per sequence (``torch.utils.flop_counter``: matmuls and attention)."""
    bwd_flop: float
    """Backward FLOPs per sequence."""
    saved_bytes: float
    """Bytes saved for backward per sequence without recomputation, at the traced dtype."""
    output_bytes: float
    """Bytes of the layer's output per sequence, at the traced dtype."""
    fwd_ops: float = 0.0
    """ATen operators the layer dispatches in its forward (one dispatch each, whatever the
    batch size); each costs the device's ``op_overhead_s`` (``timing.traced_layer_s``; the
    CPU's fixed time per operator, 0 on GPUs). 0 in traces made before meshplan counted
    them."""
    bwd_ops: float = 0.0
    """ATen operators its backward dispatches."""
    tensors: int = 0
    """Parameter tensors the layer owns (a shared one counts once, in its first user); 0 in
    traces made before meshplan counted them."""

    def __post_init__(self) -> None:
        for field in ("kind", "params", "fwd_flop", "bwd_flop", "saved_bytes", "output_bytes",
                      "fwd_ops", "bwd_ops", "tensors"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"traced layer {self.name!r}: {field} must be a number >= 0, "
                                 f"got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer, by its architecture numbers."""

    name: str
    """Catalog or user name, shown in reports."""
    num_layers: int
    """Transformer blocks (l)."""
    hidden_size: int
    """Model width (h)."""
    num_heads: int
    """Attention (query) heads (a)."""
    ffn_hidden_size: int
    """Width of the MLP's inner layer (4h for GPT-3; 8h/3 rounded for Llama)."""
    vocab_size: int
    """Tokenizer vocabulary (V)."""
    seq_len: int
    """Default training sequence length (s); a plan may override it."""
    num_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means ``num_heads`` (plain MHA)."""
    head_dim: int | None = None
    """Per-head width; None means ``hidden_size // num_heads``."""
    padded_vocab_size: int | None = None
    """Embedding rows after padding for tensor-parallel divisibility; None means ``vocab_size``."""
    activation: Activation = "gelu"
    """MLP nonlinearity: ``gelu`` (two matrices) or ``swiglu`` (three)."""
    norm: Norm = "layernorm"
    """``layernorm`` (weight and bias) or ``rmsnorm`` (weight only)."""
    position_embedding: PositionEmbedding = "learned"
    """``learned`` adds an s x h table; ``rope`` and ``alibi`` add no parameters."""
    linear_bias: bool = True
    """Biases on every linear layer (GPT-3, BLOOM); Llama has none."""
    qkv_bias: bool = False
    """Bias on the Q/K/V projections only (Qwen-style), ignored when ``linear_bias``."""
    qk_norm: bool = False
    """A norm (the model's ``norm``) over each attention head's query and key before RoPE,
    one ``head_dim``-wide weight for the queries and one for the keys, shared by the heads
    (Qwen3's ``q_norm`` / ``k_norm``; Megatron-LM's ``--qk-layernorm``): ``2 head_dim``
    parameters per layer (twice that for LayerNorm), and activations
    (``activations.qk_norm_bytes``)."""
    tied_embeddings: bool = True
    """LM head shares the word-embedding matrix."""
    embedding_norm: bool = False
    """A norm right after the word embedding (BLOOM)."""
    dropout: bool = False
    """Dropout after attention and MLP (GPT-3/Megatron era); adds 1-byte masks to activations."""
    num_experts: int = 0
    """MoE experts per MoE layer; 0 for a dense model."""
    moe_top_k: int = 0
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int | None = None
    """Expert MLP inner width; None means ``ffn_hidden_size``."""
    moe_layer_freq: int = 1
    """Every k-th layer is MoE (1: all layers)."""
    rope_theta: float = 10000.0
    """RoPE base (Su et al. 2021; 10,000 in Llama 1/2, 500,000 in Llama 3); the runtime's
    rotary tables. No effect on the cost model."""
    norm_eps: float = 1e-5
    """Epsilon of every norm (HF ``rms_norm_eps`` / ``layer_norm_epsilon``); runtime only."""
    rope_scaling: str = ""
    """HF ``rope_scaling.rope_type`` when the config scales RoPE ("" for none): the runtime
    implements ``linear`` and ``llama3`` and refuses the others."""
    rope_factor: float = 1.0
    """RoPE scaling ``factor`` (``linear``, ``llama3``)."""
    rope_low_freq_factor: float = 1.0
    """``llama3`` scaling: ``low_freq_factor``."""
    rope_high_freq_factor: float = 4.0
    """``llama3`` scaling: ``high_freq_factor``."""
    rope_original_max_len: int = 8192
    """``llama3`` scaling: ``original_max_position_embeddings``."""
    sliding_window: int | None = None
    """Sliding-window attention: each token attends to itself and the ``sliding_window - 1``
    tokens before it (Mistral's ``sliding_window``, Beltagy et al. 2020); None: full causal
    attention. The runtime masks accordingly; the cost model counts full causal attention
    (an upper bound on the attention FLOPs when the window is shorter than the sequence)."""
    hf_model_type: str = ""
    """HF ``model_type`` the spec was read from ("" otherwise): which HF architecture its
    weights load from and save to (``runtime/hf.py``)."""
    reported_params: float | None = None
    """Parameter count the model's authors report, for reference only."""
    source: str = ""
    """Where the numbers come from."""
    traced: tuple[TracedLayer, ...] = ()
    """Per-layer costs of a traced module (see the module docstring); empty for an analytic
    transformer. When given, ``num_layers`` equals its length and ``seq_len`` is the traced
    sequence length."""
    traced_dtype_bytes: int = 2
    """Bytes per element of the dtype the module was traced in (scales ``saved_bytes``)."""
    traced_extra_saved_bytes: float = 0.0
    """Bytes per sequence saved for backward outside any layer (e.g. the loss)."""
    factory: str = ""
    """``package.module:callable`` that builds the traced module, for the runtime."""
    traced_chain: bool = False
    """Each traced layer takes the previous one's output and no two layers share a parameter:
    the module is a chain of its layers (what the runtime needs to cut it into stages)."""

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "ffn_hidden_size",
                      "vocab_size", "seq_len", "moe_layer_freq"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        for field in ("num_kv_heads", "head_dim", "padded_vocab_size", "moe_ffn_hidden_size",
                      "sliding_window"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value <= 0):
                raise ValueError(f"{field} must be a positive integer or null, got {value!r}")
        for field in ("num_experts", "moe_top_k"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{field} must be an integer >= 0, got {value!r}")
        for field, limit in MODEL_LIMITS.items():
            value = getattr(self, field)
            if value is not None and value > limit.maximum:
                raise ValueError(f"{field} must be at most {limit.maximum} ({limit.name}), "
                                 f"got {value!r}")
        if self.activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {self.activation!r}")
        if self.norm not in _NORMS:
            raise ValueError(f"norm must be one of {_NORMS}, got {self.norm!r}")
        if self.position_embedding not in _POSITIONS:
            raise ValueError(f"position_embedding must be one of {_POSITIONS}, "
                             f"got {self.position_embedding!r}")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads "
                             f"{self.num_heads}; give head_dim explicitly")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be a multiple of num_kv_heads "
                             f"{self.kv_heads}")
        if self.padded_vocab_size is not None and self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"padded_vocab_size {self.padded_vocab_size} is smaller than "
                             f"vocab_size {self.vocab_size}")
        if self.num_experts < 0 or self.moe_top_k < 0:
            raise ValueError(f"num_experts and moe_top_k must be >= 0, got "
                             f"{self.num_experts}, {self.moe_top_k}")
        if self.num_experts and not 1 <= self.moe_top_k <= self.num_experts:
            raise ValueError(f"moe_top_k must be in 1..num_experts={self.num_experts}, "
                             f"got {self.moe_top_k}")
        if self.traced:
            if len(self.traced) != self.num_layers:
                raise ValueError(f"num_layers {self.num_layers} must equal the "
                                 f"{len(self.traced)} traced layers")
            if self.num_heads != 1 or self.num_experts:
                raise ValueError("a traced model has num_heads 1 and no experts (its layers "
                                 "carry the costs)")
            if self.traced_dtype_bytes not in (1, 2, 4, 8):
                raise ValueError(f"traced_dtype_bytes must be 1, 2, 4 or 8, got "
                                 f"{self.traced_dtype_bytes!r}")

    @functools.cached_property
    def is_traced(self) -> bool:
        return bool(self.traced)

    # ----- derived sizes -------------------------------------------------------------------
    @functools.cached_property
    def kv_heads(self) -> int:
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    @functools.cached_property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @functools.cached_property
    def q_size(self) -> int:
        """Width of the query projection output (a * d)."""
        return self.num_heads * self.head_size

    @functools.cached_property
    def kv_size(self) -> int:
        """Width of each of the key and value projection outputs (a_kv * d)."""
        return self.kv_heads * self.head_size

    @functools.cached_property
    def vocab_rows(self) -> int:
        """Embedding rows actually allocated (the padded vocabulary)."""
        return self.padded_vocab_size if self.padded_vocab_size is not None else self.vocab_size

    @functools.cached_property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    @functools.cached_property
    def expert_ffn_size(self) -> int:
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None \
            else self.ffn_hidden_size

    @functools.cached_property
    def num_moe_layers(self) -> int:
        return self.num_layers // self.moe_layer_freq if self.is_moe else 0

    def is_moe_layer(self, index: int) -> bool:
        """Layer ``index`` (0-based) is an MoE layer: every ``moe_layer_freq``-th, last first."""
        return self.is_moe and (index + 1) % self.moe_layer_freq == 0

    @functools.cached_property
    def layers_of_one_kind(self) -> bool:
        """Every layer dense, or every layer MoE."""
        return len({self.is_moe_layer(i) for i in range(self.num_layers)}) == 1

    # ----- parameter counts ----------------------------------------------------------------
    @functools.cached_property
    def norm_params(self) -> int:
        """Parameters of one norm: 2h for LayerNorm (weight, bias), h for RMSNorm."""
        return 2 * self.hidden_size if self.norm == "layernorm" else self.hidden_size

    @functools.cached_property
    def qk_norm_params(self) -> int:
        """The query and key norms of one layer (``qk_norm``): a head-wide norm each."""
        if not self.qk_norm:
            return 0
        return 2 * self.head_size * (2 if self.norm == "layernorm" else 1)

    @functools.cached_property
    def attention_params(self) -> int:
        h, q, kv = self.hidden_size, self.q_size, self.kv_size
        weights = h * q + 2 * h * kv + q * h + self.qk_norm_params
        if self.linear_bias:
            return weights + q + 2 * kv + h
        return weights + (q + 2 * kv if self.qkv_bias else 0)

    def mlp_params(self, ffn: int | None = None) -> int:
        """One dense MLP of inner width ``ffn`` (default the model's)."""
        h, f = self.hidden_size, ffn if ffn is not None else self.ffn_hidden_size
        matrices = 3 if self.activation == "swiglu" else 2
        bias = ((matrices - 1) * f + h) if self.linear_bias else 0
        return matrices * h * f + bias

    @functools.cached_property
    def dense_layer_params(self) -> int:
        return self.attention_params + self.mlp_params() + 2 * self.norm_params

    @functools.cached_property
    def moe_layer_params(self) -> int:
        router = self.hidden_size * self.num_experts
        return (self.attention_params + 2 * self.norm_params + router
                + self.num_experts * self.mlp_params(self.expert_ffn_size))

    def layer_params(self, index: int) -> int:
        if self.traced:
            return self.traced[index].params
        return self.moe_layer_params if self.is_moe_layer(index) else self.dense_layer_params

    @functools.cached_property
    def layers_params(self) -> int:
        """All transformer blocks together (every layer of a traced model)."""
        if self.traced:
            return sum(layer.params for layer in self.traced)
        moe = self.num_moe_layers
        return moe * self.moe_layer_params + (self.num_layers - moe) * self.dense_layer_params

    @functools.cached_property
    def embedding_params(self) -> int:
        """Input side: word embedding, learned positions, embedding norm (a traced model's
        embedding is one of its layers)."""
        if self.traced:
            return 0
        params = self.vocab_rows * self.hidden_size
        if self.position_embedding == "learned":
            params += self.seq_len * self.hidden_size
        if self.embedding_norm:
            params += self.norm_params
        return params

    @functools.cached_property
    def head_params(self) -> int:
        """Output side: final norm and, if untied, the LM head matrix (a traced model's head is
        one of its layers)."""
        if self.traced:
            return 0
        lm_head = 0 if self.tied_embeddings else self.vocab_rows * self.hidden_size
        return self.norm_params + lm_head

    @functools.cached_property
    def num_params(self) -> int:
        """Total trainable parameters (tied matrices counted once)."""
        return self.embedding_params + self.layers_params + self.head_params

    @functools.cached_property
    def active_params(self) -> int:
        """Parameters touched per token (MoE counts ``moe_top_k`` experts)."""
        if not self.is_moe:
            return self.num_params
        inactive = (self.num_experts - self.moe_top_k) * self.mlp_params(self.expert_ffn_size)
        return self.num_params - self.num_moe_layers * inactive

    # ----- matmul sizes used by the FLOP count ---------------------------------------------
    @functools.cached_property
    def attention_matmul_params(self) -> int:
        """Weights multiplied per token in attention projections (biases excluded)."""
        h, q, kv = self.hidden_size, self.q_size, self.kv_size
        return 2 * h * q + 2 * h * kv

    def mlp_matmul_params(self, ffn: int | None = None) -> int:
        f = ffn if ffn is not None else self.ffn_hidden_size
        return (3 if self.activation == "swiglu" else 2) * self.hidden_size * f

    def layer_graph(self) -> "nx.DiGraph":
        """A traced model's layers as a networkx DiGraph: nodes in execution order with their
        ``TracedLayer`` fields (and ``order``), an edge from each layer to the next."""
        import networkx as nx

        graph = nx.DiGraph()
        for index, layer in enumerate(self.traced):
            graph.add_node(layer.name, order=index, **dataclasses.asdict(layer))
            if index:
                graph.add_edge(self.traced[index - 1].name, layer.name)
        return graph

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["traced"] = [dataclasses.asdict(layer) for layer in self.traced]
        return data


MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelSpec))
