"""Models many times what one rank holds, trained on 8 CPU processes: peak RSS per rank.

Two plans of a Llama-shaped decoder of 0.32 B parameters (1.21 GiB of fp32 weights, 8x one
rank's parameter shard under dp8) on this machine's ``cpu`` cluster (8 gloo processes, fp32,
3 steps), built on ``meta`` and filled shard by shard (runtime/materialize.py), so no rank
ever holds a whole stage while building: ``dp8 zero3`` and ``pp2 dp4 zero3``. Under a
pipeline FSDP keeps the stage gathered and its gradients unsharded through backward
(costmodel/frameworks.py, ``framework_buffer_bytes``), so a rank holds about half the model
there. The 0.55 B shape (``LARGE``, 2.2 GB) was killed for memory on this 23 GiB machine
under both plans (a rank past 3 GB).

Each rank's peak resident set size is compared with the cost model's predicted peak for its
stage plus a fixed overhead: the peak RSS of the same launch shape with the ``tiny`` model,
whose own tensors are negligible (what torch, gloo and Python hold: 345-346 MiB here), plus
``ALLOWANCE_MIB`` for resident memory that is neither a live tensor nor in that baseline
(glibc's arenas for allocations under the workers' 64 KiB mmap threshold, gloo's transient
buffers on its own threads). The allowance is twice the most such memory seen on any rank
(14 MiB, dp8 on 2026-12-02: peak RSS less live-tensor peak less baseline); the table shows that
unexplained part per rank, so how much of the allowance a run uses is visible. The cost model
is meant to be exact, not conservative, so without an allowance a rank whose prediction is
right to the MiB passes or fails by rounding.

    python benchmarks/large_cpu_rss.py [--out DIR]

Writes ``large-cpu-rss-<date>.{md,json}`` under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from meshplan.costmodel import ParallelConfig, estimate, load_cluster, load_model
from meshplan.planner.plan import Plan, write_plan

RESULTS = Path(__file__).resolve().parent / "results"
LARGE = dataclasses.replace(
    load_model("llama2-7b"), name="llama-0.55b", num_layers=16, hidden_size=1536,
    num_heads=12, num_kv_heads=None, ffn_hidden_size=4096, vocab_size=32000,
    padded_vocab_size=None, seq_len=128, reported_params=None,
    source="benchmarks/large_cpu_rss.py: Llama 2 shape scaled to 0.55 B parameters")
COMMON = dict(zero_stage=3, global_batch_size=8, micro_batch_size=1, seq_len=128,
              dtype="fp32")
MEDIUM = dataclasses.replace(LARGE, name="llama-0.32b", num_layers=8)
PLANS = {"dp8 zero3": (MEDIUM, ParallelConfig(dp=8, **COMMON), 3),
         "pp2 dp4 zero3": (MEDIUM, ParallelConfig(pp=2, dp=4, **COMMON), 3)}
TIMEOUT_S = 1500
ALLOWANCE_MIB = 32


def _run(model, config: ParallelConfig, folder: Path, steps: int) -> dict:
    cluster = load_cluster("cpu", nodes=1, gpus_per_node=config.world_size)
    plan = Plan.from_estimate(estimate(model, cluster, config, framework="meshplan"),
                              provenance={"source": "benchmarks/large_cpu_rss.py"})
    path, report = folder / f"{model.name}.json", folder / f"{model.name}-report.json"
    write_plan(plan, path)
    subprocess.run([sys.executable, "-m", "meshplan", "run", str(path), "--steps", str(steps),
                    "--report", str(report), "--oversubscribe"], check=True,
                   timeout=TIMEOUT_S, stdout=subprocess.DEVNULL)
    return json.loads(report.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = []
    lines = []
    for name, (model, config, steps) in PLANS.items():
        with tempfile.TemporaryDirectory() as tmp:
            base = _run(dataclasses.replace(load_model("tiny"), name="tiny"), config, Path(tmp), 1)
            run = _run(model, config, Path(tmp), steps)
        baseline = max(rank["rss_peak_bytes"] for rank in base["per_rank"])
        overhead = baseline + ALLOWANCE_MIB * 2 ** 20
        weights = model.num_params * 4
        lines += [f"## {name}: {model.name} ({model.num_params / 1e9:.2f} B params, "
                  f"{weights / 2 ** 30:.2f} GiB fp32), {steps} steps", "",
                  f"Fixed overhead {overhead / 2 ** 20:.0f} MiB: the peak RSS of the same "
                  f"launch with `tiny` ({baseline / 2 ** 20:.0f} MiB) plus {ALLOWANCE_MIB} MiB. "
                  f"Losses: {[round(x, 4) for x in run['losses']]}.",
                  "", "| rank | stage | peak RSS MiB | RSS growth while building MiB | live "
                  "tensors peak MiB | predicted peak MiB | live / predicted | RSS - live - "
                  "baseline MiB | predicted + overhead MiB | RSS within |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for rank in run["per_rank"]:
            bound = rank["predicted_peak_bytes"] + overhead
            unexplained = rank["rss_peak_bytes"] - (rank["peak_bytes"] or 0) - baseline
            row = {"plan": name, "rank": rank["rank"], "stage": rank["stage"],
                   "rss_peak_bytes": rank["rss_peak_bytes"],
                   "build_rss_bytes": rank["build_rss_bytes"],
                   "live_peak_bytes": rank["peak_bytes"],
                   "predicted_peak_bytes": rank["predicted_peak_bytes"],
                   "baseline_bytes": baseline, "overhead_bytes": overhead,
                   "within": rank["rss_peak_bytes"] <= bound}
            rows.append(row)
            lines.append(f"| {rank['rank']} | {rank['stage']} | "
                         f"{rank['rss_peak_bytes'] / 2 ** 20:.0f} | "
                         f"{(rank['build_rss_bytes'] or 0) / 2 ** 20:.0f} | "
                         f"{(rank['peak_bytes'] or 0) / 2 ** 20:.0f} | "
                         f"{rank['predicted_peak_bytes'] / 2 ** 20:.0f} | "
                         f"{(rank['peak_bytes'] or 0) / rank['predicted_peak_bytes']:.3f} | "
                         f"{unexplained / 2 ** 20:+.1f} | "
                         f"{bound / 2 ** 20:.0f} | {row['within']} |")
        lines.append("")
    text = "# Large models on 8 CPU processes: peak RSS per rank\n\n" + "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"large-cpu-rss-{dt.date.today().isoformat()}"
    (args.out / f"{stem}.md").write_text(text)
    (args.out / f"{stem}.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
