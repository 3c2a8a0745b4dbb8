"""What is alive at the peak of a low-precision step of meshplan's runtime, tensor by tensor.

``benchmarks/gpu_runtime.py`` measures the runtime's peak allocated bytes on a GPU; this
script says what they are. It runs the runtime's own single-GPU training step (ZeRO-0: the
decoder from ``runtime/model.py``, ``apply_checkpointing``, ``torch.autocast`` in the plan's
dtype over forward and loss, ``lm_loss``, backward per micro-batch, AdamW) under a dispatch mode
that records every tensor storage created (``runtime/memory.py``'s live-storage tracker) and,
at each new peak, which op made each live storage, its dtype change for casts, and the phase
of the step (forward of a layer, its recomputation, backward, the optimizer step). Prints the
peak with its composition for each recompute mode, beside ``torch.cuda.max_memory_allocated``
on CUDA (the allocator's view of the same run) and the cost model's prediction for the
``meshplan`` framework. Writes ``memory-breakdown-<device>-<model>-<date>.{md,json}``.

    python benchmarks/gpu_memory_breakdown.py                      # CUDA, llama3.2-1b
    python benchmarks/gpu_memory_breakdown.py --device cpu --model tiny --seq-len 64

On the CPU the step runs in the plan's dtype under CPU autocast (whose op lists differ from
CUDA's: which ops it runs in fp32 is device-specific). Without CUDA and without
``--device cpu`` it stops with one line (exit 2).
"""

from __future__ import annotations

import argparse
import collections
import copy
import datetime as dt
import json
import sys
import time
from pathlib import Path

import torch

from meshplan.costmodel import (ParallelConfig, default_calibration, estimate, load_cluster,
                                load_model)
from meshplan.runtime.memory import LiveStorageTracker
from meshplan.runtime.model import build_decoder
from meshplan.runtime.parallelize import apply_checkpointing
from meshplan.runtime.train import lm_loss

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class PeakComposition(LiveStorageTracker):
    """The live-storage tracker, remembering what made each storage and, at every new peak,
    the live bytes by (op, phase of the step)."""

    def __init__(self) -> None:
        super().__init__()
        self.op = "before tracking"
        self.phase = "setup"
        self.made: dict[int, tuple[str, str]] = {}
        self.at_peak: collections.Counter = collections.Counter()
        self.peak_phase = ""
        self.recording = False
        self._pending = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func).removeprefix("aten.").removesuffix(".default")
        if func is torch.ops.aten._to_copy.default:
            name += f" {args[0].dtype} -> {(kwargs or {}).get('dtype', args[0].dtype)}"
            name = name.replace("torch.", "")
        self.op = name
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _register(self, storage, nbytes):
        entry = super()._register(storage, nbytes)
        self.made[id(entry)] = (self.op, self.phase)
        return entry

    def _add(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self._pending = self.recording
            self.peak_phase = self.phase

    def _free(self, entry) -> None:
        # the live set at a peak is the one just before the first free after it: snapshot it
        # then (once per peak that is followed by a free, not at every allocation)
        if self._pending and self.live_bytes == self.peak_bytes:
            self.snapshot(freed=entry)
        super()._free(entry)

    def snapshot(self, freed=None) -> None:
        """The live bytes by maker; ``freed``: the entry being freed now (its storage has
        already left ``_entries``, but it was live at the peak)."""
        self._pending = False
        self.at_peak = collections.Counter()
        for entry in [*self._entries.values(), *([freed] if freed is not None else [])]:
            if entry.nbytes:
                op, phase = self.made.get(id(entry), ("?", "?"))
                self.at_peak[f"{op} [{_coarse(phase)}]"] += entry.nbytes


def _coarse(phase: str) -> str:
    """``forward``, ``recompute``, ``backward``, ``loss``, ``step`` or ``setup`` of a phase."""
    return phase.split(" ")[0]


def run_mode(spec, base, *, mode: str, dtype: torch.dtype, device: torch.device, micro_batch: int,
             seq_len: int, microbatches: int) -> dict:
    torch.manual_seed(0)
    tracker = PeakComposition()
    copied = copy.deepcopy(base)  # initialised once on the CPU
    with tracker:
        model = copied.to(device)
        del copied
        for param in model.parameters():
            tracker.track(param)
        apply_checkpointing(model, mode)
        blocks = list(model.layers.values())
        for index, block in enumerate(blocks):
            def pre(module, args, index=index):
                tracker.phase = (f"recompute layer {index}" if tracker.phase.startswith(
                    ("backward", "recompute")) else f"forward layer {index}")
            block.register_forward_pre_hook(pre)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4,
                                      fused=device.type == "cuda")
        tokens = torch.randint(0, spec.vocab_size, (2, microbatches * micro_batch, seq_len + 1),
                               device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        for step in range(2):
            if step == 1:
                tracker.reset_peak()
                tracker.recording = True
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
            batch = tokens[step]
            for index, chunk in enumerate(batch.chunk(microbatches)):
                tracker.phase = f"forward mb {index}"
                with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                    logits = model(chunk[:, :-1])
                    tracker.phase = f"loss mb {index}"
                    loss = lm_loss(logits, chunk[:, 1:])
                del logits
                tracker.phase = f"backward mb {index}"
                (loss / microbatches).backward()
                del loss
            tracker.phase = "step"
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if tracker._pending:
            tracker.snapshot()
    allocator = (torch.cuda.max_memory_allocated() if device.type == "cuda" else None)
    return {"mode": mode, "tracked_peak_bytes": tracker.peak_bytes,
            "allocator_peak_bytes": allocator, "peak_phase": tracker.peak_phase,
            "composition": dict(tracker.at_peak.most_common())}


def predicted_peak(model_name: str, spec, *, mode: str, dtype: str, micro_batch: int,
                   seq_len: int, microbatches: int) -> float:
    cluster = load_cluster("dgx-h200", nodes=1, gpus_per_node=1)
    config = ParallelConfig(global_batch_size=micro_batch * microbatches,
                            micro_batch_size=micro_batch, seq_len=seq_len, dtype=dtype,
                            recompute=mode)
    est = estimate(spec, cluster, config, framework="meshplan",
                   calibration=default_calibration())
    return est.memory.peak_bytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3.2-1b")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--modes", default="none,selective,full")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_memory_breakdown.py: no CUDA device here; run it on a GPU machine (or pass "
              "--device cpu)", file=sys.stderr)
        return 2
    spec = load_model(args.model)
    device = torch.device(args.device)
    rows, start = [], time.perf_counter()
    base = build_decoder(spec)
    for mode in args.modes.split(","):
        row = run_mode(spec, base, mode=mode, dtype=DTYPES[args.dtype], device=device,
                       micro_batch=args.micro_batch, seq_len=args.seq_len,
                       microbatches=args.microbatches)
        row["predicted_peak_bytes"] = predicted_peak(
            args.model, spec, mode=mode, dtype=args.dtype, micro_batch=args.micro_batch,
            seq_len=args.seq_len, microbatches=args.microbatches)
        rows.append(row)
        print(f"{mode}: tracked {row['tracked_peak_bytes'] / 2**20:.1f} MiB, allocator "
              f"{(row['allocator_peak_bytes'] or 0) / 2**20:.1f} MiB, predicted "
              f"{row['predicted_peak_bytes'] / 2**20:.1f} MiB, at {row['peak_phase']} "
              f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    lines = [f"# Peak composition: {args.model}, {args.dtype} autocast, micro-batch "
             f"{args.micro_batch} x {args.seq_len}, {args.microbatches} micro-batches, "
             f"{torch.cuda.get_device_name(0) if args.device == 'cuda' else 'cpu'}, "
             f"torch {torch.__version__}", ""]
    for row in rows:
        lines += [f"## {row['mode']}: tracked {row['tracked_peak_bytes'] / 2**20:.1f} MiB, "
                  f"allocator {(row['allocator_peak_bytes'] or 0) / 2**20:.1f} MiB, predicted "
                  f"{row['predicted_peak_bytes'] / 2**20:.1f} MiB; peak at {row['peak_phase']}",
                  "", "| made by [phase] | MiB |", "|---|---|"]
        lines += [f"| {key} | {value / 2**20:.2f} |"
                  for key, value in row["composition"].items() if value >= 2**16]
        lines.append("")
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"memory-breakdown-{args.device}-{args.model}-{dt.date.today()}"
    (args.out / f"{stem}.md").write_text(text + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps({"args": {k: str(v) for k, v in
                                                                vars(args).items()},
                                                       "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
