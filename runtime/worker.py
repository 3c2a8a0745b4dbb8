"""The torchrun worker: ``python -m meshplan.runtime.worker '<job JSON>'`` (what ``launch.py`` starts).

A job lists one or more plan files of the same world size and the run options. The worker
joins the process group once and runs the plans one after another, each on a fresh DeviceMesh
(new sub-groups, destroyed after the plan), writing each plan's report on rank 0. Running
several plans in one launch saves the start-up of the processes (seconds per rank on a small
CPU machine), which is what the runtime tests use.

Fail fast: plan checks run before the process group is joined and end the worker with exit
code 2 and one line; a diverged run (NaN/Inf loss or gradient norm, seen alike by every rank)
ends every worker with exit code 3 and one line from rank 0, a damaged checkpoint with exit
code 2 and one line (``integrity.py``); any other error prints its
traceback and ends the process at once
(``os._exit``) so no rank lingers in a collective; torchrun then stops the other ranks.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import traceback
from dataclasses import asdict, dataclass

import torch.distributed as dist

from meshplan.planner.plan import Plan, read_plan
from meshplan.runtime import agent, elastic, prefork
from meshplan.runtime import mesh as mesh_mod
from meshplan.runtime.integrity import CorruptCheckpoint
from meshplan.runtime.report import RunReport
from meshplan.runtime.train import RunOptions, TrainingDiverged, run_plan

EXIT_USAGE = 2
EXIT_FAILED = 1
EXIT_DIVERGED = 3
"""The loss or gradient norm became NaN/Inf (``train.TrainingDiverged``)."""


@dataclass(frozen=True, kw_only=True)
class Job:
    """Plans to run in one launch, where to write their reports, and the run options."""

    plans: tuple[str, ...]
    """Plan files (all of the same world size)."""
    reports: tuple[str | None, ...]
    """Report path per plan (None: no report file)."""
    options: RunOptions
    progress_to_stderr: bool = False
    """Log progress lines on stderr (keeps stdout for ``--json``)."""

    def __post_init__(self) -> None:
        if len(self.plans) != len(self.reports) or not self.plans:
            raise ValueError(f"a job needs one report entry per plan, got {len(self.plans)} "
                             f"plans and {len(self.reports)} reports")
        if self.options.checkpoint_dir and len(self.plans) > 1:
            raise ValueError(f"a job with a checkpoint folder runs one plan, got "
                             f"{len(self.plans)}")

    def to_json(self) -> str:
        return json.dumps({"plans": list(self.plans), "reports": list(self.reports),
                           "options": asdict(self.options),
                           "progress_to_stderr": self.progress_to_stderr})

    @classmethod
    def from_json(cls, text: str) -> "Job":
        data = json.loads(text)
        return cls(plans=tuple(data["plans"]), reports=tuple(data["reports"]),
                   options=RunOptions(**data["options"]),
                   progress_to_stderr=bool(data.get("progress_to_stderr", False)))


def under_torchrun() -> bool:
    """True inside a torchrun worker (RANK and WORLD_SIZE are set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def check_job(job: Job, world_size: int, *, plans: list[Plan] | None = None) -> list[Plan]:
    """Read (unless the caller already did: ``plans``) and check every plan before any work;
    ValueError names the first problem. An elastic job's plan may have another world size
    (``elastic.choose_plan`` replans)."""
    plans = [read_plan(path) for path in job.plans] if plans is None else plans
    for path, plan in zip(job.plans, plans):
        try:
            mesh_mod.check_supported(plan.config, plan.model)
            if not job.options.elastic:
                mesh_mod.check_world_size(plan.config, world_size)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
    return plans


def _configure_logging(rank: int, *, to_stderr: bool) -> None:
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(message)s", stream=sys.stderr if to_stderr else sys.stdout,
                        force=True)


def _write_report(report: RunReport, path: str) -> None:
    """Write ``report`` as JSON; a missing folder (another node's path) only logs a warning."""
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        logging.getLogger(__name__).warning("report not written: no folder for %s on this "
                                            "node (rank 0's)", path)
        return
    with open(path, "w") as out:
        json.dump(report.to_dict(), out, indent=2)
        out.write("\n")


def _refused(rank: int, code: int, err: Exception) -> int:
    """End this worker with ``code`` and one line: recorded in the job's error file for
    ``meshplan run`` to print (``agent.report_error``), else printed by rank 0."""
    line = str(err) or type(err).__name__
    if not agent.report_error(code, line) and rank == 0:
        print(f"meshplan: error: {line}", file=sys.stderr)
    return code


def import_training() -> None:
    """Import ``prefork.TRAINING_MODULES``: the parts of torch.distributed that training
    uses (DTensor, FSDP2, tensor parallelism, ZeRO, pipelining, DCP) and the runtime's own.

    The runtime's modules import them inside the functions that use them, so that
    ``meshplan run``'s launching process, which only checks the plan and starts torchrun,
    starts in about half the time (2 s instead of 5 s of CPU on a 2-core machine). A worker
    imports all of them here, first thing, as it did when they were module-level imports:
    before strict mode (``strict.py``) wraps the collectives when the process group is
    joined, and outside the measured build (``memory.RssGrowth``) and memory windows. A
    worker forked from the preloaded server (``prefork.py``) finds them imported.
    """
    for name in prefork.TRAINING_MODULES:
        importlib.import_module(name)


def run_job(job: Job, *, plans: list[Plan] | None = None) -> int:
    """Run ``job`` in this torchrun worker (its plans already read: ``plans``); returns the
    exit code."""
    import_training()
    rank = int(os.environ.get("RANK", "0"))
    _configure_logging(rank, to_stderr=job.progress_to_stderr)
    try:
        plans = check_job(job, int(os.environ["WORLD_SIZE"]), plans=plans)
    except ValueError as err:
        return _refused(rank, EXIT_USAGE, err)
    backend = mesh_mod.init_distributed(timeout_s=job.options.init_timeout_s)
    chosen = None
    if job.options.elastic:  # one plan (Job checks): the one for this world size
        try:
            chosen = elastic.choose_plan(
                plans[0], world_size=dist.get_world_size(),
                local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                time_limit_s=job.options.replan_time_limit_s)
        except elastic.NoElasticPlan as err:
            return _refused(rank, EXIT_USAGE, err)
        plans = [chosen.plan]
    for plan, report_path in zip(plans, job.reports):
        try:
            report = run_plan(plan, job.options, backend=backend, chosen=chosen)
        except TrainingDiverged as err:  # every rank sees the same loss and norm
            return _refused(rank, EXIT_DIVERGED, err)
        except CorruptCheckpoint as err:  # every rank gets the same verdict
            return _refused(rank, EXIT_USAGE, err)
        if report is not None and report_path:
            _write_report(report, report_path)
    dist.destroy_process_group()
    return 0


def run_job_or_exit(job: Job, *, plans: list[Plan] | None = None) -> int:
    """``run_job``, but any error prints its traceback and ends the process at once: a rank
    that failed must not linger (its peers would wait in a collective until the timeout)."""
    try:
        return run_job(job, plans=plans)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_FAILED)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m meshplan.runtime.worker '<job JSON>' (started by meshplan run)",
              file=sys.stderr)
        return EXIT_USAGE
    return run_job_or_exit(Job.from_json(args[0]))


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
