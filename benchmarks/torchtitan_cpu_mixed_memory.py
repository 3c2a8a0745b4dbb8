"""torchtitan's 16-bit and float8 code paths on this CPU: measured peaks against the model.

The other torchtitan CPU rows of ``costmodel/data/memory_runs.json`` train in fp32. These train
as torchtitan runs on GPUs: bf16 parameters through FSDP2's mixed precision (fp32 gradient
reduction), optionally with torchao's float8 linears (tensorwise scaling, the weights
all-gathered in float8 with their scales precomputed, the LM head left in bf16: meshplan's
torchtitan export), eager or with each block compiled. Each plan is meshplan's plan exported
to torchtitan and stepped as rank 0 of torch's fake process group (``gpu_torchtitan_memory.
run_rank``: one process, every buffer of the rank allocated with its real shape; its dry run
reproduces the gloo rows), with meshplan's ``tiny`` shapes: live tensor bytes over two steps
after one, or, compiled, the CPU allocator's bytes (``AllocatorPeak``) over two steps after
two. Each plan runs in a process of its own.

    python benchmarks/torchtitan_cpu_mixed_memory.py            # measure and compare
    python benchmarks/torchtitan_cpu_mixed_memory.py --record   # and write the rows
    python benchmarks/torchtitan_cpu_mixed_memory.py --live PLAN [--within OP]
                                                     # what is alive at PLAN's peak
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS = ROOT / "costmodel" / "data" / "memory_runs.json"
TIMEOUT_S = 600
PLANS = {
    # id: (dp, tp, micro-batch, policy, vocabulary, float8, compile)
    f"torchtitan-cpu-tiny-{kind}-{shape}": (dp, tp, micro, policy, vocab,
                                            kind.startswith("float8"),
                                            "model" if kind.endswith("compile") else "none")
    for kind in ("bf16", "float8", "bf16-compile", "float8-compile")
    for shape, (dp, tp, micro, policy, vocab) in {
        "fsdp2-full-mb8": (2, 1, 8, "full", 256), "fsdp2-none-mb8": (2, 1, 8, "none", 256),
        "fsdp2-op-mb8": (2, 1, 8, "op", 256), "fsdp4-full-mb8": (4, 1, 8, "full", 256),
        "v1024-fsdp2-tp2-full-mb8": (2, 2, 8, "full", 1024),
        "v1024-fsdp2-tp2-op-mb8": (2, 2, 8, "op", 1024),
        # four times the tokens (the compiled full-AC steps' peak moves to the loss, where the
        # final norm's CPU composite holds its fp32 copies: composite_final_norm_bytes)
        "fsdp2-full-mb32": (2, 1, 32, "full", 256), "fsdp2-op-mb32": (2, 1, 32, "op", 256),
        "fsdp2-none-mb32": (2, 1, 32, "none", 256),
        "v1024-fsdp2-tp2-full-mb32": (2, 2, 32, "full", 1024),
        "v1024-fsdp2-tp2-op-mb32": (2, 2, 32, "op", 1024)}.items()
    # torch 2.13 does not compile torchtitan's TP block on the CPU (its AOT autograd refuses
    # the device mesh among the saved values)
    if not (kind.endswith("compile") and tp > 1)
}


def measure_one(plan_id: str) -> dict:
    """Measure one plan in this process (``--one``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_torchtitan_memory import dry_measure
    dp, tp, micro, policy, vocab, float8, compile_mode = PLANS[plan_id]
    measured, predicted = dry_measure(dp, tp, micro, policy, vocab, dtype="bf16",
                                      float8=float8, compile_mode=compile_mode)
    return {"id": plan_id, "measured": measured, "predicted": predicted}


def _allocation_label(ops: str) -> str:
    """The op that made an allocation (``AllocatorPeak.live_at_peak``'s ``<``-joined chain,
    innermost first), beside the first op around it that is not an ATen op."""
    chain = ops.split("<")
    outer = next((op for op in chain if not op.startswith("aten::")), "")
    return f"{chain[0][:28]} in {outer[:60]}" if outer != chain[0] else chain[0][:90]


def print_live(plan_id: str, within: str | None) -> None:
    """The allocations alive at ``plan_id``'s peak (or at the highest point inside ops named
    ``within``), grouped by size and the op that made them (``--live``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_torchtitan_memory import dry_measure
    dp, tp, micro, policy, vocab, float8, compile_mode = PLANS[plan_id]
    measured, predicted, meter = dry_measure(dp, tp, micro, policy, vocab, dtype="bf16",
                                             float8=float8, compile_mode=compile_mode,
                                             live=True)
    try:
        live = meter.live_at_peak(within)
    except ValueError as exc:
        print(f"torchtitan_cpu_mixed_memory: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"{plan_id}: peak {measured} B (model {predicted:.0f} B); "
          f"{sum(size for size, _ in live)} B alive at the point shown, {len(live)} blocks")
    groups = Counter((size, _allocation_label(ops)) for size, ops in live)
    for (size, op), count in sorted(groups.items(), key=lambda item: -item[0][0] * item[1]):
        print(f"{size:>11,d} B x {count:<3d} {op}")


def memory_row(plan_id: str, measured: int) -> dict:
    """``plan_id``'s row of ``memory_runs.json``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from torchtitan_cpu_memory import policy_fields
    dp, tp, micro, policy, vocab, float8, compile_mode = PLANS[plan_id]
    config = {"dp": dp, "zero_stage": 3, "micro_batch_size": micro,
              "global_batch_size": dp * micro, "seq_len": 64, "dtype": "bf16"}
    if tp > 1:
        config.update(tp=tp, sp=True)
    fields = policy_fields(policy)
    config["recompute"] = fields["recompute"]
    if fields["recompute"] == "selective":
        config["selective_ac"] = fields["selective_ac"]
    if float8:
        config["float8"] = True
    if compile_mode != "none":
        config["compile"] = compile_mode
    model = "tiny" if vocab == 256 else {
        "num_layers": 4, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2,
        "ffn_hidden_size": 176, "vocab_size": vocab, "seq_len": 64, "activation": "swiglu",
        "norm": "rmsnorm", "position_embedding": "rope", "linear_bias": False,
        "tied_embeddings": False, "dropout": False, "name": f"tiny-vocab{vocab}"}
    meter = ("bytes held through torch's CPU allocator over steps 3-4 (the profiler's "
             "allocation events: the live-tensor tracker cannot run under compile)"
             if compile_mode != "none" else "peak live tensor bytes over steps 2-3")
    parts = [f"FSDP {dp}"] + ([f"TP {tp} (SP, loss parallelism)"] if tp > 1 else [])
    source = (f"torchtitan 0.2.2's own code path on this project's CPU (torch 2.13.0+cpu), "
              f"one rank of a fake process group of {dp * tp} ({' x '.join(parts)}): meshplan's "
              f"plan exported to torchtitan and read by its ConfigManager; bf16 parameters "
              f"through FSDP2's mixed precision, fp32 reduction"
              + (", torchao 0.18 float8 linears (tensorwise, float8 all-gather, precomputed "
                 "scales, the output layer in bf16)" if float8 else "")
              + (", each block compiled" if compile_mode != "none" else "")
              + f"; activation checkpointing {policy}; the tiny model's shapes"
              + (f" with {vocab} vocabulary rows" if vocab != 256 else "")
              + f", {micro} x 64 tokens; {meter}. Measured {dt.date.today().isoformat()} with "
              f"`python benchmarks/torchtitan_cpu_mixed_memory.py`.")
    return {"id": plan_id, "framework": "torchtitan", "model": model, "cluster": "cpu",
            "nodes": 1, "gpus_per_node": dp * tp, "config": config,
            "measured": {"peak_allocated_bytes": measured}, "source": source}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--one", choices=sorted(PLANS), help=argparse.SUPPRESS)
    parser.add_argument("--plans", nargs="+", choices=sorted(PLANS), default=list(PLANS))
    parser.add_argument("--record", action="store_true",
                        help="write the measured rows into costmodel/data/memory_runs.json")
    parser.add_argument("--live", choices=sorted(PLANS), metavar="PLAN",
                        help="print the allocations alive at PLAN's peak (the CPU allocator's "
                             "events replayed), by size and the op that made them")
    parser.add_argument("--within", metavar="OP",
                        help="with --live: the highest point reached inside ops whose name "
                             "contains OP (e.g. CompiledFunctionBackward), not the step's peak")
    args = parser.parse_args()
    if args.within and not args.live:
        parser.error("--within needs --live PLAN")
    if args.live:
        print_live(args.live, args.within)
        return
    if args.one:
        print(json.dumps(measure_one(args.one)))
        return
    results = []
    for plan_id in args.plans:
        done = subprocess.run([sys.executable, __file__, "--one", plan_id], capture_output=True,
                              text=True, timeout=TIMEOUT_S, cwd=ROOT)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            print(f"{plan_id}: failed\n{done.stderr[-3000:]}", file=sys.stderr)
            raise SystemExit(1)
        result = json.loads(lines[-1])
        results.append(result)
        print(f"{plan_id}: measured {result['measured']} B, predicted "
              f"{result['predicted']:.0f} B, {result['predicted'] / result['measured'] - 1:+.3f}",
              flush=True)
    if args.record:
        data = json.loads(ROWS.read_text())
        new = {r["id"]: memory_row(r["id"], r["measured"]) for r in results}
        kept = [row for row in data["runs"] if row["id"] not in new]
        data["runs"] = kept + list(new.values())
        ROWS.write_text(json.dumps(data, indent=1) + "\n")
        print(f"recorded {len(new)} rows in {ROWS}")


if __name__ == "__main__":
    main()
