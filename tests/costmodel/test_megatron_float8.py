"""float8 training under --framework megatron: Transformer Engine's linears as Megatron-LM
drives them (``--fp8-recipe tensorwise``, the recipe meshplan's export writes).

Byte counts are written out here linear by linear from what TE does (a max-abs pass and a
cast-transpose per activation and gradient, the weights cast on a step's first micro-batch
and kept in both layouts until its end), not read from the code under test; the NeMo
throughputs are in ``costmodel/data/reference_runs.json`` (family ``nemo-h100-fp8``).
"""

from __future__ import annotations

import pytest

from meshplan.costmodel import default_calibration, eager
from meshplan.costmodel.config import ParallelConfig
from meshplan.costmodel.estimate import estimate
from meshplan.costmodel.hardware import load_cluster
from meshplan.costmodel.models import load_model
from meshplan.testing import run_cli

H, Q, KV, F, LAYERS = 4096, 4096, 1024, 14336, 32  # Llama 3 8B
WEIGHTS_PER_LAYER = H * Q + 2 * H * KV + Q * H + 3 * H * F  # wq wk wv wo, w1 w3 w2


def _config(**changes) -> ParallelConfig:
    base = dict(dp=8, zero_stage=1, recompute="none", micro_batch_size=1, global_batch_size=8,
                seq_len=8192)
    return ParallelConfig(**{**base, **changes})


def test_te_casts_activations_and_gradients_per_micro_batch_but_not_the_weights():
    """Per element of each linear's input and output gradient: a max-abs read (2 bytes), then
    a read of the bf16 tensor and two float8 writes (row- and column-major): 6 bytes.
    Megatron-core's block has four TE linears (linear_qkv, linear_proj, linear_fc1 with gate
    and up together, linear_fc2), so the block input and the MLP input are cast once each."""
    model = load_model("llama3-8b")
    tokens = 8192
    inputs = H + Q + H + F  # into linear_qkv, linear_proj, linear_fc1, linear_fc2
    grads = Q + 2 * KV + H + 2 * F + H  # out of the same four linears
    expected = 6 * (inputs + grads) * tokens
    assert eager.float8_cast_bytes(model, _config(float8=True), tokens=tokens,
                                   transformer_engine=True) == pytest.approx(expected, rel=1e-12)
    # torchao (torchtitan, eager) converts seven nn.Linear modules, each casting its own
    # input (the block input three times, the MLP input twice), and casts the weights on
    # every micro-batch on top: a max-abs pass and two casts, 2 + 3 + 3 bytes per weight element
    torchao_inputs = 3 * H + Q + 2 * H + F  # into wq, wk, wv; wo; w1, w3; w2
    assert eager.float8_cast_bytes(model, _config(float8=True), tokens=tokens) \
        == pytest.approx(6 * (torchao_inputs + grads) * tokens + 8 * WEIGHTS_PER_LAYER,
                         rel=1e-12)


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_te_casts_the_weights_once_per_step(micro_batches):
    """The step's one weight cast (8 bytes per weight element of every layer, at the device's
    calibrated HBM rate) is the whole difference of the once-per-step term, whatever the
    number of micro-batches."""
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", nodes=1)
    calibration = default_calibration()
    gbs = 8 * micro_batches
    bf16 = estimate(model, cluster, _config(global_batch_size=gbs), framework="megatron")
    fp8 = estimate(model, cluster, _config(global_batch_size=gbs, float8=True),
                   framework="megatron")
    rate = (cluster.gpu.hbm_bytes_per_s
            * calibration.device(cluster.gpu.key).memory_efficiency)
    assert fp8.time.optimizer_s - bf16.time.optimizer_s == pytest.approx(
        8 * WEIGHTS_PER_LAYER * LAYERS / rate, rel=1e-9)
    assert fp8.time.step_s < bf16.time.step_s


def test_te_keeps_weights_twice_and_linear_inputs_once_in_float8():
    """Against the bf16 plan under Megatron-LM: a float8 copy and its transpose, one byte
    each, of every block linear's weight, and one byte less per element of each linear's
    saved input (the two norms' outputs into wq/wk/wv and w1/w3, the attention output into
    wo, the gate product into w2), one micro-batch of 4096 tokens in flight."""
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", nodes=1)
    config = _config(seq_len=4096)
    bf16 = estimate(model, cluster, config, framework="megatron")
    fp8 = estimate(model, cluster, config.replace(float8=True), framework="megatron")
    saved_inputs = 4096 * (H + H + Q + F)
    assert fp8.memory.peak_bytes - bf16.memory.peak_bytes == pytest.approx(
        (2 * WEIGHTS_PER_LAYER - saved_inputs) * LAYERS, rel=1e-12)


def test_cli_estimates_a_megatron_float8_plan():
    result = run_cli("estimate", "--model", "llama3-8b", "--cluster", "dgx-h100",
                     "--framework", "megatron", "--global-batch", "16", "--float8")
    assert result.code == 0, result.err
    assert "float8 linears" in result.out


def test_only_torchtitan_gathers_zero3_weights_in_float8():
    """torchtitan all-gathers its float8 linears' weights already cast (1 byte); Transformer
    Engine casts after the gather, which moves the compute dtype (2 bytes) of every weight."""
    from meshplan.costmodel.memory import stage_params
    from meshplan.costmodel.timing import zero3_gather_bytes
    model = load_model("llama3-8b")
    config = _config(zero_stage=3, float8=True)
    params = stage_params(model, config, 0)
    total = params.dense + params.expert
    assert zero3_gather_bytes(config, params, framework="megatron") == 2 * total
    assert zero3_gather_bytes(config, params, framework="torchtitan") < 2 * total


def test_te_delayed_scaling_drops_the_max_abs_passes_and_fuses_casts_into_producers():
    """Transformer Engine's delayed scaling (``float8_recipe="delayed"``, NeMo's default) takes
    its scales from an amax history the kernels update: a standalone cast-transpose moves 4
    bytes per element (read bf16, write two float8 copies) instead of 6, and the once-per-step
    weight cast 6 per weight element instead of 8. The kernel that produces a linear's input
    can then write it in float8 itself: the two norms (into linear_qkv and linear_fc1) and the
    SwiGLU (into linear_fc2) write 1 byte, transposed later for the weight gradient (read 1,
    write 1): 3 bytes; the SwiGLU's backward writes linear_fc1's output gradient in both
    layouts: 2 bytes. The attention output and the other three output gradients are cast on
    their own."""
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", nodes=1)
    tokens = 8192
    standalone = Q + (Q + 2 * KV) + H + H  # proj in; qkv, proj and fc2 output gradients
    by_norms_and_activation = H + H + F
    by_activation_backward = 2 * F
    expected = (4 * standalone + 3 * by_norms_and_activation + 2 * by_activation_backward) \
        * tokens
    delayed = _config(float8=True, float8_recipe="delayed")
    assert eager.float8_cast_bytes(model, delayed, tokens=tokens, transformer_engine=True) \
        == pytest.approx(expected, rel=1e-12)
    calibration = default_calibration()
    rate = (cluster.gpu.hbm_bytes_per_s
            * calibration.device(cluster.gpu.key).memory_efficiency)
    current = estimate(model, cluster, _config(float8=True), framework="megatron")
    late = estimate(model, cluster, delayed, framework="megatron")
    assert current.time.optimizer_s - late.time.optimizer_s == pytest.approx(
        2 * WEIGHTS_PER_LAYER * LAYERS / rate, rel=1e-9)
    assert late.time.step_s < current.time.step_s


def test_delayed_scaling_is_megatron_only_and_needs_float8():
    from meshplan.testing import usage_error
    args = ["estimate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--global-batch", "16"]
    assert "needs float8 training" in usage_error(*args, "--framework", "megatron",
                                                  "--float8-recipe", "delayed")
    assert "modelled for --framework megatron only" in usage_error(
        *args, "--framework", "torchtitan", "--float8", "--float8-recipe", "delayed")
    result = run_cli(*args, "--framework", "megatron", "--float8", "--float8-recipe", "delayed",
                     "--json")
    assert result.code == 0, result.err
