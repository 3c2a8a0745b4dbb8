"""Model catalog and loading: published parameter counts, HF key styles, ModelSpec JSON, errors.

Published numbers are hard-coded here with their source: they are facts to reproduce, not outputs
of our code.
"""

from __future__ import annotations

import dataclasses
import json
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.costmodel.model import ModelSpec
from meshplan.costmodel.models import from_hf_config, load_model, model_catalog

# Narayanan et al. 2021 (arXiv:2104.04473), Table 1 and Sec. 5.1: V = 51200, s = 2048.
NARAYANAN_VOCAB = 51200
NARAYANAN_SEQ = 2048
# (catalog name, attention heads, hidden size, layers, parameters in billions as printed)
NARAYANAN_TABLE1 = [
    ("megatron-1.7b", 24, 2304, 24, 1.7),
    ("megatron-3.6b", 32, 3072, 30, 3.6),
    ("megatron-7.5b", 32, 4096, 36, 7.5),
    ("megatron-18.4b", 48, 6144, 40, 18.4),
    ("megatron-39.1b", 64, 8192, 48, 39.1),
    ("megatron-76.1b", 80, 10240, 60, 76.1),
    ("megatron-145.6b", 96, 12288, 80, 145.6),
    ("megatron-310.1b", 128, 16384, 96, 310.1),
    ("megatron-529.6b", 128, 20480, 105, 529.6),
    ("megatron-1t", 160, 25600, 128, 1008.0),
]
# Other GPT-style models with the same V and s, (name, heads, hidden, layers):
# Korthikanti et al. 2022 (arXiv:2205.05198) Table 3; Smith et al. 2022 (arXiv:2201.11990) Sec. 3;
# Brown et al. 2020 (arXiv:2005.14165) Table 2.1 (1.3B: 16 heads of 128 since 24 x 128 != 2048;
# 13B: d_model 5120 = 40 x 128, the table's 5140 being inconsistent with its own head sizes).
OTHER_EQ2_MODELS = [
    ("megatron-22b", 64, 6144, 48),
    ("mt-nlg-530b", 128, 20480, 105),
    ("gpt3-125m", 12, 768, 12),
    ("gpt3-350m", 16, 1024, 24),
    ("gpt3-760m", 16, 1536, 24),
    ("gpt3-1.3b", 16, 2048, 24),
    ("gpt3-2.7b", 32, 2560, 32),
    ("gpt3-6.7b", 32, 4096, 32),
    ("gpt3-13b", 40, 5120, 40),
    ("gpt3-175b", 96, 12288, 96),
]

# Exact parameter counts of released checkpoints.
PUBLISHED_EXACT = {
    "llama2-7b": 6_738_415_616,  # meta-llama/Llama-2-7b-hf
    "llama2-13b": 13_015_864_320,  # meta-llama/Llama-2-13b-hf
    "llama2-70b": 68_976_648_192,  # meta-llama/Llama-2-70b-hf
    "llama3.2-1b": 1_235_814_400,  # meta-llama/Llama-3.2-1B
    "llama3-8b": 8_030_261_248,  # meta-llama/Meta-Llama-3-8B
    "llama3-70b": 70_553_706_496,  # meta-llama/Meta-Llama-3-70B
    "llama3-405b": 405_853_388_800,  # meta-llama/Llama-3.1-405B
    "mixtral-8x7b": 46_702_792_704,  # mistralai/Mixtral-8x7B-v0.1
    "bloom-176b": 176_247_271_424,  # bigscience/bloom model card (BigScience 2022)
}
MIXTRAL_ACTIVE_B = 12.9  # Jiang et al. 2024 (arXiv:2401.04088) Sec. 1: 12.9B active per token
# Brown et al. 2020 Table 2.1 model names (rounded sizes).
GPT3_NAMED = {"gpt3-125m": 125e6, "gpt3-350m": 350e6, "gpt3-760m": 760e6, "gpt3-1.3b": 1.3e9,
              "gpt3-2.7b": 2.7e9, "gpt3-6.7b": 6.7e9, "gpt3-13b": 13e9, "gpt3-175b": 175e9}
GPT3_NAME_TOLERANCE = 0.03
ROUNDED_SIZE_TOLERANCE = 0.01
NARAYANAN_HALF_PRINTED = 0.05e9  # Table 1 prints billions to one decimal


def narayanan_eq2(*, layers: int, hidden: int, vocab: int, seq: int) -> Fraction:
    """Narayanan et al. 2021 Eq. 2: P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12lh)), exactly."""
    l, h = layers, hidden
    return 12 * l * h * h * (1 + Fraction(13, 12 * h) + Fraction(vocab + seq, 12 * l * h))


# ----- catalog: published counts ---------------------------------------------------------------
@pytest.mark.parametrize("name,heads,hidden,layers,published_b", NARAYANAN_TABLE1)
def test_narayanan_table1_eq2_exact(name, heads, hidden, layers, published_b):
    spec = model_catalog()[name]
    assert (spec.num_heads, spec.hidden_size, spec.num_layers) == (heads, hidden, layers)
    eq2 = narayanan_eq2(layers=layers, hidden=hidden, vocab=NARAYANAN_VOCAB, seq=NARAYANAN_SEQ)
    assert eq2.denominator == 1
    # Eq. 2 leaves out the final LayerNorm (weight and bias, 2h).
    assert spec.num_params - 2 * hidden == eq2
    assert round(float(eq2) / 1e9, 1) == published_b
    assert spec.reported_params == pytest.approx(published_b * 1e9)


@pytest.mark.parametrize("name,heads,hidden,layers", OTHER_EQ2_MODELS)
def test_gpt_style_models_follow_eq2(name, heads, hidden, layers):
    spec = model_catalog()[name]
    assert (spec.num_heads, spec.hidden_size, spec.num_layers) == (heads, hidden, layers)
    assert (spec.vocab_rows, spec.seq_len) == (NARAYANAN_VOCAB, NARAYANAN_SEQ)
    eq2 = narayanan_eq2(layers=layers, hidden=hidden, vocab=NARAYANAN_VOCAB, seq=NARAYANAN_SEQ)
    assert spec.num_params - 2 * hidden == eq2


def test_megatron_1t_eq2_value():
    # Hand check of the largest row: 12*128*25600^2 + 13*128*25600 + (51200+2048)*25600.
    assert narayanan_eq2(layers=128, hidden=25600, vocab=51200, seq=2048) == 1_008_038_707_200
    assert model_catalog()["megatron-1t"].num_params == 1_008_038_758_400


@pytest.mark.parametrize("name,published", sorted(PUBLISHED_EXACT.items()))
def test_exact_published_counts(name, published):
    assert model_catalog()[name].num_params == published


def test_mixtral_active_params():
    spec = model_catalog()["mixtral-8x7b"]
    assert spec.active_params == 12_879_925_248
    assert round(spec.active_params / 1e9, 1) == MIXTRAL_ACTIVE_B


@pytest.mark.parametrize("name,named_size", sorted(GPT3_NAMED.items()))
def test_gpt3_counts_near_their_names(name, named_size):
    spec = model_catalog()[name]
    assert spec.num_params == pytest.approx(named_size, rel=GPT3_NAME_TOLERANCE)


def test_bloom_vocab_padding_explains_count():
    spec = model_catalog()["bloom-176b"]
    assert (spec.vocab_size, spec.vocab_rows) == (250_680, 250_880)
    unpadded = dataclasses.replace(spec, padded_vocab_size=None)
    assert spec.num_params - unpadded.num_params == 200 * 14336


def test_every_entry_has_source_and_matches_reported():
    catalog = model_catalog()
    assert len(catalog) == 30
    for name, spec in catalog.items():
        assert spec.name == name
        assert spec.source.strip(), name
        assert spec.reported_params and spec.reported_params > 0, name
        if name in {row[0] for row in NARAYANAN_TABLE1}:  # printed to 0.1B: within half of that
            assert abs(spec.num_params - spec.reported_params) < NARAYANAN_HALF_PRINTED, name
            continue
        tolerance = GPT3_NAME_TOLERANCE if name.startswith("gpt3-") else ROUNDED_SIZE_TOLERANCE
        assert spec.num_params == pytest.approx(spec.reported_params, rel=tolerance), name


def test_family_conventions():
    catalog = model_catalog()
    for name, spec in catalog.items():
        if name.startswith(("llama", "mixtral")) or name == "tiny":
            assert (spec.activation, spec.norm, spec.position_embedding) == \
                ("swiglu", "rmsnorm", "rope"), name
            assert not spec.linear_bias and not spec.dropout, name
            # the small Llama 3.2 models tie the LM head to the embedding; the others do not
            assert spec.tied_embeddings == (name == "llama3.2-1b"), name
        elif name.startswith(("gpt3", "megatron", "mt-nlg")):
            assert (spec.activation, spec.norm, spec.position_embedding) == \
                ("gelu", "layernorm", "learned"), name
            assert spec.linear_bias and spec.tied_embeddings and spec.dropout, name
            assert spec.ffn_hidden_size == 4 * spec.hidden_size, name


def test_tiny_model():
    spec = load_model("tiny")
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.kv_heads) == (4, 64, 4, 2)
    assert (spec.vocab_size, spec.seq_len) == (256, 64)
    # 4 x (64*64*2 + 64*32*2 + 3*64*176 + 2*64) + 2*256*64 + 64
    assert spec.num_params == 217_664


def test_catalog_returns_a_fresh_dict():
    catalog = model_catalog()
    catalog.pop("tiny")
    assert "tiny" in model_catalog()


# ----- load_model ------------------------------------------------------------------------------
def test_load_by_name_and_seq_len_override():
    assert load_model("llama2-7b") == model_catalog()["llama2-7b"]
    assert load_model("Llama2-7B") == model_catalog()["llama2-7b"]
    spec = load_model("llama2-7b", seq_len=8192)
    assert spec.seq_len == 8192 and spec.num_params == 6_738_415_616  # rope: no table


def test_seq_len_override_resizes_learned_positions():
    base = load_model("gpt3-125m")
    longer = load_model("gpt3-125m", seq_len=4096)
    assert longer.num_params - base.num_params == (4096 - 2048) * 768


@pytest.mark.parametrize("name", sorted(model_catalog()))
def test_modelspec_json_round_trip(tmp_path, name):
    spec = model_catalog()[name]
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(spec.to_dict(), indent=2))
    assert load_model(str(path)) == spec


def test_modelspec_json_name_defaults_to_file_stem(tmp_path):
    fields = model_catalog()["tiny"].to_dict()
    del fields["name"]
    path = tmp_path / "my-model.json"
    path.write_text(json.dumps(fields))
    assert load_model(str(path)).name == "my-model"


# ----- HuggingFace configs ---------------------------------------------------------------------
LLAMA2_7B_HF = {  # meta-llama/Llama-2-7b-hf config.json (the size keys)
    "_name_or_path": "meta-llama/Llama-2-7b-hf", "architectures": ["LlamaForCausalLM"],
    "model_type": "llama", "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 11008, "max_position_embeddings": 4096, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False, "vocab_size": 32000,
}
LLAMA3_8B_HF = {  # meta-llama/Meta-Llama-3-8B config.json, with head_dim as newer exports write it
    "model_type": "llama", "hidden_act": "silu", "hidden_size": 4096, "head_dim": 128,
    "intermediate_size": 14336, "max_position_embeddings": 8192, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "tie_word_embeddings": False,
    "vocab_size": 128256,
}
MIXTRAL_HF = {  # mistralai/Mixtral-8x7B-v0.1 config.json
    "model_type": "mixtral", "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
    "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "num_local_experts": 8, "tie_word_embeddings": False, "vocab_size": 32000,
}
GPT2_SMALL_HF = {  # openai-community/gpt2 config.json
    "model_type": "gpt2", "activation_function": "gelu_new", "n_ctx": 1024, "n_embd": 768,
    "n_head": 12, "n_inner": None, "n_layer": 12, "n_positions": 1024, "vocab_size": 50257,
}
PYTHIA_160M_HF = {  # EleutherAI/pythia-160m config.json
    "model_type": "gpt_neox", "hidden_act": "gelu", "hidden_size": 768,
    "intermediate_size": 3072, "max_position_embeddings": 2048, "num_attention_heads": 12,
    "num_hidden_layers": 12, "rotary_pct": 0.25, "tie_word_embeddings": False,
    "use_parallel_residual": True, "vocab_size": 50304,
}
BLOOM_560M_HF = {  # bigscience/bloom-560m config.json
    "model_type": "bloom", "hidden_size": 1024, "n_head": 16, "n_layer": 24,
    "vocab_size": 250880, "hidden_dropout": 0.0, "attention_dropout": 0.0,
}
BLOOM_176B_HF = {  # bigscience/bloom config.json (n_embed and num_attention_heads spellings)
    "model_type": "bloom", "n_embed": 14336, "num_attention_heads": 112, "n_layer": 70,
    "vocab_size": 250880,
}
OPT_125M_HF = {  # facebook/opt-125m config.json
    "model_type": "opt", "activation_function": "relu", "do_layer_norm_before": True,
    "ffn_dim": 3072, "hidden_size": 768, "max_position_embeddings": 2048,
    "num_attention_heads": 12, "num_hidden_layers": 12, "vocab_size": 50272,
    "word_embed_proj_dim": 768, "dropout": 0.1,
}

# Published totals of the released checkpoints.
GPT2_SMALL_PARAMS = 124_439_808  # openai-community/gpt2 (Radford et al. 2019 "117M" model)
PYTHIA_160M_PARAMS = 162_322_944  # Biderman et al. 2023 (arXiv:2304.01373); pythia model card
PYTHIA_160M_NON_EMBEDDING = 85_056_000  # same source, "non-embedding params" (Table 1)
BLOOM_560M_PARAMS = 559_214_592  # bigscience/bloom-560m model card
OPT_125M_PARAMS = 125_239_296  # facebook/opt-125m checkpoint (Zhang et al. 2022, arXiv:2205.01068)


def _same_architecture(loaded: ModelSpec, catalog_name: str, **overrides) -> None:
    expected = dataclasses.replace(model_catalog()[catalog_name], name=loaded.name,
                                   source=loaded.source, reported_params=None,
                                   hf_model_type=loaded.hf_model_type, **overrides)
    assert loaded == expected


def test_hf_llama2_7b():
    spec = from_hf_config(LLAMA2_7B_HF, name="Llama-2-7b-hf")
    assert spec.num_params == 6_738_415_616
    _same_architecture(spec, "llama2-7b", num_kv_heads=32)


def test_hf_llama3_8b_head_dim_key():
    spec = from_hf_config(LLAMA3_8B_HF, name="llama3")
    assert spec.head_dim is None and spec.head_size == 128
    assert spec.num_params == 8_030_261_248
    _same_architecture(spec, "llama3-8b")


def test_hf_explicit_head_dim_is_kept():
    config = dict(LLAMA2_7B_HF, hidden_size=5120, head_dim=128, num_key_value_heads=8)
    spec = from_hf_config(config, name="nemo-like")  # 32 heads x 128 != 5120 (Mistral-Nemo)
    assert spec.head_dim == 128 and spec.q_size == 4096


def test_hf_mixtral():
    spec = from_hf_config(MIXTRAL_HF, name="mixtral")
    assert (spec.num_experts, spec.moe_top_k) == (8, 2)
    assert spec.num_params == 46_702_792_704
    _same_architecture(spec, "mixtral-8x7b", seq_len=32768)


def test_hf_gpt2_small():
    spec = from_hf_config(GPT2_SMALL_HF, name="gpt2")
    assert spec.num_params == GPT2_SMALL_PARAMS
    assert (spec.ffn_hidden_size, spec.seq_len, spec.position_embedding) == (3072, 1024, "learned")
    assert spec.tied_embeddings and spec.linear_bias and spec.dropout


def test_hf_gpt_neox_pythia():
    spec = from_hf_config(PYTHIA_160M_HF, name="pythia-160m")
    assert spec.num_params == PYTHIA_160M_PARAMS
    assert spec.num_params - 2 * 50304 * 768 == PYTHIA_160M_NON_EMBEDDING
    assert not spec.tied_embeddings and spec.position_embedding == "rope"


def test_hf_bloom():
    assert from_hf_config(BLOOM_560M_HF, name="bloom-560m").num_params == BLOOM_560M_PARAMS
    spec = from_hf_config(BLOOM_176B_HF, name="bloom")
    assert spec.num_params == 176_247_271_424
    assert spec.seq_len == 2048 and spec.position_embedding == "alibi" and spec.embedding_norm
    with_seq = from_hf_config(dict(BLOOM_560M_HF, seq_length=4096), name="bloom-560m")
    assert with_seq.seq_len == 4096


def test_hf_opt_125m_misses_only_the_two_offset_position_rows():
    spec = from_hf_config(OPT_125M_HF, name="opt-125m")
    assert spec.num_params + 2 * 768 == OPT_125M_PARAMS
    assert spec.tied_embeddings and spec.dropout


def test_hf_opt_projected_embeddings_rejected():
    config = dict(OPT_125M_HF, hidden_size=1024, word_embed_proj_dim=512)
    with pytest.raises(ValueError, match="word_embed_proj_dim 512 != hidden_size 1024"):
        from_hf_config(config, name="opt-350m")


@pytest.mark.parametrize("config", [GPT2_SMALL_HF, BLOOM_560M_HF, OPT_125M_HF, PYTHIA_160M_HF,
                                    LLAMA2_7B_HF], ids=lambda c: c["model_type"])
def test_hf_style_detected_without_model_type(config):
    untyped = {k: v for k, v in config.items() if k != "model_type"}
    typed = from_hf_config(config, name="m")
    assert from_hf_config(untyped, name="m") == dataclasses.replace(typed, hf_model_type="")


def test_hf_config_file_and_folder(tmp_path):
    folder = tmp_path / "Llama-2-7b-hf"
    folder.mkdir()
    config = {k: v for k, v in LLAMA2_7B_HF.items() if k != "_name_or_path"}
    (folder / "config.json").write_text(json.dumps(config))
    from_file = load_model(str(folder / "config.json"))
    assert from_file.name == "Llama-2-7b-hf" and from_file.num_params == 6_738_415_616
    assert load_model(folder) == from_file
    assert str(folder / "config.json") in from_file.source
    assert load_model(str(folder), seq_len=2048).seq_len == 2048


def test_hf_name_from_name_or_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GPT2_SMALL_HF | {"_name_or_path": "openai-community/gpt2"}))
    assert load_model(str(path)).name == "gpt2"


@settings(max_examples=50, deadline=None)
@given(layers=st.integers(1, 8), kv_heads=st.sampled_from([1, 2, 4]), group=st.integers(1, 4),
       head=st.sampled_from([16, 32, 64]), ffn=st.integers(1, 512), vocab=st.integers(1, 5000),
       tied=st.booleans())
def test_hf_llama_count_law(layers, kv_heads, group, head, ffn, vocab, tied):
    """Llama-style count: l (2hq + 2h kv + 3hf + 2h) + (1 or 2) V h + h, with q = h here."""
    heads = kv_heads * group
    hidden = heads * head
    config = {"model_type": "llama", "num_hidden_layers": layers, "hidden_size": hidden,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "intermediate_size": ffn, "vocab_size": vocab, "max_position_embeddings": 128,
              "tie_word_embeddings": tied}
    kv = kv_heads * head
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * ffn + 2 * hidden
    expected = layers * per_layer + (1 if tied else 2) * vocab * hidden + hidden
    assert from_hf_config(config, name="law").num_params == expected


# ----- errors ----------------------------------------------------------------------------------
def test_unknown_name_lists_close_matches():
    with pytest.raises(ValueError, match="unknown model 'llama-7b'") as info:
        load_model("llama-7b")
    message = str(info.value)
    assert "llama2-7b" in message and "path" in message and "JSON" in message


def test_unknown_name_without_close_match_lists_catalog():
    with pytest.raises(ValueError, match="catalog names: tiny, gpt3-125m"):
        load_model("zzzzqqq")


def test_missing_file_that_looks_like_a_path(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(str(tmp_path / "nope.json"))
    with pytest.raises(ValueError, match="does not exist"):
        load_model("models/llama.json")


def test_directory_without_config_json(tmp_path):
    with pytest.raises(ValueError, match="model directory .* has no config.json"):
        load_model(str(tmp_path))


def _tiny_fields(**changes) -> dict:
    return model_catalog()["tiny"].to_dict() | changes


def test_unknown_key_in_modelspec_json(tmp_path):
    path = tmp_path / "typo.json"
    path.write_text(json.dumps(_tiny_fields(hiden_size=64)))
    with pytest.raises(ValueError, match=r"unknown ModelSpec key\(s\) \['hiden_size'\]") as info:
        load_model(str(path))
    assert "accepted keys: name, num_layers, hidden_size" in str(info.value)
    assert "typo.json" in str(info.value)


def test_missing_key_in_modelspec_json(tmp_path):
    fields = _tiny_fields()
    del fields["ffn_hidden_size"], fields["vocab_size"]
    path = tmp_path / "short.json"
    path.write_text(json.dumps(fields))
    with pytest.raises(ValueError, match=r"missing required ModelSpec key\(s\) "
                                         r"\['ffn_hidden_size', 'vocab_size'\]"):
        load_model(str(path))


def test_malformed_json_names_file_and_position(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{\n  "num_layers": 4,\n  "hidden_size": ,\n}\n')
    with pytest.raises(ValueError, match=r"broken\.json: not valid JSON: .* line 3 column 18"):
        load_model(str(path))


def test_json_must_be_an_object(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object, got list"):
        load_model(str(path))


@pytest.mark.parametrize("field,value", [("num_layers", 0), ("hidden_size", -64),
                                         ("vocab_size", 0), ("ffn_hidden_size", -1),
                                         ("hidden_size", 64.0)])
def test_nonpositive_sizes_in_modelspec_json(tmp_path, field, value):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_tiny_fields(**{field: value})))
    with pytest.raises(ValueError, match=f"bad.json.*{field} must be a positive integer"):
        load_model(str(path))


def test_wrong_bool_type_in_modelspec_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_tiny_fields(linear_bias="no")))
    with pytest.raises(ValueError, match="'linear_bias': 'no'.* must be true or false"):
        load_model(str(path))


@pytest.mark.parametrize("key,value,message", [
    ("num_hidden_layers", 0, "num_layers must be a positive integer, got 0"),
    ("hidden_size", -4096, "hidden_size must be a positive integer, got -4096"),
    ("intermediate_size", 0, "ffn_hidden_size must be a positive integer, got 0"),
    ("num_key_value_heads", 5, "num_heads 32 must be a multiple of num_kv_heads 5"),
    ("num_attention_heads", 7, "hidden_size 4096 is not divisible by num_heads 7"),
])
def test_invalid_hf_values(key, value, message):
    with pytest.raises(ValueError, match=message):
        from_hf_config(dict(LLAMA2_7B_HF, **{key: value}), name="bad")


def test_heads_not_multiple_of_kv_heads_in_modelspec_json(tmp_path):
    path = tmp_path / "gqa.json"
    path.write_text(json.dumps(_tiny_fields(num_kv_heads=3)))
    with pytest.raises(ValueError, match="num_heads 4 must be a multiple of num_kv_heads 3"):
        load_model(str(path))


def test_hf_missing_key_and_unsupported_type():
    config = {k: v for k, v in LLAMA2_7B_HF.items() if k != "intermediate_size"}
    with pytest.raises(ValueError, match=r"none of the keys \['intermediate_size'\]"):
        from_hf_config(config, name="x")
    with pytest.raises(ValueError, match="model_type 'gemma' is not supported; supported: llama"):
        from_hf_config(dict(LLAMA2_7B_HF, model_type="gemma"), name="x")
    with pytest.raises(ValueError, match="attention_bias/mlp_bias"):
        from_hf_config(dict(LLAMA2_7B_HF, attention_bias=True), name="x")


def test_seq_len_override_validated():
    with pytest.raises(ValueError, match="seq_len must be a positive integer, got 0"):
        load_model("tiny", seq_len=0)


def test_count_bounds_hold_for_python_callers_too():
    """The JSON readers' upper bounds are ModelSpec's own: a flag or a caller cannot pass them."""
    with pytest.raises(ValueError) as info:
        load_model("tiny", seq_len=2**24 + 1)
    assert str(info.value) == "seq_len must be at most 16777216 (MAX_SEQ_LEN), got 16777217"
    with pytest.raises(ValueError) as info:
        dataclasses.replace(model_catalog()["tiny"], num_layers=10**30)
    assert str(info.value) == f"num_layers must be at most 4096 (MAX_LAYERS), got {10**30}"


def test_hf_values_read_are_type_checked():
    with pytest.raises(ValueError) as info:
        from_hf_config(dict(LLAMA2_7B_HF, num_hidden_layers=10**30), name="x")
    assert str(info.value) == (f"HF config of 'x': 'num_hidden_layers': {10**30} is not "
                               f"accepted; num_hidden_layers must be an integer up to 4096 "
                               f"(MAX_LAYERS)")
    with pytest.raises(ValueError) as info:
        from_hf_config(dict(LLAMA2_7B_HF, tie_word_embeddings="false"), name="x")
    assert str(info.value) == ("HF config of 'x': 'tie_word_embeddings': 'false' is not "
                               "accepted; tie_word_embeddings must be true or false")
