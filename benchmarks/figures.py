"""The README's figure: per-GPU memory as stacked bars across ZeRO stages and data-parallel degrees.

Every number comes from ``costmodel.estimate``; this script only sweeps configurations, shapes
the per-stage memory of each estimate into a table and draws it. ``notebooks/01_memory.ipynb``
uses the same helpers (``memory_rows``, ``zero_dp_table``, ``plot_stacked_memory``).

The sweep: ``--model`` with tensor parallelism ``--tp`` inside a node and data parallelism
across nodes (no pipeline), sequence parallelism on, selective recomputation, one sequence per
micro-batch; ZeRO 0-3 at each ``--dp``. Bars stack the allocated bytes of the stage with the
largest reserved memory, a black tick marks its reserved bytes and the dashed line the capacity
of one GPU.

    python benchmarks/figures.py [--model llama2-70b] [--cluster dgx-a100-80gb]
                                 [--framework deepspeed] [--dp 8 64 512] [--out DIR]

Writes ``memory-bars-<model>-<cluster>.png`` (and prints the table in GiB) under
``benchmarks/results/`` by default.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from meshplan.costmodel import FRAMEWORKS, ParallelConfig, estimate, estimate_to_dict, load_cluster
from meshplan.costmodel import load_model
from meshplan.costmodel.estimate import Estimate

RESULTS = Path(__file__).resolve().parent / "results"
GIB = 2**30
COMPONENTS = (("params_bytes", "parameters"), ("grads_bytes", "gradients"),
              ("optimizer_bytes", "optimizer states"), ("activations_bytes", "activations"),
              ("buffers_bytes", "buffers"))
"""Per-stage memory columns of ``estimate_to_dict`` stacked in the bars, bottom first."""
MICRO_BATCHES_PER_STEP = 8
"""Micro-batches per replica per step in the sweep (without pipelining memory does not depend
on it; it only sets the global batch)."""


def stage_table(est: Estimate) -> pd.DataFrame:
    """One row per pipeline stage of ``est``: bytes per component (``estimate_to_dict``)."""
    return pd.DataFrame(estimate_to_dict(est)["memory"]["per_stage"])


def memory_rows(estimates: dict[str, Estimate]) -> pd.DataFrame:
    """One row per labelled estimate: its largest stage's components, reserved bytes, host bytes
    per node for offloaded states, and whether it fits."""
    rows = []
    for label, est in estimates.items():
        stages = stage_table(est)
        worst = stages.loc[stages.reserved_bytes.idxmax()]
        c = est.config
        rows.append({"label": label, "zero_stage": c.zero_stage, "dp": c.dp,
                     "recompute": c.stage_recompute(int(worst.stage)), "offload": c.offload,
                     "stage": int(worst.stage),
                     **{column: float(worst[column]) for column, _ in COMPONENTS},
                     "peak_bytes": float(worst.peak_bytes),
                     "reserved_bytes": float(worst.reserved_bytes),
                     "host_bytes_per_node": est.memory.cpu_bytes_per_node
                     + est.memory.nvme_bytes_per_node,
                     "capacity_bytes": est.memory.capacity_bytes, "fits": est.fits})
    return pd.DataFrame(rows)


def zero_dp_table(model_name: str, cluster_name: str, *, dps: tuple[int, ...], framework: str,
                  tp: int = 8, seq_len: int = 4096, recompute: str = "selective") -> pd.DataFrame:
    """``memory_rows`` for ZeRO 0-3 at each data-parallel degree in ``dps`` (see the module
    docstring for the rest of the configuration)."""
    model = load_model(model_name)
    gpus_per_node = load_cluster(cluster_name).gpus_per_node
    estimates = {}
    for dp in dps:
        if (tp * dp) % gpus_per_node:
            raise ValueError(f"tp x dp = {tp} x {dp} does not fill whole {cluster_name} nodes "
                             f"of {gpus_per_node} GPUs")
        cluster = load_cluster(cluster_name, nodes=tp * dp // gpus_per_node)
        for zero in (0, 1, 2, 3):
            config = ParallelConfig(tp=tp, dp=dp, sp=tp > 1, zero_stage=zero,
                                    recompute=recompute, micro_batch_size=1,
                                    global_batch_size=dp * MICRO_BATCHES_PER_STEP,
                                    seq_len=seq_len)
            estimates[f"ZeRO-{zero}\ndp {dp}"] = estimate(model, cluster, config,
                                                          framework=framework)
    return memory_rows(estimates)


def plot_stacked_memory(ax: plt.Axes, table: pd.DataFrame, *, label_column: str = "label",
                        xlabel: str, title: str) -> None:
    """Stacked bars (GiB) of ``COMPONENTS`` per row of ``table``; a black tick for the reserved
    bytes and a dashed line for the GPU capacity when ``table`` has those columns."""
    bottom = pd.Series(0.0, index=table.index)
    positions = range(len(table))
    for column, name in COMPONENTS:
        values = table[column] / GIB
        ax.bar(positions, values, bottom=bottom, label=name)
        bottom = bottom + values
    if "reserved_bytes" in table:
        ax.scatter(positions, table.reserved_bytes / GIB, marker="_", s=300, color="k",
                   zorder=3, label="reserved (+ allocator slack, communicators)")
    if "capacity_bytes" in table:
        capacity_gib = table.capacity_bytes.max() / GIB
        ax.axhline(capacity_gib, color="k", ls="--", lw=1,
                   label=f"GPU capacity ({capacity_gib:.0f} GiB)")
    ax.set_xticks(list(positions), table[label_column].astype(str), fontsize=8)
    ax.set(xlabel=xlabel, ylabel="allocated memory per GPU (GiB)", title=title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama2-70b", help="catalog model (default %(default)s)")
    parser.add_argument("--cluster", default="dgx-a100-80gb",
                        help="catalog cluster (default %(default)s)")
    parser.add_argument("--framework", default="deepspeed", choices=FRAMEWORKS,
                        help="whose memory accounting (default %(default)s)")
    parser.add_argument("--tp", type=int, default=8, help="tensor-parallel degree (default 8)")
    parser.add_argument("--dp", type=int, nargs="+", default=[8, 64, 512],
                        help="data-parallel degrees (default 8 64 512)")
    parser.add_argument("--seq-len", type=int, default=4096, help="sequence length (default 4096)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="output folder")
    args = parser.parse_args()
    plt.switch_backend("Agg")
    table = zero_dp_table(args.model, args.cluster, dps=tuple(args.dp), framework=args.framework,
                          tp=args.tp, seq_len=args.seq_len)
    columns = {column: f"{name} GiB" for column, name in
               (*COMPONENTS, ("reserved_bytes", "reserved"))}
    shown = table.assign(label=table.label.str.replace("\n", ", "),
                         **{column: table[column] / GIB for column in columns})
    print(shown[["label", *columns, "fits"]].rename(columns=columns)
          .to_string(index=False, float_format="{:.1f}".format))
    fig, ax = plt.subplots(figsize=(1.0 + 0.75 * len(table), 5))
    plot_stacked_memory(ax, table, xlabel="ZeRO stage and data-parallel degree",
                        title=f"{args.model} on {args.cluster} ({args.framework}, tp {args.tp}, "
                              f"seq {args.seq_len}): memory per GPU")
    fig.tight_layout()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"memory-bars-{args.model}-{args.cluster}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
