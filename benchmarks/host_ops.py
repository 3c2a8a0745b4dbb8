"""Host work of one decoder block: ATen ops dispatched per recompute mode, and their host time.

On a GPU the host thread queues kernels ahead of the device, so a layer costs the larger of
its kernels' time and the host's time to issue them. The host's share grows with the ops a
layer dispatches and with what runs around each: under selective recomputation meshplan's
runtime (and torchtitan's per-op policy) wraps every op of the block's forward and of its
recomputation in torch's selective-checkpoint dispatch modes (Python code per op). This
script measures both on the machine it runs on, with the runtime's own ``Block``:

- op counts per micro-batch of one block, forward and backward, under ``none``, ``full`` and
  ``selective`` (the runtime's ``_selective_policy``), counted with a dispatch mode, for the
  Llama-3.2-1B block under bf16 autocast (how a GPU plan runs) and the ``tiny`` block in fp32;
- host seconds per op: one ``tiny``-shaped block (16 tokens, so kernels cost next to
  nothing) timed forward + backward under each mode on one thread; per op of ``none``, and
  the extra of ``selective`` over ``full`` per op that passes the selective modes (the
  forward and the recomputation: twice the forward's ops).

Writes ``host-ops-<device>-<date>.{md,json}`` under ``benchmarks/results/`` (or ``--out``).
A few seconds on a CPU.

    python benchmarks/host_ops.py [--out DIR] [--repeats 7]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime as dt
import functools
import json
import statistics
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from meshplan.costmodel import ModelSpec, load_model
from meshplan.runtime.model import Block
from meshplan.runtime.parallelize import _selective_policy

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("none", "full", "selective")


class _CountOps(TorchDispatchMode):
    """Counts the ATen ops dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _forward(block: Block, x: torch.Tensor, mode: str, autocast: bool) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if mode == "none":
            return block(x)
        if mode == "full":
            return checkpoint(block, x, use_reentrant=False)
        return checkpoint(block, x, use_reentrant=False, context_fn=functools.partial(
            create_selective_checkpoint_contexts, _selective_policy))


def count_ops(model: str | ModelSpec, *, autocast: bool,
              tokens: int = 32) -> dict[str, dict[str, int]]:
    """{mode: {"forward": n, "backward": n}} ATen ops of one block of ``model`` (a catalog
    name or a spec) for one micro-batch (the backward count includes the recomputation it
    triggers). The counts follow the block's structure, not its widths: Llama-3.2-1B narrowed
    to hidden 256 (4 heads, 1 KV head, ffn 1024) dispatches the same 95 / 153, 92 / 305 and
    99 / 299 ops as at full width, in a second instead of 48 on a 2-core CPU."""
    spec = dataclasses.replace(load_model(model) if isinstance(model, str) else model,
                               num_layers=1)
    block = Block(spec)
    x = torch.randn(1, tokens, spec.hidden_size, requires_grad=True)
    out = {}
    for mode in MODES:
        with _CountOps() as forward:
            y = _forward(block, x, mode, autocast)
        with _CountOps() as backward:
            y.float().sum().backward()
        out[mode] = {"forward": sum(forward.ops.values()),
                     "backward": sum(backward.ops.values())}
    return out


def time_block(*, repeats: int, calls: int = 200) -> dict[str, float]:
    """{mode: median seconds of one forward + backward of a 16-token ``tiny`` block} on one
    thread (kernels on 16 x 64 tensors cost next to nothing: the time is host work)."""
    torch.set_num_threads(1)
    spec = dataclasses.replace(load_model("tiny"), num_layers=1)
    block = Block(spec)
    x = torch.randn(1, 16, spec.hidden_size, requires_grad=True)

    def step(mode: str) -> None:
        _forward(block, x, mode, False).sum().backward()

    for mode in MODES:  # warm-up
        for _ in range(calls):
            step(mode)
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(repeats):  # the modes in turn, so that drift in the machine's speed is shared
        for mode in MODES:
            start = time.perf_counter()
            for _ in range(calls):
                step(mode)
            samples[mode].append((time.perf_counter() - start) / calls)
    out = {mode: statistics.median(values) for mode, values in samples.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    counts = {"llama3.2-1b bf16 autocast": count_ops("llama3.2-1b", autocast=True),
              "tiny fp32": count_ops("tiny", autocast=False)}
    seconds = time_block(repeats=args.repeats)
    tiny = counts["tiny fp32"]
    total = {m: tiny[m]["forward"] + tiny[m]["backward"] for m in MODES}
    per_op = seconds["none"] / total["none"]
    sac_ops = 2 * tiny["none"]["forward"]  # the forward and its recomputation
    sac_extra = (seconds["selective"] - seconds["full"]) / sac_ops
    summary = {"host_s_per_op_none": per_op, "sac_extra_s_per_op": sac_extra,
               "sac_to_plain_ratio": sac_extra / per_op,
               "full_over_none": seconds["full"] / seconds["none"],
               "selective_over_none": seconds["selective"] / seconds["none"]}
    lines = [f"# Host work of one decoder block ({dt.date.today()}, CPU, one thread)", "",
             "| block | mode | forward ops | backward ops | total |", "|---|---|---|---|---|"]
    for name, by_mode in counts.items():
        for mode in MODES:
            c = by_mode[mode]
            lines.append(f"| {name} | {mode} | {c['forward']} | {c['backward']} | "
                         f"{c['forward'] + c['backward']} |")
    lines += ["", "| mode | tiny block fwd+bwd (us) |", "|---|---|"]
    lines += [f"| {m} | {seconds[m] * 1e6:.0f} |" for m in MODES]
    lines += ["", f"- host per op under none: {per_op * 1e6:.2f} us",
              f"- selective's extra over full per op passing the selective modes "
              f"({sac_ops} = 2 x forward): {sac_extra * 1e6:.2f} us "
              f"({summary['sac_to_plain_ratio']:.2f}x the plain per-op time)",
              f"- host time over none's: full {summary['full_over_none']:.2f}x, selective "
              f"{summary['selective_over_none']:.2f}x (``timing.HOST_OP_EQUIVALENTS``)"]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"host-ops-cpu-{dt.date.today()}"
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps(
        {"counts": counts, "seconds": seconds, "summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
