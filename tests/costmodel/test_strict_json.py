"""Strict JSON inputs: every document a user gives meshplan is read by one loader
(``costmodel.jsonio``) and a bad one is a user error (exit 2) with one line naming the file, the
key and what would be accepted.

One test per case per document kind (ModelSpec JSON, HF ``config.json``, cluster JSON with its
GPU object, calibration, plan file), each through the command line. The expected lines are
written out here: they are the contract (key names, bounds such as MAX_LAYERS = 4096), not
copied from the code. Absurd counts must fail at once rather than send the planner into a
search that never ends, hence the timeouts.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest

from meshplan.costmodel.jsonio import (POSITIVE, Schema, check_object, count,
                                       load_json_document, parse_json_document, schema_of)
from meshplan.testing import run_cli, usage_error

TINY = {"num_layers": 4, "hidden_size": 64, "num_heads": 4, "ffn_hidden_size": 176,
        "vocab_size": 256, "seq_len": 64}
"""A ModelSpec JSON with only the required sizes (the name comes from the file)."""
LLAMA_HF = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 176,
            "vocab_size": 256, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
            "torch_dtype": "float32"}
"""A HuggingFace Llama config.json (``rms_norm_eps`` and ``torch_dtype`` are keys meshplan
does not read: unknown keys are normal in HF configs)."""
CLUSTER = {"gpu": "cpu", "gpus_per_node": 2, "nvlink_latency_s": 2e-5, "nics_per_node": 1,
           "nic_bytes_per_s": 1e9, "nic_latency_s": 5e-5}
"""A cluster JSON with only the required keys."""
GPU = {"name": "Test GPU", "peak_flop_per_s": {"bf16": 1e15}, "hbm_bytes": 80 * 2**30,
       "hbm_bytes_per_s": 3e12, "nvlink_bytes_per_s": 4.5e11}
"""A GPU object for a cluster's ``gpu``."""
ABSURD = 10**30
MAX_LAYERS = 4096
MAX_NODES = 65536


def write(path: Path, document: Any) -> Path:
    """``document`` as JSON in ``path``; a string is written as it is (for NaN, Infinity)."""
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    return path


def edited(base: dict, **changes: Any) -> dict:
    return {**copy.deepcopy(base), **changes}


def without(base: dict, key: str) -> dict:
    return {k: v for k, v in copy.deepcopy(base).items() if k != key}


def estimate_args(*, model: Any = "tiny", cluster: Any = "cpu", calibration: Any = None) -> list:
    args = ["estimate", "--model", model, "--cluster", cluster, "--global-batch", "2"]
    return args + (["--calibration", calibration] if calibration else [])


# ----- ModelSpec JSON ----------------------------------------------------------------------------
MODEL_CASES = {
    "unknown-key": (edited(TINY, wings=2),
                    "unknown ModelSpec key(s) ['wings']; accepted keys: name, num_layers, "
                    "hidden_size, num_heads, ffn_hidden_size, vocab_size, seq_len, num_kv_heads, "
                    "head_dim, padded_vocab_size, activation, norm, position_embedding, "
                    "linear_bias, qkv_bias, qk_norm, tied_embeddings, embedding_norm, dropout, "
                    "num_experts, moe_top_k, moe_ffn_hidden_size, moe_layer_freq, "
                    "rope_theta, norm_eps, rope_scaling, rope_factor, rope_low_freq_factor, "
                    "rope_high_freq_factor, rope_original_max_len, sliding_window, hf_model_type, "
                    "reported_params, source, traced, traced_dtype_bytes, "
                    "traced_extra_saved_bytes, factory, traced_chain"),
    "missing-key": (without(TINY, "vocab_size"),
                    "missing required ModelSpec key(s) ['vocab_size']; required: name, "
                    "num_layers, hidden_size, num_heads, ffn_hidden_size, vocab_size, seq_len"),
    "string-for-int": (edited(TINY, num_layers="4"),
                       "'num_layers': '4' is not accepted; num_layers must be a positive "
                       "integer up to 4096 (MAX_LAYERS)"),
    "float-for-int": (edited(TINY, hidden_size=64.5),
                      "'hidden_size': 64.5 is not accepted; hidden_size must be a positive "
                      "integer up to 1048576 (MAX_HIDDEN_SIZE)"),
    "bool-for-int": (edited(TINY, num_heads=True),
                     "'num_heads': true is not accepted; num_heads must be a positive integer "
                     "up to 16384 (MAX_HEADS)"),
    "int-for-bool": (edited(TINY, linear_bias=1),
                     "'linear_bias': 1 is not accepted; linear_bias must be true or false"),
    "unknown-choice": (edited(TINY, activation="relu"),
                       "'activation': 'relu' is not accepted; activation must be one of "
                       "\"gelu\", \"swiglu\""),
    "nan": (json.dumps(TINY).replace('"hidden_size": 64', '"hidden_size": NaN'),
            "'hidden_size': NaN is not accepted; hidden_size must be a finite number (JSON "
            "has no NaN or Infinity)"),
    "infinity": (json.dumps(TINY).replace('"seq_len": 64', '"seq_len": Infinity'),
                 "'seq_len': Infinity is not accepted; seq_len must be a finite number (JSON "
                 "has no NaN or Infinity)"),
    "overflow": (json.dumps(TINY).replace('"seq_len": 64', '"seq_len": 1e400'),
                 "'seq_len': 1e400 is not accepted; seq_len must be a finite number (it is "
                 "beyond the largest float)"),
    "zero": (edited(TINY, vocab_size=0),
             "'vocab_size': 0 is not accepted; vocab_size must be a positive integer up to "
             "16777216 (MAX_VOCAB_SIZE)"),
    "negative": (edited(TINY, ffn_hidden_size=-176),
                 "'ffn_hidden_size': -176 is not accepted; ffn_hidden_size must be a positive "
                 "integer up to 4194304 (MAX_FFN_HIDDEN_SIZE)"),
    "duplicate-key": ('{"num_layers": 4, "num_layers": 5}',
                      "the key 'num_layers' appears twice in one JSON object; give each key "
                      "once"),
    "traced-entry": (edited(TINY, traced=[{"name": "layers.0"}]),
                     "traced layer 0: missing required TracedLayer key(s) ['kind', 'params', "
                     "'fwd_flop', 'bwd_flop', 'saved_bytes', 'output_bytes']; required: name, "
                     "kind, params, fwd_flop, bwd_flop, saved_bytes, output_bytes"),
}


def test_a_valid_model_file_is_read(tmp_path):
    path = write(tmp_path / "mine.json", TINY)
    assert run_cli(*estimate_args(model=path), "--json").json()["model"]["name"] == "mine"


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_bad_model_file(tmp_path, case):
    document, message = MODEL_CASES[case]
    path = write(tmp_path / "model.json", document)
    assert usage_error(*estimate_args(model=path)) == f"meshplan: error: {path}: {message}"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("layers, shown", [(1e30, "1e+30"), (ABSURD, str(ABSURD)),
                                           (MAX_LAYERS + 1, str(MAX_LAYERS + 1))],
                         ids=["1e30", "10**30", "bound+1"])
def test_absurd_layer_count_fails_fast(tmp_path, layers, shown):
    path = write(tmp_path / "deep.json", edited(TINY, num_layers=layers))
    line = usage_error("plan", "--model", path, "--cluster", "cpu", "--global-batch", "8")
    assert line == (f"meshplan: error: {path}: 'num_layers': {shown} is not accepted; "
                    f"num_layers must be a positive integer up to 4096 (MAX_LAYERS)")


def test_the_layer_bound_itself_is_accepted(tmp_path):
    path = write(tmp_path / "deep.json", edited(TINY, num_layers=MAX_LAYERS))
    data = run_cli("models", "--model", path, "--json").json()
    assert data["num_layers"] == MAX_LAYERS


# ----- HuggingFace config.json -------------------------------------------------------------------
HF_CASES = {
    "missing-key": (without(LLAMA_HF, "intermediate_size"),
                    "none of the keys ['intermediate_size'] is set (model_type 'llama'); one "
                    "of them is required"),
    "string-for-int": (edited(LLAMA_HF, num_hidden_layers="4"),
                       "'num_hidden_layers': '4' is not accepted; num_hidden_layers must be an "
                       "integer up to 4096 (MAX_LAYERS)"),
    "float-for-int": (edited(LLAMA_HF, hidden_size=64.0),
                      "'hidden_size': 64.0 is not accepted; hidden_size must be an integer up "
                      "to 1048576 (MAX_HIDDEN_SIZE)"),
    "string-for-bool": (edited(LLAMA_HF, tie_word_embeddings="false"),
                        "'tie_word_embeddings': 'false' is not accepted; tie_word_embeddings "
                        "must be true or false"),
    "dropout-above-one": (edited(LLAMA_HF, attention_dropout=2),
                          "'attention_dropout': 2 is not accepted; attention_dropout must be a "
                          "number in [0, 1]"),
    "zero": (edited(LLAMA_HF, num_attention_heads=0),
             "num_heads must be a positive integer, got 0"),
    "negative": (edited(LLAMA_HF, max_position_embeddings=-64),
                 "seq_len must be a positive integer, got -64"),
    "absurd": (edited(LLAMA_HF, num_hidden_layers=ABSURD),
               f"'num_hidden_layers': {ABSURD} is not accepted; num_hidden_layers must be an "
               f"integer up to 4096 (MAX_LAYERS)"),
    "model-type-not-a-string": (edited(LLAMA_HF, model_type=["llama"]),
                                "HF model_type ['llama'] is not supported; supported: llama, "
                                "mistral, mixtral, qwen2, qwen3, qwen3_moe, gpt2, gpt_neox, "
                                "bloom, opt (or write a ModelSpec JSON; --model traces the "
                                "configs of the model types the installed transformers "
                                "knows)"),
}


def test_a_valid_hf_config_with_unknown_keys_is_read(tmp_path):
    path = write(tmp_path / "config.json", LLAMA_HF)
    data = run_cli(*estimate_args(model=path), "--json").json()
    # by hand: 4 layers x (attention 4 x 64^2 with K, V at 2 of 4 heads = 12,288; SwiGLU
    # 3 x 64 x 176 = 33,792; two RMSNorms 128) + embedding and untied head 2 x 256 x 64 + norm 64
    assert data["model"]["num_params"] == 4 * (12288 + 33792 + 128) + 2 * 256 * 64 + 64


@pytest.mark.parametrize("case", list(HF_CASES))
def test_bad_hf_config(tmp_path, case):
    document, message = HF_CASES[case]
    path = write(tmp_path / "config.json", document)
    assert usage_error(*estimate_args(model=path)) == \
        f"meshplan: error: {path} (read as a HuggingFace config): {message}"


@pytest.mark.parametrize("text, message", [
    ('"vocab_size": NaN', "'vocab_size': NaN is not accepted; vocab_size must be a finite number "
                          "(JSON has no NaN or Infinity)"),
    ('"rms_norm_eps": -Infinity', "'rms_norm_eps': -Infinity is not accepted; rms_norm_eps must "
                                  "be a finite number (JSON has no NaN or Infinity)"),
], ids=["nan", "infinity"])
def test_non_finite_number_in_an_hf_config(tmp_path, text, message):
    """Refused while parsing, before the keys tell an HF config (even a key meshplan ignores)."""
    key = text.split(":")[0]
    body = json.dumps(edited(LLAMA_HF, **{key.strip('"'): "<x>"})).replace(f'{key}: "<x>"', text)
    path = write(tmp_path / "config.json", body)
    assert usage_error(*estimate_args(model=path)) == f"meshplan: error: {path}: {message}"


@pytest.mark.timeout(30)
def test_absurd_hf_layer_count_fails_fast(tmp_path):
    path = write(tmp_path / "config.json", edited(LLAMA_HF, num_hidden_layers=ABSURD))
    line = usage_error("plan", "--model", path, "--cluster", "cpu", "--global-batch", "8")
    assert f"'num_hidden_layers': {ABSURD} is not accepted" in line


# ----- cluster JSON ------------------------------------------------------------------------------
CLUSTER_CASES = {
    "unknown-key": (edited(CLUSTER, colour="red"),
                    "unknown ClusterSpec key(s) ['colour']; accepted keys: name, gpu, nodes, "
                    "gpus_per_node, nvlink_latency_s, nics_per_node, nic_bytes_per_s, "
                    "nic_latency_s, nodes_per_leaf, spine_oversubscription, pcie_bytes_per_s, "
                    "host_bytes, nvme_bytes, nvme_bytes_per_s, host_flop_per_s, source"),
    "missing-key": (without(CLUSTER, "nic_bytes_per_s"),
                    "missing required ClusterSpec key(s) ['nic_bytes_per_s']; required: gpu, "
                    "gpus_per_node, nvlink_latency_s, nics_per_node, nic_bytes_per_s, "
                    "nic_latency_s"),
    "string-for-int": (edited(CLUSTER, gpus_per_node="2"),
                       "'gpus_per_node': '2' is not accepted; gpus_per_node must be a positive "
                       "integer up to 1024 (MAX_GPUS_PER_NODE)"),
    "float-for-int": (edited(CLUSTER, nodes=2.0),
                      "'nodes': 2.0 is not accepted; nodes must be a positive integer up to "
                      "65536 (MAX_NODES)"),
    "bool-for-int": (edited(CLUSTER, nics_per_node=True),
                     "'nics_per_node': true is not accepted; nics_per_node must be a positive "
                     "integer up to 1024 (MAX_GPUS_PER_NODE)"),
    "nan": (json.dumps(CLUSTER).replace('"nic_latency_s": 5e-05', '"nic_latency_s": NaN'),
            "'nic_latency_s': NaN is not accepted; nic_latency_s must be a finite number (JSON "
            "has no NaN or Infinity)"),
    "infinity": (json.dumps(CLUSTER).replace('"nic_bytes_per_s": 1000000000.0',
                                             '"nic_bytes_per_s": Infinity'),
                 "'nic_bytes_per_s': Infinity is not accepted; nic_bytes_per_s must be a "
                 "finite number (JSON has no NaN or Infinity)"),
    "zero": (edited(CLUSTER, nic_bytes_per_s=0),
             "'nic_bytes_per_s': 0 is not accepted; nic_bytes_per_s must be a number > 0"),
    "negative": (edited(CLUSTER, nvlink_latency_s=-1e-6),
                 "'nvlink_latency_s': -1e-06 is not accepted; nvlink_latency_s must be a "
                 "number >= 0"),
    "absurd-nodes": (edited(CLUSTER, nodes=ABSURD),
                     f"'nodes': {ABSURD} is not accepted; nodes must be a positive integer up "
                     f"to 65536 (MAX_NODES)"),
    "too-many-gpus": (edited(CLUSTER, nodes=MAX_NODES, gpus_per_node=8),
                      "cluster 'cluster': 65536 nodes x 8 GPUs is more than 262144 GPUs "
                      "(MAX_GPUS)"),
    "gpu-not-a-name-or-object": (edited(CLUSTER, gpu=7),
                                 "'gpu': 7 is not accepted; gpu must be a string or an object "
                                 "with the GpuSpec keys"),
    "gpu-unknown-key": (edited(CLUSTER, gpu={**GPU, "fast": True}),
                        "unknown GpuSpec key(s) ['fast'] in gpu; accepted keys: key, name, "
                        "peak_flop_per_s, hbm_bytes, hbm_bytes_per_s, nvlink_bytes_per_s, "
                        "nvls_efficiency, source"),
    "gpu-missing-key": (edited(CLUSTER, gpu=without(GPU, "hbm_bytes")),
                        "missing required GpuSpec key(s) ['hbm_bytes'] in gpu; required: name, "
                        "peak_flop_per_s, hbm_bytes, hbm_bytes_per_s, nvlink_bytes_per_s"),
    "gpu-string-for-number": (edited(CLUSTER, gpu=edited(GPU, peak_flop_per_s={"bf16": "1e15"})),
                              "'gpu.peak_flop_per_s.bf16': '1e15' is not accepted; "
                              "gpu.peak_flop_per_s.bf16 must be a number > 0"),
    "gpu-zero": (edited(CLUSTER, gpu=edited(GPU, hbm_bytes=0)),
                 "'gpu.hbm_bytes': 0 is not accepted; gpu.hbm_bytes must be a positive integer"),
}


def test_a_valid_cluster_file_is_read(tmp_path):
    path = write(tmp_path / "cluster.json", edited(CLUSTER, gpu=GPU))
    data = run_cli(*estimate_args(cluster=path), "--json").json()
    assert data["cluster"] == {"name": "cluster", "gpu": "custom", "nodes": 1, "gpus_per_node": 2,
                               "num_gpus": 2}


@pytest.mark.parametrize("case", list(CLUSTER_CASES))
def test_bad_cluster_file(tmp_path, case):
    document, message = CLUSTER_CASES[case]
    path = write(tmp_path / "cluster.json", document)
    assert usage_error(*estimate_args(cluster=path)) == f"meshplan: error: {path}: {message}"


DP_ACROSS = ("--dp", "4", "--zero", "3")
PP_ACROSS = ("--pp", "2", "--dp", "2")


@pytest.mark.parametrize("command", ["estimate", "plan"])
@pytest.mark.parametrize("field, value, layout, term", [
    ("nic_bytes_per_s", 1e-300, DP_ACROSS, "zero_comm_s"),  # infinite
    ("nic_bytes_per_s", 1e-6, DP_ACROSS, "zero_comm_s"),  # 5e16 s: finite, absurd
    ("nic_latency_s", 1e300, PP_ACROSS, "pp_comm_s"),  # finite, but not in nanoseconds
    ("gpu", edited(GPU, peak_flop_per_s={"bf16": 1e-300}), DP_ACROSS, "compute_s")],
    ids=["nic-rate-inf", "nic-rate-absurd", "nic-latency", "flops"])
def test_rates_that_give_absurd_times_are_a_user_error(tmp_path, command, field, value, layout,
                                                       term):
    """Numbers the schema accepts (> 0, finite) that make a time infinite or absurd:
    ``estimate --json`` printed ``Infinity`` (not JSON) and ``plan`` ended in an OverflowError
    traceback. Now one line names the stage, the term and the limit (MAX_TERM_S, 1e12 s).
    Llama 2 7B on 2 nodes of 2 GPUs, with data parallelism or the pipeline across the NIC
    (collectives take the calibration's latencies, pipeline sends the cluster's)."""
    path = write(tmp_path / "cluster.json", {**CLUSTER, "gpu": GPU, "nodes": 2, field: value})
    line = usage_error(command, "--model", "llama2-7b", "--cluster", path, "--global-batch",
                       "8", "--seq-len", "64", *layout)
    assert "stage 0's predicted" in line and term in line and "beyond 1e+12 s" in line, line


@pytest.mark.timeout(30)
def test_absurd_node_count_fails_fast(tmp_path):
    path = write(tmp_path / "cluster.json", edited(CLUSTER, nodes=ABSURD))
    line = usage_error("plan", "--model", "tiny", "--cluster", path, "--global-batch", "8")
    assert f"'nodes': {ABSURD} is not accepted" in line


@pytest.mark.timeout(30)
def test_absurd_nodes_flag_fails_fast():
    line = usage_error("plan", "--model", "tiny", "--cluster", "dgx-h100", "--nodes", ABSURD,
                       "--global-batch", "8")
    assert line == (f"meshplan: error: cluster 'dgx-h100': nodes must be at most 65536 "
                    f"(MAX_NODES), got {ABSURD}")


# ----- calibration -------------------------------------------------------------------------------
DEVICE = {"matmul_efficiency": 0.5, "matmul_overhead_s": 1e-6, "attention_efficiency": 0.4,
          "flash_attention_efficiency": 0.4, "memory_efficiency": 0.6}
CALIBRATION_KEYS = ("devices, elementwise_traffic_factor, attention_core_traffic_factor, "
                    "framework_compute_factor, nvlink_efficiency, network_efficiency, "
                    "tp_overlap, dp_overlap, pp_overlap, offload_overlap, "
                    "host_adam_flop_per_param, allocator_fragmentation, communicator_bytes, "
                    "link_latency_s, collective_call_s, library_hop_latency_s, "
                    "host_adam_bytes_per_param, "
                    "host_memory_bytes_per_s, host_copy_bytes_per_s, zero3_path_bytes_per_s, "
                    "zero3_path_rank_s, source, about")
CALIBRATION_CASES = {
    "unknown-key": ({"tp_overlap": 0.5, "tp_overlaps": 0.5},
                    f"unknown Calibration key(s) ['tp_overlaps']; accepted keys: "
                    f"{CALIBRATION_KEYS}"),
    "missing-device-key": ({"devices": {"cpu": without(DEVICE, "memory_efficiency")}},
                           "missing required DeviceCalibration key(s) ['memory_efficiency'] in "
                           "devices.cpu; required: matmul_efficiency, matmul_overhead_s, "
                           "attention_efficiency, flash_attention_efficiency, "
                           "memory_efficiency"),
    "string-for-number": ({"tp_overlap": "0.5"},
                          "'tp_overlap': '0.5' is not accepted; tp_overlap must be a number in "
                          "[0, 1]"),
    "bool-for-number": ({"devices": {"cpu": edited(DEVICE, memory_efficiency=True)}},
                        "'devices.cpu.memory_efficiency': true is not accepted; "
                        "devices.cpu.memory_efficiency must be a number in (0, 1]"),
    "nan": ('{"nvlink_efficiency": NaN}',
            "'nvlink_efficiency': NaN is not accepted; nvlink_efficiency must be a finite "
            "number (JSON has no NaN or Infinity)"),
    "infinity": ('{"communicator_bytes": Infinity}',
                 "'communicator_bytes': Infinity is not accepted; communicator_bytes must be a "
                 "finite number (JSON has no NaN or Infinity)"),
    "zero": ({"host_adam_flop_per_param": 0},
             "'host_adam_flop_per_param': 0 is not accepted; host_adam_flop_per_param must be "
             "a number > 0"),
    "negative": ({"collective_call_s": -1e-3},
                 "'collective_call_s': -0.001 is not accepted; collective_call_s must be a "
                 "number >= 0"),
    "above-one": ({"dp_overlap": 1.5},
                  "'dp_overlap': 1.5 is not accepted; dp_overlap must be a number in [0, 1]"),
    "unknown-link-kind": ({"link_latency_s": {"nvlink": 1e-6}},
                          "key 'nvlink' in link_latency_s is not accepted; each key of "
                          "link_latency_s must be one of \"inter\", \"intra\""),
    "unknown-framework": ({"framework_compute_factor": {"nemo": 1.1}},
                          "key 'nemo' in framework_compute_factor is not accepted; each key of "
                          "framework_compute_factor must be one of \"meshplan\", "
                          "\"megatron\", \"deepspeed\", \"torchtitan\", \"ideal\""),
}


def test_a_valid_calibration_file_is_read(tmp_path):
    path = write(tmp_path / "cal.json", {"about": "test", "devices": {"cpu": DEVICE},
                                         "dp_overlap": 0.25})
    base = run_cli(*estimate_args(), "--json").json()["time"]["compute_s"]
    slower = run_cli(*estimate_args(calibration=path), "--json").json()["time"]["compute_s"]
    assert slower != base  # the file's cpu efficiencies were used


@pytest.mark.parametrize("case", list(CALIBRATION_CASES))
def test_bad_calibration_file(tmp_path, case):
    document, message = CALIBRATION_CASES[case]
    path = write(tmp_path / "cal.json", document)
    assert usage_error(*estimate_args(calibration=path)) == f"meshplan: error: {path}: {message}"


# ----- plan file ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plan_document(tmp_path_factory) -> dict:
    """A two-stage plan of the tiny model on two CPU ranks, as ``plan -o`` writes it."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    result = run_cli("plan", "--model", "tiny", "--cluster", "cpu", "--gpus-per-node", "2",
                     "--pp", "2", "--global-batch", "8", "-o", path)
    assert result.code == 0, result.err
    return json.loads(path.read_text())


def _plan_edit(change) -> Any:
    def make(document: dict) -> dict:
        document = copy.deepcopy(document)
        change(document)
        return document
    return make


PLAN_CASES = {
    "unknown-key": (_plan_edit(lambda d: d.update(learning_rate=3e-4)),
                    "unknown plan file key(s) ['learning_rate']; accepted keys: tp, pp, dp, cp, "
                    "ep, sp, zero_stage, offload, offload_device, recompute, selective_ac, "
                    "recompute_early_stop, compile, float8, float8_recipe, grad_reduce_dtype, "
                    "float8_head, async_tp, "
                    "tp_comm_overlap, attention_kernel, cross_entropy_fusion, overlap_comm, "
                    "cp_comm_type, micro_batch_size, "
                    "global_batch_size, vpp, seq_len, layers_per_stage, mesh_order, "
                    "flash_attention, dtype, grad_accum_steps, schema_version, framework, model, "
                    "cluster, predicted, provenance"),
    "missing-key": (_plan_edit(lambda d: d.pop("dtype")),
                    "missing required plan file key(s) ['dtype']; required: tp, pp, dp, cp, ep, "
                    "sp, zero_stage, offload, offload_device, recompute, micro_batch_size, "
                    "global_batch_size, vpp, seq_len, layers_per_stage, mesh_order, "
                    "flash_attention, dtype, grad_accum_steps, schema_version, framework, model, "
                    "cluster, predicted, provenance"),
    "string-for-int": (_plan_edit(lambda d: d.update(tp="1")),
                       "'tp': '1' is not accepted; tp must be a positive integer up to 262144 "
                       "(MAX_GPUS)"),
    "float-for-int": (_plan_edit(lambda d: d.update(pp=2.0)),
                      "'pp': 2.0 is not accepted; pp must be a positive integer up to 262144 "
                      "(MAX_GPUS)"),
    "int-for-bool": (_plan_edit(lambda d: d.update(sp=0)),
                     "'sp': 0 is not accepted; sp must be true or false"),
    "list-item": (_plan_edit(lambda d: d.update(layers_per_stage=[2, "2"])),
                  "'layers_per_stage[1]': '2' is not accepted; layers_per_stage[1] must be a "
                  "positive integer up to 4096 (MAX_LAYERS)"),
    "zero": (_plan_edit(lambda d: d.update(global_batch_size=0)),
             "'global_batch_size': 0 is not accepted; global_batch_size must be a positive "
             "integer up to 16777216 (MAX_GLOBAL_BATCH)"),
    "negative": (_plan_edit(lambda d: d.update(micro_batch_size=-2)),
                 "'micro_batch_size': -2 is not accepted; micro_batch_size must be a positive "
                 "integer up to 16777216 (MAX_GLOBAL_BATCH)"),
    "model-string-for-int": (_plan_edit(lambda d: d["model"].update(num_layers="4")),
                             "'num_layers': '4' is not accepted; num_layers must be a positive "
                             "integer up to 4096 (MAX_LAYERS)"),
    "cluster-gpu-negative": (_plan_edit(lambda d: d["cluster"]["gpu"].update(hbm_bytes=-1)),
                             "'gpu.hbm_bytes': -1 is not accepted; gpu.hbm_bytes must be a "
                             "positive integer"),
    "predicted-missing-key": (_plan_edit(lambda d: d["predicted"]["time"].pop("step_s")),
                              "missing required estimate time key(s) ['step_s'] in "
                              "predicted.time; required: step_s, compute_s, tp_comm_s, "
                              "cp_comm_s, ep_comm_s, pp_comm_s, pp_bubble_s, dp_comm_s, "
                              "offload_s, optimizer_s, exposed_comm_s, dp_comm_total_s, "
                              "bottleneck_stage"),
    "predicted-string-for-number": (
        _plan_edit(lambda d: d["predicted"]["time"].update(step_s="fast")),
        "'predicted.time.step_s': 'fast' is not accepted; predicted.time.step_s must be a "
        "number > 0"),
    "predicted-negative": (
        _plan_edit(lambda d: d["predicted"]["memory"]["per_stage"][1].update(peak_bytes=-5)),
        "'predicted.memory.per_stage[1].peak_bytes': -5 is not accepted; "
        "predicted.memory.per_stage[1].peak_bytes must be a number >= 0"),
    "predicted-schema-version": (
        _plan_edit(lambda d: d["predicted"].update(schema_version=2)),
        "'predicted.schema_version': 2 is not accepted; predicted.schema_version must be one "
        "of 1"),
}
"""Each edit, and the line after ``<file>`` (``<file> model:`` / ``<file> cluster:`` for the
nested documents, see ``PLAN_ORIGIN``)."""
PLAN_ORIGIN = {"model-string-for-int": " model", "cluster-gpu-negative": " cluster"}


@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_bad_plan_file(plan_document, tmp_path, case):
    make, message = PLAN_CASES[case]
    path = write(tmp_path / "plan.json", make(plan_document))
    origin = f"{path}{PLAN_ORIGIN.get(case, '')}"
    assert usage_error("export", path, "--to", "megatron") == \
        f"meshplan: error: {origin}: {message}"


@pytest.mark.parametrize("text, message", [
    ('"step_s": NaN', "'predicted.time.step_s': NaN is not accepted; predicted.time.step_s must "
                      "be a finite number (JSON has no NaN or Infinity)"),
    ('"step_s": Infinity', "'predicted.time.step_s': Infinity is not accepted; "
                           "predicted.time.step_s must be a finite number (JSON has no NaN or "
                           "Infinity)"),
], ids=["nan", "infinity"])
def test_non_finite_number_in_a_plan_file(plan_document, tmp_path, text, message):
    document = copy.deepcopy(plan_document)
    document["predicted"]["time"]["step_s"] = "<step>"
    path = write(tmp_path / "plan.json", json.dumps(document).replace('"step_s": "<step>"', text))
    assert usage_error("export", path, "--to", "megatron") == f"meshplan: error: {path}: {message}"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("where", ["model", "plan"])
def test_absurd_counts_in_a_plan_file_fail_fast(plan_document, tmp_path, where):
    """``explain`` searches the plan's space again: an absurd count must stop it at once."""
    document = copy.deepcopy(plan_document)
    if where == "model":
        document["model"]["num_layers"] = ABSURD
        expected = (f"{{path}} model: 'num_layers': {ABSURD} is not accepted; num_layers must "
                    f"be a positive integer up to 4096 (MAX_LAYERS)")
    else:
        document["global_batch_size"] = ABSURD
        expected = (f"{{path}}: 'global_batch_size': {ABSURD} is not accepted; "
                    f"global_batch_size must be a positive integer up to 16777216 "
                    f"(MAX_GLOBAL_BATCH)")
    path = write(tmp_path / "plan.json", document)
    assert usage_error("explain", path) == "meshplan: error: " + expected.format(path=path)


# ----- the loader's API (for the runtime's documents too) ----------------------------------------
@dataclass(frozen=True, kw_only=True)
class _Options:
    steps: int
    backend: Literal["gloo", "nccl"] = "gloo"


@dataclass(frozen=True, kw_only=True)
class _Job:
    """Shaped like the runtime's torchrun job description."""

    plans: tuple[str, ...]
    reports: tuple[str | None, ...]
    options: _Options
    timeout_s: float | None = None


JOB_SCHEMA = schema_of(_Job, name="job", limits={"timeout_s": POSITIVE})
OPTIONS_LIMITS = {"steps": count(1000, "MAX_STEPS")}


def test_schema_of_derives_keys_types_and_required_from_the_dataclass():
    job = {"plans": ["a.json"], "reports": [None], "options": {"steps": 3}}
    check_object(job, JOB_SCHEMA, origin="job.json")
    assert JOB_SCHEMA.required == {"plans", "reports", "options"}
    cases = [
        ({**job, "reports": [3]}, "job.json: 'reports[0]': 3 is not accepted; reports[0] must "
                                  "be null or a string"),
        ({**job, "options": {"steps": 3, "backend": "mpi"}},
         "job.json: 'options.backend': 'mpi' is not accepted; options.backend must be one of "
         "\"gloo\", \"nccl\""),
        ({**job, "options": {}}, "job.json: missing required _Options key(s) ['steps'] in "
                                 "options; required: steps"),
        ({**job, "timeout_s": 0}, "job.json: 'timeout_s': 0 is not accepted; timeout_s must be "
                                  "null or a number > 0"),
        ({**job, "plans": "a.json"}, "job.json: 'plans': 'a.json' is not accepted; plans must "
                                     "be a list, each item a string"),
        ({**job, "reports": {}}, "job.json: 'reports': {} is not accepted; reports must be a "
                                 "list, each item null or a string"),
    ]
    for data, message in cases:
        with pytest.raises(ValueError) as info:
            check_object(data, JOB_SCHEMA, origin="job.json")
        assert str(info.value) == message


def test_schema_of_limits_and_parse_from_text():
    options = schema_of(_Options, limits=OPTIONS_LIMITS)
    assert parse_json_document('{"steps": 1000}', origin="run", schema=options) == {"steps": 1000}
    with pytest.raises(ValueError) as info:
        parse_json_document('{"steps": 1001}', origin="run", schema=options)
    assert str(info.value) == ("run: 'steps': 1001 is not accepted; steps must be a positive "
                               "integer up to 1000 (MAX_STEPS)")
    with pytest.raises(TypeError, match=r"limits for unknown keys \['step'\]"):
        schema_of(_Options, limits={"step": count(3, "X")})


def test_load_json_document_names_the_file(tmp_path):
    schema = Schema(name="report", rules={}, required=frozenset(), extra_keys=True)
    path = write(tmp_path / "report.json", {"anything": [1, {"goes": None}]})
    assert load_json_document(path, what="run report", schema=schema)["anything"][0] == 1
    with pytest.raises(ValueError) as info:
        load_json_document(tmp_path / "none.json", what="run report")
    assert str(info.value) == f"run report file {str(tmp_path / 'none.json')!r} does not exist"
    with pytest.raises(ValueError) as info:
        load_json_document(tmp_path, what="cluster")
    assert str(info.value) == f"cluster file {str(tmp_path)!r} is a directory; give a JSON file"
    write(path, '{"losses": [1.0, NaN]}')
    with pytest.raises(ValueError) as info:
        load_json_document(path, what="run report", schema=schema)
    assert str(info.value) == (f"{path}: 'losses[1]': NaN is not accepted; losses[1] must be a "
                               f"finite number (JSON has no NaN or Infinity)")
