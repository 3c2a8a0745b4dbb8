"""Qwen3 and Qwen3-MoE from their HuggingFace configs: per-head query and key norms
(``ModelSpec.qk_norm``), Qwen3-MoE's expert keys, and what each part of meshplan does with them
(cost model, exports, runtime refusal)."""

from __future__ import annotations

import dataclasses

import pytest

from meshplan.costmodel import ParallelConfig, estimate, load_cluster, load_model
from meshplan.costmodel.activations import FP32_BYTES, layer_activation_bytes, qk_norm_bytes
from meshplan.costmodel.models import from_hf_config

QWEN3_8B_HF = {  # Qwen/Qwen3-8B config.json (shapes as torchtitan 0.2.2's qwen3 "8B" flavour)
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
    "intermediate_size": 12288, "num_attention_heads": 32, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
    "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
    "sliding_window": None, "max_window_layers": 36,
}
QWEN3_30B_A3B_HF = {  # Qwen/Qwen3-30B-A3B config.json (torchtitan's "30B-A3B" flavour)
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_attention_heads": 32,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "norm_topk_prob": True, "vocab_size": 151936, "max_position_embeddings": 40960,
    "rope_theta": 1000000, "tie_word_embeddings": False,
}


def test_qwen3_8b_counts_its_query_and_key_norms():
    spec = from_hf_config(QWEN3_8B_HF, name="qwen3-8b")
    assert spec.qk_norm and not spec.qkv_bias and spec.head_size == 128
    # by hand: embedding and head 2 x 151936 x 4096; per layer q/o 2 x 4096^2, k/v
    # 2 x 4096 x 1024, MLP 3 x 4096 x 12288, two norms 2 x 4096, q/k norms 2 x 128; final norm
    per_layer = 2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128
    assert spec.num_params == 2 * 151936 * 4096 + 36 * per_layer + 4096 == 8_190_735_360
    assert spec.qk_norm_params == 256


def test_qwen3_moe_keys():
    spec = from_hf_config(QWEN3_30B_A3B_HF, name="qwen3-30b-a3b")
    assert (spec.num_experts, spec.moe_top_k, spec.moe_ffn_hidden_size,
            spec.moe_layer_freq) == (128, 8, 768, 1)
    assert spec.qk_norm and spec.num_moe_layers == 48
    # by hand: attention 2 x 2048 x 4096 + 2 x 2048 x 512, router 2048 x 128, experts
    # 128 x 3 x 2048 x 768, norms 2 x 2048 + 2 x 128; embedding and head 2 x 151936 x 2048
    per_layer = (2 * 2048 * 4096 + 2 * 2048 * 512 + 2048 * 128 + 128 * 3 * 2048 * 768
                 + 2 * 2048 + 2 * 128)
    assert spec.num_params == 48 * per_layer + 2 * 151936 * 2048 + 2048 == 30_532_122_624
    assert spec.active_params == spec.num_params - 48 * 120 * 3 * 2048 * 768
    # transformers 5 writes the expert count as num_local_experts
    renamed = {k: v for k, v in QWEN3_30B_A3B_HF.items() if k != "num_experts"}
    assert from_hf_config(dict(renamed, num_local_experts=128), name="x") == dataclasses.replace(
        spec, name="x")
    every_other = from_hf_config(dict(QWEN3_30B_A3B_HF, decoder_sparse_step=2), name="x")
    assert every_other.moe_layer_freq == 2 and every_other.num_moe_layers == 24


@pytest.mark.parametrize("change,message", [
    ({"mlp_only_layers": [0, 47]}, "mlp_only_layers"),
    ({"use_sliding_window": True}, "qwen3_moe with use_sliding_window"),
])
def test_qwen3_moe_refuses_what_a_model_spec_cannot_hold(change, message):
    with pytest.raises(ValueError, match=message):
        from_hf_config(dict(QWEN3_30B_A3B_HF, **change), name="x")


@pytest.mark.parametrize("config", [QWEN3_8B_HF, QWEN3_30B_A3B_HF], ids=["8b", "30b-a3b"])
def test_parameters_are_what_transformers_builds(config):
    """The count against transformers' own Qwen3 / Qwen3-MoE module, built on the meta device
    from a copy of the config with fewer layers (the per-layer count is what is checked)."""
    transformers = pytest.importorskip("transformers")
    import torch

    small = dict(config, num_hidden_layers=2)
    fields = {k: v for k, v in small.items() if k not in ("model_type", "architectures")}
    hf_config = transformers.AutoConfig.for_model(small["model_type"], **fields)
    with torch.device("meta"):
        module = transformers.AutoModelForCausalLM.from_config(hf_config)
    built = sum(p.numel() for p in module.parameters())
    assert from_hf_config(small, name="x").num_params == built


def test_query_and_key_norms_keep_their_inputs_and_statistics():
    spec = from_hf_config(QWEN3_8B_HF, name="qwen3-8b")
    plain = dataclasses.replace(spec, qk_norm=False)
    config = ParallelConfig(tp=2, micro_batch_size=2, global_batch_size=2, seq_len=1024)
    tokens = 2 * 1024
    # q (4096) and k (1024) in bf16, one fp32 statistic per head and token (32 + 8), over tp 2
    expected = tokens * (2 * (4096 + 1024) + FP32_BYTES * (32 + 8)) / 2
    assert qk_norm_bytes(spec, config) == expected
    for mode in ("none", "selective"):
        assert (layer_activation_bytes(spec, config, recompute=mode)
                - layer_activation_bytes(plain, config, recompute=mode)) == expected
    assert layer_activation_bytes(spec, config, recompute="full") == \
        layer_activation_bytes(plain, config, recompute="full")
    assert qk_norm_bytes(plain, config) == 0


def test_estimate_of_a_qwen3_config_folder(tmp_path):
    import json

    folder = tmp_path / "Qwen3-8B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN3_8B_HF))
    model = load_model(str(folder))
    assert model.qk_norm and model.hf_model_type == "qwen3"
    cluster = load_cluster("dgx-h100", nodes=1)
    config = ParallelConfig(dp=8, zero_stage=1, micro_batch_size=1, global_batch_size=16,
                            seq_len=4096, recompute="selective")
    with_norms = estimate(model, cluster, config, framework="megatron")
    without = estimate(dataclasses.replace(model, qk_norm=False), cluster, config,
                       framework="megatron")
    gained = with_norms.memory.peak_bytes - without.memory.peak_bytes
    # the 36 layers' norm inputs and statistics, and their 36 x 256 weights' states
    assert 36 * qk_norm_bytes(model, config) < gained < 36 * qk_norm_bytes(model, config) + 1e6


def test_runtime_runs_qwen3_and_refuses_query_and_key_norms_elsewhere():
    """The runtime's decoder has Qwen3's norms (tests/runtime/test_hf.py checks it against
    transformers); a model with them is Qwen3 on the HF side, and Qwen3 without them, or
    with Q/K/V biases, or LayerNorm ones, has no HF equivalent."""
    from meshplan.runtime.hf import check_mappable
    from meshplan.runtime.mesh import UnsupportedPlan, check_supported

    spec = from_hf_config(QWEN3_8B_HF, name="qwen3-8b")
    check_supported(ParallelConfig(global_batch_size=1, seq_len=128), spec)
    assert check_mappable(spec, what="--init-from") == "qwen3"
    assert check_mappable(dataclasses.replace(spec, hf_model_type=""), what="x") == "qwen3"
    with pytest.raises(ValueError, match="query and key norms \\(qk_norm\\) outside Qwen3"):
        check_mappable(dataclasses.replace(spec, hf_model_type="llama"), what="--init-from")
    with pytest.raises(ValueError, match="Qwen3 without its query and key norms"):
        check_mappable(dataclasses.replace(spec, qk_norm=False), what="--save-hf")
    with pytest.raises(ValueError, match="with Q/K/V biases"):
        check_mappable(dataclasses.replace(spec, qkv_bias=True), what="--save-hf")
    with pytest.raises(UnsupportedPlan, match="RMSNorms in the runtime"):
        check_supported(ParallelConfig(global_batch_size=1, seq_len=128),
                        dataclasses.replace(spec, norm="layernorm"))
