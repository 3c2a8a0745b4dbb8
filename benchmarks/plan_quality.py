"""Plan quality: the planner's best plan against each published configuration.

For every published run in ``costmodel/data/reference_runs.json`` (model, GPU count, global
batch, sequence length, framework), plan with the default search space under the run's own
settings (``planner.space.SETTING_FIELDS``: torch.compile, float8, the attention kernel, the
gradient reduce dtype, TP overlap, ...: what the trainer ran, not layout choices the planner
searches) and compare the best plan's predicted throughput with the published
configuration's, both under the same cost model and calibration. Also reports the published
configuration's rank among the planner's ranked candidates (``>K`` when more than K plans beat
it). Writes
``plan-quality-a100-h100-<date>.{md,json,png}`` under ``benchmarks/results/``.

    python benchmarks/plan_quality.py [--time-limit S] [--top K]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from meshplan.costmodel import default_calibration  # noqa: E402
from meshplan.costmodel.reference import predict, reference_runs  # noqa: E402
from meshplan.planner.search import search  # noqa: E402
from meshplan.planner.space import SETTING_FIELDS, SearchSpace  # noqa: E402
from common import print_table, save_png  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def quality_rows(time_limit_s: float, top_k: int) -> list[dict]:
    calibration = default_calibration()
    rows = []
    for run in reference_runs():
        published = predict(run, calibration)
        space = SearchSpace(global_batch_size=run.config.global_batch_size,
                            seq_len=run.config.seq_len, dtype=run.config.dtype,
                            flash_attention=run.config.flash_attention,
                            **{name: getattr(run.config, name) for name in SETTING_FIELDS})
        result = search(run.model, run.cluster, space, framework=run.framework,
                        calibration=calibration, top_k=top_k, time_limit_s=time_limit_s)
        best = result.ranked[0].estimate
        faster = sum(1 for s in result.ranked if s.step_s < published.time.step_s - 1e-9)
        rank = str(faster + 1) if faster < len(result.ranked) else f">{len(result.ranked)}"
        c = best.config
        rows.append({
            "run": run.id, "gpus": run.cluster.num_gpus, "framework": run.framework,
            "published_tokens_per_s": published.throughput.tokens_per_s,
            "planner_tokens_per_s": best.throughput.tokens_per_s,
            "ratio": best.throughput.tokens_per_s / published.throughput.tokens_per_s,
            "published_rank": rank,
            "planner_plan": (f"tp{c.tp} pp{c.pp} dp{c.dp} cp{c.cp} z{c.zero_stage} "
                             f"{c.offload} mb{c.micro_batch_size} v{c.vpp} "
                             f"{c.recompute if isinstance(c.recompute, str) else 'mixed'}"),
            "solver_status": result.status, "solver_wall_s": result.wall_s,
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--top", type=int, default=50, help="candidates ranked per search")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    table = pd.DataFrame(quality_rows(args.time_limit, args.top))
    print_table(table, {"published_tokens_per_s": "{:,.0f}", "planner_tokens_per_s": "{:,.0f}",
                        "ratio": "{:.3f}", "solver_wall_s": "{:.2f}"}, width=220)
    print(f"\nplanner >= published on {int((table.ratio >= 1 - 1e-9).sum())} of {len(table)} "
          f"runs; mean ratio {table.ratio.mean():.3f}, min {table.ratio.min():.3f}")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"plan-quality-a100-h100-{dt.date.today().isoformat()}"
    (args.out / f"{stem}.md").write_text("# Planner's best plan vs published configurations\n\n"
                                         + table.to_markdown(index=False, floatfmt=".3f") + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps(table.to_dict(orient="records"), indent=2))
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.barh(table.run, table.ratio)
    ax.axvline(1.0, color="k", lw=1)
    ax.set(xlabel="planner's best / published configuration (predicted tokens/s, ratio)",
           ylabel="published run", title="meshplan planner vs published configurations")
    ax.tick_params(axis="y", labelsize=7)
    save_png(fig, args.out / f"{stem}.png")


if __name__ == "__main__":
    main()
