"""torchrun, started by ``meshplan run``: ``python -m meshplan.runtime <torchrun args>``
(``runtime/__main__.py``; ``python -m meshplan.runtime.agent`` runs the same).

It is torchrun's own ``main`` (``torch.distributed.run``) with one difference, how a failure
ends. A worker that refuses its input (a damaged checkpoint, a diverged loss, a plan that does
not fit the launch) writes one line to the job's error file (``ERROR_FILE`` in its environment,
``report_error``) and exits; this agent then ends quietly with that worker's exit code, and
``meshplan run`` prints the line. Without the file (a crash: the worker printed its own
traceback) torchrun's failure table is kept, it names the rank and exit code that failed.

Also quiet: torchrun's log lines about stopping the other workers once the error file exists,
and a rendezvous that ended for want of nodes (recorded in the file as ``too_few_nodes``).
"""

from __future__ import annotations

import json
import logging
import os
import sys

ERROR_FILE = "MESHPLAN_ERROR_FILE"
"""Environment variable: where a worker records the error that ended it (first one wins)."""
START_ENV = "MESHPLAN_WORKER_START"
"""Environment variable: how this agent starts its workers: ``forkserver`` (forks of one
preloaded interpreter, ``prefork.py``; what ``meshplan run`` asks for on the CPU) or
``spawn`` (one interpreter each, torchrun's way; the default)."""
TOO_FEW_NODES = "too_few_nodes"
"""The error file's ``kind`` when the rendezvous ended for want of nodes."""
AGENT_LOGGERS = ("torch.distributed.elastic.multiprocessing.api",
                 "torch.distributed.elastic.agent.server.api",
                 "torch.distributed.elastic.agent.server.local_elastic_agent",
                 "torch.distributed.launcher.api", "torch.distributed.run")
"""torchrun's loggers that report on workers being stopped after one failed."""


def report_error(code: int, message: str, *, kind: str = "worker") -> bool:
    """Record ``message`` (one line) and ``code`` in the job's error file; False without one
    (a worker started by hand under torchrun: the caller prints instead). The first record
    wins: peers that reach the same verdict leave it."""
    path = os.environ.get(ERROR_FILE)
    if not path:
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return True
    except OSError:  # the folder is gone (the launcher ended): nothing to tell
        return False
    with os.fdopen(fd, "w") as out:
        json.dump({"code": code, "message": message, "kind": kind}, out)
    return True


def read_error(path: str) -> dict | None:
    """The recorded error (``code``, ``message``, ``kind``), or None when none was written."""
    try:
        with open(path) as handle:
            record = json.load(handle)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "code" in record else None


class _AfterRecordedError(logging.Filter):
    """Drops torchrun's log records once a worker has recorded its error."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def filter(self, record: logging.LogRecord) -> bool:
        return not os.path.exists(self.path)


def main(argv: list[str]) -> int:
    forked = os.environ.get(START_ENV) == "forkserver"
    if forked:  # the server imports the training stack while this process imports torchrun
        _start_forkserver()
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import (RendezvousClosedError,
                                                          RendezvousTimeoutError)

    path = os.environ.get(ERROR_FILE)
    if path:
        for name in AGENT_LOGGERS:
            logging.getLogger(name).addFilter(_AfterRecordedError(path))
    try:
        if forked:
            _run_forked(argv)
        else:
            torchrun.main(argv)
    except ChildFailedError:
        recorded = read_error(path) if path else None
        if recorded is None:
            raise
        return int(recorded["code"])
    except (RendezvousTimeoutError, RendezvousClosedError) as ended:
        if not path:
            raise
        report_error(4, str(ended) or type(ended).__name__, kind=TOO_FEW_NODES)
        return 4
    return 0


def _start_forkserver() -> None:
    """Start multiprocessing's fork server, preloading ``prefork.TRAINING_MODULES``."""
    import multiprocessing
    import multiprocessing.forkserver

    from meshplan.runtime import prefork

    multiprocessing.set_forkserver_preload(list(prefork.TRAINING_MODULES))
    multiprocessing.forkserver.ensure_running()


def _run_forked(argv: list[str]) -> None:
    """torchrun's ``run`` with the worker program (``-m meshplan.runtime.worker JOB``)
    run as ``prefork.entry("meshplan.runtime.worker", JOB)`` in forks of multiprocessing's
    fork server (``_start_forkserver``). ``torchrun.run`` also fills in a rendezvous for
    ``--standalone`` and the static backend; the command line meshplan builds names its c10d
    rendezvous, and others are refused here rather than half supported."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.launcher.api import elastic_launch

    from meshplan.runtime import prefork

    args = torchrun.parse_args(argv)
    if not args.module or args.training_script != "meshplan.runtime.worker":
        raise ValueError(f"{START_ENV}=forkserver runs meshplan's worker only, "
                         f"not {args.training_script!r}")
    if args.standalone or args.rdzv_backend == "static":  # torchrun.run rewrites these
        raise ValueError(f"{START_ENV}=forkserver needs an explicit c10d rendezvous "
                         f"(--rdzv-backend c10d --rdzv-endpoint --rdzv-id, as "
                         f"launch.torchrun_command passes)")
    config, _, _ = torchrun.config_from_args(args)
    config.start_method = "forkserver"
    try:
        record(elastic_launch(config=config, entrypoint=prefork.entry))(
            args.training_script, *args.training_script_args)
    finally:
        _stop_forkserver()


def _stop_forkserver() -> None:
    """Stop multiprocessing's fork server and wait for it. The server reaps the workers it
    forked, so once waited for, their CPU time and its own (the preload's imports) count
    among this agent's children (``RUSAGE_CHILDREN``) and so among ``meshplan run``'s:
    ``meshplan validate`` subtracts that from the machine's busy time to tell other
    processes' load (``workflows.validate.foreign_cores``). Left running, the server outlived
    the agent unwaited, an orphan, and the run's own workers counted as other processes' load
    (0.9 of this machine's 2 cores in every CPU ``validate``). Its resource tracker is left to
    end with the agent, as multiprocessing's own exit handlers expect; it does no work."""
    import multiprocessing.forkserver

    stop = getattr(multiprocessing.forkserver._forkserver, "_stop", None)
    if stop is not None:  # CPython's (3.8-3.14) way to stop the server and wait for it
        stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
