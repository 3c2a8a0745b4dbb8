"""Worker of ``test_pipelined_fsdp2.py``: counts the FSDP2 collectives one rank issues per step
of ``torch.distributed.pipelining``'s 1F1B over FSDP2-sharded blocks (gloo, 4 ranks: pp 2 x
dp 2), as meshplan's runtime and torchtitan build a pipeline stage with ZeRO-3
(``fully_shard(reshard_after_forward=False)`` per block, bf16 parameters, fp32 reduction).
Prints one line per step: ``counts <rank> <step> <reduce-scatters> <all-gathers>``."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

BLOCKS, MICRO_BATCHES, STEPS, WIDTH = 3, 4, 3, 32

calls = {"reduce_scatter": 0, "all_gather": 0}


def _counted(name: str, fn):
    def wrapper(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)
    return wrapper


# FSDP2's default collectives call these two (torch/distributed/fsdp/_fully_shard/
# _fsdp_collectives.py); nothing else in this script does
dist.reduce_scatter_single = _counted("reduce_scatter", dist.reduce_scatter_single)
dist.all_gather_single = _counted("all_gather", dist.all_gather_single)


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)
    blocks = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(BLOCKS)])
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False, mp_policy=policy)
    fully_shard(blocks, mesh=mesh["dp"], reshard_after_forward=False, mp_policy=policy)
    pp = mesh.get_local_rank("pp")
    stage = PipelineStage(blocks, pp, 2, torch.device("cpu"), group=mesh.get_group("pp"))
    schedule = Schedule1F1B(stage, n_microbatches=MICRO_BATCHES,
                            loss_fn=lambda y, t: (y.float() - t).pow(2).mean())
    x, target = torch.randn(2 * MICRO_BATCHES, WIDTH), torch.randn(2 * MICRO_BATCHES, WIDTH)
    for step in range(STEPS):
        calls.update(reduce_scatter=0, all_gather=0)
        if pp == 0:
            schedule.step(x)
        else:
            schedule.step(target=target, losses=[])
        print(f"counts {dist.get_rank()} {step} {calls['reduce_scatter']} {calls['all_gather']}",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
