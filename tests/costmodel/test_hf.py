"""costmodel.hf: HuggingFace ``transformers`` models from a local config, profiled without weights.

Expected numbers are published or independently counted, never taken from the code under test:

* parameters: Llama-2-7B 6,738,415,616 and Llama-3-70B 70,553,706,496 (the released
  checkpoints, as in costmodel/data/models.json; Touvron et al. 2023 arXiv:2307.09288, Llama
  Team 2024 arXiv:2407.21783); GPT-2 124,439,808 (the released ``gpt2`` checkpoint, Radford et
  al. 2019). ``costmodel.models.from_hf_config`` (the analytic count) must agree as well;
* FLOPs: ``FlopCounterMode`` run here over a training step of the same model built directly in
  a ``FakeTensorMode`` (not through ``trace_module``); CPU flash attention, which has no
  upstream formula, is counted with upstream's formula for the CUDA flash kernel;
* per-block forward FLOPs against ``costmodel.flops`` with ``causal=False`` (the counter
  ignores causality): measured equal for both models (0.0% off), asserted within 1%.

The configs below are the published ``config.json`` files (HF hub ``openai-community/gpt2``,
``meta-llama/Llama-2-7b-hf``, ``meta-llama/Meta-Llama-3-70B``) less their tokenizer and
generation keys. Profiling uses 2 sequences of 128 tokens (70B: 1 x 128).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import flop_counter

transformers = pytest.importorskip("transformers")

from meshplan.costmodel.flops import attention_flop_per_token, layer_matmul_flop_per_token  # noqa: E402
from meshplan.costmodel.hf import hf_config, trace_hf  # noqa: E402
from meshplan.costmodel.models import from_hf_config  # noqa: E402
from meshplan.costmodel.tracing import top_level_layers  # noqa: E402

GPT2_CONFIG = {
    "model_type": "gpt2", "activation_function": "gelu_new", "attn_pdrop": 0.1,
    "embd_pdrop": 0.1, "resid_pdrop": 0.1, "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05, "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12,
    "n_positions": 1024, "vocab_size": 50257,
}
LLAMA2_7B_CONFIG = {
    "model_type": "llama", "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 11008, "max_position_embeddings": 4096, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "tie_word_embeddings": False,
    "vocab_size": 32000,
}
LLAMA3_70B_CONFIG = {
    "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0,
    "hidden_act": "silu", "hidden_size": 8192, "initializer_range": 0.02,
    "intermediate_size": 28672, "max_position_embeddings": 8192, "num_attention_heads": 64,
    "num_hidden_layers": 80, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "vocab_size": 128256,
}
PUBLISHED_PARAMS = {"gpt2": 124_439_808, "llama2-7b": 6_738_415_616,
                    "llama3-70b": 70_553_706_496}
CONFIGS = {"gpt2": GPT2_CONFIG, "llama2-7b": LLAMA2_7B_CONFIG, "llama3-70b": LLAMA3_70B_CONFIG}
BATCH, SEQ = 2, 128
MAX_RSS_GROWTH_BYTES = 2e9
"""Far below the 141 GB of Llama-3-70B's bf16 weights."""

_ATEN = torch.ops.aten
_CPU_FLASH_AS_CUDA_FLASH = {  # upstream's raw formulas (``__wrapped__``: before shape_wrapper)
    _ATEN._scaled_dot_product_flash_attention_for_cpu:
        flop_counter.flop_registry[_ATEN._scaled_dot_product_flash_attention].__wrapped__,
    _ATEN._scaled_dot_product_flash_attention_for_cpu_backward:
        flop_counter.flop_registry[_ATEN._scaled_dot_product_flash_attention_backward]
        .__wrapped__,
}


def _flop_counter_totals(config, *, micro_batch: int, seq_len: int) -> tuple[int, int]:
    """(forward, backward) FLOPs of one fake-mode training step, by FlopCounterMode alone."""
    counter = flop_counter.FlopCounterMode(display=False, custom_mapping=_CPU_FLASH_AS_CUDA_FLASH)
    with FakeTensorMode():
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="sdpa", dtype=torch.bfloat16).train()
        ids = torch.zeros((micro_batch, seq_len), dtype=torch.long)
        with counter:
            output = model(input_ids=ids, labels=ids, use_cache=False)
            fwd_flop = counter.get_total_flops()
            output.loss.backward()
        return fwd_flop, counter.get_total_flops() - fwd_flop


def _blocks(lg) -> list[str]:
    return [n for n in lg.layers if n.rpartition(".")[2].isdigit()]


@pytest.fixture(scope="module", params=["gpt2", "llama2-7b"])
def traced(request):
    name = request.param
    config = hf_config(CONFIGS[name])
    return name, config, trace_hf(config, micro_batch=BATCH, seq_len=SEQ)


def test_parameters_match_published_and_analytic_counts(traced):
    name, _, lg = traced
    nodes = lg.graph.nodes
    spec = from_hf_config(CONFIGS[name], name=name)
    assert lg.total_params == PUBLISHED_PARAMS[name] == spec.num_params
    assert sum(nodes[n]["params"] for n in lg.graph) == lg.total_params
    assert all(nodes[n]["params"] == spec.dense_layer_params for n in _blocks(lg))


def test_layers_are_the_nested_blocks_in_execution_order(traced):
    name, _, lg = traced
    if name == "gpt2":
        expected = (["transformer.wte", "transformer.wpe", "transformer.drop"]
                    + [f"transformer.h.{i}" for i in range(12)] + ["transformer.ln_f", "lm_head"])
    else:
        expected = (["model.embed_tokens", "model.rotary_emb"]
                    + [f"model.layers.{i}" for i in range(32)] + ["model.norm", "lm_head"])
    assert lg.layers == expected
    nodes = lg.graph.nodes
    assert len({nodes[n]["repeated"] for n in _blocks(lg)}) == 1
    assert nodes[_blocks(lg)[0]]["repeated"] is not None
    assert nodes["lm_head"]["repeated"] is None
    # GPT-2's head is tied to wte, which runs first and owns the weight.
    assert (nodes["lm_head"]["params"] == 0) == (name == "gpt2")


def test_flops_equal_an_independent_flop_counter_run(traced):
    _, config, lg = traced
    fwd_flop, bwd_flop = _flop_counter_totals(config, micro_batch=BATCH, seq_len=SEQ)
    nodes = lg.graph.nodes
    assert lg.total_fwd_flop == fwd_flop
    assert lg.total_bwd_flop == bwd_flop
    # Every counted FLOP happens inside a layer: nothing outside (the loss is not a matmul).
    assert sum(nodes[n]["fwd_flop"] for n in lg.graph) == fwd_flop
    assert sum(nodes[n]["bwd_flop"] for n in lg.graph) == bwd_flop


def test_block_forward_flops_match_costmodel_flops(traced):
    name, _, lg = traced
    spec = from_hf_config(CONFIGS[name], name=name)
    tokens = BATCH * SEQ
    analytic = tokens * (layer_matmul_flop_per_token(spec, 0)
                         + attention_flop_per_token(spec, seq_len=SEQ, causal=False))
    for block in _blocks(lg):
        assert lg.graph.nodes[block]["fwd_flop"] == pytest.approx(analytic, rel=0.01)
    lm_head = 2 * tokens * spec.hidden_size * spec.vocab_rows
    assert lg.graph.nodes["lm_head"]["fwd_flop"] == lm_head


def test_layer_root_descent_on_plain_modules():
    def block():
        return torch.nn.Linear(4, 4)

    class Body(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.blocks = block(), torch.nn.ModuleList([block(), block()])

    class Wrapper(torch.nn.Module):  # CausalLM-like: the blocks sit at body.blocks.N
        def __init__(self):
            super().__init__()
            self.body, self.head = Body(), block()

    class EncoderDecoder(torch.nn.Module):  # two children hold blocks: not descended into
        def __init__(self):
            super().__init__()
            self.encoder, self.decoder = Body(), Body()

    assert list(top_level_layers(Wrapper())) == ["body.embed", "body.blocks.0", "body.blocks.1",
                                                 "head"]
    assert list(top_level_layers(EncoderDecoder())) == ["encoder", "decoder"]


def test_hub_names_are_refused_not_fetched():
    with pytest.raises(ValueError, match="not a local config.json"):
        hf_config("meta-llama/Llama-2-7b-hf")
    with pytest.raises(ValueError, match="model_type"):
        hf_config({"hidden_size": 64})


def test_config_file_and_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_70B_CONFIG))
    for ref in (tmp_path, tmp_path / "config.json"):
        config = hf_config(ref)
        assert isinstance(config, transformers.LlamaConfig)
        assert config.num_key_value_heads == 8
        assert config.rope_parameters["rope_theta"] == 500000.0


_CHILD_PREAMBLE = """
import json, resource, socket, sys, time
attempts = []
def refuse(*args, **kwargs):
    attempts.append(repr(args)[:80])
    raise OSError("network disabled by test_hf")
socket.socket.connect = refuse
socket.create_connection = refuse
socket.getaddrinfo = refuse
from meshplan.costmodel.hf import hf_config, trace_hf
"""


def _run_child(body: str, tmp_path: Path) -> dict:
    """Run ``body`` in a fresh interpreter with sockets refused and an empty HF cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env["HF_HOME"] = str(tmp_path / "hf-home")
    script = _CHILD_PREAMBLE + textwrap.dedent(body)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_profiling_is_offline(tmp_path):
    report = _run_child(f"""
        lg = trace_hf(hf_config({GPT2_CONFIG!r}), micro_batch=1, seq_len=16)
        import os, huggingface_hub.constants as hub
        print(json.dumps({{"params": lg.total_params, "attempts": attempts,
                          "env": os.environ.get("HF_HUB_OFFLINE"), "hub": hub.HF_HUB_OFFLINE}}))
        """, tmp_path)
    assert report["params"] == PUBLISHED_PARAMS["gpt2"]
    assert report["attempts"] == []
    assert report["env"] == "1" and report["hub"] is True
    hf_home = tmp_path / "hf-home"
    assert not hf_home.exists() or not any(hf_home.rglob("*"))


@pytest.mark.slow
def test_llama3_70b_traces_without_weight_memory(tmp_path):
    # A fresh interpreter, so that an earlier test's peak RSS cannot hide this one's; a tiny
    # Llama is traced first so imports and one-off caches are not counted as growth.
    report = _run_child(f"""
        tiny = dict({LLAMA3_70B_CONFIG!r}, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        trace_hf(tiny, micro_batch=1, seq_len=8)
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        start = time.perf_counter()
        lg = trace_hf({LLAMA3_70B_CONFIG!r}, micro_batch=1, seq_len=128)
        elapsed_s = time.perf_counter() - start
        rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(json.dumps({{"elapsed_s": elapsed_s, "rss_growth": rss_after - rss_before,
                          "rss_peak": rss_after, "params": lg.total_params,
                          "attempts": attempts}}))
        """, tmp_path)
    print(f"llama3-70b trace: {report['elapsed_s']:.1f} s, peak RSS +"
          f"{report['rss_growth'] / 2**20:.0f} MiB over the warm-up, process peak "
          f"{report['rss_peak'] / 2**20:.0f} MiB")
    # speed is bounded by the child's timeout, not asserted: wall-clock time measures the load
    # Growth over the warm-up, and the whole process (Python, torch, transformers) as well.
    assert report["rss_growth"] < MAX_RSS_GROWTH_BYTES
    assert report["rss_peak"] < MAX_RSS_GROWTH_BYTES
    spec = from_hf_config(LLAMA3_70B_CONFIG, name="llama3-70b")
    assert report["params"] == PUBLISHED_PARAMS["llama3-70b"] == spec.num_params
    assert report["attempts"] == []


OLMO2_TINY = {"model_type": "olmo2", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 256, "max_position_embeddings": 64}
GEMMA2_TINY = {"model_type": "gemma2", "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 16, "vocab_size": 256, "max_position_embeddings": 64}


def _meta_params(config: dict) -> int:
    """Parameters transformers' own model of ``config`` holds (shared tensors once)."""
    fields = dict(config)
    hf = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("config", [OLMO2_TINY, GEMMA2_TINY], ids=["olmo2", "gemma2"])
def test_configs_the_analytic_reader_lacks_are_traced(tmp_path, config):
    """OLMo 2 and Gemma 2 have no analytic key reader: their config folder is traced as
    ``hf-config:PATH`` (Gemma 2 with eager attention: transformers gives it no SDPA path)."""
    from meshplan.costmodel.models import is_traced_ref, load_model

    folder = tmp_path / f"my-{config['model_type']}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    assert is_traced_ref(str(folder)) and is_traced_ref(str(folder / "config.json"))
    spec = load_model(str(folder), seq_len=32, dtype="fp32")
    assert spec.is_traced and spec.name == folder.name and spec.seq_len == 32
    assert spec.factory == f"hf-config:{(folder / 'config.json').resolve()}"
    assert spec.num_params == _meta_params(config)
    assert load_model(str(folder)).seq_len == 64  # no seq_len: max_position_embeddings


def test_a_traced_config_keeps_its_loss_as_trace_hf_does(tmp_path):
    """The CLI's path (``load_model`` of a config folder, ``hf-config:PATH``) traces a training
    step as ``trace_hf`` does: labels in, the model's own cross-entropy out, so its fp32
    log-softmax (tokens x vocabulary x 4 bytes) is what the loss keeps outside the layers.
    Until 2026-12-07 that path fed token ids alone and backpropagated a sum of the logits,
    which keeps nothing: Gemma 2 2B at 8,192 tokens planned 7.8 GiB light."""
    from meshplan.costmodel.models import load_model

    folder = tmp_path / "gemma2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(GEMMA2_TINY))
    spec = load_model(str(folder), seq_len=32, dtype="fp32")
    log_softmax = 32 * GEMMA2_TINY["vocab_size"] * 4
    assert spec.traced_extra_saved_bytes >= log_softmax
    graph = trace_hf(GEMMA2_TINY, micro_batch=1, seq_len=32, dtype=torch.float32)
    layers_saved = sum(graph.graph.nodes[n]["saved_bytes"] for n in graph.layers)
    assert spec.traced_extra_saved_bytes == graph.total_saved_bytes - layers_saved


QWEN3_NEXT_TINY = {"model_type": "qwen3_next", "hidden_size": 64, "intermediate_size": 128,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "head_dim": 16, "vocab_size": 256, "max_position_embeddings": 64,
                   "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                   "num_experts": 4, "num_experts_per_tok": 2, "linear_num_value_heads": 4,
                   "linear_num_key_heads": 2, "linear_key_head_dim": 16,
                   "linear_value_head_dim": 16}


def test_a_hybrid_linear_attention_config_is_traced(tmp_path):
    """Qwen3-Next mixes linear-attention and attention layers (three of the first one in four:
    two layers are both linear); a forward that builds a key/value cache of linear-attention
    layers alone fails ("get_seq_length can only be called on Attention layers"). Training
    runs without one (``use_cache=False``), and so does the trace."""
    from meshplan.costmodel.models import load_model

    folder = tmp_path / "qwen3-next"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN3_NEXT_TINY))
    spec = load_model(str(folder), seq_len=32)  # bf16: its experts' grouped matmul needs it
    assert spec.is_traced and spec.num_params == _meta_params(QWEN3_NEXT_TINY)


def test_known_and_unknown_model_types_are_not_traced(tmp_path):
    from meshplan.costmodel.models import is_traced_ref, load_model

    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(LLAMA2_7B_CONFIG))
    assert not is_traced_ref(str(tmp_path / "llama"))  # read analytically
    assert not load_model(str(tmp_path / "llama")).is_traced
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({**OLMO2_TINY,
                                                              "model_type": "no_such_model"}))
    assert not is_traced_ref(str(tmp_path / "odd"))
    with pytest.raises(ValueError, match="model_type 'no_such_model' is not supported"):
        load_model(str(tmp_path / "odd"))
