"""Traced models against the analytic cost model, and planning them.

1. A HuggingFace Llama-3-8B built from its config on meta (``costmodel.hf``, needs the ``hf``
   extra) is traced layer by layer and estimated like the catalog's analytic ``llama3-8b``
   under the same configurations (tp 1, which is what a traced model allows): step time and
   per-stage peak memory side by side. They differ where the two models count differently:
   the trace counts non-causal attention FLOPs (``FlopCounterMode`` ignores causality) at the
   matmul efficiency and what eager modules actually save.
2. ``meshplan plan`` wall time for traced models: the example with unlike layers
   (``meshplan.runtime.examples:hybrid``) on the cpu cluster and the traced Llama-3-8B on 64 H100s.

Writes ``traced-models-<date>.{md,json}`` under ``benchmarks/results/``.

    python benchmarks/traced_models.py
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import time
from pathlib import Path

from meshplan.costmodel import ParallelConfig, estimate, load_cluster, load_model
from meshplan.costmodel.hf import hf_config
from meshplan.costmodel.factory import spec_from_graph
from meshplan.costmodel.tracing import trace_module
from meshplan.planner.space import SearchSpace
from meshplan.planner.search import search
from meshplan.costmodel.calibration import default_calibration

RESULTS = Path(__file__).resolve().parent / "results"
SEQ = 8192
LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
             "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
"""Llama-3-8B's published config.json values (Meta, 2024)."""
CONFIGS = {
    "dp64 ZeRO-2": dict(dp=64, zero_stage=2),
    "pp4 dp16 ZeRO-1 full recompute": dict(pp=4, dp=16, zero_stage=1, recompute="full"),
    "pp8 dp8 ZeRO-1": dict(pp=8, dp=8, zero_stage=1),
}


def traced_llama() -> tuple:
    from transformers import AutoModelForCausalLM
    import torch

    config = hf_config(LLAMA3_8B)
    start = time.perf_counter()
    graph = trace_module(lambda: AutoModelForCausalLM.from_config(
                               config, attn_implementation="sdpa"),
                           example_inputs=lambda: {"input_ids": torch.zeros((1, SEQ),
                                                                            dtype=torch.long)},
                           dtype=torch.bfloat16,
                           loss_fn=lambda out: out.logits.float().sum())
    spec = spec_from_graph(graph, name="llama3-8b (traced)", seq_len=SEQ, micro_batch=1,
                           dtype_bytes=2, source="benchmarks/traced_models.py")
    return spec, time.perf_counter() - start


def compare(traced, analytic, cluster) -> list[dict]:
    rows = []
    for name, fields in CONFIGS.items():
        base = ParallelConfig(micro_batch_size=1, global_batch_size=512, seq_len=SEQ, **fields)
        for label, spec in (("analytic", analytic), ("traced", traced)):
            config = base
            if fields.get("pp", 1) > 1:  # same blocks per stage; the traced model's extra
                blocks = base.stage_layers(analytic.num_layers)  # layers go to the ends
                extra = spec.num_layers - analytic.num_layers
                if label == "traced":
                    first = 2  # embedding and rotary embedding
                    blocks = (blocks[0] + first, *blocks[1:-1], blocks[-1] + extra - first)
                config = dataclasses.replace(base, layers_per_stage=tuple(blocks))
            est = estimate(spec, cluster, config)
            rows.append({"config": name, "model": label, "step_s": est.time.step_s,
                         "stage_peaks_gib": [round(s.peak_bytes / 2**30, 2)
                                             for s in est.memory.per_stage]})
    return rows


def plan_times(traced) -> list[dict]:
    rows = []
    hybrid = load_model("meshplan.runtime.examples:hybrid", dtype="fp32")
    cases = (("meshplan.runtime.examples:hybrid", hybrid, load_cluster("cpu"), 8, "fp32"),
             ("llama3-8b (traced)", traced, load_cluster("dgx-h100", nodes=8), 512, "bf16"))
    for name, spec, cluster, batch, dtype in cases:
        space = SearchSpace(global_batch_size=batch, seq_len=spec.seq_len, dtype=dtype,
                            recompute_modes=("none", "full"))
        start = time.perf_counter()
        result = search(spec, cluster, space, framework="meshplan",
                        calibration=default_calibration(), top_k=3)
        best = result.ranked[0].estimate
        rows.append({"model": name, "gpus": cluster.num_gpus, "candidates": result.candidates,
                     "solves": result.solves, "status": result.status,
                     "wall_s": time.perf_counter() - start, "best_step_s": best.time.step_s,
                     "best": f"pp {best.config.pp} dp {best.config.dp} ZeRO-"
                             f"{best.config.zero_stage} mb {best.config.micro_batch_size} "
                             f"layers {list(best.config.stage_layers(spec.num_layers))}"})
    return rows


def main() -> None:
    traced, trace_s = traced_llama()
    analytic = load_model("llama3-8b")
    cluster = load_cluster("dgx-h100", nodes=8)
    rows = compare(traced, analytic, cluster)
    plans = plan_times(traced)
    date = dt.date.today().isoformat()
    lines = [f"# Traced models ({date})", "",
             f"Llama-3-8B traced on meta from its config (1 x {SEQ} tokens, bf16) in "
             f"{trace_s:.1f} s: {traced.num_layers} layers, {traced.num_params:,} params "
             f"(analytic {analytic.num_params:,}).", "",
             "## Same configurations, analytic vs traced (dgx-h100, 8 nodes, tp 1, mb 1, "
             "global batch 512)", "",
             "| configuration | model | step s | peak GiB per stage |", "|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['config']} | {row['model']} | {row['step_s']:.3f} | "
                     f"{', '.join(map(str, row['stage_peaks_gib']))} |")
    lines += ["", "## Planning traced models (meshplan framework, recompute none/full)", "",
              "| model | GPUs | candidates | solves | status | wall s | best step s | best |",
              "|---|---|---|---|---|---|---|---|"]
    for row in plans:
        lines.append(f"| {row['model']} | {row['gpus']} | {row['candidates']} | "
                     f"{row['solves']} | {row['status']} | {row['wall_s']:.2f} | "
                     f"{row['best_step_s']:.4f} | {row['best']} |")
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"traced-models-{date}.md").write_text(text)
    (RESULTS / f"traced-models-{date}.json").write_text(json.dumps(
        {"trace_s": trace_s, "compare": rows, "plans": plans}, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main()
