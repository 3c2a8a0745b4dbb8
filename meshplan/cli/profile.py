"""``meshplan profile``: measure this machine into a calibration
(``meshplan.workflows.profile``), then print what was measured next to the catalog."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from meshplan.cli.args import positive_int
from meshplan.cli.errors import EXIT_OK
from meshplan.cli.inputs import load_calibration_flag, load_flagged
from meshplan.cli.output import refuse_overwrite
from meshplan.costmodel.config import DTYPES
from meshplan.costmodel.hardware import load_cluster

if TYPE_CHECKING:
    from meshplan.workflows.profile import ProfileResult


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", metavar="FILE", default="calibration.json",
                        help="calibration JSON to write (default calibration.json)")
    parser.add_argument("--measurements", metavar="FILE",
                        help="raw timings and fitted values as JSON (default: --out with "
                             "'-measurements' before '.json')")
    parser.add_argument("--nproc-per-node", type=positive_int, metavar="K",
                        help="local processes for the collectives, groups of 2, 4, ... K "
                             "(default 2 on the CPU, one per GPU up to 8; 1 skips them). Under "
                             "torchrun every process of the job takes part instead, and "
                             "cross-node links are measured too")
    parser.add_argument("--force", action="store_true",
                        help="let --out and --measurements overwrite existing files")
    parser.add_argument("--quick", action="store_true",
                        help="fewer and smaller sizes (seconds; for tests)")
    parser.add_argument("--dtype", choices=DTYPES,
                        help="GEMM dtype (default fp32 on the CPU, bf16 on a GPU)")
    parser.add_argument("--calibration", metavar="FILE",
                        help="calibration the measured values are written over (default: "
                             "built-in)")
    parser.add_argument("--cluster", metavar="NAME",
                        help="catalog cluster whose NIC bandwidth the cross-node fit is "
                             "expressed against (default: the first with this device)")


def run(args: argparse.Namespace) -> int:
    """Under torchrun the ranks other than 0 print nothing and return 0."""
    from meshplan.workflows.profile import measurements_path, profile

    refuse_overwrite("--out", args.out, force=args.force)
    refuse_overwrite("--measurements", measurements_path(args.out, args.measurements),
                     force=args.force)
    base = load_calibration_flag(args.calibration)
    cluster = (load_flagged("--cluster", args.cluster, lambda: load_cluster(args.cluster))
               if args.cluster else None)
    result = profile(out=args.out, measurements=args.measurements,
                     nproc_per_node=args.nproc_per_node, quick=args.quick, dtype=args.dtype,
                     base=base, cluster=cluster)
    if result is None:  # a torchrun rank other than 0
        return EXIT_OK
    print(profile_lines(result))
    print(f"wrote {result.out} (device {result.device_key!r}) and {result.measurements} in "
          f"{result.wall_s:.1f} s")
    return EXIT_OK


def profile_lines(result: ProfileResult) -> str:
    """What was measured, one line per kind, next to the catalog figures."""
    measured, fit, catalog = result.measured, result.fit, result.catalog
    lines = [f"topology   {measured.topology}",
             f"matmul     {fit.matmul_flop_per_s / 1e12:.4g} TFLOP/s + "
             f"{fit.matmul_overhead_s * 1e6:.2f} us/call  ({result.dtype}; catalog peak "
             f"{catalog.peak_flop_per_s / 1e12:.4g})",
             f"memory     {fit.memory_bytes_per_s / 1e9:.1f} GB/s  (catalog "
             f"{catalog.hbm_bytes_per_s / 1e9:.1f})"]
    if fit.gemm_half_rows is not None and fit.fresh_page_bytes_per_s is not None:
        lines.append(f"small ops  GEMMs at half rate at {fit.gemm_half_rows:.1f} rows; fresh "
                     f"pages {fit.fresh_page_bytes_per_s / 1e9:.2f} GB/s  (weight gradients, "
                     f"gather buffers)")
    lines.append("host-dev   " + (", ".join(f"{way} {rate / 1e9:.1f} GB/s" for way, rate in
                                            fit.host_copy_bytes_per_s.items())
                                  or "skipped: no CUDA device (pinned H2D/D2H need one)"))
    lines.append("host adam  " + ", ".join(
        f"{rate / 1e6:.0f} M params/s on {threads} thread{'s' if threads > 1 else ''}"
        for threads, rate in sorted(fit.host_adam_params_per_s.items()))
        + "  (fused fp32 AdamW in host memory: the offloaded optimizer step)")
    reference = {"intra": ("link", catalog.link_bytes_per_s),
                 "inter": ("NIC", catalog.nic_bytes_per_s)}
    for kind in ("intra", "inter"):
        link = fit.links.get(kind)
        if link is None:
            why = ("one process" if kind == "intra" else
                   "one node; run under torchrun --nnodes N to measure it")
            lines.append(f"{kind:<10} not measured ({why})")
            continue
        lines.append(f"{kind:<10} alpha {link.latency_s * 1e6:.1f} us, beta "
                     f"{link.bytes_per_s / 1e9:.2f} GB/s over groups of "
                     f"{', '.join(map(str, link.group_sizes))} ({measured.backend}; catalog "
                     f"{reference[kind][0]} {reference[kind][1] / 1e9:.2f} GB/s)")
    return "\n".join(lines)
