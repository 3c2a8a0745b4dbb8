"""One GPU, a ~1B-parameter model, several plans: measured against predicted memory and time.

Runs Llama-3.2-1B (1.24B parameters, bf16, sequence 2048) through ``meshplan run`` on one GPU
under plans that differ in recomputation (none, selective, full) and ZeRO / offload (ZeRO-0,
ZeRO-1, optimizer offload, ZeRO-3 with parameters offloaded; one GPU is one data-parallel
rank, so ZeRO-1 shards nothing and checks that the runtime's ZeRO-1 path costs what ZeRO-0
does), and prints each plan's measured peak allocated and reserved memory and median step time
next to the cost model's prediction for the ``meshplan`` framework on a one-GPU cluster of the
detected kind. Writes ``gpu-<gpu>-<date>.{md,json}`` under ``benchmarks/results/`` (rows as
notebook 03 reads them).

Sized to finish in under 8 minutes on one H200 (about 20 s start-up and 8 steps per plan):

    python benchmarks/gpu_runtime.py [--cluster dgx-h200] [--steps 8] [--plans none,full,...]
    python benchmarks/gpu_runtime.py --dry-run   # CPU: cluster cpu, the tiny model, fp32

``--calibration FILE`` predicts with a calibration JSON (``meshplan profile --out FILE`` on
the same machine first: its host AdamW rate, pinned and pageable copies and GEMM rate replace
the built-in node-level values, which matters for the offload plans on a machine that is a
slice of a node) instead of the built-in one.

On a machine without CUDA (and without ``--dry-run``) it stops with a one-line message
(exit 2). ``--dry-run`` runs every plan the same way on this machine's ``cpu`` cluster with the
``tiny`` model in fp32 (the CPU has no fast bf16), so the script's whole path, from plans to
the results files (``gpu-dryrun-cpu-<date>.*``), is checked where no GPU is lent; its numbers
say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from meshplan.costmodel import ParallelConfig, estimate, load_cluster, load_model
from meshplan.costmodel.calibration import Calibration, default_calibration, load_calibration
from meshplan.planner.plan import Plan, write_plan

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "llama3.2-1b"
COMMON = dict(global_batch_size=8, micro_batch_size=2, seq_len=2048, dtype="bf16")
DRY_MODEL = "tiny"
DRY_COMMON = dict(global_batch_size=8, micro_batch_size=2, seq_len=64, dtype="fp32")
PLANS = {
    "none": dict(recompute="none"),
    "zero1": dict(recompute="selective", zero_stage=1),
    "selective": dict(recompute="selective"),
    "full": dict(recompute="full"),
    "offload-optimizer": dict(recompute="selective", offload="optimizer"),
    "zero3-offload-params": dict(recompute="selective", zero_stage=3,
                                 offload="optimizer+params"),
    # FSDP2's bf16 parameters without autocast: CUDA's fused RMSNorm keeps no normalised
    # copy (activations.layer_activation_bytes, fused_norm; 2026-12-07, not yet on a GPU)
    "zero3-full": dict(recompute="full", zero_stage=3),
}


def make_plan(cluster_name: str, fields: dict, *, dry_run: bool = False,
              calibration: Calibration | None = None, calibration_name: str = "built-in"
              ) -> Plan:
    model = load_model(DRY_MODEL if dry_run else MODEL)
    cluster = load_cluster(cluster_name, nodes=1, gpus_per_node=1)
    config = ParallelConfig(**{**(DRY_COMMON if dry_run else COMMON), **fields})
    est = estimate(model, cluster, config, framework="meshplan",
                   calibration=calibration or default_calibration())
    return Plan.from_estimate(est, provenance={"calibration": calibration_name,
                                               "source": "benchmarks/gpu_runtime.py"})


def run_plan(plan: Plan, steps: int, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        plan_file, report_file = Path(tmp) / "plan.json", Path(tmp) / "report.json"
        write_plan(plan, plan_file)
        subprocess.run([sys.executable, "-m", "meshplan", "run", str(plan_file),
                        "--steps", str(steps), "--report", str(report_file),
                        "--nproc-per-node", "1"], check=True, timeout=timeout_s)
        return json.loads(report_file.read_text())


def write_results(rows: list[dict], args: argparse.Namespace) -> None:
    """Print the table and (re)write ``gpu-<gpu>-<date>.{md,json}``: called after each plan,
    so a run cut short keeps the plans it finished."""
    table = pd.DataFrame(rows)
    for column in ("measured_peak_bytes", "measured_step_s"):
        if column not in table:
            table[column] = float("nan")
    table["peak_ratio"] = table.measured_peak_bytes / table.predicted_peak_bytes
    table["step_ratio"] = table.measured_step_s / table.predicted_step_s
    pd.set_option("display.width", 200)
    print(table.to_string(index=False))
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = "dryrun-cpu" if args.dry_run else load_cluster(args.cluster).gpu.key
    model = DRY_MODEL if args.dry_run else MODEL
    stem = f"gpu-{gpu}-{dt.date.today().isoformat()}"
    (args.out / f"{stem}.md").write_text(f"# {model} on one {gpu}: measured vs predicted\n\n"
                                         + table.to_markdown(index=False, floatfmt=".4g") + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps(table.to_dict(orient="records"),
                                                      indent=2))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", default="dgx-h200",
                        help="catalog cluster whose GPU this is (default dgx-h200)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--plans", default=",".join(PLANS),
                        help=f"comma-separated subset of {', '.join(PLANS)}")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per plan")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--calibration", metavar="FILE",
                        help="calibration JSON to predict with (default: the built-in one)")
    parser.add_argument("--dry-run", action="store_true",
                        help="run every plan on this machine's CPU (tiny model, fp32)")
    args = parser.parse_args()
    try:
        calibration = load_calibration(args.calibration)
    except (OSError, ValueError) as error:
        print(f"gpu_runtime.py: --calibration: {error}", file=sys.stderr)
        return 2
    import torch
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_runtime.py: no CUDA device here; run it on a GPU machine (or pass "
              "--dry-run)", file=sys.stderr)
        return 2
    names = args.plans.split(",")
    unknown = [n for n in names if n not in PLANS]
    if unknown:
        print(f"gpu_runtime.py: unknown plan {unknown[0]!r}; choose from {', '.join(PLANS)}",
              file=sys.stderr)
        return 2
    cluster_name = "cpu" if args.dry_run else args.cluster
    device_name = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(0)
    rows, start = [], time.perf_counter()
    for name in names:
        plan = make_plan(cluster_name, PLANS[name], dry_run=args.dry_run,
                         calibration=calibration,
                         calibration_name=args.calibration or "built-in")
        row = {"plan": name, "gpu": device_name,
               "predicted_peak_bytes": plan.prediction.memory.peak_bytes,
               "predicted_reserved_bytes": plan.prediction.memory.peak_reserved_bytes,
               "predicted_step_s": plan.prediction.step_s,
               # the step's optimizer and offload terms, beside the run's optimizer phase
               "predicted_optimizer_s": plan.prediction.time.optimizer_s,
               "predicted_offload_s": plan.prediction.time.offload_s}
        try:
            report = run_plan(plan, args.steps, args.timeout)
        except (subprocess.SubprocessError, OSError, ValueError) as error:
            # one plan that fails (out of memory, a hang past --timeout) keeps the others
            why = (f"timed out after {error.timeout:.0f} s"
                   if isinstance(error, subprocess.TimeoutExpired) else
                   f"exit {error.returncode}" if isinstance(error, subprocess.CalledProcessError)
                   else f"{type(error).__name__}: {error}"[:160])
            print(f"{name}: failed: {why}", file=sys.stderr)
            rows.append({**row, "error": why})
        else:
            rank = report["per_rank"][0]
            rows.append({**row, "measured_peak_bytes": rank["peak_bytes"],
                         "measured_reserved_bytes": rank["peak_reserved_bytes"],
                         "predicted_peak_bytes": rank["predicted_peak_bytes"],
                         "measured_step_s": report["step_s_median"],
                         "predicted_step_s": report["predicted"]["step_s"],
                         # clipping and the optimizer step (host copies included), the
                         # first step left out
                         "measured_optimizer_s": statistics.median(
                             report["optimizer_s"][1:] or report["optimizer_s"])})
        print(f"{name}: done after {time.perf_counter() - start:.0f} s", file=sys.stderr)
        write_results(rows, args)
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
