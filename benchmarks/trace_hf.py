"""Tracing HuggingFace models without weights: parameters, trace time and peak memory.

Builds GPT-2 124M, Llama-2-7B and Llama-3-70B with ``transformers`` from their published
``config.json`` (no download, no weights) and profiles one training step with
``meshplan.costmodel.hf.trace_hf``. Per model: traced parameters against the published count and
``costmodel.models.from_hf_config``, per-block forward FLOPs against ``costmodel.flops``
(non-causal, as the FLOP counter counts), the trace wall time and the growth of peak RSS.
Each model runs in a fresh process that first traces a tiny model of the same type, so imports
and one-off caches are not counted. Writes ``trace-hf-<date>.{md,json}`` under
``benchmarks/results/``. Needs the ``hf`` extra.

    python benchmarks/trace_hf.py [--micro-batch 1] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing
import resource
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from meshplan.costmodel.flops import attention_flop_per_token, layer_matmul_flop_per_token
from meshplan.costmodel.models import from_hf_config

RESULTS = Path(__file__).resolve().parent / "results"
BF16_BYTES = 2

CASES = {  # name: (published parameters and their source, config.json less tokenizer keys)
    "gpt2-124m": (124_439_808, "released gpt2 checkpoint (Radford et al. 2019)", {
        "model_type": "gpt2", "activation_function": "gelu_new", "attn_pdrop": 0.1,
        "embd_pdrop": 0.1, "resid_pdrop": 0.1, "layer_norm_epsilon": 1e-05, "n_ctx": 1024,
        "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024, "vocab_size": 50257}),
    "llama2-7b": (6_738_415_616, "released checkpoint (Touvron et al. 2023, 2307.09288)", {
        "model_type": "llama", "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 11008, "max_position_embeddings": 4096,
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
        "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "vocab_size": 32000}),
    "llama3-70b": (70_553_706_496, "released checkpoint (Llama Team 2024, 2407.21783)", {
        "model_type": "llama", "hidden_act": "silu", "hidden_size": 8192,
        "intermediate_size": 28672, "max_position_embeddings": 8192,
        "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "vocab_size": 128256}),
}
TINY = {  # warm-up overrides per model_type
    "gpt2": {"n_embd": 64, "n_head": 4, "n_layer": 2},
    "llama": {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 2},
}


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def trace_case(config: dict, micro_batch: int, seq_len: int) -> dict:
    """Runs in a fresh process: warm up on a tiny model, then trace ``config`` once."""
    from meshplan.costmodel.hf import trace_hf

    trace_hf({**config, **TINY[config["model_type"]]}, micro_batch=1, seq_len=8)
    rss_before = _peak_rss_bytes()
    start = time.perf_counter()
    lg = trace_hf(config, micro_batch=micro_batch, seq_len=seq_len)
    trace_s = time.perf_counter() - start
    blocks = [n for n in lg.layers if n.rpartition(".")[2].isdigit()]
    return {"params": lg.total_params, "trace_s": trace_s, "rss_before_bytes": rss_before,
            "rss_growth_bytes": _peak_rss_bytes() - rss_before,
            "rss_peak_bytes": _peak_rss_bytes(), "layers": len(lg.layers),
            "block_fwd_flop": lg.graph.nodes[blocks[0]]["fwd_flop"],
            "total_fwd_flop": lg.total_fwd_flop, "total_bwd_flop": lg.total_bwd_flop}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = []
    context = multiprocessing.get_context("spawn")
    for name, (published, source, config) in CASES.items():
        with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
            row = pool.submit(trace_case, config, args.micro_batch, args.seq_len).result()
        spec = from_hf_config(config, name=name)
        tokens = args.micro_batch * args.seq_len
        analytic = tokens * (layer_matmul_flop_per_token(spec, 0)
                             + attention_flop_per_token(spec, seq_len=args.seq_len))
        rows.append({"model": name, "published_params": published, "source": source,
                     "analytic_params": spec.num_params,
                     "bf16_weight_bytes": BF16_BYTES * published,
                     "block_fwd_vs_analytic": row["block_fwd_flop"] / analytic, **row})
    lines = ["| model | params traced | published | analytic | trace s | peak RSS growth MiB "
             "| process peak RSS MiB | bf16 weights GiB | block fwd FLOP / analytic |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['params']:,} | {r['published_params']:,} | "
              f"{r['analytic_params']:,} | {r['trace_s']:.1f} | "
              f"{r['rss_growth_bytes'] / 2**20:.0f} | {r['rss_peak_bytes'] / 2**20:.0f} | "
              f"{r['bf16_weight_bytes'] / 2**30:.1f} | "
              f"{r['block_fwd_vs_analytic']:.4f} |" for r in rows]
    setup = (f"micro-batch {args.micro_batch} x {args.seq_len} tokens, bf16, one forward and "
             f"backward (labels = input ids); each model in a fresh process after a tiny warm-up")
    print(setup)
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"trace-hf-{dt.date.today().isoformat()}"
    (args.out / f"{stem}.md").write_text("# Tracing HF models without weights\n\n" + setup
                                         + "\n\n" + "\n".join(lines) + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps(
        {"micro_batch": args.micro_batch, "seq_len": args.seq_len, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
