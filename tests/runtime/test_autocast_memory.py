"""The runtime's 16-bit path (autocast over fp32 weights, ZeRO 0-1) against the cost model's
peak memory for the ``meshplan`` framework.

On a GPU: the peaks ``benchmarks/gpu_runtime.py`` measured on one H200 (torch 2.11,
``torch.cuda.max_memory_allocated``; ``benchmarks/results/gpu-h200-2026-12-04.json``) for
Llama-3.2-1B, bf16, global batch 8 of micro-batch 2 x 2048 tokens. Before the cost model knew
autocast (fp32 residual stream, per-consumer casts of the norms' outputs, the weight cast
cache) it under-predicted them by 4.9-9.3 %.

On the CPU: the same path, run with ``MESHPLAN_CPU_PLAN_DTYPE=1`` (CPU autocast in bf16, the
CPU's unfused RMSNorm) on the tiny model, measured by the runtime's live-tensor tracker.
"""

from __future__ import annotations

import json

import pytest

from meshplan.costmodel import ParallelConfig, default_calibration, estimate, load_cluster, load_model
from meshplan.runtime.train import CPU_PLAN_DTYPE_ENV

H200_PEAKS = {  # plan fields -> measured peak allocated bytes on one H200
    (("recompute", "none"),): 36_065_576_960,
    (("recompute", "selective"),): 31_239_489_536,
    (("recompute", "selective"), ("zero_stage", 1)): 31_239_489_536,
    (("recompute", "full"),): 28_152_481_792,
    (("recompute", "selective"), ("offload", "optimizer")): 21_352_974_336,
}


@pytest.mark.parametrize("fields", list(H200_PEAKS), ids=lambda f: "-".join(v for _, v in f
                                                                           if isinstance(v, str)))
def test_h200_peaks_of_llama_1b_are_predicted_within_half_a_percent(fields):
    config = ParallelConfig(global_batch_size=8, micro_batch_size=2, seq_len=2048,
                            dtype="bf16", **dict(fields))
    est = estimate(load_model("llama3.2-1b"), load_cluster("dgx-h200", nodes=1, gpus_per_node=1),
                   config, framework="meshplan", calibration=default_calibration())
    measured = H200_PEAKS[fields]
    # the allocator also holds cuBLAS's workspace and the like (about 80 MiB here)
    assert measured / est.memory.peak_bytes == pytest.approx(1.0, abs=0.005)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qk-norm"])
def test_cpu_bf16_autocast_peaks_are_predicted(tmp_path, plan_file, torchrun, monkeypatch,
                                               qk_norm):
    """With Qwen3's query and key norms too: under autocast their fp32 weights meet 16-bit
    inputs, so ``torch.rms_norm`` runs its composite, keeping the fp32 input and normalised
    input (``activations.qk_norm_bytes``: 1.057 with the bf16 input counted once)."""
    import dataclasses

    monkeypatch.setenv(CPU_PLAN_DTYPE_ENV, "1")
    model = load_model("tiny")
    if qk_norm:
        model = dataclasses.replace(model, name="tiny-qk-norm", qk_norm=True)
    modes = ("none", "selective", "full")
    plans = [plan_file(model, ParallelConfig(global_batch_size=8, micro_batch_size=2,
                                             seq_len=64, dtype="bf16", recompute=mode),
                       tmp_path / f"{mode}.json") for mode in modes]
    reports = [tmp_path / f"{mode}-report.json" for mode in modes]
    done = torchrun(plans, reports, nproc=1, steps=2)
    assert done.returncode == 0, done.stderr[-2000:]
    for mode, path in zip(modes, reports):
        rank = json.loads(path.read_text())["per_rank"][0]
        assert rank["memory_source"] == "cpu-live-tensors"
        ratio = rank["peak_bytes"] / rank["predicted_peak_bytes"]
        # measured 1.009-1.011; before the autocast terms 1.02-1.17
        assert 0.97 <= ratio <= 1.03, (mode, ratio)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cpu_bf16_autocast_peaks_under_tp_and_sp(tmp_path, plan_file, torchrun, monkeypatch):
    """tp 2 with SP: autocast gathers the norms' fp32 outputs, then casts the whole sequence
    once per consumer matmul (no recomputation: 5.4 % under-predicted while the casts were
    counted sequence-split); the selective policy keeps the gathered fp32 outputs (7.3 % under
    while counted in bf16)."""
    monkeypatch.setenv(CPU_PLAN_DTYPE_ENV, "1")
    for mode, ranks in _run_tiny_bf16(tmp_path, plan_file, torchrun, ("selective", "none"),
                                      tp=2, sp=True):
        for rank in ranks:
            ratio = rank["peak_bytes"] / rank["predicted_peak_bytes"]
            # measured 0.995, or 1.023-1.026 when gloo still holds gathers (GLOO_HELD_GATHERS)
            assert 0.96 <= ratio <= 1.045, (mode, ratio)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_cpu_bf16_autocast_peaks_under_pp2(tmp_path, plan_file, torchrun, monkeypatch):
    """pp 2: the pipeline schedule runs under one autocast context, so the cast cache lives
    through every phase; a recomputed block casts its weights again in its own backward
    (``memory.recompute_cast_bytes``: without it the first stage was 5.2 % under-predicted
    under full recomputation, 2.1 % under selective). The last stage holds the loss before
    any of its blocks recomputes: its loss phase without the recomputation workspace, its
    blocks' backward without the loss's logits (while they were counted together it was 7 %
    over-predicted)."""
    monkeypatch.setenv(CPU_PLAN_DTYPE_ENV, "1")
    for mode, ranks in _run_tiny_bf16(tmp_path, plan_file, torchrun,
                                      ("full", "selective", "none"), pp=2):
        for rank in ranks:
            ratio = rank["peak_bytes"] / rank["predicted_peak_bytes"]
            # measured: first stage 1.018 (full), 0.993 (selective), 1.013 (none); last stage
            # 0.985, 0.978, 1.008
            assert 0.97 <= ratio <= 1.03, (mode, rank["stage"], ratio)


def _run_tiny_bf16(tmp_path, plan_file, torchrun, modes, **fields):
    """Two steps of the tiny model in bf16 on two processes, one plan per recompute mode
    (``fields``: the layout); (mode, the report's per-rank entries) per plan."""
    plans = [plan_file(load_model("tiny"), ParallelConfig(
        global_batch_size=8, micro_batch_size=2, seq_len=64, dtype="bf16", recompute=mode,
        **fields), tmp_path / f"{mode}.json") for mode in modes]
    reports = [tmp_path / f"{mode}-report.json" for mode in modes]
    done = torchrun(plans, reports, nproc=2, steps=2)
    assert done.returncode == 0, done.stderr[-2000:]
    return [(mode, json.loads(report.read_text())["per_rank"])
            for mode, report in zip(modes, reports)]
