"""Workers forked from one preloaded interpreter, for launches on the CPU.

A worker spends most of its start-up importing torch and the parts of torch.distributed that
training uses (``TRAINING_MODULES``: DTensor, FSDP2, pipelining, DCP; 5-6 s of CPU each on a
2-core machine). Started as separate interpreters (torchrun's way for a program), every worker
of a node pays that; on a CPU node whose workers share the cores it is most of a short run.
For a launch on the CPU the agent (``agent.py``) instead starts its workers with
multiprocessing's *forkserver*: one server process imports ``TRAINING_MODULES`` once, and each
worker is a fork of it that runs ``entry``. A restart after a failure forks again from the
same server. From ``entry`` on, a worker does what ``python -m meshplan.runtime.worker`` does.

On CUDA the workers stay separate interpreters: a CUDA context cannot be inherited through a
fork, and one CUDA call in the server would break every worker. ``MESHPLAN_WORKER_START``
(``agent.START_ENV``) picks the start method by hand: ``forkserver`` or ``spawn``;
``launch.worker_environment`` sets ``forkserver`` on the CPU unless the user set it.

This module itself imports nothing heavy: the agent imports it to name ``entry``.
"""

from __future__ import annotations

import importlib
import os
import sys

TRAINING_MODULES = (
    "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
    "torch.distributed.pipelining", "torch.distributed.pipelining.schedules",
    "torch.distributed.tensor", "torch.distributed.tensor._utils",
    "meshplan.runtime.chain", "meshplan.runtime.optim", "meshplan.runtime.parallelize",
    "meshplan.runtime.worker",
)
"""What a worker imports before it joins the job (``worker.import_training``), and what the
fork server preloads."""

started_as = "spawn"
"""How this worker started: ``forkserver`` (a fork of the preloaded server, set by ``entry``)
or ``spawn`` (an interpreter of its own); the run report's ``worker_start``."""


def entry(program: str, *argv: str) -> None:
    """A forked worker's main: ``main(argv)`` of the module named ``program`` (what
    ``python -m program argv...`` runs, torchrun's way of naming it; the agent passes
    ``meshplan.runtime.worker`` and its job), from the module the server preloaded. The worker
    is named, not imported here, as torchrun names it: this module stays a leaf that the
    worker itself imports. A non-zero exit code ends the process at once (as a worker of its
    own interpreter does); exit code 0 returns, so that torchrun's process context collects
    the worker's (empty) return value."""
    global started_as
    started_as = "forkserver"
    sys.stdout.reconfigure(line_buffering=True)
    code = importlib.import_module(program).main(list(argv))
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)
