"""torch.compile and float8 training under --framework torchtitan.

Byte counts are derived here operator by operator (torchtitan's llama3 block, torchao's float8
roofline ``torchao/testing/float8/roofline_utils.py``), not read from the code under test;
throughputs are torchtitan's published ones (``costmodel/data/reference_runs.json``).
"""

from __future__ import annotations

import dataclasses

import pytest

from meshplan.costmodel import eager
from meshplan.costmodel.config import ParallelConfig
from meshplan.costmodel.estimate import estimate
from meshplan.costmodel.hardware import load_cluster
from meshplan.costmodel.memory import stage_params
from meshplan.costmodel.models import load_model
from meshplan.costmodel.reference import predict, reference_runs
from meshplan.costmodel.timing import layer_forward, zero3_gather_bytes
from meshplan.costmodel import default_calibration
from meshplan.testing import usage_error

H, Q, KV, F = 4096, 4096, 1024, 14336  # Llama 3 8B


def _config(**changes) -> ParallelConfig:
    base = dict(dp=8, zero_stage=3, recompute="selective", micro_batch_size=2,
                global_batch_size=16, seq_len=8192)
    return ParallelConfig(**{**base, **changes})


def test_compiled_block_moves_fewer_bytes_per_token():
    """Eager: two RMSNorms of 7 passes and two residual adds of 3, RoPE on q and k (read and
    write bf16, plus 16 fp32 bytes), the head-merging copy, SwiGLU in 5 passes. Compiled: 9
    norm/residual passes in three kernels, RoPE read and write, the copy, SwiGLU in 3."""
    model = load_model("llama3-8b")
    config = _config(compile="model")
    eager_bytes = 2 * (2 * 7 + 2 * 3) * H + (Q + KV) * (2 * 2 + 16) + 2 * 2 * Q + 2 * 5 * F
    fused_bytes = 2 * 9 * H + (Q + KV) * 2 * 2 + 2 * 2 * Q + 2 * 3 * F
    assert eager.layer_elementwise_bytes(model, config, tokens=1) == eager_bytes
    assert eager.compiled_layer_elementwise_bytes(model, config, tokens=1) == fused_bytes


def _roofline_linear_bytes(m: float, k: float, n: float, *, fused: bool) -> float:
    """torchao's tensorwise roofline for one linear (M x K input, K x N weight), fwd + bwd:
    input: max-abs (unless fused) + read bf16, write float8 twice; weight: max-abs, then a
    forward and a backward cast; output gradient: as the input."""
    amax = 0 if fused else 2
    return (amax + 2 + 2) * m * k + (2 + 3 + 3) * k * n + (amax + 2 + 2) * m * n


@pytest.mark.parametrize("compile_mode", ["none", "model"])
def test_float8_casts_follow_torchaos_roofline_linear_by_linear(compile_mode):
    model = load_model("llama3-8b")
    config = _config(float8=True, compile=compile_mode)
    m = 2 * 8192
    fused = compile_mode != "none"
    linears = [(H, Q), (H, KV), (H, KV), (Q, H), (H, F), (H, F), (F, H)]  # wq wk wv wo w1 w3 w2
    expected = sum(_roofline_linear_bytes(m, k, n, fused=fused) for k, n in linears)
    assert eager.float8_cast_bytes(model, config, tokens=m) == pytest.approx(expected, rel=1e-12)


def test_float8_runs_the_blocks_linears_at_the_float8_peak():
    """Same efficiency, the float8 peak: the GEMM term halves, less the casts' traffic."""
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", nodes=1)
    cal = default_calibration()
    bf16 = layer_forward(model, cluster, _config(compile="model"), cal, moe=False,
                         framework="torchtitan")
    fp8_config = _config(compile="model", float8=True)
    fp8 = layer_forward(model, cluster, fp8_config, cal, moe=False, framework="torchtitan")
    device = cal.device(cluster.gpu.key)
    casts = eager.float8_cast_bytes(model, fp8_config, tokens=2 * 8192) / 3 \
        / (cluster.gpu.hbm_bytes_per_s * device.memory_efficiency)
    overhead = 5 * device.matmul_overhead_s  # per call: QKV, the projection, 3 MLP matrices
    ratio = cluster.gpu.peak("bf16") / cluster.gpu.peak("fp8")  # 989 / 1979 TFLOP/s
    assert fp8.gemm_s - casts - overhead == pytest.approx((bf16.gemm_s - overhead) * ratio,
                                                          rel=1e-9)
    assert fp8.core_s == bf16.core_s  # attention stays bf16


def test_float8_all_gathers_block_weights_in_one_byte():
    model = load_model("llama3-8b")
    config = _config(float8=True)
    params = stage_params(model, config, 0)
    blocks = params.dense - params.root
    assert zero3_gather_bytes(config, params) == 2 * params.root + blocks
    assert zero3_gather_bytes(_config(), params) == 2 * (params.dense + params.expert)


def test_float8_head_runs_the_lm_head_at_the_float8_peak_with_its_casts():
    """The head's three GEMMs (forward, input and weight gradients) at the float8 peak, plus
    torchao's roofline for one more linear (M tokens x H into V rows), not fused (the head is
    outside the compiled blocks)."""
    from meshplan.costmodel.timing import _lm_head_s
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", nodes=1)
    cal = default_calibration()
    device = cal.device(cluster.gpu.key)
    blocks = _config(compile="model", float8=True)
    head = _config(compile="model", float8=True, float8_head=True)
    m, v = 2 * 8192, model.vocab_rows
    flop = 3 * 2 * m * H * v
    efficiency = device.gemm_efficiency(True) * device.row_efficiency(m)
    saved = flop / efficiency * (1 / cluster.gpu.peak("bf16") - 1 / cluster.gpu.peak("fp8"))
    casts = _roofline_linear_bytes(m, H, v, fused=False) \
        / (cluster.gpu.hbm_bytes_per_s * device.memory_efficiency)
    assert eager.float8_head_cast_bytes(model, head, tokens=m) == \
        pytest.approx(_roofline_linear_bytes(m, H, v, fused=False), rel=1e-12)
    difference = _lm_head_s(model, cluster, blocks, cal, framework="torchtitan") \
        - _lm_head_s(model, cluster, head, cal, framework="torchtitan")
    assert difference == pytest.approx(saved - casts, rel=1e-9)


def test_float8_head_gathers_the_head_in_one_byte():
    model = load_model("llama3-8b")
    params = stage_params(model, _config(float8=True), 0)
    blocks = params.dense - params.root
    head = model.head_params  # tp 1: the final norm and the output weight
    assert zero3_gather_bytes(_config(float8=True, float8_head=True), params) == \
        2 * (params.root - head) + blocks + head


def test_float8_head_needs_float8_and_an_untied_head():
    with pytest.raises(ValueError, match="needs float8 training of the blocks"):
        _config(float8_head=True)
    tied = load_model("gpt3-125m")
    assert tied.tied_embeddings
    with pytest.raises(ValueError, match="LM head of its own"):
        estimate(tied, load_cluster("dgx-h100", nodes=1),
                 _config(float8=True, float8_head=True, seq_len=2048), framework="torchtitan")
    message = usage_error("estimate", "--model", "llama3-8b", "--cluster", "dgx-h100",
                          "--framework", "torchtitan", "--global-batch", "16",
                          "--float8-head")
    assert message.startswith("meshplan: error:") and "--float8" in message
    assert "\n" not in message.strip()


def test_compiled_loss_keeps_one_fp32_sized_copy_of_the_logits():
    """Eager loss backward: 3 fp32 vocabulary tensors; compiled: the saved bf16 logits and
    their bf16 gradient, and ``del pred`` no longer frees a block to the cache."""
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", nodes=1)
    blocks = estimate(model, cluster, _config(compile="model"), framework="torchtitan")
    both = estimate(model, cluster, _config(compile="model+loss"), framework="torchtitan")
    logits = 2 * 8192 * model.vocab_rows * 4  # one fp32 copy
    assert blocks.memory.peak_bytes - both.memory.peak_bytes == pytest.approx(2 * logits,
                                                                              rel=1e-9)


@pytest.mark.parametrize("run_id", [
    "torchtitan-llama3.1-8b-fsdp8-h100-compile",
    "torchtitan-llama3.1-8b-fsdp8-h100-compile-float8",
    "torchtitan-llama3.1-8b-fsdp128-h100-compile",
    "torchtitan-llama3.1-8b-fsdp128-h100-compile-float8",
])
def test_published_compile_and_float8_throughputs(run_id):
    """torchtitan's December 2024 tables, held out (nothing was fitted on them), on the Grand
    Teton H100s they ran on: within 7.5 % each (they are 4-7 % slower predicted than measured;
    their FSDP ring inside a node moves a quarter of the 2.4 TB/s HBM's rate, so it slows the
    compute beside it by two thirds of its own time, ``timing.prefetch_contention``)."""
    run = next(r for r in reference_runs() if r.id == run_id)
    error = predict(run, default_calibration()).time.step_s / run.measured_step_s - 1
    assert abs(error) <= 0.075, f"{run_id}: {error:+.3f}"


def test_compile_speedup_comes_from_the_element_wise_kernels():
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", nodes=1)
    eager_run = estimate(model, cluster, _config(), framework="torchtitan")
    compiled = estimate(model, cluster, _config(compile="model"), framework="torchtitan")
    assert compiled.time.step_s < eager_run.time.step_s
    assert compiled.time.dp_comm_total_s == eager_run.time.dp_comm_total_s


@pytest.mark.parametrize("framework", ["megatron", "deepspeed", "meshplan", "ideal"])
def test_compile_and_the_float8_head_are_torchtitan_options(framework):
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", nodes=1)
    with pytest.raises(ValueError, match="--compile is modelled"):
        estimate(model, cluster, _config(compile="model"), framework=framework)
    with pytest.raises(ValueError, match="--float8-head is modelled for --framework torchtitan"):
        estimate(model, cluster, _config(float8=True, float8_head=True), framework=framework)


@pytest.mark.parametrize("framework", ["deepspeed", "meshplan", "ideal"])
def test_float8_is_a_torchtitan_and_megatron_option(framework):
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", nodes=1)
    with pytest.raises(ValueError, match="--framework torchtitan and megatron only"):
        estimate(model, cluster, _config(float8=True), framework=framework)


def test_float8_needs_float8_tensor_cores():
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-a100-80gb", nodes=1)
    with pytest.raises(ValueError, match="float8 tensor cores"):
        estimate(model, cluster, _config(float8=True), framework="torchtitan")


def test_config_rejects_unknown_compile_mode_and_float8_outside_bf16():
    with pytest.raises(ValueError, match="compile must be one of"):
        _config(compile="yes")
    with pytest.raises(ValueError, match="needs dtype bf16"):
        _config(float8=True, dtype="fp16")


def test_cli_float8_under_deepspeed_is_one_line_exit_2():
    message = usage_error("estimate", "--model", "llama3-8b", "--cluster", "dgx-h100",
                          "--framework", "deepspeed", "--global-batch", "16", "--float8")
    assert message.startswith("meshplan: error:") and "torchtitan and megatron only" in message
    assert "\n" not in message.strip()


def test_estimate_report_names_the_settings():
    from meshplan.testing import run_cli

    result = run_cli("estimate", "--model", "llama3-8b", "--cluster", "dgx-h100",
                     "--framework", "torchtitan", "--zero", "3", "--micro-batch", "2",
                     "--global-batch", "16", "--seq-len", "8192", "--compile", "model",
                     "--float8")
    assert result.code == 0, result.err
    plan_line = next(line for line in result.out.splitlines() if line.startswith("plan:"))
    assert plan_line.endswith(", torch.compile model, float8 linears")
    result = run_cli("estimate", "--model", "llama3-8b", "--cluster", "dgx-h100",
                     "--framework", "torchtitan", "--zero", "3", "--micro-batch", "2",
                     "--global-batch", "16", "--seq-len", "8192", "--float8", "--float8-head")
    assert result.code == 0, result.err
    plan_line = next(line for line in result.out.splitlines() if line.startswith("plan:"))
    assert plan_line.endswith(", float8 linears and LM head")


def test_float8_leaves_moe_experts_in_bf16():
    """The linear converter swaps ``nn.Linear`` modules only: an MoE layer's experts (and its
    router) keep their bf16 GEMMs, its attention projections run in float8."""
    model, cluster = load_model("mixtral-8x7b"), load_cluster("dgx-h100", nodes=1)
    cal = default_calibration()
    config = _config(compile="model", ep=8)
    bf16 = layer_forward(model, cluster, config, cal, moe=True, framework="torchtitan")
    fp8_config = config.replace(float8=True)
    fp8 = layer_forward(model, cluster, fp8_config, cal, moe=True, framework="torchtitan")
    device = cal.device(cluster.gpu.key)
    casts = eager.float8_cast_bytes(model, fp8_config, moe=True, tokens=2 * 8192) / 3 \
        / (cluster.gpu.hbm_bytes_per_s * device.memory_efficiency)
    tokens, h = 2 * 8192, model.hidden_size
    projections = 2 * tokens * h * (2 * model.q_size + 2 * model.kv_size)
    ratio = cluster.gpu.peak("bf16") / cluster.gpu.peak("fp8")
    saved = projections / (cluster.gpu.peak("bf16") * device.gemm_efficiency(True)) * (1 - ratio)
    assert bf16.gemm_s - (fp8.gemm_s - casts) == pytest.approx(saved, rel=1e-9)


def test_compiled_block_keeps_what_its_partition_keeps():
    """A compiled Llama-3-8B block without recomputation keeps, per token in bf16, what
    torchtitan's block saved when compiled on this CPU (``benchmarks/torchtitan_saved_tensors.py
    --policy none --compile``: 15 tensors, listed by shape): the block input and the two norms'
    outputs (3 h), q, k and v (q + 2 kv), the attention output twice (as SDPA returned it and
    as the output projection reads it: 2 q) with the fp32 log-sum-exp per head, the three
    ffn-wide tensors of the MLP (3 f), and the two norms' fp32 inverse RMS; not the residual
    between attention and MLP, SiLU's output or any fp32 or RoPE intermediate."""
    from meshplan.costmodel import activations as act

    model = load_model("llama3-8b")
    config = _config(compile="model", recompute="none")
    tokens = 2 * 8192
    per_token = 2 * (3 * H + (Q + 2 * KV) + 2 * Q + 3 * F) + 2 * 4 + 4 * model.num_heads
    assert act.layer_activation_bytes(model, config, recompute="none", compiled=True) \
        == per_token * tokens
    eager = act.layer_activation_bytes(model, config, recompute="none", eager=True,
                                       rope_tables=False)
    assert eager > per_token * tokens


def test_compiled_float8_block_keeps_neither_norm_output_nor_an_ffn_tensor():
    """With torchao's float8 linears the compiled block's partition saves 2 h-wide and one
    ffn-wide bf16 tensor fewer (measured on torchtitan's tiny block in bf16: 946,176 bytes
    kept without float8, 634,922 with, the difference being 2 x 512 x 64 + 512 x 176 bf16
    elements less 42 bytes of scales): it rebuilds them and their float8 casts in backward.
    Under float8 TP the count stays as without float8 (not measured)."""
    from meshplan.costmodel import activations as act

    model = load_model("llama3-8b")
    tokens = 2 * 8192
    compiled = {f8: act.layer_activation_bytes(model, _config(compile="model", float8=f8),
                                               recompute="none", compiled=True)
                for f8 in (False, True)}
    assert compiled[False] - compiled[True] == 2 * tokens * (2 * H + F)
    tp = {f8: act.layer_activation_bytes(model, _config(compile="model", float8=f8, tp=2,
                                                        sp=True, dp=4),
                                         recompute="none", compiled=True)
          for f8 in (False, True)}
    assert tp[False] == tp[True]


def test_eager_float8_cast_holds_fp32_copies_of_an_ffn_wide_gradient():
    """torchao's eager tensorwise cast (``hp_tensor_to_float8_dynamic``) of an output gradient
    upcasts and scales it (fp32, 4 bytes an element), clamps it (fp32, 4) and casts it (1);
    at the peak of an eager block backward that replaces one of the SwiGLU's two bf16
    ffn-wide gradients: 9 - 2 bytes more per element. Compiled, the cast is one kernel."""
    from meshplan.costmodel import activations as act

    model = load_model("llama3-8b")
    tokens = 2 * 8192
    assert act.float8_cast_workspace_bytes(model, _config(float8=True)) == 7 * tokens * F
    assert act.float8_cast_workspace_bytes(model, _config(float8=True, tp=2, sp=True, dp=4)) \
        == 7 * tokens * F / 2
    assert act.float8_cast_workspace_bytes(model, _config(float8=True, compile="model")) == 0
    assert act.float8_cast_workspace_bytes(model, _config()) == 0


def test_cpu_rmsnorm_keeps_fp32_copies_of_a_16_bit_input():
    """Eager bf16 without autocast (torchtitan under FSDP2's mixed precision): on the CPU
    ``torch.rms_norm`` is its composite, which upcasts the input and keeps the fp32 copy, the
    fp32 normalised input and the bf16 output (10 bytes an element where the model counted
    the input, a normalised copy and the output in bf16: 6); CUDA's fused kernel keeps the
    input and the inverse RMS, so no normalised copy. Two norms a layer."""
    from meshplan.costmodel import activations as act

    model = load_model("llama3-8b")
    config = _config(recompute="none")
    tokens = 2 * 8192
    cpu, gpu = (act.layer_activation_bytes(model, config, recompute="none", eager=True,
                                           rope_tables=False, fused_norm=fused)
                for fused in (False, True))
    assert cpu - gpu == 2 * (10 - 2 * 2) * tokens * H
    fp32 = _config(recompute="none", dtype="fp32")
    cpu32, gpu32 = (act.layer_activation_bytes(model, fp32, recompute="none", eager=True,
                                               rope_tables=False, fused_norm=fused)
                    for fused in (False, True))
    assert cpu32 - gpu32 == 2 * 4 * tokens * H  # the normalised copy alone


def test_cpu_final_rmsnorm_composite_at_the_loss():
    """torchtitan's final norm on the CPU runs torch's composite RMSNorm: from a bf16 input it
    keeps the fp32 upcast, the fp32 normalised input and the fp32 inverse RMS beside its bf16
    output, where the model had counted the bf16 input. The live tensors at the loss's
    backward of torchtitan's bf16 step on this CPU (tiny, FSDP 2, blocks compiled, full AC,
    32 x 64 tokens): 524,288 + 524,288 + 8,192 bytes of fp32 and the 262,144-byte output. Its
    backward runs before any block's, so the model counts them at the loss phase (the step's
    peak there), and only on the CPU."""
    from meshplan.costmodel import activations as act
    from meshplan.costmodel.memory import last_stage_head_bytes

    tiny = load_model("tiny")
    config = ParallelConfig(dp=2, zero_stage=3, recompute="full", micro_batch_size=32,
                            global_batch_size=64, seq_len=64, dtype="bf16", compile="model")
    measured = 524_288 + 524_288 + 8_192 + 262_144
    counted_before = 2 * 2 * 32 * 64 * tiny.hidden_size  # the bf16 input and output
    cpu, gpu = (last_stage_head_bytes(tiny, config, "torchtitan", device_key=key)
                for key in ("cpu", "h100-sxm"))
    assert cpu - gpu == act.composite_final_norm_bytes(tiny, config) \
        == measured - counted_before
    # the other frameworks, and LayerNorm models, are unchanged
    assert last_stage_head_bytes(tiny, config, "meshplan", device_key="cpu") == \
        last_stage_head_bytes(tiny, config, "meshplan", device_key="h100-sxm")
    gpt = load_model("gpt3-125m")
    assert act.composite_final_norm_bytes(gpt, config) == 0
    # fp32: the upcast is the input itself; the normalised copy and the statistics remain
    fp32 = ParallelConfig(dp=2, zero_stage=3, recompute="full", micro_batch_size=32,
                          global_batch_size=64, seq_len=64, dtype="fp32")
    assert act.composite_final_norm_bytes(tiny, fp32) == (4 * 64 + 4) * 32 * 64
    # under SP the norm runs on the sequence shard
    sp = ParallelConfig(dp=2, tp=2, sp=True, zero_stage=3, recompute="full",
                        micro_batch_size=32, global_batch_size=64, seq_len=64, dtype="bf16")
    assert act.composite_final_norm_bytes(tiny, sp) == (6 * 64 + 4) * 32 * 64 / 2
    # the step's peak on the CPU: the loss phase carries the composite, a block's does not
    cluster = load_cluster("cpu", nodes=1, gpus_per_node=2)
    on_cpu = estimate(tiny, cluster, config, framework="torchtitan")
    assert on_cpu.memory.per_stage[0].peak_bytes == pytest.approx(10_006_052, rel=0.02)


def test_compiled_float8_block_backward_rebuilds_and_casts():
    """A compiled float8 block's backward (torchtitan on this CPU, tiny, FSDP 2, full AC,
    8 x 64 tokens): the live allocations of its compiled backward at the step's peak hold
    4 x 180,224 + 360,448 + 4 x 90,112 bytes ffn-wide where the bf16 step's hold 6 x 180,224
    (4 f bytes a token more), and as many h-wide bytes (3 x 65,536 + 4 x 32,768 against
    5 x 65,536); and they hold again the norm outputs and the ffn-wide tensor its partition did
    not keep, which the model takes off its saved bytes."""
    from meshplan.costmodel import activations as act

    tiny = load_model("tiny")
    config = ParallelConfig(dp=2, zero_stage=3, recompute="full", micro_batch_size=8,
                            global_batch_size=16, seq_len=64, dtype="bf16", compile="model",
                            float8=True)
    tokens, h, f = 8 * 64, tiny.hidden_size, tiny.ffn_hidden_size
    ffn_wide = (4 * 180_224 + 360_448 + 4 * 90_112) - 6 * 180_224
    assert 3 * 65_536 + 4 * 32_768 == 5 * 65_536  # h-wide: no more bytes
    not_kept = (act.layer_activation_bytes(tiny, dataclasses.replace(config, float8=False),
                                           recompute="none", compiled=True)
                - act.layer_activation_bytes(tiny, config, recompute="none", compiled=True))
    assert not_kept == 2 * tokens * (2 * h + f)
    assert act.float8_compiled_backward_bytes(tiny, config, recompute="full") == ffn_wide + not_kept
    # nothing without compile, under TP, or without float8
    for other in (dataclasses.replace(config, compile="none"),
                  dataclasses.replace(config, float8=False),
                  dataclasses.replace(config, tp=2, sp=True, dp=1)):
        assert act.float8_compiled_backward_bytes(tiny, other, recompute="full") == 0
    assert act.float8_compiled_backward_bytes(tiny, config, recompute="op") == 0
    # in the step: the block's backward phase carries it, on any device
    cluster = load_cluster("cpu", nodes=1, gpus_per_node=2)
    peak = estimate(tiny, cluster, config, framework="torchtitan").memory.per_stage[0].peak_bytes
    assert peak == pytest.approx(3_840_388, rel=0.03)  # the measured step (memory_runs.json)
