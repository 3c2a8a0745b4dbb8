"""Planner time from 8 to 16,384 GPUs, odd node counts included (whole search space).

Each case searches the whole default space (every degree, ZeRO stage, offload, micro-batch,
virtual stages, rank layout, layer split and per-stage recompute) for the fastest plan, with one
CP-SAT worker and a time limit (default 60 s): CPU seconds, status (OPTIMAL, or FEASIBLE with its
proven gap), the wall-clock seconds to its first plan; then the same case with ``--time-limit 1``,
which must still return a plan. Prints a table and writes
``planner-scaling-a100-h100-<date>.{md,json,png}`` under ``benchmarks/results/``.

Every search runs in a fresh Python process, as one ``meshplan plan`` does, and only the search
call is timed (CPU seconds of that process). Timing the cases one after another in one process
measured up to 1.3x more: the caches of the earlier cases stay alive, and the heap the
interpreter manages grows with them.

    python benchmarks/planner_scaling.py [--runs 1] [--time-limit 60] [--cp-comm-type p2p]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing
import statistics
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from meshplan.costmodel import default_calibration, load_cluster, load_model  # noqa: E402
from meshplan.planner.search import search  # noqa: E402
from meshplan.planner.space import SearchSpace  # noqa: E402
from common import print_table, save_png  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

CASES = (  # model, cluster, nodes, global batch (sequences), sequence length, framework
    ("llama3-8b", "dgx-h100", 1, 256, 8192, "meshplan"),
    ("llama3-70b", "dgx-h100", 8, 512, 8192, "megatron"),
    ("mixtral-8x7b", "dgx-h100", 16, 1024, 4096, "megatron"),
    ("gpt3-175b", "dgx-a100-80gb", 64, 1536, 2048, "megatron"),
    ("mt-nlg-530b", "dgx-a100-80gb", 280, 1920, 2048, "megatron"),
    ("llama3-405b", "dgx-h100", 1024, 2048, 8192, "megatron"),
    ("llama3-405b", "dgx-h100", 2048, 2048, 8192, "megatron"),
    ("llama3-8b", "dgx-h100", 3, 192, 8192, "meshplan"),
    ("llama3-70b", "dgx-h100", 5, 480, 8192, "megatron"),
    ("llama3-70b", "dgx-h100", 7, 448, 8192, "megatron"),
    ("gpt3-175b", "dgx-a100-80gb", 97, 1552, 2048, "megatron"),
    ("mt-nlg-530b", "dgx-a100-80gb", 315, 1890, 2048, "megatron"),
    ("llama3-405b", "dgx-h100", 1000, 2000, 8192, "megatron"),
    ("llama3-405b", "dgx-h100", 4096, 2048, 8192, "megatron"),
)


def _timed_search(model_name: str, cluster_name: str, nodes: int, batch: int, seq: int,
                  framework: str, time_limit_s: float,
                  cp_comm_type: str = "auto") -> tuple[float, dict]:
    """One search, in the process it is called in: (CPU seconds, what the table reports)."""
    model, cluster = load_model(model_name), load_cluster(cluster_name, nodes=nodes)
    space = SearchSpace(global_batch_size=batch, seq_len=seq, cp_comm_type=cp_comm_type)
    calibration = default_calibration()
    start = time.process_time()
    result = search(model, cluster, space, framework=framework, calibration=calibration,
                    top_k=1, time_limit_s=time_limit_s)
    cpu_s = time.process_time() - start
    best = result.ranked[0].estimate
    c = best.config
    return cpu_s, {"gpus": cluster.num_gpus, "gpu": cluster.gpu.key, "solves": result.solves,
                   "status": result.status, "gap": result.stats["gap"],
                   "first_plan_s": result.stats["first_plan_s"], "step_s": best.time.step_s,
                   "plan": (f"tp{c.tp} pp{c.pp} dp{c.dp} cp{c.cp} ep{c.ep} z{c.zero_stage} "
                            f"mb{c.micro_batch_size} v{c.vpp}")}


def _fresh_process(*args) -> tuple[float, dict]:
    """``_timed_search`` in a new interpreter (spawned: nothing inherited from this one)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_timed_search, args)


def time_case(model_name: str, cluster_name: str, nodes: int, batch: int, seq: int,
              framework: str, runs: int, time_limit_s: float, cp_comm_type: str = "auto") -> dict:
    case = (model_name, cluster_name, nodes, batch, seq, framework)
    timed = [_fresh_process(*case, time_limit_s, cp_comm_type) for _ in range(runs)]
    cpu_s, result = statistics.median(t for t, _ in timed), timed[-1][1]
    quick_cpu, quick = _fresh_process(*case, 1.0, cp_comm_type)
    return {"model": model_name, "gpus": result["gpus"], "gpu": result["gpu"],
            "solves": result["solves"], "status": result["status"], "gap": result["gap"],
            "cpu_s": cpu_s, "first_plan_s": result["first_plan_s"],
            "limit1_cpu_s": quick_cpu, "limit1_status": quick["status"],
            "limit1_vs_best": quick["step_s"] / result["step_s"],
            "best_step_s": result["step_s"], "best_plan": result["plan"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--only", type=int, nargs="*", help="case indices to run")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--cp-comm-type", default="auto",
                        help="the context-parallel exchange (default auto: the planner "
                             "searches each one the framework runs; p2p: the ring only)")
    parser.add_argument("--tag", default="", help="appended to the output files' names")
    args = parser.parse_args()
    runs = args.runs
    cases = [c for i, c in enumerate(CASES) if args.only is None or i in args.only]
    table = pd.DataFrame([time_case(*case, runs=runs, time_limit_s=args.time_limit,
                                    cp_comm_type=args.cp_comm_type)
                          for case in cases])
    print_table(table, {"cpu_s": "{:.2f}", "first_plan_s": "{:.2f}", "gap": "{:.1%}",
                        "limit1_cpu_s": "{:.2f}", "limit1_vs_best": "{:.4f}",
                        "best_step_s": "{:.3f}"})
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"planner-scaling-a100-h100-{dt.date.today().isoformat()}{args.tag}"
    (args.out / f"{stem}.md").write_text(
        f"# Planner CPU time (median of {runs} searches, each in a fresh process, 1 CP-SAT "
        f"worker, time limit {args.time_limit:g} s)\n\n"
        + table.to_markdown(index=False, floatfmt=".3f") + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps(table.to_dict(orient="records"),
                                                      indent=2))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(table.gpus, table.cpu_s, "o")
    for _, row in table.iterrows():
        ax.annotate(row["model"], (row.gpus, row.cpu_s), fontsize=7,
                    textcoords="offset points", xytext=(3, 3))
    ax.set(xscale="log", xlabel="GPUs", ylabel="planner CPU time (s)",
           title="meshplan planner: full joint search, one CP-SAT worker")
    save_png(fig, args.out / f"{stem}.png")


if __name__ == "__main__":
    main()
