"""Give a stage built on ``meta`` its real tensors, each rank only its own shard.

A rank builds its decoder chunk on the meta device (shapes only, no memory), applies tensor
parallelism and, under ZeRO-3 / FSDP, ``fully_shard`` there too; only then are the tensors
allocated (``to_empty``) and filled. Each parameter is then a local shard of a global tensor:
plain (replicated), a DTensor over the tensor-parallel mesh, or a DTensor over (dp, tp) with
FSDP's strided dim-0 shard on top of TP's. ``local_slices`` gives the region of the global
tensor this rank holds (DTensor's ``compute_local_shape_and_global_offset``, which follows
FSDP's ``_StridedShard`` too), and a ``Fill`` returns that region's values:

- ``random_fill``: the parameter's ``model.initial_value`` (drawn whole on the CPU, one
  parameter at a time, then sliced), so every layout starts from the single process's weights;
- ``hf.SliceReader``: the region read from the HF safetensors checkpoint, nothing else of it.

A rank's memory while building is its own shards plus one parameter's whole value (random
init) or nothing beyond its shards (loading): a 70B stage is never whole on any rank.

torch APIs: ``nn.Module.to_empty``, ``torch.distributed.tensor.DTensor``,
``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from meshplan.runtime.model import initial_value

# torch.distributed.tensor (DTensor, about 1 s to import) is imported by the functions that use
# it: ``meshplan run``'s launching process imports this module without training
# (``worker.import_training``).

Fill = Callable[[str, tuple[int, ...], tuple[slice, ...]], torch.Tensor]
"""(parameter name, global shape, this rank's region) -> the region's values."""


def clean_name(name: str) -> str:
    """A parameter's name without activation-checkpoint and DDP wrapper prefixes."""
    return name.replace("_checkpoint_wrapped_module.", "").removeprefix("module.")


def local_slices(param: torch.Tensor) -> tuple[slice, ...]:
    """The region of the global tensor that this rank's shard of ``param`` holds."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(param, DTensor):
        return tuple(slice(0, size) for size in param.shape)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                          param.placements)
    return tuple(slice(start, start + size) for start, size in zip(offset, shape))


def random_fill(*, num_layers: int, seed: int, tied_copy: bool) -> Fill:
    """Fill with the decoder's initial values (``model.initial_value``)."""
    def fill(name: str, shape: tuple[int, ...], region: Sequence[slice]) -> torch.Tensor:
        return initial_value(name, shape, num_layers=num_layers, seed=seed,
                             tied_copy=tied_copy)[tuple(region)]
    return fill


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device, fill: Fill) -> None:
    """Allocate ``module``'s parameters on ``device`` (``to_empty``) and fill each rank's
    shard from ``fill``. Shared parameters (tied embeddings) stay shared (``to_empty``
    gives each owner its own tensor) and are filled once."""
    from torch.distributed.tensor import DTensor

    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((sub, name))
    module.to_empty(device=device)
    for (sub, name), *others in (found for found in owners.values() if len(found) > 1):
        for other, other_name in others:
            other._parameters[other_name] = sub._parameters[name]
    for name, param in module.named_parameters():  # each shared parameter once
        local = param.to_local() if isinstance(param, DTensor) else param
        if local.numel() == 0:
            continue
        value = fill(clean_name(name), tuple(param.shape), local_slices(param))
        if tuple(value.shape) != tuple(local.shape):
            raise AssertionError(f"{name}: filled {tuple(value.shape)}, the shard is "
                                 f"{tuple(local.shape)}")
        local.copy_(value)
