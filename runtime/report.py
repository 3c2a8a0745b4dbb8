"""The ``run --report`` document (DESIGN.md, schema_version 1), typed, read and written here.

``RunReport`` is what a run measured next to what its plan predicted; ``to_dict`` is the one
place its JSON is produced (the keys of DESIGN.md plus the extras the runtime adds:
``ratio``, ``peak_bytes``, ``step_s``, ``compute_dtype``, ``resumed_from_step``,
``restarts``, ``grad_norms``, ``lrs``, ``optimizer_s``, ``recipe``, ``worker_start``), and
``report_from_dict`` the one place it is read, strictly (``costmodel.jsonio``). Its ``plan``
object is the estimate's (``estimate.config_to_dict``).
Derived values (median step, tokens/s, ratios, the largest peak) are computed from the
measurements, never stored twice.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshplan.costmodel import schema
from meshplan.costmodel.jsonio import (NON_NEGATIVE, POSITIVE, Limit, Rule, Schema,
                                       check_object, load_json_document, schema_of)


def _ratio(measured: float | None, predicted: float | None) -> float | None:
    return measured / predicted if measured is not None and predicted else None


@dataclass(frozen=True, kw_only=True)
class RankReport:
    """One rank's measured peak memory next to its stage's predicted peak."""

    rank: int
    stage: int
    peak_bytes: int | None
    """Peak allocated bytes (None where nothing measured them: CPU without the tracker)."""
    peak_reserved_bytes: int | None
    rss_peak_bytes: int | None
    """Peak resident set size of the process."""
    memory_source: str
    """What measured ``peak_bytes`` (CUDA allocator, live-tensor tracker, none)."""
    predicted_peak_bytes: float | None
    """The plan's prediction for this rank's stage."""
    build_rss_bytes: int | None = None
    """How far the resident memory rose while this rank built (and loaded) its model: its
    shards, plus what building needed beyond them (``memory.RssGrowth``)."""

    @property
    def peak_ratio(self) -> float | None:
        return _ratio(self.peak_bytes, self.predicted_peak_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "stage": self.stage, "peak_bytes": self.peak_bytes,
                "peak_reserved_bytes": self.peak_reserved_bytes,
                "rss_peak_bytes": self.rss_peak_bytes, "memory_source": self.memory_source,
                "predicted_peak_bytes": self.predicted_peak_bytes,
                "peak_ratio": self.peak_ratio, "build_rss_bytes": self.build_rss_bytes}


@dataclass(frozen=True, kw_only=True)
class RunReport:
    """A run of one plan: losses, step times, per-rank peaks, and the plan's predictions."""

    plan: dict[str, Any]
    """The plan's configuration as the estimate writes it (``config_to_dict``)."""
    world_size: int
    backend: str
    losses: tuple[float, ...]
    """Global-batch loss of every step, as rank 0 logs it."""
    step_s: tuple[float, ...]
    """Wall time of every step."""
    predicted_step_s: float
    predicted_peak_bytes: float
    per_rank: tuple[RankReport, ...]
    compute_dtype: str | None = None
    """The dtype the model really computed in (a CPU run of a bf16 plan uses fp32)."""
    resumed_from_step: int | None = None
    restarts: int = 0
    """torchrun restarts before this report."""
    grad_norms: tuple[float, ...] = ()
    """Global gradient L2 norm of every step, before clipping."""
    lrs: tuple[float, ...] = ()
    """Learning rate of every step."""
    optimizer_s: tuple[float, ...] = ()
    """Seconds of clipping and the optimizer step (offload copies included; the slowest
    rank's) of each step this attempt ran: after a resume, only the steps since it."""
    recipe: dict[str, Any] | None = None
    """The training recipe (``recipe.Recipe`` as a dict)."""
    worker_start: str | None = None
    """How the workers started: ``forkserver`` (forks of one preloaded interpreter, the CPU
    default) or ``spawn`` (an interpreter each; ``runtime/prefork.py``)."""
    tracked_steps: tuple[int, ...] = ()
    """Indices into ``step_s`` of the steps this attempt ran under the CPU live-tensor tracker
    (``RunOptions.memory_steps``): its dispatch overhead is in their times, so the median
    leaves them out when other steps were timed. A resumed run's earlier steps are not
    listed."""
    membership_changes: tuple[dict[str, Any], ...] = ()
    """An elastic run's membership records (``elastic.report_changes``), oldest first; the
    document has the key only when there was a change."""
    timeshare: float = 1.0
    """Processes per usable CPU core on node 0, when above 1: a CPU run under
    ``--oversubscribe``. The plan's prediction is for one core per process (one CPU "device"
    each); here each process got ``1 / timeshare`` of one (``timeshared_step_s``). 1 on GPUs
    and when every process had its core."""

    @property
    def timeshared_step_s(self) -> float:
        """The predicted step on the cores the run shared: ``predicted_step_s`` times
        ``timeshare``, as if every process computed all the time (processes idle in a
        pipeline bubble leave their share to the others, so a pipeline can run faster)."""
        return self.predicted_step_s * self.timeshare

    @property
    def step_s_median(self) -> float:
        """Median step time, without the first (warm-up) step when there are several, and
        without the steps timed under the CPU tracker when others were timed."""
        tracked = set(self.tracked_steps)
        bare = [s for index, s in enumerate(self.step_s) if index > 0 and index not in tracked]
        return statistics.median(bare or (self.step_s[1:] if len(self.step_s) > 1
                                          else self.step_s))

    @property
    def tokens_per_s(self) -> float:
        """Global batch x sequence length per median step."""
        return self.plan["global_batch_size"] * self.plan["seq_len"] / self.step_s_median

    @property
    def peak_bytes(self) -> int | None:
        """The largest measured per-rank peak (None if no rank measured one)."""
        peaks = [r.peak_bytes for r in self.per_rank if r.peak_bytes is not None]
        return max(peaks) if peaks else None

    def to_dict(self) -> dict[str, Any]:
        """The ``run --report`` document."""
        return {"schema_version": schema.RUN_REPORT, "plan": self.plan,
                "world_size": self.world_size, "backend": self.backend,
                "losses": list(self.losses), "step_s_median": self.step_s_median,
                "tokens_per_s": self.tokens_per_s,
                "predicted": {"step_s": self.predicted_step_s,
                              "peak_bytes": self.predicted_peak_bytes,
                              "timeshared_step_s": self.timeshared_step_s},
                "ratio": {"step_s": _ratio(self.step_s_median, self.predicted_step_s),
                          "peak_bytes": _ratio(self.peak_bytes, self.predicted_peak_bytes),
                          "timeshared_step_s": _ratio(self.step_s_median,
                                                      self.timeshared_step_s)},
                "timeshare": self.timeshare,
                "peak_bytes": self.peak_bytes, "step_s": list(self.step_s),
                "per_rank": [r.to_dict() for r in self.per_rank],
                "compute_dtype": self.compute_dtype,
                "resumed_from_step": self.resumed_from_step, "restarts": self.restarts,
                "grad_norms": list(self.grad_norms), "lrs": list(self.lrs),
                "optimizer_s": list(self.optimizer_s), "recipe": self.recipe,
                "tracked_steps": list(self.tracked_steps),
                "worker_start": self.worker_start,
                **({"membership_changes": list(self.membership_changes)}
                   if self.membership_changes else {})}


_RANK_SCHEMA = schema_of(RankReport, name="run report rank", extra_keys=True,
                         rules={"peak_ratio": Rule(kind="float", nullable=True)},
                         limits={"rank": NON_NEGATIVE, "stage": NON_NEGATIVE,
                                 "peak_bytes": NON_NEGATIVE, "peak_reserved_bytes": NON_NEGATIVE,
                                 "rss_peak_bytes": NON_NEGATIVE})
_PREDICTED_SCHEMA = Schema(
    name="run report predicted", extra_keys=True, required=frozenset({"step_s", "peak_bytes"}),
    rules={"step_s": Rule(kind="float", limit=POSITIVE),
           "peak_bytes": Rule(kind="float", limit=NON_NEGATIVE)})
REPORT_SCHEMA = schema_of(
    RunReport, name="run report", extra_keys=True,
    exclude=("predicted_step_s", "predicted_peak_bytes"),
    rules={"schema_version": Rule(kind="int", limit=Limit(choices=(schema.RUN_REPORT,))),
           "plan": Rule(kind="object"),
           "recipe": Rule(kind="object", nullable=True),
           "worker_start": Rule(kind="str", nullable=True,
                                limit=Limit(choices=("forkserver", "spawn"))),
           "membership_changes": Rule(kind="list", items=Rule(kind="object")),
           "per_rank": Rule(kind="list", items=Rule(kind="object", schema=_RANK_SCHEMA)),
           "predicted": Rule(kind="object", schema=_PREDICTED_SCHEMA),
           "step_s_median": Rule(kind="float", limit=POSITIVE),
           "tokens_per_s": Rule(kind="float", limit=POSITIVE)},
    limits={"world_size": Limit(minimum=1), "step_s": POSITIVE,
            "timeshare": Limit(minimum=1)},
    required=("schema_version", "plan", "world_size", "backend", "losses", "step_s_median",
              "tokens_per_s", "predicted", "per_rank", "step_s"))
"""The document's keys: DESIGN.md's, the runtime's extras (optional, so reports of 0.1 read),
and unknown extras tolerated, as DESIGN.md lets the report grow. Derived keys (median,
tokens/s, ratios, the largest peak) are checked for type and recomputed, not read."""
_RANK_FIELDS = tuple(f.name for f in dataclasses.fields(RankReport))
_OPTIONAL_FIELDS = ("compute_dtype", "resumed_from_step", "restarts", "recipe",
                    "worker_start", "timeshare")
_OPTIONAL_SERIES = ("grad_norms", "lrs", "optimizer_s", "membership_changes", "tracked_steps")


def report_from_dict(data: Any, *, origin: str) -> RunReport:
    """The RunReport in a ``run --report`` document; one-line ValueError otherwise."""
    check_object(data, REPORT_SCHEMA, origin=origin)
    ranks = tuple(RankReport(**{k: entry[k] for k in _RANK_FIELDS if k in entry})
                  for entry in data["per_rank"])
    return RunReport(plan=data["plan"], world_size=data["world_size"], backend=data["backend"],
                     losses=tuple(data["losses"]), step_s=tuple(data["step_s"]),
                     predicted_step_s=data["predicted"]["step_s"],
                     predicted_peak_bytes=data["predicted"]["peak_bytes"], per_rank=ranks,
                     **{f: data[f] for f in _OPTIONAL_FIELDS if f in data},
                     **{f: tuple(data[f]) for f in _OPTIONAL_SERIES if f in data})


def read_report(path: str | Path) -> RunReport:
    """The run report in the file ``path`` (``report_from_dict``)."""
    return report_from_dict(load_json_document(path, what="run report"), origin=str(path))
