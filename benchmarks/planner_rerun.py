"""The planner on the published large-scale scenarios: MT-NLG 530B, BLOOM 176B, Llama 3 405B.

For each scenario (model, GPUs, global batch, sequence length, framework of the published run)
the planner searches the whole default space; the table gives the published configuration's
predicted step time, the planner's best plan and its predicted gain (published step time over
the plan's, both under this cost model and calibration). ``--compare FILE`` adds the plan and
gain of an earlier run of this script (its ``.json``), to list how the choices changed.

Scenarios:

* MT-NLG 530B, 280 DGX A100 nodes (2,240 GPUs), batch 1920 x 2048, DeepSpeed + Megatron
  3D parallelism: tp 8, pp 35, dp 8, micro-batch 1, full recomputation (Smith et al. 2022,
  arXiv:2201.11990, Sec. 3; reference run ``mt-nlg-530b-280-nodes``).
* BLOOM 176B, 48 Jean Zay nodes (384 A100 80GB, 4x 100 Gb/s Omni-Path per node), batch 2048
  x 2048, Megatron-DeepSpeed: tp 4, pp 12, dp 8, ZeRO-1, micro-batch 2, full recomputation
  (bigscience-workshop tr11-176B-ml README: model and hardware sections).
* Llama 3 405B, 8,192 and 16,384 H100s, batch 2048 x 8192 (16M tokens): tp 8, pp 16, dp 64 /
  128 with interleaving (Dubey et al. 2024, arXiv:2407.21783, Table 4; reference runs
  ``llama3-405b-8k-gpus``, ``llama3-405b-16k-gpus``).

    python benchmarks/planner_rerun.py [--time-limit S] [--compare results/planner-rerun-X.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path

import pandas as pd

from meshplan.costmodel import (ParallelConfig, default_calibration, estimate, load_cluster,
                                load_model)
from meshplan.costmodel.reference import predict, reference_runs
from meshplan.planner.search import search
from meshplan.planner.space import SearchSpace
from common import print_table  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
REFERENCE_SCENARIOS = ("mt-nlg-530b-280-nodes", "llama3-405b-8k-gpus", "llama3-405b-16k-gpus")
BLOOM = dict(model="bloom-176b", cluster="jean-zay-a100", nodes=48, framework="deepspeed",
             config=dict(tp=4, pp=12, dp=8, zero_stage=1, micro_batch_size=2,
                         global_batch_size=2048, seq_len=2048, recompute="full",
                         flash_attention=False))


def scenarios():
    """(name, model, cluster, framework, published estimate) of every scenario."""
    calibration = default_calibration()
    runs = {run.id: run for run in reference_runs()}
    for name in REFERENCE_SCENARIOS:
        run = runs[name]
        yield name, run.model, run.cluster, run.framework, predict(run, calibration)
    model = load_model(BLOOM["model"])
    cluster = load_cluster(BLOOM["cluster"], nodes=BLOOM["nodes"])
    yield ("bloom-176b-384-gpus", model, cluster, BLOOM["framework"],
           estimate(model, cluster, ParallelConfig(**BLOOM["config"]),
                    framework=BLOOM["framework"], calibration=calibration))


def describe(config: ParallelConfig) -> str:
    recompute = config.recompute if isinstance(config.recompute, str) else "mixed"
    return (f"tp{config.tp} pp{config.pp} dp{config.dp} cp{config.cp} z{config.zero_stage} "
            f"{config.offload} mb{config.micro_batch_size} v{config.vpp} "
            f"{'sp ' if config.sp else ''}{recompute}")


def rows(time_limit_s: float) -> list[dict]:
    out = []
    calibration = default_calibration()
    for name, model, cluster, framework, published in scenarios():
        c = published.config
        space = SearchSpace(global_batch_size=c.global_batch_size, seq_len=c.seq_len,
                            dtype=c.dtype, flash_attention=c.flash_attention)
        result = search(model, cluster, space, framework=framework, calibration=calibration,
                        top_k=1, time_limit_s=time_limit_s)
        best = result.ranked[0].estimate
        out.append({
            "scenario": name, "gpus": cluster.num_gpus, "framework": framework,
            "published": describe(c), "published_step_s": published.time.step_s,
            "published_fits": published.fits,
            "plan": describe(best.config), "plan_step_s": best.time.step_s,
            "gain": published.time.step_s / best.time.step_s,
            "status": result.status, "gap": result.stats.get("gap", 0.0),
        })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--compare", type=Path, help="an earlier run's .json")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--tag", default=dt.date.today().isoformat())
    args = parser.parse_args()
    table = pd.DataFrame(rows(args.time_limit))
    if args.compare:
        before = {r["scenario"]: r for r in json.loads(args.compare.read_text())}
        table["before_plan"] = [before.get(s, {}).get("plan", "") for s in table.scenario]
        table["before_gain"] = [before.get(s, {}).get("gain", float("nan"))
                                for s in table.scenario]
    print_table(table, {"published_step_s": "{:.2f}", "plan_step_s": "{:.2f}",
                        "gain": "{:.3f}", "gap": "{:.3f}", "before_gain": "{:.3f}"}, width=240)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"planner-rerun-{args.tag}"
    (args.out / f"{stem}.md").write_text(
        "# The planner on the published large-scale scenarios\n\n"
        + table.to_markdown(index=False, floatfmt=".3f") + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps(table.to_dict(orient="records"),
                                                      indent=2))


if __name__ == "__main__":
    main()
