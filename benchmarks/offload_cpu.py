"""Optimizer offload on this CPU: the cost model's offload term against the measured difference.

Two plans of a 0.12 B Llama shape (fp32), each with and without ``--offload optimizer``: one
process (``dp1``: ZeRO-Offload's one-GPU case) and two processes under ZeRO-3 (``dp2 zero3``).
Each pair runs in turns (``--rounds`` pairs of ``meshplan run``, ``--steps`` steps each); a
round's sample is the offload run's median step less the plain run's, and the samples' mean
and median are reported (the median is robust to a round another process on this 2-core
machine slowed). The predicted difference is the offload plan's step less the plain plan's,
both by ``estimate``: the host AdamW step and the host copies in, the device AdamW step out.
On a CPU "device" the offloading runtime runs torch's fused CPU AdamW while the plain plan
runs the default foreach kernel, so offload can be the faster.

Beside the step, each run reports the seconds of its optimizer phase (clipping and the
optimizer step, offload copies included: the run report's ``optimizer_s``), which is the only
phase the offload term describes; the difference of those medians is printed too, so a
step-time difference that forward and backward's run-to-run noise moves can be told from an
offload term that is wrong.

The sequence is short by default (``--seq-len 32``, two micro-batches of one sequence): the
offload term is a once-per-step phase that does not depend on the tokens, while forward and
backward's run-to-run spread on this shared 2-core machine grows with them. At 128 tokens
forward and backward take about 4 s a step and move by +-0.2 s between runs, as much as the
difference being measured (rounds of one dp2 measurement ranged from -0.07 to -0.89 s); at 32
tokens they take a quarter of that, and the difference stands out of the noise.

    python benchmarks/offload_cpu.py [--rounds 5] [--steps 20] [--seq-len 32]
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
COMMON = dict(micro_batch_size=1, global_batch_size=2, dtype="fp32")
PLANS = {"dp1": ParallelConfig(dp=1, zero_stage=0, **COMMON),
         "dp2 zero3": ParallelConfig(dp=2, zero_stage=3, **COMMON)}
TIMEOUT_S = 900


def _median_after_first(values: list[float]) -> float:
    return statistics.median(values[1:] if len(values) > 1 else values)


def measure(name: str, config: ParallelConfig, rounds: int, steps: int, seq_len: int) -> dict:
    config = config.replace(seq_len=seq_len)
    model = dataclasses.replace(MODEL, seq_len=seq_len)
    cluster = load_cluster("cpu", nodes=1, gpus_per_node=config.world_size)
    estimates = {kind: estimate(model, cluster, config.replace(offload=offload),
                                framework="meshplan")
                 for kind, offload in (("plain", "none"), ("offload", "optimizer"))}
    step_s: dict[str, list[float]] = {kind: [] for kind in estimates}
    optimizer_s: dict[str, list[float]] = {kind: [] for kind in estimates}
    with tempfile.TemporaryDirectory() as tmp:
        for kind, est in estimates.items():
            write_plan(Plan.from_estimate(est, provenance={"source": "offload_cpu.py"}),
                       Path(tmp) / f"{kind}.json")
        for round_ in range(rounds):
            for kind in estimates:
                report = Path(tmp) / f"{kind}-{round_}.json"
                subprocess.run([sys.executable, "-m", "meshplan", "run",
                                str(Path(tmp) / f"{kind}.json"), "--steps", str(steps),
                                "--report", str(report)], check=True, timeout=TIMEOUT_S,
                               stdout=subprocess.DEVNULL)
                data = json.loads(report.read_text())
                step_s[kind].append(data["step_s_median"])
                optimizer_s[kind].append(_median_after_first(data["optimizer_s"]))
    diffs = [o - p for o, p in zip(step_s["offload"], step_s["plain"])]
    phase = [o - p for o, p in zip(optimizer_s["offload"], optimizer_s["plain"])]
    return {"plan": name, "predicted_s": {k: e.time.step_s for k, e in estimates.items()},
            "predicted_optimizer_s": {k: e.time.optimizer_s + e.time.offload_s
                                      for k, e in estimates.items()},
            "measured_s": step_s, "measured_optimizer_s": optimizer_s,
            "predicted_diff_s": estimates["offload"].time.step_s
            - estimates["plain"].time.step_s,
            "predicted_optimizer_diff_s": sum(
                sign * (estimates[k].time.optimizer_s + estimates[k].time.offload_s)
                for sign, k in ((1, "offload"), (-1, "plain"))),
            "measured_diff_s": diffs, "measured_optimizer_diff_s": phase}


def describe(result: dict, rounds: int, steps: int) -> list[str]:
    predicted, diffs = result["predicted_diff_s"], result["measured_diff_s"]
    phase = result["measured_optimizer_diff_s"]
    mean, median = statistics.mean(diffs), statistics.median(diffs)
    phase_median = statistics.median(phase)
    phase_predicted = result["predicted_optimizer_diff_s"]
    procs = 1 if result["plan"] == "dp1" else 2
    return [
        f"## {result['plan']}: {procs} CPU process(es), {rounds} rounds of {steps} steps", "",
        "| plan | predicted step s | measured median steps s | predicted optimizer phase s "
        "| measured optimizer phase s |", "|---|---|---|---|---|",
        *(f"| {kind} | {result['predicted_s'][kind]:.3f} | "
          f"{', '.join(f'{s:.3f}' for s in result['measured_s'][kind])} | "
          f"{result['predicted_optimizer_s'][kind]:.3f} | "
          f"{', '.join(f'{s:.3f}' for s in result['measured_optimizer_s'][kind])} |"
          for kind in ("plain", "offload")), "",
        f"offload - plain, step: predicted {predicted:+.3f} s; measured mean {mean:+.3f} s, "
        f"median {median:+.3f} s (rounds {', '.join(f'{d:+.3f}' for d in diffs)}); "
        f"predicted / measured {predicted / mean:.2f} (mean), {predicted / median:.2f} "
        f"(median).", "",
        f"offload - plain, optimizer phase: predicted {phase_predicted:+.3f} s; measured "
        f"median {phase_median:+.3f} s (rounds {', '.join(f'{d:+.3f}' for d in phase)}); "
        f"predicted / measured {phase_predicted / phase_median:.2f}.", ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--plans", nargs="+", choices=sorted(PLANS), default=list(PLANS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    results = [measure(name, PLANS[name], args.rounds, args.steps, args.seq_len)
               for name in args.plans]
    lines = ["# Optimizer offload on CPU: predicted vs measured step-time difference", "",
             f"{MODEL.name} ({MODEL.num_params / 1e9:.2f} B params), fp32, micro-batch 1, "
             f"global batch 2, seq {args.seq_len}; the run's median step (first step left "
             "out).", ""]
    for result in results:
        lines += describe(result, args.rounds, args.steps)
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"offload-cpu-{dt.date.today().isoformat()}"
    (args.out / f"{stem}.md").write_text(text)
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
