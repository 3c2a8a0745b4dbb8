"""Optimizer offload on this CPU: the cost model's offload term against the measured difference.

One plan (a 0.12 B Llama shape, dp 2 ZeRO-3 on two CPU processes, fp32) with and without
``--offload optimizer``, run in turns (``--rounds`` pairs of ``meshplan run``, ``--steps``
steps each, the runtime's median step). The predicted difference is the offload plan's
step less the plain plan's, both by ``estimate``: the host AdamW step and the host copies in,
the device AdamW step out. On a CPU "device" the offloading runtime runs torch's fused CPU
AdamW while the plain plan runs the default foreach kernel, so offload can be the faster.

    python benchmarks/offload_cpu.py [--rounds 3] [--steps 20]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from meshplan.costmodel import ParallelConfig, estimate, load_cluster, load_model
from meshplan.planner.plan import Plan, write_plan

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = dataclasses.replace(
    load_model("llama2-7b"), name="llama-0.12b", num_layers=4, hidden_size=1024, num_heads=8,
    num_kv_heads=None, ffn_hidden_size=2816, vocab_size=32000, padded_vocab_size=None,
    seq_len=128, reported_params=None,
    source="benchmarks/offload_cpu.py: a Llama 2 shape at 0.12 B parameters")
CONFIG = ParallelConfig(dp=2, zero_stage=3, micro_batch_size=1, global_batch_size=2,
                        seq_len=128, dtype="fp32")
TIMEOUT_S = 900


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    cluster = load_cluster("cpu", nodes=1, gpus_per_node=CONFIG.world_size)
    estimates = {name: estimate(MODEL, cluster, CONFIG.replace(offload=offload),
                                framework="meshplan")
                 for name, offload in (("plain", "none"), ("offload", "optimizer"))}
    measured: dict[str, list[float]] = {name: [] for name in estimates}
    with tempfile.TemporaryDirectory() as tmp:
        for name, est in estimates.items():
            write_plan(Plan.from_estimate(est, provenance={"source": "offload_cpu.py"}),
                       Path(tmp) / f"{name}.json")
        for round_ in range(args.rounds):
            for name in estimates:
                report = Path(tmp) / f"{name}-{round_}.json"
                subprocess.run([sys.executable, "-m", "meshplan", "run",
                                str(Path(tmp) / f"{name}.json"), "--steps", str(args.steps),
                                "--report", str(report)], check=True, timeout=TIMEOUT_S,
                               stdout=subprocess.DEVNULL)
                measured[name].append(json.loads(report.read_text())["step_s_median"])
    diffs = [o - p for o, p in zip(measured["offload"], measured["plain"])]
    predicted = estimates["offload"].time.step_s - estimates["plain"].time.step_s
    mean = statistics.mean(diffs)
    lines = [
        "# Optimizer offload on CPU: predicted vs measured step-time difference", "",
        f"{MODEL.name} ({MODEL.num_params / 1e9:.2f} B params), dp 2 ZeRO-3, fp32, 2 CPU "
        f"processes; {args.rounds} rounds of {args.steps} steps (median step of each run).", "",
        "| plan | predicted step s | measured median steps s |", "|---|---|---|",
        *(f"| {name} | {estimates[name].time.step_s:.3f} | "
          f"{', '.join(f'{s:.3f}' for s in measured[name])} |" for name in estimates), "",
        f"offload - plain: predicted {predicted:+.3f} s; measured {mean:+.3f} s "
        f"(rounds {', '.join(f'{d:+.3f}' for d in diffs)}); predicted / measured "
        f"{predicted / mean:.2f}.", ""]
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"offload-cpu-{dt.date.today().isoformat()}"
    (args.out / f"{stem}.md").write_text(text)
    (args.out / f"{stem}.json").write_text(json.dumps(
        {"predicted_s": {n: e.time.step_s for n, e in estimates.items()},
         "measured_s": measured, "predicted_diff_s": predicted, "measured_diff_s": diffs},
        indent=2))


if __name__ == "__main__":
    main()
