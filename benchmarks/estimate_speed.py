"""How long one ``estimate`` call takes in Python (the planner calls it many thousands of times).

Times warm calls (topology and group caches filled by a first call) for a few representative
plans and prints the median and 95th percentile per call; writes
``estimate-speed-cpu-<date>.{md,json,png}`` under ``benchmarks/results/``.

    python benchmarks/estimate_speed.py [--repeats N]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from meshplan.costmodel import ParallelConfig, estimate, load_cluster, load_model  # noqa: E402
from common import save_png  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

CASES = (  # model, cluster, nodes, config
    ("llama3-8b", "dgx-h100", 1,
     ParallelConfig(tp=2, pp=1, dp=4, zero_stage=3, global_batch_size=64, seq_len=8192,
                    recompute="selective")),
    ("megatron-145.6b", "dgx-a100-80gb", 192,
     ParallelConfig(tp=8, pp=8, dp=24, sp=True, zero_stage=1, global_batch_size=2304,
                    recompute="selective")),
    ("mt-nlg-530b", "dgx-a100-80gb", 280,
     ParallelConfig(tp=8, pp=35, dp=8, zero_stage=1, global_batch_size=1920,
                    recompute="full")),
    ("llama3-405b", "dgx-h100", 2048,
     ParallelConfig(tp=8, pp=16, dp=128, sp=True, zero_stage=1, global_batch_size=2048,
                    seq_len=8192, vpp=2, recompute="full")),
    ("mixtral-8x7b", "dgx-h100", 8,
     ParallelConfig(tp=2, pp=4, dp=8, ep=8, sp=True, zero_stage=1, global_batch_size=256,
                    seq_len=4096, recompute="selective")),
)


def time_case(model_name: str, cluster_name: str, nodes: int, config: ParallelConfig,
              repeats: int) -> dict:
    model = load_model(model_name)
    cluster = load_cluster(cluster_name, nodes=nodes)
    estimate(model, cluster, config)  # warm the topology and group caches
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        estimate(model, cluster, config)
        samples.append(time.perf_counter() - start)
    samples.sort()
    return {"model": model_name, "gpus": cluster.num_gpus,
            "plan": f"tp{config.tp} pp{config.pp} dp{config.dp} ep{config.ep}",
            "median_ms": 1e3 * statistics.median(samples),
            "p95_ms": 1e3 * samples[int(0.95 * (len(samples) - 1))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = [time_case(*case, repeats=args.repeats) for case in CASES]
    lines = ["| model | GPUs | plan | median ms | p95 ms |", "|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['gpus']} | {r['plan']} | {r['median_ms']:.3f} | "
              f"{r['p95_ms']:.3f} |" for r in rows]
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"estimate-speed-cpu-{dt.date.today().isoformat()}"
    (args.out / f"{stem}.md").write_text("# estimate() time per call (warm)\n\n"
                                         + "\n".join(lines) + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps(rows, indent=2))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([f"{r['model']}\n{r['gpus']} GPUs" for r in rows], [r["median_ms"] for r in rows])
    ax.axhline(2.0, color="k", ls="--", lw=1, label="2 ms budget")
    ax.set(ylabel="time per estimate() call (ms, median)", xlabel="model and GPU count",
           title="meshplan estimate() speed on this CPU")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend()
    save_png(fig, args.out / f"{stem}.png")


if __name__ == "__main__":
    main()
