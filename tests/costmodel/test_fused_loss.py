"""A fused cross-entropy kernel under --framework torchtitan
(``ParallelConfig.cross_entropy_fusion``): the FSDP trainers that call one (llm-foundry's
``fused_crossentropy``, OLMo-core's ``fused_loss``) read the 16-bit logits and write their
gradient in one pass each and keep no fp32 copy, where torchtitan's own eager loss upcasts
them (``F.cross_entropy(logits.float())``)."""

from __future__ import annotations

import pytest

from meshplan.costmodel import (ParallelConfig, default_calibration, estimate, load_cluster,
                                load_model)
from meshplan.costmodel import timing
from meshplan.costmodel.memory import last_stage_head_bytes
from meshplan.testing import run_cli, usage_error

TOKENS = 4 * 2048


def _config(**kw) -> ParallelConfig:
    base = dict(dp=8, zero_stage=3, micro_batch_size=4, global_batch_size=32, seq_len=2048,
                recompute="full")
    return ParallelConfig(**{**base, **kw})


def test_fused_loss_time_is_eight_bytes_per_logit_against_forty_four():
    """The LM head's time drops by (44 - 8) bytes per logit at the device's element-wise
    bandwidth: the unfused loss's upcast, log-softmax and its backward (44) against one read
    forward and a read and a write backward with the maximum's second read (8)."""
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", nodes=1)
    calibration = default_calibration()
    device = calibration.device(cluster.gpu.key)
    bandwidth = cluster.gpu.hbm_bytes_per_s * device.memory_efficiency
    plain = timing._lm_head_s(model, cluster, _config(), calibration, framework="torchtitan")
    fused = timing._lm_head_s(model, cluster, _config(cross_entropy_fusion=True), calibration,
                              framework="torchtitan")
    logits = TOKENS * 128_256
    assert plain - fused == pytest.approx((44 - 8) * logits / bandwidth, rel=1e-9)


def test_fused_loss_keeps_the_logits_and_their_gradient_only():
    """What the last stage holds for the loss falls by two fp32-sized logit copies: the eager
    loss holds three at its backward (the upcast, the log-softmax output, its gradient), the
    fused kernel the 16-bit logits and their 16-bit gradient (one fp32 copy's bytes)."""
    model = load_model("llama3-8b")
    plain = last_stage_head_bytes(model, _config(), "torchtitan")
    fused = last_stage_head_bytes(model, _config(cross_entropy_fusion=True), "torchtitan")
    assert plain - fused == pytest.approx(2 * 4 * TOKENS * 128_256, rel=1e-12)


def test_fused_loss_changes_nothing_under_tensor_parallelism():
    """Under TP torchtitan's loss is its vocabulary-parallel one; the setting has no kernel to
    replace there (as async TP changes nothing without TP)."""
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", nodes=1)
    kw = dict(tp=2, dp=4, sp=True)
    plain = estimate(model, cluster, _config(**kw), framework="torchtitan")
    fused = estimate(model, cluster, _config(**kw, cross_entropy_fusion=True),
                     framework="torchtitan")
    assert fused.time.step_s == plain.time.step_s
    assert fused.memory.peak_bytes == plain.memory.peak_bytes


@pytest.mark.parametrize("framework", ["deepspeed", "meshplan"])
def test_fused_loss_is_refused_where_it_is_not_modelled(framework):
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", nodes=1)
    with pytest.raises(ValueError, match="megatron and torchtitan only"):
        estimate(model, cluster, _config(cross_entropy_fusion=True), framework=framework)


def test_the_cli_plans_a_fused_loss_under_torchtitan_and_its_export_refuses_it(tmp_path):
    """``plan --framework torchtitan --cross-entropy-fusion`` prices the fused kernel; torchtitan
    0.2.2 has no such option, so its export says so in one line (exit 2) and names the way
    torchtitan does run one (its compiled loss)."""
    plan = tmp_path / "plan.json"
    done = run_cli("plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "1",
                   "--framework", "torchtitan", "--global-batch", "16", "--zero", "3",
                   "--tp", "1", "--cross-entropy-fusion", "-o", str(plan))
    assert done.code == 0, done.err
    message = usage_error("export", str(plan), "--to", "torchtitan")
    assert "no fused cross-entropy option" in message and "--compile model+loss" in message
    assert "megatron and torchtitan only" in usage_error(
        "estimate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--global-batch", "16",
        "--framework", "deepspeed", "--cross-entropy-fusion")


def test_the_torchtitan_export_takes_the_setting_where_it_priced_nothing(tmp_path):
    """Under TP the setting changed no price (torchtitan's loss is its vocabulary-parallel
    one), so the export has nothing to refuse."""
    plan = tmp_path / "plan.json"
    done = run_cli("plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "1",
                   "--framework", "torchtitan", "--global-batch", "16", "--zero", "3",
                   "--tp", "2", "--sp", "--cross-entropy-fusion", "-o", str(plan))
    assert done.code == 0, done.err
    assert run_cli("export", str(plan), "--to", "torchtitan").code == 0
