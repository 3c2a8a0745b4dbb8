"""Per-step training metrics: one console line and one JSONL record per optimizer step (rank 0).

A record (``StepMetrics.to_dict``, one JSON object per line of ``--metrics FILE``)::

    {"step": 3, "loss": 4.91, "grad_norm": 2.7, "grad_norm_clipped": 1.0, "lr": 0.003,
     "step_s": 0.21, "tokens_per_s": 2438.1, "mfu": 0.0004,
     "allocated_bytes": 1234567, "reserved_bytes": 2345678}

``grad_norm`` is the global L2 gradient norm before clipping, ``grad_norm_clipped`` the norm
measured again after clipping (equal to ``grad_norm`` when clipping did not engage, null
without ``--max-grad-norm``). ``step_s`` is the slowest rank's, memory the largest rank's
bytes at the end of the step (CUDA allocator; live tensors on the CPU, null when not tracked).
``mfu`` = model FLOP per step (the cost model's count for the plan, 6 N per token plus
attention, as in the plan's prediction) / ``step_s`` / world size / the cluster's peak FLOP/s
of the plan's dtype (Chowdhery et al. 2022, arXiv:2204.02311, Appendix B).
A resumed run (from the checkpoint of step K) first drops the file's records of steps after K
(an earlier attempt ran them past its last checkpoint; they are run again), then appends: every
step is in the file once, from the attempt whose result the run kept.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass

from meshplan.planner.plan import Plan

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class StepMetrics:
    """What one optimizer step did (the same on every rank but memory, taken at its max)."""

    step: int
    """Optimizer step, 1-based."""
    loss: float
    grad_norm: float
    grad_norm_clipped: float | None
    lr: float
    step_s: float
    tokens_per_s: float
    mfu: float
    allocated_bytes: int | None
    reserved_bytes: int | None
    optimizer_s: float | None = None
    """Seconds of clipping and the optimizer step (the slowest rank's), within ``step_s``."""

    def to_dict(self) -> dict:
        return asdict(self)

    def console_line(self) -> str:
        clipped = ("" if self.grad_norm_clipped is None
                   else f" (clipped {self.grad_norm_clipped:.4f})")
        memory = ("" if self.allocated_bytes is None else
                  f" mem {self.allocated_bytes / 1e6:.1f}/{self.reserved_bytes / 1e6:.1f} MB")
        # "step K loss" is the progress line the CLI's users and tests read (K 0-based)
        return (f"step {self.step - 1} loss {self.loss:.6f} grad_norm {self.grad_norm:.4f}"
                f"{clipped} lr {self.lr:.3e} step_time {self.step_s:.4f} tokens/s "
                f"{self.tokens_per_s:.1f} mfu {self.mfu:.2%}{memory}")


def mfu(plan: Plan, step_s: float) -> float:
    """Model FLOP utilisation of a step of ``step_s`` seconds (module docstring)."""
    flop = plan.prediction.throughput.model_flop_per_step
    peak = plan.cluster.gpu.peak(plan.config.dtype)
    return flop / step_s / plan.config.world_size / peak


class MetricsLog:
    """Writes ``StepMetrics`` to the log and, on rank 0 with a path, to a JSONL file."""

    def __init__(self, path: str | None, *, rank: int, resumed_from: int | None = None) -> None:
        self._rank = rank
        self._file = None
        if path is not None and rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            if resumed_from is not None:
                _keep_through(path, resumed_from)
            self._file = open(path, "a", buffering=1)  # a line per step, flushed

    def write(self, metrics: StepMetrics) -> None:
        if self._rank != 0:
            return
        logger.info("%s", metrics.console_line())
        if self._file is not None:
            self._file.write(json.dumps(metrics.to_dict()) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _keep_through(path: str, step: int) -> None:
    """Drop the records of steps after ``step`` from the JSONL file ``path`` (atomically; a
    line that is not a record is kept)."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as handle:
        for line in handle:
            try:
                record_step = json.loads(line).get("step")
            except (ValueError, AttributeError):
                record_step = None
            if not isinstance(record_step, int) or record_step <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
    with open(path + ".tmp", "w") as out:
        out.writelines(kept)
    os.replace(path + ".tmp", path)
