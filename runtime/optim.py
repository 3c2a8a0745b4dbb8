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

Hyperparameters come from the run's recipe (``recipe.Recipe``); ``set_lr`` sets the learning
rate of a step on every optimizer a wrapper holds.

For checkpoints (``checkpoint.py``) ``adamw_states`` presents the AdamW state this rank keeps,
whichever wrapper holds it, per model parameter and in the parameter's layout;
``reload_master_weights`` refreshes host copies after the parameters were loaded.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from meshplan.runtime.recipe import Recipe



def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def foreach_ok(params: list[torch.Tensor]) -> bool:
    """True when the foreach kernels can take ``params`` together (all plain tensors, or all
    DTensors on one mesh); mixing them makes ``torch._foreach_*`` fail."""
    meshes = {p.device_mesh if isinstance(p, DTensor) else None for p in params}
    return len(meshes) <= 1


def host_threads(local_world_size: int | None = None) -> int:
    """CPU threads one rank's host AdamW may use: the node's cores shared by its local
    ranks (``LOCAL_WORLD_SIZE``), at least one."""
    local = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, (os.cpu_count() or 1) // max(1, local))


@contextlib.contextmanager
def _intra_op_threads(count: int):
    """``torch.set_num_threads(count)`` for the block (the workers run on one thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class HostOffloadAdamW(torch.optim.Optimizer):
    """AdamW whose fp32 master weights and moments live in host memory (ZeRO-Offload).

    Host buffers (master weights and gradient landing buffers) are allocated once, pinned
    when a GPU is present, so both copies run as DMA without a staging copy. ``step`` queues
    every gradient's device -> host copy (``non_blocking``), waits for them once, runs the
    host AdamW on ``threads`` CPU threads (``host_threads``: the node's cores over its
    ranks) with torch's fused CPU kernel, and queues the host -> device copies of the
    updated parameters without waiting (the device stream orders them before the next
    forward). Measured here, one thread: 93 M parameters/s with the per-tensor loop, about
    550 M with the fused kernel (``meshplan profile`` measures the rate it gets).
    """

    def __init__(self, params: Iterable[torch.Tensor], *, threads: int | None = None,
                 **hyper) -> None:
        super().__init__(params, dict(hyper))
        pin = torch.cuda.is_available()
        self.threads = threads or host_threads()
        self._pairs = []
        self._grads = []
        for group in self.param_groups:
            for param in group["params"]:
                local = _local(param).detach()
                host = torch.empty(local.shape, dtype=torch.float32, pin_memory=pin)
                host.copy_(local)
                self._pairs.append((param, host))
                self._grads.append(torch.empty(local.shape, dtype=torch.float32,
                                               pin_memory=pin))
        kernel = {k: v for k, v in hyper.items() if k not in ("fused", "foreach")}
        self._host = torch.optim.AdamW([h for _, h in self._pairs], fused=True, **kernel)

    @property
    def host_optimizer(self) -> torch.optim.AdamW:
        """The AdamW stepping the host copies (it holds the moments)."""
        return self._host

    @property
    def pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, its fp32 host copy) for every parameter."""
        return list(self._pairs)

    @torch.no_grad()
    def reload_master_weights(self) -> None:
        """Copy the parameters into the host copies (after the parameters were loaded)."""
        for param, host in self._pairs:
            host.copy_(_local(param))

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("HostOffloadAdamW.step does not take a closure")
        devices = set()
        for (param, host), landing in zip(self._pairs, self._grads):
            grad = param.grad
            if grad is None:
                host.grad = None
                continue
            local = _local(grad)
            landing.copy_(local, non_blocking=local.is_cuda)
            host.grad = landing
            if local.is_cuda:
                devices.add(local.device)
        for device in devices:  # the landing buffers are complete
            torch.cuda.synchronize(device)
        with _intra_op_threads(self.threads):
            self._host.step()
        for param, host in self._pairs:
            local = _local(param)
            local.copy_(host, non_blocking=local.is_cuda)
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

    @property
    def inner(self) -> torch.optim.Optimizer | None:
        """The optimizer over this rank's parameters (None when it owns none)."""
        return self._inner

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ShardedStateOptimizer.step does not take a closure")
        if self._inner is not None:
            self._inner.step()
        for param, src in zip(self._params, self._sources):
            dist.broadcast(_local(param), src=src, group=self._group)
        return None


def _kernel(impl: str, params: list[torch.Tensor]) -> dict:
    """AdamW's kernel flags for ``--optimizer-impl`` (foreach only where ``foreach_ok``)."""
    if impl == "fused":
        return {"fused": True}
    return {"foreach": impl == "foreach" and foreach_ok(params)}


class HostThreadsAdamW(torch.optim.AdamW):
    """torch's fused CPU AdamW stepping on ``threads`` CPU threads (``host_threads``): the
    optimizer of FSDP2's CPU offload (``optimizer+params``), whose sharded parameters,
    gradients and moments all live in host memory.

    The workers run on one thread (``OMP_NUM_THREADS=1``, runtime/launch.py), where a
    1.24 B-parameter step took about 20 s on an H200's host
    (``benchmarks/results/gpu-h200-2026-12-04.md``), and the recipe's default foreach kernel
    makes about ten passes over the host memory per step. The fused kernel makes one (the
    28 bytes per parameter ``Calibration.host_adam_bytes_per_param`` prices) and takes the
    sharded DTensors as they are: on this CPU, two threads, 1.2 G parameters/s against 0.23 G
    with foreach and 0.14 G with the per-tensor loop, the same updates to the bit (as for
    ``HostOffloadAdamW``, the recipe's kernel choice does not apply)."""

    def __init__(self, params: Iterable[torch.Tensor], *, threads: int | None = None,
                 **hyper) -> None:
        kernel = {k: v for k, v in hyper.items() if k not in ("fused", "foreach")}
        super().__init__(params, fused=True, **kernel)
        self.threads = threads or host_threads()

    @torch.no_grad()
    def step(self, closure=None):
        with _intra_op_threads(self.threads):
            return super().step(closure)


def build_optimizer(modules: list[nn.Module], *, zero_stage: int, offload: str,
                    dp_mesh: DeviceMesh, recipe: Recipe) -> torch.optim.Optimizer:
    """The optimizer over every parameter of ``modules`` (the rank's model chunks)."""
    params = [p for m in modules for p in m.parameters()]
    hyper = {**recipe.adamw_kwargs(), **_kernel(recipe.optimizer_impl, params)}
    inner = {"optimizer": HostOffloadAdamW,
             "optimizer+params": HostThreadsAdamW}.get(offload, torch.optim.AdamW)
    if zero_stage == 1 and dp_mesh.size() > 1:
        if any(isinstance(p, DTensor) for p in params):
            return ShardedStateOptimizer(params, dp_mesh=dp_mesh, optimizer_class=inner,
                                         **hyper)
        return ZeroRedundancyOptimizer(params, optimizer_class=inner,
                                       process_group=dp_mesh.get_group(), **hyper)
    return inner(params, **hyper)


# ----- state for checkpoints ---------------------------------------------------------------------

def _state_holder(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """The optimizer that keeps this rank's states: ZeRO-1 wrappers hold them in an inner one."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer.optim
    if isinstance(optimizer, ShardedStateOptimizer):
        return optimizer.inner
    return optimizer


def _adamw_keys(optimizer: torch.optim.Optimizer
                ) -> tuple[torch.optim.AdamW | None, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(the torch AdamW holding the states, [(model parameter, its key in that AdamW)])."""
    holder = _state_holder(optimizer)
    if holder is None:
        return None, []
    if isinstance(holder, HostOffloadAdamW):
        return holder.host_optimizer, holder.pairs
    if isinstance(holder, torch.optim.AdamW):
        return holder, [(p, p) for group in holder.param_groups for p in group["params"]]
    raise TypeError(f"no checkpoint support for optimizer {type(holder).__name__}")


@torch.no_grad()
def _init_states(adamw: torch.optim.AdamW, keys: list[torch.Tensor]) -> None:
    """Create missing AdamW states with a zero-learning-rate step on zero gradients (as
    ``torch.distributed.checkpoint.state_dict`` does): moments 0, parameters unchanged."""
    missing = [key for key in keys if key not in adamw.state]
    if not missing:
        return
    for key in missing:  # AdamW skips the others (no gradient): their states stay as they are
        key.grad = torch.zeros_like(key)
    rates = [group["lr"] for group in adamw.param_groups]
    for group in adamw.param_groups:
        group["lr"] = 0.0
    adamw.step()
    for group, rate in zip(adamw.param_groups, rates):
        group["lr"] = rate
    for key in missing:
        key.grad = None


def _as_param_layout(state: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``state`` (shaped like ``param``'s local shard) as a DTensor laid out like ``param``."""
    if not isinstance(param, DTensor) or isinstance(state, DTensor) or state.dim() == 0:
        return state
    return DTensor.from_local(state, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def adamw_states(optimizer: torch.optim.Optimizer
                 ) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """(model parameter, its AdamW state) for each parameter whose state this rank keeps.

    The state is ``{"step", "exp_avg", "exp_avg_sq"}`` holding the optimizer's own tensors
    (loading into them in place restores the optimizer); moments kept on host copies of local
    shards are wrapped as DTensors laid out like the parameter, so every layout presents the
    same global tensors. Under ZeRO-1 a rank lists only the parameters it owns. States not
    created yet (before the first step) are created first (``_init_states``).
    """
    adamw, pairs = _adamw_keys(optimizer)
    if adamw is None:
        return []
    _init_states(adamw, [key for _, key in pairs])
    return [(param, {name: _as_param_layout(value, param)
                     for name, value in adamw.state[key].items()})
            for param, key in pairs]


def reload_master_weights(optimizer: torch.optim.Optimizer) -> None:
    """Refresh host master copies from the parameters (optimizer offload), else nothing."""
    holder = _state_holder(optimizer)
    if isinstance(holder, HostOffloadAdamW):
        holder.reload_master_weights()


def _nested(optimizer: torch.optim.Optimizer | None) -> Iterable[torch.optim.Optimizer]:
    """``optimizer`` and every optimizer it wraps (ZeRO-1's inner, offload's host AdamW)."""
    if optimizer is None:
        return
    yield optimizer
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        yield from _nested(optimizer.optim)
    elif isinstance(optimizer, ShardedStateOptimizer):
        yield from _nested(optimizer.inner)
    elif isinstance(optimizer, HostOffloadAdamW):
        yield from _nested(optimizer.host_optimizer)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group of ``optimizer`` and of what it wraps."""
    for inner in _nested(optimizer):
        for group in inner.param_groups:
            group["lr"] = lr
