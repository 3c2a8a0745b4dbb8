"""The optimizer of a plan: AdamW, sharded for ZeRO-1, or with its states on the host.

* ZeRO-0/2/3: ``torch.optim.AdamW`` over the module's (FSDP2-sharded, for 2/3) parameters.
* ZeRO-1: ``torch.distributed.optim.ZeroRedundancyOptimizer`` wrapping AdamW over the
  data-parallel group: each rank keeps Adam moments for 1/dp of the parameters and broadcasts
  the parameters it updated (Rajbhandari et al. 2020, arXiv:1910.02054, stage P_os). It cannot
  broadcast DTensors, so with tensor parallelism ``ShardedStateOptimizer`` does the same on
  each parameter's local (tensor-parallel) shard.
* offload ``optimizer``: ``HostOffloadAdamW`` keeps fp32 master weights and Adam moments in host
  memory and runs the update there (ZeRO-Offload, Ren et al. 2021, arXiv:2101.06840): gradients
  are copied device -> host, AdamW steps on the host copies, parameters are copied back. It
  works under every ZeRO stage (with ZeRO-1 it is the sharded optimizer's inner class).
  Offload ``optimizer+params`` is FSDP2's ``CPUOffloadPolicy`` (parallelize.py) with plain
  AdamW: the sharded parameters, gradients and states all live on the host.

Hyperparameters are fixed (``ADAMW``) so runs of different layouts are comparable.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

ADAMW = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
"""AdamW hyperparameters of every run (GPT-3's betas and weight decay, a small-model lr)."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def foreach_ok(params: list[torch.Tensor]) -> bool:
    """True when the foreach kernels can take ``params`` together (all plain tensors, or all
    DTensors on one mesh); mixing them makes ``torch._foreach_*`` fail."""
    meshes = {p.device_mesh if isinstance(p, DTensor) else None for p in params}
    return len(meshes) <= 1


class HostOffloadAdamW(torch.optim.Optimizer):
    """AdamW whose fp32 master weights and moments live in host memory (ZeRO-Offload).

    ``step`` copies each gradient (its local shard for DTensors) to the host, runs
    ``torch.optim.AdamW`` on the host copies and writes the result back into the parameter.
    """

    def __init__(self, params: Iterable[torch.Tensor], **hyper) -> None:
        super().__init__(params, dict(hyper))
        self._pairs = [(p, _local(p).detach().to("cpu", torch.float32, copy=True))
                       for group in self.param_groups for p in group["params"]]
        self._host = torch.optim.AdamW([h for _, h in self._pairs], **hyper)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("HostOffloadAdamW.step does not take a closure")
        for param, host in self._pairs:
            grad = param.grad
            host.grad = None if grad is None else _local(grad).to("cpu", torch.float32)
        self._host.step()
        for param, host in self._pairs:
            _local(param).copy_(host)
        return None


def partition(sizes: list[int], parts: int) -> list[int]:
    """Owner (0..parts-1) of each item: largest first onto the least-loaded part (greedy LPT,
    as ZeroRedundancyOptimizer does); ties go to the lower part, so every rank agrees."""
    loads = [0] * parts
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owner = min(range(parts), key=lambda p: (loads[p], p))
        owners[index] = owner
        loads[owner] += sizes[index]
    return owners


class ShardedStateOptimizer(torch.optim.Optimizer):
    """ZeRO-1 for DTensor parameters: rank d of the data-parallel group keeps optimizer states
    for the parameters ``partition`` gives it, steps them, and broadcasts their local shards.

    Gradients must already be averaged over the group (``replicate`` does that).
    """

    def __init__(self, params: Iterable[torch.Tensor], *, dp_mesh: DeviceMesh,
                 optimizer_class: type, **hyper) -> None:
        super().__init__(params, dict(hyper))
        self._params = [p for group in self.param_groups for p in group["params"]]
        self._group = dp_mesh.get_group()
        ranks = dist.get_process_group_ranks(self._group)
        owners = partition([_local(p).numel() for p in self._params], len(ranks))
        self._sources = [ranks[o] for o in owners]
        mine = [p for p, src in zip(self._params, self._sources) if src == dist.get_rank()]
        self._inner = optimizer_class(mine, **hyper) if mine else None

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ShardedStateOptimizer.step does not take a closure")
        if self._inner is not None:
            self._inner.step()
        for param, src in zip(self._params, self._sources):
            dist.broadcast(_local(param), src=src, group=self._group)
        return None


def build_optimizer(modules: list[nn.Module], *, zero_stage: int, offload: str,
                    dp_mesh: DeviceMesh) -> torch.optim.Optimizer:
    """The optimizer over every parameter of ``modules`` (the rank's model chunks)."""
    params = [p for m in modules for p in m.parameters()]
    hyper = dict(ADAMW, foreach=foreach_ok(params))
    inner = HostOffloadAdamW if offload == "optimizer" else torch.optim.AdamW
    if zero_stage == 1 and dp_mesh.size() > 1:
        if any(isinstance(p, DTensor) for p in params):
            return ShardedStateOptimizer(params, dp_mesh=dp_mesh, optimizer_class=inner,
                                         **hyper)
        return ZeroRedundancyOptimizer(params, optimizer_class=inner,
                                       process_group=dp_mesh.get_group(), **hyper)
    return inner(params, **hyper)
