"""Worker of ``test_sp_copies.py``: what DTensor's sequence-parallel collectives copy on the
compute stream (gloo, 2 ranks, a 1-D mesh). A ``[b, s, h]`` hidden state sharded on the
sequence (``Shard(1)``, as torchtitan's and meshplan's SP plans shard it) is all-gathered
(``Replicate``) and a partial sum of that shape is reduce-scattered back to ``Shard(1)``; a
dispatch mode records every ``aten.cat`` and the elements it writes. Prints one line per case:
``copies <rank> <b> <all-gather cat elements> <reduce-scatter cat elements>``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

SEQ, HIDDEN = 16, 8


class CatElements(TorchDispatchMode):
    """Elements written by ``aten.cat`` while active."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.cat:
            self.elements += out.numel()
        return out


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    for batch in (4, 1):
        local = torch.randn(batch, SEQ // 2, HIDDEN)
        sharded = DTensor.from_local(local, mesh, [Shard(1)])
        with CatElements() as gather:
            whole = sharded.redistribute(mesh, [Replicate()]).to_local()
        assert whole.shape == (batch, SEQ, HIDDEN)
        partial = DTensor.from_local(torch.randn(batch, SEQ, HIDDEN), mesh, [Partial()])
        with CatElements() as scatter:
            part = partial.redistribute(mesh, [Shard(1)]).to_local()
        assert part.shape == (batch, SEQ // 2, HIDDEN)
        print(f"copies {rank} {batch} {gather.elements} {scatter.elements}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
