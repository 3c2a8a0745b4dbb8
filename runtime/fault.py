"""Fault injection for the fault-tolerance tests: one rank dies abruptly, once.

``MESHPLAN_FAULT_AT_STEP=k`` makes global rank ``MESHPLAN_FAULT_RANK`` (default 0) end with
``os._exit(1)`` right after step k (counted from 1; after that step's checkpoint when one is
due), as a crashed or killed process would: no cleanup, its peers left waiting in a collective
until torchrun stops them (with ``MESHPLAN_FAULT_NAN=1`` it writes NaN into a parameter before
that step instead). ``MESHPLAN_FAULT_MARKER`` names a file that the rank creates just
before it exits; while the file exists no fault is injected, so the job torchrun restarts (with
``--max-restarts``) runs through. With ``MESHPLAN_FAULT_HOLD=1`` no rank exits: after step k
every rank waits (at most ``HOLD_MAX_S``) until the marker exists, rank 0 having created
``<marker>.held``; a test then changes the job's membership at a known step (kills a node or
starts one) and creates the marker.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

FAULT_EXIT_CODE = 1
HOLD_MAX_S = 300.0
"""The longest a held rank waits for the marker (a test that forgot it still ends)."""


@dataclass(frozen=True, kw_only=True)
class Fault:
    """Which rank dies after which step, and the marker that makes it happen once."""

    step: int
    rank: int
    marker: str
    hold: bool = False
    """Wait after the step until the marker exists instead of exiting (``MESHPLAN_FAULT_HOLD``)."""
    nan: bool = False
    """Instead of ending the process, write NaN into the rank's first parameter before the
    step (``MESHPLAN_FAULT_NAN=1``): the step's loss and gradients become NaN."""

    def __post_init__(self) -> None:
        if self.step < 1 or self.rank < 0:
            raise ValueError(f"MESHPLAN_FAULT_AT_STEP must be >= 1 and MESHPLAN_FAULT_RANK "
                             f">= 0, got {self.step} and {self.rank}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "Fault | None":
        """The fault the environment asks for, or None."""
        if "MESHPLAN_FAULT_AT_STEP" not in env:
            return None
        if not env.get("MESHPLAN_FAULT_MARKER"):
            raise ValueError("MESHPLAN_FAULT_AT_STEP needs MESHPLAN_FAULT_MARKER (a file path: "
                             "the fault happens only while it does not exist)")
        return cls(step=int(env["MESHPLAN_FAULT_AT_STEP"]),
                   rank=int(env.get("MESHPLAN_FAULT_RANK", "0")),
                   marker=env["MESHPLAN_FAULT_MARKER"],
                   nan=env.get("MESHPLAN_FAULT_NAN", "0") not in ("", "0"),
                   hold=env.get("MESHPLAN_FAULT_HOLD", "0") not in ("", "0"))

    def before_step(self, step: int, rank: int, modules: list) -> None:
        """With ``nan``: poison the first parameter of the faulty rank before step ``step``."""
        if not self.nan or step != self.step or rank != self.rank:
            return
        param = next(p for m in modules for p in m.parameters())
        local = param.to_local() if hasattr(param, "to_local") else param
        logger.warning("fault injection: rank %d writes NaN into a parameter before step %d",
                       rank, step)
        with torch.no_grad():
            local.fill_(float("nan"))

    def after_step(self, step: int, rank: int) -> None:
        """End this process if it is the faulty rank, ``step`` is the fault's, and the marker
        does not exist yet (creating it first)."""
        if self.hold and step == self.step and not os.path.exists(self.marker):
            self._hold(rank)
            return
        if (self.nan or self.hold or step != self.step or rank != self.rank
                or os.path.exists(self.marker)):
            return
        with open(self.marker, "w") as handle:
            handle.write(f"rank {rank} exited after step {step}\n")
        logger.warning("fault injection: rank %d exits after step %d", rank, step)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(FAULT_EXIT_CODE)

    def _hold(self, rank: int) -> None:
        if rank == 0:
            with open(self.marker + ".held", "w") as handle:
                handle.write(f"held after step {self.step}\n")
            logger.warning("fault injection: every rank waits after step %d for %s", self.step,
                           self.marker)
        deadline = time.monotonic() + HOLD_MAX_S
        while not os.path.exists(self.marker) and time.monotonic() < deadline:
            time.sleep(0.05)
