"""``meshplan run``: execute a plan with torch.distributed under torchrun and report measured
against predicted. The runtime is imported only inside ``run`` (DESIGN.md)."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from meshplan.cli.args import positive_float, positive_int
from meshplan.cli.output import check_folder, print_json

if TYPE_CHECKING:
    from meshplan.runtime.report import RunReport


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan_file", metavar="plan.json", help="a plan file (meshplan plan -o)")
    parser.add_argument("--steps", type=positive_int, default=10, metavar="N",
                        help="optimizer steps (default 10; the first is a warm-up)")
    parser.add_argument("--seed", type=int, default=0, help="weights and data seed (default 0)")
    parser.add_argument("--data", metavar="FILE",
                        help="token file (flat uint16/int32 array) instead of synthetic tokens")
    parser.add_argument("--report", metavar="FILE",
                        help="write the run report JSON (schema_version 1) to FILE")
    parser.add_argument("--timeout", type=positive_float, default=60.0, metavar="S",
                        help="process-group timeout in seconds (default 60)")
    saving = parser.add_argument_group("checkpoints (torch.distributed.checkpoint)")
    saving.add_argument("--checkpoint-dir", metavar="DIR",
                        help="checkpoint folder, shared by all nodes (layout: "
                             "runtime/checkpoint.py)")
    saving.add_argument("--checkpoint-every", type=positive_int, metavar="N",
                        help="save after every N steps (default: never; DIR is then only read)")
    saving.add_argument("--resume", action="store_true",
                        help="continue from the latest complete checkpoint in DIR, under this "
                             "plan (it may differ from the one that saved it)")
    group = parser.add_argument_group("torchrun (ignored when already under torchrun)")
    group.add_argument("--nproc-per-node", type=positive_int, metavar="K",
                       help="processes per node (default: the plan's world size / nodes)")
    group.add_argument("--nnodes", type=positive_int, default=1, metavar="N",
                       help="nodes (default 1)")
    group.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                       help="c10d rendezvous (default on one node: 127.0.0.1, a free port)")
    group.add_argument("--rdzv-id", metavar="ID", help="rendezvous job id, the same on all nodes")
    group.add_argument("--max-restarts", type=int, default=0, metavar="K",
                       help="restart the workers up to K times after a failure; they resume "
                            "from the latest checkpoint in DIR (default 0)")
    parser.add_argument("--json", action="store_true",
                        help="print the run report JSON on stdout (progress goes to stderr)")


def run(args: argparse.Namespace) -> int:
    """Exit code 0, or the workers' (1) when one failed; ValueError when refused."""
    from meshplan.runtime import launch
    from meshplan.runtime.train import RunOptions

    if args.data and not os.path.isfile(args.data):
        raise ValueError(f"--data {args.data!r}: no such file")
    check_folder("--report", args.report)
    options = RunOptions(steps=args.steps, seed=args.seed, data=args.data,
                         timeout_s=args.timeout, checkpoint_dir=args.checkpoint_dir,
                         checkpoint_every=args.checkpoint_every or 0, resume=args.resume)
    where = launch.Launch(nproc_per_node=args.nproc_per_node, nnodes=args.nnodes,
                          rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
                          max_restarts=args.max_restarts)
    result = launch.run(args.plan_file, options=options, launch=where, report=args.report,
                        json_output=args.json)
    if result.report is not None:
        if args.json:
            print_json(result.report.to_dict())
        else:
            print(run_summary(result.report))
    return result.exit_code


def run_summary(report: RunReport) -> str:
    """Measured against predicted, for people: step time and the largest per-rank peak."""
    def ratio(measured: float | None, predicted: float) -> str:
        return f"{measured / predicted:.2f}x" if measured is not None and predicted else "n/a"

    lines = [f"ran {len(report.losses)} steps on {report.world_size} processes "
             f"({report.backend}); final loss {report.losses[-1]:.4f}",
             f"step time  measured {report.step_s_median:.4f} s   predicted "
             f"{report.predicted_step_s:.4f} s   ratio "
             f"{ratio(report.step_s_median, report.predicted_step_s)}"]
    if report.resumed_from_step is not None:
        lines.append(f"resumed from checkpoint step-{report.resumed_from_step} "
                     f"({report.restarts} torchrun restarts)")
    if report.peak_bytes is not None:
        lines.append(f"peak/rank  measured {report.peak_bytes / 1e6:.2f} MB   predicted "
                     f"{report.predicted_peak_bytes / 1e6:.2f} MB   ratio "
                     f"{ratio(report.peak_bytes, report.predicted_peak_bytes)}")
    return "\n".join(lines)
