"""One GPU: profile it, plan with that calibration, refit on one plan, check on another.

Four ``meshplan`` commands, each in a fresh interpreter as a user runs them:

1. ``profile`` (bf16; NCCL collectives when there are >= 2 GPUs, none on one GPU, where the
   links keep the built-in values) -> ``profile.json``;
2. ``plan`` Llama-3.2-1B (1.24B parameters, global batch 8, sequence 2048) on ``dgx-h200``
   restricted to one node of one GPU (``--nodes 1 --gpus-per-node 1``, as
   ``gpu_runtime.py`` does) with ``--calibration profile.json``;
3. ``validate --refit`` the best plan (plan A) under the profiled calibration ->
   ``refit.json``;
4. ``validate --calibration refit.json`` the best plan that differs from A and offloads
   nothing (plan B): does a factor fitted on one plan carry to another?

Prints every figure and writes ``gpu-profile-validate-<gpu>-<date>.{md,json}`` (plus the
calibration, measurement and plan files) under ``--out``: ``$OUT`` when set, else
``benchmarks/results/``. Sized for under 8 minutes on one H200 (profile about 1 min, plan
under 30 s, each validate about 1 min of torchrun start-up and 6 steps).

    python benchmarks/gpu_profile_validate.py [--cluster dgx-h200] [--steps 6]
    python benchmarks/gpu_profile_validate.py --dry-run   # CPU: cluster cpu, tiny, --quick

Without CUDA (and without ``--dry-run``) it stops at once with one line (exit 2).
``--dry-run`` runs the same steps on the CPU (cluster ``cpu``, the ``tiny`` model, ``profile
--quick``, sequence 64) to test the plumbing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 480.0
"""The whole script should finish within this on one H200."""
GPU_SETUP = dict(model="llama3.2-1b", global_batch="8", seq_len="2048", plan_time_limit="30")
DRY_SETUP = dict(model="tiny", global_batch="8", seq_len="64", plan_time_limit="10")
STEP_LINE = re.compile(r"step time\s+measured ([\d.e+-]+) s\s+predicted ([\d.e+-]+) s")
REFIT_LINE = re.compile(r"^refit\s.*?(?:factor|scaled by) ([\d.e+-]+)", re.MULTILINE)


def meshplan(*argv: str, timeout_s: float) -> str:
    """``python -m meshplan ARGV``; its stdout (stderr passes through). Raises on failure."""
    print(f"$ meshplan {' '.join(argv)}", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, "-m", "meshplan", *argv], cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, timeout=timeout_s, check=False)
    print(done.stdout, file=sys.stderr, end="", flush=True)
    if done.returncode != 0:
        raise SystemExit(f"gpu_profile_validate.py: 'meshplan {argv[0]}' failed "
                         f"(exit {done.returncode})")
    return done.stdout


def validate(plan_file: Path, *, calibration: Path, steps: int, refit: Path | None,
             timeout_s: float) -> dict:
    """``meshplan validate``: measured and predicted step time, ratio, refit factor."""
    argv = ["validate", str(plan_file), "--steps", str(steps), "--calibration", str(calibration)]
    if refit is not None:
        argv += ["--refit", "--out", str(refit)]
    out = meshplan(*argv, timeout_s=timeout_s)
    step = STEP_LINE.search(out)
    if step is None:
        raise SystemExit(f"gpu_profile_validate.py: no 'step time' line in:\n{out}")
    measured_s, predicted_s = float(step.group(1)), float(step.group(2))
    factor = REFIT_LINE.search(out)
    return {"plan": plan_file.name, "calibration": calibration.name,
            "measured_step_s": measured_s, "predicted_step_s": predicted_s,
            "ratio": measured_s / predicted_s,
            "refit_factor": float(factor.group(1)) if factor else None}


def choose_plans(plans: list[dict]) -> tuple[dict, dict]:
    """Plan A: the best; plan B: the best other plan without offload."""
    keys = ("tp", "pp", "dp", "zero_stage", "offload", "recompute", "micro_batch_size")
    same = lambda p, q: all(p[k] == q[k] for k in keys)  # noqa: E731
    first = plans[0]
    other = next((p for p in plans[1:] if p["offload"] == "none" and not same(p, first)), None)
    if other is None:
        raise SystemExit("gpu_profile_validate.py: the planner returned no second plan "
                         "without offload; raise --top")
    return first, other


def summary(plan: dict) -> str:
    return (f"tp{plan['tp']} pp{plan['pp']} dp{plan['dp']} zero{plan['zero_stage']} "
            f"offload {plan['offload']} recompute {plan['recompute']} "
            f"mb {plan['micro_batch_size']}")


def run(args: argparse.Namespace, out: Path) -> dict:
    setup = DRY_SETUP if args.dry_run else GPU_SETUP
    cluster = "cpu" if args.dry_run else args.cluster
    start, walls = time.perf_counter(), {}
    profile, raw = out / "profile.json", out / "profile-measurements.json"
    nproc = "2" if args.dry_run else str(max(1, min(8, args.gpus)))
    meshplan("profile", "--out", str(profile), "--measurements", str(raw), "--nproc-per-node",
             nproc, *(["--quick"] if args.dry_run else []), timeout_s=240)
    walls["profile"] = time.perf_counter() - start
    planned = json.loads(meshplan(
        "plan", "--model", setup["model"], "--cluster", cluster, "--nodes", "1",
        "--gpus-per-node", "1", "--global-batch", setup["global_batch"], "--seq-len",
        setup["seq_len"], "--calibration", str(profile), "--top", "8", "--time-limit",
        setup["plan_time_limit"], "--json", timeout_s=120))
    walls["plan"] = time.perf_counter() - start - sum(walls.values())
    plan_a, plan_b = choose_plans(planned["plans"])
    files = {"A": out / "plan-a.json", "B": out / "plan-b.json"}
    for name, plan in (("A", plan_a), ("B", plan_b)):
        files[name].write_text(json.dumps(plan, indent=2) + "\n")
    refit = out / "refit.json"
    checks = [validate(files["A"], calibration=profile, steps=args.steps, refit=refit,
                       timeout_s=args.timeout)]
    walls["validate A --refit"] = time.perf_counter() - start - sum(walls.values())
    checks.append(validate(files["B"], calibration=refit, steps=args.steps, refit=None,
                           timeout_s=args.timeout))
    walls["validate B"] = time.perf_counter() - start - sum(walls.values())
    measured = json.loads(raw.read_text())
    return {"dry_run": args.dry_run, "cluster": cluster, "model": setup["model"],
            "device": measured["measurements"]["device_key"],
            "topology": measured["measurements"]["topology"], "profile_note": measured["note"],
            "profile_fit": measured["fit"],
            "plans": {"A": summary(plan_a), "B": summary(plan_b)},
            "plan_predicted_step_s": {"A": plan_a["predicted"]["time"]["step_s"],
                                      "B": plan_b["predicted"]["time"]["step_s"]},
            "validate": checks, "wall_s": walls, "total_s": time.perf_counter() - start,
            "budget_s": BUDGET_S}


def markdown(result: dict) -> str:
    fit = result["profile_fit"]
    lines = [f"# meshplan profile + validate on {result['device']} "
             f"({'dry run, CPU' if result['dry_run'] else result['cluster']})", "",
             f"profile: {result['profile_note']}", f"topology: {result['topology']}", "",
             "| profiled value | measured |", "|---|---|",
             f"| GEMM rate | {fit['matmul_flop_per_s'] / 1e12:.4g} TFLOP/s |",
             f"| GEMM overhead | {fit['matmul_overhead_s'] * 1e6:.2f} us/call |",
             f"| memory copy | {fit['memory_bytes_per_s'] / 1e9:.1f} GB/s |"]
    lines += [f"| host-device {way} | {rate / 1e9:.1f} GB/s |"
              for way, rate in fit["host_copy_bytes_per_s"].items()]
    lines += [f"| {kind} alpha / beta | {link['latency_s'] * 1e6:.1f} us / "
              f"{link['bytes_per_s'] / 1e9:.2f} GB/s |" for kind, link in fit["links"].items()]
    lines += ["", "| step | plan | calibration | measured s | predicted s | measured / "
              "predicted | refit factor |", "|---|---|---|---|---|---|---|"]
    for name, check in zip(("A (refit)", "B (check)"), result["validate"]):
        factor = f"{check['refit_factor']:.3f}" if check["refit_factor"] else "-"
        lines.append(f"| {name} | {result['plans'][name[0]]} | {check['calibration']} | "
                     f"{check['measured_step_s']:.4f} | {check['predicted_step_s']:.4f} | "
                     f"{check['ratio']:.2f} | {factor} |")
    walls = ", ".join(f"{k} {v:.0f} s" for k, v in result["wall_s"].items())
    lines += ["", f"wall: {walls}; total {result['total_s']:.0f} s "
              f"(budget {result['budget_s']:.0f} s)"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", default="dgx-h200",
                        help="catalog cluster whose GPU this is (default dgx-h200)")
    parser.add_argument("--steps", type=int, default=6, help="steps per validate (default 6)")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds per validate")
    parser.add_argument("--dry-run", action="store_true",
                        help="the same steps on the CPU (cluster cpu, tiny, profile --quick)")
    parser.add_argument("--out", type=Path,
                        default=Path(os.environ["OUT"]) if os.environ.get("OUT") else RESULTS)
    args = parser.parse_args()
    import torch
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_profile_validate.py: no CUDA device here; run it on a GPU machine "
              "(or pass --dry-run)", file=sys.stderr)
        return 2
    args.gpus = torch.cuda.device_count()
    device = "dryrun-cpu" if args.dry_run else re.sub(r"\W+", "-",
                                                        torch.cuda.get_device_name(0)).lower()
    stem = f"gpu-profile-validate-{device}-{dt.date.today().isoformat()}"
    out = args.out / stem
    out.mkdir(parents=True, exist_ok=True)
    result = run(args, out)
    text = markdown(result)
    print(text)
    (args.out / f"{stem}.md").write_text(text)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out / stem}.md, .json and the files under {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
