"""Pipeline split: which layers each (virtual) stage holds, and the schedule that runs them.

A plan gives ``layers_per_stage`` (one count per pipeline rank, possibly uneven) and ``vpp``
virtual chunks per rank. With vpp = 1 rank r holds stage r. With vpp = v the model is cut into
p v virtual stages and rank r holds stages r, r + p, ..., r + (v - 1) p (the looped placement of
Narayanan et al. 2021, arXiv:2104.04473, Sec. 2.2.1, which ``ScheduleInterleaved1F1B``
expects); rank r's ``layers_per_stage[r]`` layers are divided over its v chunks as evenly as
possible, the first chunks taking the remainder (``costmodel.config.even_split`` with
``remainder="first"``). Layers are then numbered along the virtual
stage order. Worked example, 8 layers, layers_per_stage (3, 5), p = v = 2:

    virtual stage  0 (rank 0)  1 (rank 1)  2 (rank 0)  3 (rank 1)
    layers         0 1         2 3 4       5           6 7

The embedding sits on virtual stage 0 and the LM head on the last one (rank p - 1).

Schedules: ``Schedule1F1B`` (PipeDream-Flush, Narayanan et al. 2021 Sec. 2.2) for vpp = 1 and
``ScheduleInterleaved1F1B`` for vpp > 1, with the plan's grad_accum_steps as micro-batches
(1F1B needs at least pp of them). The schedules scale gradients by 1 / micro-batches
(``scale_grads=True``), so a mean loss per micro-batch gives the gradient of the batch mean.

torch APIs: ``torch.distributed.pipelining.PipelineStage``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed import ProcessGroup

from meshplan.costmodel.config import ParallelConfig, even_split

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _PipelineSchedule


def virtual_stage_layers(config: ParallelConfig, num_layers: int) -> list[list[int]]:
    """Global layer ids of each virtual stage, in pipeline order (module docstring)."""
    per_rank = config.stage_layers(num_layers)
    counts = [even_split(n, config.vpp, remainder="first") for n in per_rank]
    stages, next_layer = [], 0
    for index in range(config.pp * config.vpp):
        rank, chunk = index % config.pp, index // config.pp
        stages.append(list(range(next_layer, next_layer + counts[rank][chunk])))
        next_layer += counts[rank][chunk]
    return stages


def rank_stage_indices(config: ParallelConfig, pp_rank: int) -> list[int]:
    """Virtual stages held by pipeline rank ``pp_rank``: r, r + p, ..., r + (v - 1) p."""
    return [pp_rank + k * config.pp for k in range(config.vpp)]


def build_schedule(modules: Sequence[nn.Module], stage_indices: Sequence[int], *,
                   config: ParallelConfig, device: torch.device, pp_group: ProcessGroup,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                   ) -> _PipelineSchedule:
    """The pipeline schedule over this rank's stage ``modules`` (already TP/AC/DP-wrapped).

    ``torch.distributed.pipelining`` (which imports torch._dynamo) is imported here, not with
    this module, so that ``meshplan run``'s launching process does not load it
    (``worker.import_training``)."""
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B,
                                              ScheduleInterleaved1F1B)

    num_stages = config.pp * config.vpp
    stages = [PipelineStage(module, index, num_stages, device, group=pp_group)
              for module, index in zip(modules, stage_indices)]
    microbatches = config.grad_accum_steps
    if microbatches < config.pp:
        raise ValueError(f"1F1B needs at least pp = {config.pp} micro-batches per step, the "
                         f"plan has {microbatches} (global batch / (dp x micro-batch))")
    if config.vpp == 1:
        return Schedule1F1B(stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
    return ScheduleInterleaved1F1B(stages, n_microbatches=microbatches, loss_fn=loss_fn)
