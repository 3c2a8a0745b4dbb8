"""How a training step is composed from its stages' terms: written once, for every number type.

The cost model composes float seconds (``estimate.compose_step``, ``timing.StageTime``), the
planner its integer-nanosecond tables (``planner.tables``), its CP-SAT model linear
expressions over solver variables (``planner.solver``) and its lower bounds floats
(``planner.search``), all with these functions, so the four cannot drift apart. Each function
uses only ``+``, ``-``, multiplication by integers and the ``exposed`` and ``largest``
operations it is given; maxima over stages are taken by the caller (``max`` on numbers, an
upper-bound variable in CP-SAT, the mean as a lower bound in the search), and the composed
quantity is passed in.

Per stage and micro-batch (``micro_total``): the terms that add up without overlap, plus the
larger of the exposed ZeRO-2/3 traffic and the exposed parameter-offload traffic, each
``max(0, raw - hidden)`` where compute can hide up to ``hidden`` of it. The two run beside
each other, not one after the other: a block's parameters cross PCIe on their own stream
before its all-gather, and both are issued ahead of the compute (FSDP2's copy-in and
all-gather streams; DeepSpeed's parameter prefetch), so the stage waits for the slower chain.
Adding their exposed parts instead let the same compute hide both, and a step could get
faster as its compute grew (full recomputation beating none under ZeRO-3 with parameter
offload, found by a randomised check of the estimator, 2026-12-07).

Per step (Narayanan et al. 2021, arXiv:2104.04473, Sec. 2.2): with per-micro-batch stage
times ``t_i``, ``m`` micro-batches and ``v`` virtual chunks,
``step = m * max_i t_i + (sum_i t_i - max_i t_i) / v + once`` where ``once`` is the sum of the
largest once-per-step exposed data-parallel traffic, optimizer step and offload step over
stages. For equal stages the middle term is the bubble ``(p - 1) / v * t``, the fraction
``(p - 1) / (v m)`` of the step's compute. ``scaled_step`` is ``v * step``: integral for
integer inputs and linear in its arguments, which is the form the solver minimises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

N = TypeVar("N")
"""A number type: float seconds, integer nanoseconds or a CP-SAT linear expression."""


def exposed(raw: N, hidden: N) -> N:
    """The part of ``raw`` traffic left on the critical path when up to ``hidden`` of it
    overlaps with compute: ``max(0, raw - hidden)``, 0 in ``raw``'s type (float or int)."""
    return max(raw - hidden, raw * 0)


def micro_total(*, linear: N, zero_comm: N, zero_hidden: N, offload_raw: N, offload_hidden: N,
                exposed: Callable[[N, N], N] = exposed,
                largest: Callable[[N, N], N] = max) -> N:
    """One stage's time per micro-batch: ``linear`` (compute, TP/CP/EP/PP communication)
    plus the larger of the exposed ZeRO-2/3 traffic and the exposed parameter-offload traffic
    (module docstring): never less when the compute grows.

    ``exposed`` builds ``max(0, raw - hidden)`` and ``largest`` the larger of two values; a
    CP-SAT caller passes ones that return a variable bounded below by both arguments.
    """
    return linear + largest(exposed(zero_comm, zero_hidden), exposed(offload_raw, offload_hidden))


def once_per_step(*, dp_exposed: N, optimizer: N, offload_step: N) -> N:
    """The once-per-step terms of a step: the largest (over stages) exposed data-parallel
    traffic, optimizer step and offload step, each its own maximum (stages run them in
    parallel after the last micro-batch, each stage its own)."""
    return dp_exposed + optimizer + offload_step


def scaled_step(*, micro_batches: int, vpp: int, top_micro: N, sum_micro: N, once: N) -> N:
    """``v`` times the step time: ``(m v - 1) T + S + v once`` (module docstring).

    ``m`` = ``micro_batches``, ``v`` = ``vpp``, ``T`` = ``top_micro`` (the slowest stage's
    time per micro-batch, ``micro_total``), ``S`` = ``sum_micro`` (the sum of every stage's),
    ``once`` = ``once_per_step``. It takes every micro-batch to cost a stage the same
    ``t_i`` (point-to-point transfers included there) and leaves out where in the pipeline the
    slowest stage sits.
    """
    m, v = micro_batches, vpp
    return (m * v - 1) * top_micro + sum_micro + v * once


def pipeline_bubble(*, vpp: int, top_micro: N, sum_micro: N) -> N:
    """The step's pipeline bubble: ``(S - T) / v`` (float seconds; ``scaled_step`` holds it
    as ``S - T`` without the division)."""
    return (sum_micro - top_micro) / vpp
