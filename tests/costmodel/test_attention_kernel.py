"""Which fused attention kernel a trainer calls (``ParallelConfig.attention_kernel``): the
framework's own (``auto``), or the Triton flash-attention kernel llm-foundry's
``attn_impl: triton`` runs, priced at the device's ``triton_attention_efficiency``."""

from __future__ import annotations

import dataclasses

import pytest

from meshplan.costmodel import (ParallelConfig, default_calibration, estimate, load_cluster,
                                load_model)
from meshplan.costmodel import timing
from meshplan.costmodel.reference import reference_runs
from meshplan.runtime.mesh import UnsupportedPlan, check_supported
from meshplan.testing import run_cli, usage_error

SEQ = 4096


def _config(**kw) -> ParallelConfig:
    base = dict(dp=8, zero_stage=3, micro_batch_size=2, global_batch_size=16, seq_len=SEQ,
                recompute="none")
    return ParallelConfig(**{**base, **kw})


def _calibration(sdpa: float, triton: float):
    """The default calibration with the H100's two fused-attention efficiencies set."""
    cal = default_calibration()
    device = dataclasses.replace(cal.device("h100-sxm"), eager_flash_attention_efficiency=sdpa,
                                 eager_flash_attention_half_seq=None,
                                 triton_attention_efficiency=triton)
    return dataclasses.replace(cal, devices={**cal.devices, "h100-sxm": device})


def test_the_triton_kernel_prices_the_attention_core_at_its_own_efficiency():
    """A layer's attention core (the forward of Q K^T and scores x V, causal) takes its FLOPs
    at the kernel's efficiency: with SDPA at 0.5 of peak and Triton at 0.25, the Triton core is
    longer by F / (0.25 P) - F / (0.5 P), F = micro-batch x 2 s^2 q (Llama 3 8B: q = 4,096)
    worked out here, P the H100's dense bf16 peak; nothing else in the layer changes."""
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", nodes=1)
    cal = _calibration(sdpa=0.5, triton=0.25)
    auto = timing.layer_forward(model, cluster, _config(), cal, moe=False,
                                framework="torchtitan")
    triton = timing.layer_forward(model, cluster, _config(attention_kernel="triton"), cal,
                                  moe=False, framework="torchtitan")
    flop = 2 * 2 * SEQ * SEQ * 4096  # micro-batch 2, causal: 2 s^2 q per sequence
    peak = cluster.gpu.peak("bf16")
    assert triton.core_s - auto.core_s == pytest.approx(flop / (0.25 * peak)
                                                        - flop / (0.5 * peak), rel=1e-9)
    assert (triton.gemm_s, triton.rest_s) == (auto.gemm_s, auto.rest_s)


def test_a_step_with_the_slower_kernel_is_slower_and_holds_the_same_memory():
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", nodes=1)
    cal = _calibration(sdpa=0.5, triton=0.25)
    auto = estimate(model, cluster, _config(), framework="torchtitan", calibration=cal)
    triton = estimate(model, cluster, _config(attention_kernel="triton"),
                      framework="torchtitan", calibration=cal)
    assert triton.time.step_s > auto.time.step_s
    assert triton.memory.peak_bytes == auto.memory.peak_bytes


def test_without_a_triton_value_the_kernel_takes_the_sdpa_one():
    cal = _calibration(sdpa=0.4, triton=0.2)
    device = dataclasses.replace(cal.device("h100-sxm"), triton_attention_efficiency=None)
    assert device.fused_attention_efficiency(True, SEQ, "triton") == 0.4
    assert cal.device("h100-sxm").fused_attention_efficiency(True, SEQ, "triton") == 0.2


@pytest.mark.parametrize("framework", ["megatron", "deepspeed", "meshplan"])
def test_the_triton_kernel_is_refused_where_it_is_not_modelled(framework):
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", nodes=1)
    with pytest.raises(ValueError, match="--attention-kernel triton is modelled for "
                                         "--framework torchtitan only"):
        estimate(model, cluster, _config(attention_kernel="triton"), framework=framework)


def test_settings_that_cannot_go_together_are_refused():
    with pytest.raises(ValueError, match="attention_kernel must be one of auto, triton"):
        _config(attention_kernel="cudnn-v9")
    with pytest.raises(ValueError, match="cannot go with --no-flash-attention"):
        _config(attention_kernel="triton", flash_attention=False)


def test_the_runtime_refuses_a_plan_priced_with_another_kernel():
    model = load_model("llama3.2-1b")
    with pytest.raises(UnsupportedPlan, match="calls torch's SDPA"):
        check_supported(_config(attention_kernel="triton", dp=1, global_batch_size=2), model)


def test_the_mosaicml_reference_rows_ran_the_triton_kernel():
    """llm-foundry's benchmark tables were swept with attn_impl triton (the script's default
    then); every other family runs its framework's own kernel."""
    for run in reference_runs():
        expected = "triton" if run.family.startswith("mosaicml") else "auto"
        assert run.config.attention_kernel == expected, run.id


def test_the_cli_plans_with_the_kernel_and_the_torchtitan_export_refuses_it(tmp_path):
    """torchtitan runs SDPA, so its export refuses the plan; Megatron-LM's export leaves the
    kernel out with a warning (as it does torch.compile)."""
    plan = tmp_path / "plan.json"
    done = run_cli("plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "1",
                   "--framework", "torchtitan", "--global-batch", "16", "--zero", "3",
                   "--tp", "1", "--attention-kernel", "triton", "-o", str(plan))
    assert done.code == 0, done.err
    assert '"attention_kernel": "triton"' in plan.read_text()
    message = usage_error("export", str(plan), "--to", "torchtitan")
    assert "triton attention kernel" in message and "--attention-kernel auto" in message
    megatron = run_cli("export", str(plan), "--to", "megatron")
    assert megatron.code == 0, megatron.err
    assert "priced with the triton attention kernel, which the export leaves out" in megatron.err
    assert "torchtitan only" in usage_error(
        "estimate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--global-batch", "16",
        "--framework", "meshplan", "--attention-kernel", "triton")
