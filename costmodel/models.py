"""Model catalog and loading: a catalog name, a ModelSpec JSON file or a HuggingFace config.json.

``load_model`` is what ``--model`` resolves through (DESIGN.md). The catalog lives in
``costmodel/data/models.json``: ``{"models": {name: {ModelSpec fields...}}}``, each entry with the
``source`` of its numbers and the authors' ``reported_params``; tests/costmodel/test_models.py
checks ``ModelSpec.num_params`` against them.

A ModelSpec JSON file holds the dataclass field names as keys (``name`` defaults to the file
stem). A HuggingFace ``config.json`` is recognised by its keys (``model_type``, ``n_layer``,
``num_hidden_layers``...) and translated by ``from_hf_config`` for the Llama/Mistral/Mixtral/
Qwen2/Qwen3/Qwen3-MoE, GPT-2, GPT-NeoX, BLOOM and OPT key styles.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import json
import logging
import os
import types
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any, Callable

from meshplan.costmodel.jsonio import (FRACTION, NON_NEGATIVE, Limit, Rule, check_object,
                                       check_value, parse_json_document, schema_of)
from meshplan.costmodel.model import MODEL_LIMITS, ModelSpec, TracedLayer
from meshplan.costmodel.refs import HF_CONFIG_REF, is_factory_ref

logger = logging.getLogger(__name__)

CATALOG_FILE = "models.json"
"""Catalog file name inside the ``costmodel/data`` package folder."""
BLOOM_DEFAULT_SEQ_LEN = 2048
"""BLOOM's training sequence length (BigScience 2022, arXiv:2211.05100, Table 3); BLOOM's HF
configs carry no sequence length since ALiBi has no position table."""
GPT_FFN_MULTIPLIER = 4
"""MLP width over model width in GPT-2/GPT-3/BLOOM (Radford et al. 2019; Brown et al. 2020)."""

TRACED_LAYER_SCHEMA = schema_of(TracedLayer, limits={
    "kind": NON_NEGATIVE, "params": NON_NEGATIVE, "fwd_flop": NON_NEGATIVE,
    "bwd_flop": NON_NEGATIVE, "saved_bytes": NON_NEGATIVE, "output_bytes": NON_NEGATIVE,
    "fwd_ops": NON_NEGATIVE, "bwd_ops": NON_NEGATIVE, "tensors": NON_NEGATIVE})
"""One entry of a ModelSpec JSON's ``traced`` list: exactly the TracedLayer fields."""
MODEL_SCHEMA = schema_of(
    ModelSpec, limits={**MODEL_LIMITS, "traced_dtype_bytes": Limit(choices=(1, 2, 4, 8)),
                       "reported_params": NON_NEGATIVE, "traced_extra_saved_bytes": NON_NEGATIVE},
    rules={"traced": Rule(kind="list", item_label="traced layer",
                          items=Rule(kind="object", schema=TRACED_LAYER_SCHEMA))})
"""A ModelSpec JSON object: the dataclass fields (required: those without a default), their
JSON types, sizes > 0 and the named upper bounds of ``model.MODEL_LIMITS``."""
_HF_MARKER_KEYS = ("model_type", "architectures", "num_hidden_layers", "n_layer", "n_embd",
                   "n_embed", "n_head", "num_attention_heads")
"""Keys that only a HuggingFace config has (a ModelSpec file says num_layers, num_heads)."""
_MISSING = object()
# ----- catalog ---------------------------------------------------------------------------------
def model_catalog() -> dict[str, ModelSpec]:
    """All catalog models by name (a fresh dict each call; the specs are frozen)."""
    return dict(_catalog())


@functools.cache
def _catalog() -> Mapping[str, ModelSpec]:
    origin = f"costmodel/data/{CATALOG_FILE}"
    text = (resources.files("meshplan.costmodel.data") / CATALOG_FILE).read_text(encoding="utf-8")
    data = parse_json_document(text, origin=origin)
    entries = data.get("models")
    if not isinstance(entries, dict):
        raise ValueError(f"{origin}: expected an object under 'models', "
                         f"got {type(entries).__name__}")
    specs = {}
    for name, entry in entries.items():
        if not isinstance(entry, dict):
            raise ValueError(f"{origin}: model {name!r} must be an object, got {entry!r}")
        if entry.get("name", name) != name:
            raise ValueError(f"{origin}: model {name!r} has a different 'name' {entry['name']!r}")
        specs[name] = spec_from_dict(entry, origin=f"{origin} model {name!r}", default_name=name)
    return types.MappingProxyType(specs)


# ----- loading ---------------------------------------------------------------------------------
def load_model(ref: str | os.PathLike[str], *, seq_len: int | None = None,
               dtype: str | None = None) -> ModelSpec:
    """Resolve ``ref``, a catalog name or a path to a JSON file, into a ``ModelSpec``.

    Catalog names win over files of the same name and match case-insensitively. A path may be a
    ModelSpec JSON (keys are ModelSpec fields), a HuggingFace ``config.json``, or a folder that
    holds a ``config.json`` (a downloaded HF snapshot). ``package.module:callable`` names a
    user's ``nn.Module`` factory, traced without weights into per-layer costs
    (``costmodel.factory``; needs torch) in ``dtype`` (default bf16; trace in the dtype the
    plans will use: other dtypes scale the traced bytes, which misjudges tensors kept in fp32). ``seq_len`` replaces the model's default
    sequence length; for learned positions that also resizes the counted position table, as
    ``ModelSpec.embedding_params`` counts ``seq_len`` rows.

    A HuggingFace config of a model type the analytic reader does not know (Gemma, Phi-3,
    DeepSeek-V3, ...; ``_HF_MODEL_TYPES`` lists those it knows) is traced instead, as
    ``hf-config:PATH`` (``refs.HF_CONFIG_REF``), when ``transformers`` is installed: the
    ``transformers`` model built from it on the meta device, at ``seq_len`` or else its
    ``max_position_embeddings``.
    """
    ref = os.fspath(ref)
    traced_config = _hf_config_to_trace(ref)
    if traced_config is not None:
        ref = f"{HF_CONFIG_REF}{traced_config}"
    if is_factory_ref(ref):
        from meshplan.costmodel.factory import model_from_factory  # imports torch
        return model_from_factory(ref, seq_len=seq_len, dtype=dtype or "bf16")
    spec = _resolve(ref)
    if seq_len is not None:
        spec = dataclasses.replace(spec, seq_len=seq_len)
    return spec


def is_traced_ref(ref: str | os.PathLike[str] | None) -> bool:
    """``load_model(ref)`` traces a module (so it takes the plans' ``seq_len`` and dtype): a
    factory reference, or a HuggingFace config of a model type the analytic reader lacks."""
    if not ref:
        return False
    ref = os.fspath(ref)
    return is_factory_ref(ref) or _hf_config_to_trace(ref) is not None


def _hf_config_to_trace(ref: str) -> Path | None:
    """The ``config.json`` ``ref`` names when it is a HuggingFace config whose model type the
    analytic reader does not know, and ``transformers`` is installed to trace it; else None
    (``_resolve`` then reads it, or reports why it cannot)."""
    catalog = _catalog()
    if ref in catalog or ref.lower() in catalog or is_factory_ref(ref):
        return None
    path = Path(ref).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not is_hf_config(data):
        return None
    model_type = data.get("model_type")
    if not isinstance(model_type, str) or model_type in _HF_MODEL_TYPES \
            or importlib.util.find_spec("transformers") is None:
        return None
    from meshplan.costmodel.hf import knows_model_type  # imports torch and transformers

    return path.resolve() if knows_model_type(model_type) else None


def _resolve(ref: str) -> ModelSpec:
    catalog = _catalog()
    if ref in catalog or ref.lower() in catalog:
        return catalog[ref if ref in catalog else ref.lower()]
    path = Path(ref).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.is_file():
        return load_model_file(path)
    if path.is_dir():
        raise ValueError(f"model directory {ref!r} has no config.json; give a HuggingFace "
                         f"checkpoint directory, a ModelSpec JSON or HF config.json, or a "
                         f"catalog name")
    if _looks_like_path(ref):
        raise ValueError(f"model file {ref!r} does not exist (resolved to {path.resolve()}); "
                         f"give an existing ModelSpec JSON or HF config.json, or a catalog name")
    close = difflib.get_close_matches(ref.lower(), list(catalog), n=5, cutoff=0.5)
    hint = (f"closest catalog names: {', '.join(close)}" if close
            else f"catalog names: {', '.join(catalog)}")
    raise ValueError(f"unknown model {ref!r}; {hint}. A path to a ModelSpec JSON file or a "
                     f"HuggingFace config.json is also accepted")


def _looks_like_path(ref: str) -> bool:
    return ("/" in ref or os.sep in ref or ref.lower().endswith(".json")
            or ref.startswith(("~", ".")))


def load_model_file(path: str | Path) -> ModelSpec:
    """Load a ModelSpec JSON or a HuggingFace config.json, told apart by their keys."""
    path = Path(path)
    data = parse_json_document(path.read_text(encoding="utf-8"), origin=str(path))
    if is_hf_config(data):
        spec = from_hf_config(data, name=_hf_model_name(data, path=path),
                              origin=f"{path} (read as a HuggingFace config)")
        return dataclasses.replace(spec, source=f"{spec.source}: {path}")
    return spec_from_dict(data, origin=str(path), default_name=path.stem)


def spec_from_dict(data: Mapping[str, Any], *, origin: str,
                   default_name: str | None = None) -> ModelSpec:
    """Build a ``ModelSpec`` from a mapping keyed by its field names, naming bad or missing keys.

    The mapping is checked against ``MODEL_SCHEMA`` (unknown and missing keys, JSON types,
    sizes and their upper bounds); ``ModelSpec`` then checks how the fields relate. ``origin``
    (a file, a catalog entry) prefixes every error message; ``default_name`` fills in a
    missing ``name``.
    """
    fields = dict(data)
    if default_name is not None:
        fields.setdefault("name", default_name)
    check_object(fields, MODEL_SCHEMA, origin=origin)
    try:
        if "traced" in fields:
            fields["traced"] = tuple(entry if isinstance(entry, TracedLayer)
                                     else TracedLayer(**entry) for entry in fields["traced"])
        return ModelSpec(**fields)
    except ValueError as err:
        raise ValueError(f"{origin}: {err}") from err


# ----- HuggingFace configs ---------------------------------------------------------------------
def is_hf_config(data: Mapping[str, Any]) -> bool:
    """True if ``data`` has keys only a HuggingFace config has (not ModelSpec field names)."""
    return any(key in data for key in _HF_MARKER_KEYS)


def _hf_model_name(config: Mapping[str, Any], *, path: Path) -> str:
    """``_name_or_path``'s last part, else the folder of a ``config.json``, else the file stem."""
    name_or_path = str(config.get("_name_or_path") or "").rstrip("/")
    if name_or_path:
        return name_or_path.rsplit("/", 1)[-1]
    if path.stem == "config" and path.parent.name:
        return path.parent.name
    return path.stem


_HF_SIZE_KEYS = {
    "num_hidden_layers": "num_layers", "n_layer": "num_layers",
    "hidden_size": "hidden_size", "n_embd": "hidden_size", "n_embed": "hidden_size",
    "word_embed_proj_dim": "hidden_size", "head_dim": "head_dim",
    "num_attention_heads": "num_heads", "n_head": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "intermediate_size": "ffn_hidden_size", "n_inner": "ffn_hidden_size",
    "ffn_dim": "ffn_hidden_size", "vocab_size": "vocab_size",
    "max_position_embeddings": "seq_len", "n_positions": "seq_len", "n_ctx": "seq_len",
    "seq_length": "seq_len", "num_local_experts": "num_experts", "num_experts": "num_experts",
    "num_experts_per_tok": "moe_top_k", "moe_intermediate_size": "moe_ffn_hidden_size",
    "decoder_sparse_step": "moe_layer_freq",
}
"""HF keys the translators read as sizes, and the ModelSpec field each becomes."""
_HF_RULES = {key: dataclasses.replace(MODEL_SCHEMA.rules[field], nullable=False,
                                      limit=dataclasses.replace(MODEL_LIMITS[field],
                                                                minimum=None))
             for key, field in _HF_SIZE_KEYS.items()}
"""What an HF size key may hold: an integer up to the bound of its ModelSpec field. Zero and
negative sizes are left to ``ModelSpec``, whose message names the field they became."""
_HF_FLAG = Rule(kind="bool")
_HF_PROBABILITY = Rule(kind="float", limit=FRACTION)


def _hf_value(config: Mapping[str, Any], key: str, rule: Rule | None, *, origin: str) -> Any:
    """``config[key]`` checked against ``rule``; None when absent or null (as HF reads it)."""
    value = config.get(key)
    if value is not None and rule is not None:
        check_value(value, rule, origin=origin, path=key)
    return value


def _get(config: Mapping[str, Any], *keys: str, origin: str, default: Any = _MISSING) -> Any:
    """The value of the first of ``keys`` present (and not null) in ``config``, checked as a
    size (``_HF_RULES``)."""
    for key in keys:
        value = _hf_value(config, key, _HF_RULES.get(key), origin=origin)
        if value is not None:
            return value
    if default is _MISSING:
        raise ValueError(f"{origin}: none of the keys {list(keys)} is set (model_type "
                         f"{config.get('model_type')!r}); one of them is required")
    return default


def _flag(config: Mapping[str, Any], key: str, *, default: bool, origin: str) -> bool:
    """The boolean ``config[key]``, ``default`` when absent or null."""
    value = _hf_value(config, key, _HF_FLAG, origin=origin)
    return default if value is None else value


def _dropout(config: Mapping[str, Any], keys_defaults: Mapping[str, float], *,
             origin: str) -> bool:
    """Any dropout probability in the config (or its HF default when absent) above zero."""
    values = {key: _hf_value(config, key, _HF_PROBABILITY, origin=origin)
              for key in keys_defaults}
    return any((default if values[key] is None else values[key]) > 0
               for key, default in keys_defaults.items())


def _canonical_head_dim(head_dim: int | None, *, hidden_size: int, num_heads: int) -> int | None:
    """None when ``head_dim`` is the implied ``hidden_size // num_heads`` (as in the catalog).

    With ``num_heads`` <= 0 ``head_dim`` is returned as given: ModelSpec refuses the heads."""
    if num_heads <= 0:
        return head_dim
    implied = hidden_size // num_heads if hidden_size % num_heads == 0 else None
    return None if head_dim == implied else head_dim


def _from_llama(config: Mapping[str, Any], origin: str) -> dict[str, Any]:
    """Llama / Mistral / Mixtral / Qwen2 / Qwen3 / Qwen3-MoE (transformers ``LlamaConfig`` and
    kin).

    The MLP is gated (gate, up and down projections) whatever ``hidden_act`` says (``silu`` in
    all of these), which is ModelSpec's three-matrix ``swiglu``. Qwen2 has biases on Q/K/V
    only (``qkv_bias``); Mistral's and Mixtral's ``sliding_window`` (null: none) is kept.
    Qwen3 and Qwen3-MoE normalise each head's query and key (``qk_norm``: transformers'
    ``Qwen3Attention`` ``q_norm`` / ``k_norm``, RMSNorm over ``head_dim``). Mixtral's
    ``num_local_experts`` (Qwen3-MoE's ``num_experts``, or ``num_local_experts`` as
    transformers 5 writes it) and ``num_experts_per_tok`` become ``num_experts`` /
    ``moe_top_k``, with experts as wide as ``intermediate_size`` (Mixtral) or
    ``moe_intermediate_size`` (Qwen3-MoE, whose ``decoder_sparse_step`` is
    ``moe_layer_freq``: transformers makes layer i sparse when (i + 1) is a multiple of it,
    as ModelSpec counts; a non-empty ``mlp_only_layers`` is refused).
    """
    model_type = config.get("model_type")
    if (_flag(config, "attention_bias", default=False, origin=origin)
            or _flag(config, "mlp_bias", default=False, origin=origin)):
        raise ValueError(f"{origin}: attention_bias/mlp_bias on a Llama-style model cannot be "
                         f"expressed by ModelSpec (all-or-Q/K/V biases only); write a ModelSpec "
                         f"JSON instead")
    hidden = _get(config, "hidden_size", origin=origin)
    heads = _get(config, "num_attention_heads", origin=origin)
    experts = _get(config, "num_local_experts", "num_experts", origin=origin, default=0)
    window = None
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and _flag(
            config, "use_sliding_window", default=False, origin=origin):
        raise ValueError(f"{origin}: {model_type} with use_sliding_window (a window on the "
                         f"layers from max_window_layers on) is not supported; set it false")
    if model_type in ("mistral", "mixtral"):
        window = _hf_value(config, "sliding_window", Rule(kind="int"), origin=origin)
    moe_fields: dict[str, Any] = {}
    if model_type == "qwen3_moe" and experts:
        if _hf_value(config, "mlp_only_layers", Rule(kind="list", items=Rule(kind="int")),
                     origin=origin):
            raise ValueError(f"{origin}: mlp_only_layers (dense MLPs on chosen layers of an "
                             f"MoE model) cannot be expressed by ModelSpec; write a ModelSpec "
                             f"JSON instead")
        moe_fields = dict(
            moe_ffn_hidden_size=_get(config, "moe_intermediate_size", origin=origin),
            moe_layer_freq=_get(config, "decoder_sparse_step", origin=origin, default=1))
    return dict(
        num_layers=_get(config, "num_hidden_layers", origin=origin), hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=_get(config, "num_key_value_heads", origin=origin, default=None),
        head_dim=_canonical_head_dim(_get(config, "head_dim", origin=origin, default=None),
                                     hidden_size=hidden, num_heads=heads),
        ffn_hidden_size=_get(config, "intermediate_size", origin=origin),
        vocab_size=_get(config, "vocab_size", origin=origin),
        seq_len=_get(config, "max_position_embeddings", origin=origin),
        activation="swiglu", norm="rmsnorm", position_embedding="rope", linear_bias=False,
        qkv_bias=model_type == "qwen2", qk_norm=model_type in ("qwen3", "qwen3_moe"),
        sliding_window=window,
        tied_embeddings=_flag(config, "tie_word_embeddings", default=False, origin=origin),
        dropout=_dropout(config, {"attention_dropout": 0.0}, origin=origin),
        num_experts=experts,
        moe_top_k=_get(config, "num_experts_per_tok", origin=origin, default=0) if experts else 0,
        **moe_fields,
        **_rope_and_norm(config, origin=origin, eps_key="rms_norm_eps"))


def _rope_and_norm(config: Mapping[str, Any], *, origin: str, eps_key: str) -> dict[str, Any]:
    """``rope_theta``, ``norm_eps``, ``rope_scaling`` (its type) and ``hf_model_type``.

    RoPE settings are top-level ``rope_theta`` and ``rope_scaling`` in configs of transformers
    4, one ``rope_parameters`` object (``rope_theta``, ``rope_type``) in those of version 5."""
    fields: dict[str, Any] = {}
    rope = config.get("rope_parameters")
    rope = rope if isinstance(rope, Mapping) else {}
    sources = ((config, "rope_theta", "rope_theta"), (rope, "rope_theta", "rope_theta"),
               (config, eps_key, "norm_eps"))
    for where, key, field in sources:
        value = _hf_value(where, key, Rule(kind="float"), origin=origin)
        if value is not None:
            if not value > 0:
                raise ValueError(f"{origin}: {key} must be > 0, got {value}")
            fields[field] = float(value)
    scaling = config.get("rope_scaling") or rope
    if isinstance(scaling, Mapping) and scaling:
        kind = str(scaling.get("rope_type", scaling.get("type", "")))
        fields["rope_scaling"] = "" if kind in ("default", "") else kind
        for key, field in (("factor", "rope_factor"), ("low_freq_factor", "rope_low_freq_factor"),
                           ("high_freq_factor", "rope_high_freq_factor")):
            value = _hf_value(scaling, key, Rule(kind="float"), origin=origin)
            if value is not None:
                fields[field] = float(value)
        original = scaling.get("original_max_position_embeddings")
        if isinstance(original, int) and original > 0:
            fields["rope_original_max_len"] = original
    if isinstance(config.get("model_type"), str):
        fields["hf_model_type"] = config["model_type"]
    return fields


def _from_gpt2(config: Mapping[str, Any], origin: str) -> dict[str, Any]:
    """GPT-2 (``GPT2Config``): learned positions, LayerNorm, biases, tied head.

    ``n_inner`` null means 4 * ``n_embd``; the vocabulary is not padded (50257 rows).
    """
    hidden = _get(config, "n_embd", origin=origin)
    return dict(
        num_layers=_get(config, "n_layer", origin=origin), hidden_size=hidden,
        num_heads=_get(config, "n_head", origin=origin),
        ffn_hidden_size=_get(config, "n_inner", origin=origin,
                             default=GPT_FFN_MULTIPLIER * hidden),
        vocab_size=_get(config, "vocab_size", origin=origin),
        seq_len=_get(config, "n_positions", "n_ctx", origin=origin),
        activation="gelu", norm="layernorm", position_embedding="learned", linear_bias=True,
        tied_embeddings=_flag(config, "tie_word_embeddings", default=True, origin=origin),
        dropout=_dropout(config, {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1},
                         origin=origin))


def _from_gpt_neox(config: Mapping[str, Any], origin: str) -> dict[str, Any]:
    """GPT-NeoX / Pythia (``GPTNeoXConfig``): rotary, LayerNorm, biases, untied head.

    Separate attention and MLP LayerNorms (two per layer) and a final one, as ModelSpec counts;
    the parallel residual changes no parameter. ``attention_bias`` false cannot be expressed.
    """
    if not _flag(config, "attention_bias", default=True, origin=origin):
        raise ValueError(f"{origin}: GPT-NeoX without attention_bias (MLP still biased) cannot "
                         f"be expressed by ModelSpec; write a ModelSpec JSON")
    return dict(
        num_layers=_get(config, "num_hidden_layers", origin=origin),
        hidden_size=_get(config, "hidden_size", origin=origin),
        num_heads=_get(config, "num_attention_heads", origin=origin),
        ffn_hidden_size=_get(config, "intermediate_size", origin=origin),
        vocab_size=_get(config, "vocab_size", origin=origin),
        seq_len=_get(config, "max_position_embeddings", origin=origin),
        activation="gelu", norm="layernorm", position_embedding="rope", linear_bias=True,
        tied_embeddings=_flag(config, "tie_word_embeddings", default=False, origin=origin),
        dropout=_dropout(config, {"hidden_dropout": 0.0, "attention_dropout": 0.0},
                         origin=origin))


def _from_bloom(config: Mapping[str, Any], origin: str) -> dict[str, Any]:
    """BLOOM (``BloomConfig``): ALiBi, embedding LayerNorm, biases, tied head, MLP 4h.

    ``vocab_size`` in BLOOM configs is already the padded 250880 rows; the sequence length is
    ``seq_length`` when given, else ``BLOOM_DEFAULT_SEQ_LEN``.
    """
    hidden = _get(config, "hidden_size", "n_embed", origin=origin)
    return dict(
        num_layers=_get(config, "n_layer", "num_hidden_layers", origin=origin),
        hidden_size=hidden,
        num_heads=_get(config, "n_head", "num_attention_heads", origin=origin),
        ffn_hidden_size=GPT_FFN_MULTIPLIER * hidden,
        vocab_size=_get(config, "vocab_size", origin=origin),
        seq_len=_get(config, "seq_length", "max_position_embeddings", origin=origin,
                     default=BLOOM_DEFAULT_SEQ_LEN),
        activation="gelu", norm="layernorm", position_embedding="alibi", linear_bias=True,
        tied_embeddings=_flag(config, "tie_word_embeddings", default=True, origin=origin),
        embedding_norm=True,
        dropout=_dropout(config, {"hidden_dropout": 0.0, "attention_dropout": 0.0},
                         origin=origin))


def _from_opt(config: Mapping[str, Any], origin: str) -> dict[str, Any]:
    """OPT (``OPTConfig``): learned positions, LayerNorm, biases, tied head; ReLU MLP.

    ReLU maps to ModelSpec's ``gelu`` (same two matrices, same parameters and FLOPs). OPT's
    position table has ``max_position_embeddings + 2`` rows (an offset of 2 kept from fairseq);
    ModelSpec counts ``seq_len`` rows, so the count is 2 * hidden_size below the checkpoint's
    (1,536 of OPT-125m's 125,239,296). ``word_embed_proj_dim`` other than ``hidden_size``
    (OPT-350m's 512-wide embedding with in/out projections) cannot be expressed. Post-LN
    configs (``do_layer_norm_before`` false, OPT-350m only) lack the final LayerNorm; ModelSpec
    still counts it.
    """
    hidden = _get(config, "hidden_size", origin=origin)
    proj = _get(config, "word_embed_proj_dim", origin=origin, default=hidden)
    if proj != hidden:
        raise ValueError(f"{origin}: word_embed_proj_dim {proj} != hidden_size {hidden} "
                         f"(projected embeddings) cannot be expressed by ModelSpec; only "
                         f"word_embed_proj_dim == hidden_size is accepted")
    return dict(
        num_layers=_get(config, "num_hidden_layers", origin=origin), hidden_size=hidden,
        num_heads=_get(config, "num_attention_heads", origin=origin),
        ffn_hidden_size=_get(config, "ffn_dim", origin=origin),
        vocab_size=_get(config, "vocab_size", origin=origin),
        seq_len=_get(config, "max_position_embeddings", origin=origin),
        activation="gelu", norm="layernorm", position_embedding="learned",
        linear_bias=_flag(config, "enable_bias", default=True, origin=origin),
        tied_embeddings=_flag(config, "tie_word_embeddings", default=True, origin=origin),
        dropout=_dropout(config, {"dropout": 0.1, "attention_dropout": 0.0}, origin=origin))


_HF_STYLES: dict[str, Callable[[Mapping[str, Any], str], dict[str, Any]]] = {
    "llama": _from_llama, "gpt2": _from_gpt2, "gpt_neox": _from_gpt_neox,
    "bloom": _from_bloom, "opt": _from_opt,
}
_HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "llama",
                   "qwen3": "llama", "qwen3_moe": "llama", "gpt2": "gpt2", "gpt_neox": "gpt_neox",
                   "bloom": "bloom", "opt": "opt"}
"""HuggingFace ``model_type`` to the key style that reads it."""


def hf_config_style(config: Mapping[str, Any], *, origin: str = "HF config") -> str:
    """Which key style reads ``config``: by ``model_type``, else by its distinctive keys."""
    model_type = config.get("model_type")
    if model_type is not None:
        if not isinstance(model_type, str) or model_type not in _HF_MODEL_TYPES:
            raise ValueError(f"{origin}: HF model_type {model_type!r} is not supported; "
                             f"supported: {', '.join(_HF_MODEL_TYPES)} (or write a ModelSpec "
                             f"JSON; --model traces the configs of the model types the "
                             f"installed transformers knows)")
        return _HF_MODEL_TYPES[model_type]
    if "n_embd" in config:
        return "gpt2"
    if "ffn_dim" in config:
        return "opt"
    if "n_layer" in config or "n_embed" in config:
        return "bloom"
    if "rotary_pct" in config or "use_parallel_residual" in config:
        return "gpt_neox"
    if "num_hidden_layers" in config and "intermediate_size" in config:
        return "llama"
    raise ValueError(f"{origin}: cannot tell the HF key style of a config with keys "
                     f"{sorted(config)}; add a model_type (one of {', '.join(_HF_MODEL_TYPES)})")


def from_hf_config(config: Mapping[str, Any], *, name: str,
                   origin: str | None = None) -> ModelSpec:
    """Translate a HuggingFace ``config.json`` (as a dict) into a ``ModelSpec`` called ``name``.

    Styles: Llama/Mistral/Mixtral/Qwen2/Qwen3/Qwen3-MoE, GPT-2, GPT-NeoX, BLOOM, OPT (see
    each ``_from_*`` for what it maps and what it leaves out). Unknown keys are normal in an HF
    config and ignored; the keys read are checked (``_HF_RULES``: sizes are integers within
    ModelSpec's bounds, flags booleans, dropouts probabilities), and invalid sizes surface as
    ModelSpec's ValueError. ``origin`` (default ``HF config of 'name'``) starts every message.
    """
    origin = origin or f"HF config of {name!r}"
    if not isinstance(config, Mapping):
        raise ValueError(f"{origin} must be a mapping, got {type(config).__name__}")
    style = hf_config_style(config, origin=origin)
    fields = _HF_STYLES[style](config, origin)
    logger.debug("HF config %r read with the %s key style", name, style)
    try:
        return ModelSpec(name=name, source=f"HuggingFace config ({style} key style)", **fields)
    except ValueError as err:
        raise ValueError(f"{origin}: {err}") from err
