"""The training recipe: learning-rate schedule, AdamW hyperparameters, global gradient clipping.

``Recipe`` holds what ``meshplan run`` takes as ``--lr``, ``--warmup-steps``, ``--lr-schedule``,
``--min-lr``, ``--weight-decay``, ``--max-grad-norm`` and ``--optimizer-impl``; checkpoints
store it (``checkpoint.TrainState.recipe``) and a resume under another recipe is refused, so a
resumed run continues the schedule exactly: the learning rate of a step is a pure function of
the recipe and the step number (``lr_at``).

Schedule (torchtitan's ``linear_warmup_*`` shape; cosine decay as in Loshchilov & Hutter 2017,
arXiv:1608.03983, without restarts): for step k = 1..N (N = ``schedule_steps``, by default the
run's ``--steps``), W = ``warmup_steps``::

    k <= W:   lr * k / (W + 1)                                  (linear warm-up, never 0)
    k >  W:   p = (k - W) / (N - W)   in (0, 1]
              constant: lr
              linear:   min_lr + (lr - min_lr) * (1 - p)
              cosine:   min_lr + (lr - min_lr) * (1 + cos(pi p)) / 2

Gradient clipping uses the *global* L2 norm over every parameter of the model, whatever the
layout (``global_grad_norm``): pending sums (``Partial`` gradients of replicated parameters
under sequence parallelism) are reduced first (``reduce_partial_grads``); then each rank sums
the squares of its local gradient pieces per (mesh, sharded mesh dimensions) group, all-reduces
each group's sum over the mesh dimensions it is sharded on (Shard placements: TP, FSDP2),
counts replicated pieces once (Replicate placements, DDP replicas), and all-reduces over the
pipeline group (each stage holds other layers). All sums are fp32 tensors on the rank's device
(NCCL takes nothing else), also for FSDP2's host-offloaded gradients.
torch's ``clip_grad_norm_`` cannot be used as is: it needs
every gradient on one mesh and one device, and knows nothing of the pipeline.

fp16 is refused (``check_dtype``): it needs a dynamic loss scaler, which the runtime does not
implement; bf16 has fp32's exponent range and needs none.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

# torch.distributed.tensor (DTensor, about 1 s to import) is imported by the functions that use
# it: ``meshplan run``'s launching process imports this module without training
# (``worker.import_training``).

SCHEDULES = ("constant", "linear", "cosine")
OPTIMIZER_IMPLS = ("foreach", "fused", "for-loop")
DEFAULT_LR = 3e-3
"""A small-model learning rate (the runtime's test models learn within a few steps)."""
DEFAULT_WEIGHT_DECAY = 0.1
"""GPT-3's AdamW weight decay (Brown et al. 2020, arXiv:2005.14165, Appendix B)."""
ADAMW_BETAS = (0.9, 0.95)
"""GPT-3's AdamW betas (ibid.)."""
ADAMW_EPS = 1e-8
DEFAULT_MAX_GRAD_NORM = 1.0
"""Global-norm clipping threshold of GPT-3 (ibid.) and torchtitan's default."""


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """Optimizer hyperparameters and schedule of a run (all JSON-able)."""

    lr: float = DEFAULT_LR
    """Peak learning rate (after warm-up)."""
    warmup_steps: int = 0
    """Steps of linear warm-up."""
    lr_schedule: str = "constant"
    """Decay after warm-up: ``constant``, ``linear`` or ``cosine``."""
    min_lr: float = 0.0
    """Learning rate at the end of a ``linear`` or ``cosine`` decay."""
    weight_decay: float = DEFAULT_WEIGHT_DECAY
    """AdamW's decoupled weight decay."""
    max_grad_norm: float | None = DEFAULT_MAX_GRAD_NORM
    """Clip the global gradient L2 norm to this; None: no clipping (the norm is still logged)."""
    optimizer_impl: str = "foreach"
    """AdamW kernel: ``foreach`` (multi-tensor), ``fused`` (one kernel per step; CUDA/CPU
    tensors of one device) or ``for-loop``."""
    schedule_steps: int | None = None
    """Steps the schedule spans (N); None: the run's ``--steps`` (``for_run``; a constant
    schedule keeps None, as it does not depend on it)."""

    def __post_init__(self) -> None:
        if not self.lr > 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= --min-lr <= --lr and --lr > 0, got lr {self.lr} and "
                             f"min_lr {self.min_lr}")
        if self.lr_schedule not in SCHEDULES:
            raise ValueError(f"--lr-schedule must be one of {', '.join(SCHEDULES)}, got "
                             f"{self.lr_schedule!r}")
        if self.optimizer_impl not in OPTIMIZER_IMPLS:
            raise ValueError(f"--optimizer-impl must be one of {', '.join(OPTIMIZER_IMPLS)}, "
                             f"got {self.optimizer_impl!r}")
        if self.warmup_steps < 0 or self.weight_decay < 0:
            raise ValueError(f"--warmup-steps and --weight-decay must be >= 0, got "
                             f"{self.warmup_steps} and {self.weight_decay}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"--max-grad-norm must be > 0, got {self.max_grad_norm}")
        if self.schedule_steps is not None and self.schedule_steps <= self.warmup_steps:
            raise ValueError(f"the schedule's {self.schedule_steps} steps must exceed "
                             f"--warmup-steps {self.warmup_steps}")

    def for_run(self, steps: int) -> "Recipe":
        """This recipe with ``schedule_steps`` resolved for a run of ``steps`` steps
        (ValueError when the warm-up does not fit)."""
        if self.schedule_steps is not None or self.lr_schedule == "constant":
            return self  # a constant schedule does not depend on the run's length
        if steps <= self.warmup_steps:
            raise ValueError(f"--warmup-steps {self.warmup_steps} leaves no step of the "
                             f"{self.lr_schedule} decay in a run of {steps} steps")
        return Recipe(**{**self.__dict__, "schedule_steps": max(steps, self.warmup_steps + 1)})

    def adamw_kwargs(self) -> dict:
        """Keyword arguments of ``torch.optim.AdamW`` (without the kernel choice)."""
        return {"lr": self.lr, "betas": ADAMW_BETAS, "eps": ADAMW_EPS,
                "weight_decay": self.weight_decay}


def lr_at(recipe: Recipe, step: int) -> float:
    """Learning rate of optimizer step ``step`` (1-based), the schedule of the module docstring."""
    warmup = recipe.warmup_steps
    if step <= warmup:
        return recipe.lr * step / (warmup + 1)
    if recipe.lr_schedule == "constant":
        return recipe.lr
    total = recipe.schedule_steps
    if total is None:
        raise ValueError("lr_at needs a recipe resolved with for_run (schedule_steps)")
    progress = min(1.0, (step - warmup) / (total - warmup))
    if recipe.lr_schedule == "linear":
        decay = 1.0 - progress
    else:
        decay = (1.0 + math.cos(math.pi * progress)) / 2.0
    return recipe.min_lr + (recipe.lr - recipe.min_lr) * decay


def check_dtype(dtype: str) -> None:
    """ValueError for fp16 (no loss scaler: gradients below 2^-24 would flush to zero)."""
    if dtype == "fp16":
        raise ValueError("fp16 plans need a dynamic loss scaler, which the runtime does not "
                         "implement; plan with dtype bf16 (no scaler needed)")


def _group_key(grad: torch.Tensor):
    """(mesh, indices of the mesh dimensions the gradient is sharded on), or None for a plain
    tensor (held whole by this rank, replicated across data parallel)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(grad, DTensor):
        return None
    # "not replicated" rather than is_shard(): FSDP2 over TP uses _StridedShard, which torch
    # 2.13 does not count as is_shard()
    sharded = tuple(i for i, p in enumerate(grad.placements) if not p.is_replicate())
    return grad.device_mesh, sharded


@torch.no_grad()
def reduce_partial_grads(params: list[torch.Tensor]) -> None:
    """Replace gradients that are still pending sums (``Partial`` placements: a replicated
    parameter used on sequence shards, under sequence parallelism) by their reduced value,
    which the optimizer would otherwise reduce implicitly; their norms and clipping then see
    the real gradient."""
    from torch.distributed.tensor import DTensor, Replicate

    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            param.grad = grad.redistribute(
                grad.device_mesh, [Replicate() if p.is_partial() else p for p in grad.placements])


@torch.no_grad()
def global_grad_norm(params: Iterable[torch.Tensor], *, device: torch.device,
                     pp_mesh: DeviceMesh | None) -> torch.Tensor:
    """The L2 norm of all gradients of the whole model (fp32 scalar on ``device``; the same on
    every rank). Parameters without a gradient count as zero."""
    from torch.distributed.tensor import DTensor

    params = list(params)
    reduce_partial_grads(params)
    groups: dict = defaultdict(list)
    for param in params:
        if param.grad is not None:
            groups[_group_key(param.grad)].append(param.grad)
    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    for key, grads in groups.items():
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        norms = torch._foreach_norm([t.float() for t in local])
        part = torch.stack([n.to(device) for n in norms]).square().sum()
        if key is not None:
            mesh, sharded = key
            for dim in sharded:
                dist.all_reduce(part, group=mesh.get_group(dim))
        total_sq += part
    if pp_mesh is not None and pp_mesh.size() > 1:
        dist.all_reduce(total_sq, group=pp_mesh.get_group())
    return total_sq.sqrt()


@torch.no_grad()
def clip_grads(params: Iterable[torch.Tensor], *, total_norm: torch.Tensor,
               max_norm: float) -> None:
    """Scale every gradient by min(1, max_norm / (total_norm + 1e-6)) (torch's formula)."""
    from torch.distributed.tensor import DTensor

    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    by_device: dict = defaultdict(list)
    for param in params:
        if param.grad is not None:
            grad = param.grad
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            by_device[local.device].append(local)
    for where, grads in by_device.items():
        torch._foreach_mul_(grads, coef.to(where))
