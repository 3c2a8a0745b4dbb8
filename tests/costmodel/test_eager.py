"""What eager (FSDP-trainer) frameworks cost beyond the matmuls: per-framework recomputation,
early-stopping checkpoints, unfused element-wise and loss traffic, prefetched collectives."""

from __future__ import annotations

import dataclasses

import pytest

from meshplan.costmodel import (ParallelConfig, default_calibration, estimate, load_cluster,
                                load_model)
from meshplan.costmodel import recompute, timing


def _step(model, cluster, framework="torchtitan", calibration=None, **config):
    return estimate(load_model(model), load_cluster(cluster, nodes=config.pop("nodes", 1)),
                    ParallelConfig(**config), framework=framework,
                    calibration=calibration or default_calibration()).time


def test_torchtitan_op_policy_recomputes_every_second_matmul():
    """torchtitan's per-op policy saves aten.mm outputs except every second one of a block in
    forward order (wq wk wv wo w1 w3 w2: wk, wo and w3 are recomputed). Llama-3-8B: h 4096,
    kv 1024, ffn 14336."""
    h, kv, f = 4096, 1024, 14336
    recomputed = h * kv + h * h + h * f
    total = 2 * h * h + 2 * h * kv + 3 * h * f
    fraction = recompute.torchtitan_recomputed_mm_fraction(load_model("llama3-8b"), moe=False)
    assert fraction == pytest.approx(recomputed / total, rel=1e-12)


def test_selective_means_each_frameworks_policy():
    """On one plan, torchtitan's per-op policy (a third of the matmuls and every element-wise
    op) costs more than Megatron's selective recomputation (the attention core: one more
    fused-attention forward), and less than full recomputation."""
    common = dict(dp=8, zero_stage=3, micro_batch_size=1, global_batch_size=8, seq_len=8192)
    none = _step("llama3-8b", "dgx-a100-80gb", **common, recompute="none").step_s
    op = _step("llama3-8b", "dgx-a100-80gb", **common, recompute="selective").step_s
    full = _step("llama3-8b", "dgx-a100-80gb", **common, recompute="full").step_s
    assert none < op < full
    assert (op - none) > 0.2 * (full - none)  # a third of the matmuls and every element-wise op
    mega_none = _step("llama3-8b", "dgx-a100-80gb", "megatron", **common, recompute="none")
    mega_sel = _step("llama3-8b", "dgx-a100-80gb", "megatron", **common, recompute="selective")
    assert 0 < mega_sel.step_s - mega_none.step_s < 0.5 * (op - none)


def test_early_stop_skips_the_last_matmul_under_full_recomputation():
    """An early-stopping checkpoint does not rerun the block's last matmul (w2): the step is
    shorter by that matmul's forward time on every layer; Megatron-LM ignores the setting."""
    common = dict(dp=8, zero_stage=3, micro_batch_size=1, global_batch_size=8, seq_len=4096,
                  recompute="full")
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-a100-80gb", nodes=1)
    config = ParallelConfig(**common)
    plain = _step("llama3-8b", "dgx-a100-80gb", **common)
    early = _step("llama3-8b", "dgx-a100-80gb", **common, recompute_early_stop=True)
    parts = timing.layer_forward(model, cluster, config, default_calibration(), moe=False,
                                 framework="torchtitan")
    h, f = model.hidden_size, model.ffn_hidden_size
    w2_share = h * f / (2 * h * h + 2 * h * model.kv_size + 3 * h * f)
    saved = model.num_layers * w2_share * parts.gemm_s \
        * default_calibration().compute_factor("torchtitan")
    assert plain.compute_s - early.compute_s == pytest.approx(saved, rel=1e-9)
    assert _step("llama3-8b", "dgx-a100-80gb", "megatron", **common).step_s == \
        _step("llama3-8b", "dgx-a100-80gb", "megatron", **common,
              recompute_early_stop=True).step_s


def test_eager_loss_traffic_grows_with_the_vocabulary():
    """torch's unfused fp32 cross entropy moves 44 bytes per logit: a model's LM-head time
    under an eager framework exceeds Megatron's fused loss (28) by more as the vocabulary
    grows."""
    config = ParallelConfig(dp=8, zero_stage=3, micro_batch_size=8, global_batch_size=64,
                            seq_len=2048)
    fused = config.replace(cross_entropy_fusion=True)
    cluster = load_cluster("dgx-a100-80gb", nodes=1)
    calibration = default_calibration()
    small = load_model("llama2-7b")  # 32,000 tokens
    large = dataclasses.replace(small, name="wide-vocab", vocab_size=128_256)
    gap = [timing._lm_head_s(m, cluster, config, calibration, framework="torchtitan")
           - timing._lm_head_s(m, cluster, fused, calibration, framework="megatron")
           for m in (small, large)]
    assert 0 < gap[0] < gap[1]
    assert gap[1] / gap[0] == pytest.approx(large.vocab_rows / small.vocab_rows, rel=0.05)


def test_fsdp_prefetch_hides_latency_that_deepspeed_pays():
    """With prefetch overlap calibrated, FSDP's per-block calls (bytes and ring latency)
    overlap compute, so 512 ranks cost little more than 128; DeepSpeed's per-tensor ZeRO-3
    gathers keep their latency on the critical path either way."""
    calibration = default_calibration()
    common = dict(zero_stage=3, micro_batch_size=8, seq_len=2048, recompute="none")
    steps = {n: _step("llama3-8b", "dgx-h100", nodes=n // 8, dp=n, global_batch_size=8 * n,
                      **common).step_s for n in (128, 512)}
    off = dataclasses.replace(calibration, devices={
        key: dataclasses.replace(dev, prefetch_overlap=None)
        for key, dev in calibration.devices.items()})
    steps_off = {n: _step("llama3-8b", "dgx-h100", nodes=n // 8, dp=n,
                          global_batch_size=8 * n, calibration=off, **common).step_s
                 for n in (128, 512)}
    assert steps[512] - steps[128] < 0.5 * (steps_off[512] - steps_off[128])
    ds = [_step("llama3-8b", "dgx-h100", "deepspeed", nodes=64, dp=512, global_batch_size=4096,
                calibration=cal, **common).step_s for cal in (calibration, off)]
    assert ds[0] == ds[1]
