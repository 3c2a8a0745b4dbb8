"""torchtitan's own code path on this CPU: measured per-rank peak against the cost model.

Builds torchtitan 0.2.2's llama3 ``Transformer`` in a tiny flavour (the shapes of meshplan's
``tiny`` model), applies torchtitan's ``apply_ac`` (its selective op policy, or every Nth
layer, or full) and ``apply_fsdp`` (FSDP2 over 2 gloo ranks, fp32 on CPU), and runs its train
step (zero_grad, forward, ``cross_entropy_loss``, ``del pred``, backward, fused AdamW step).
Peaks are live tensor bytes (``meshplan.runtime.memory.PeakMemory``) over steps 2-3; the
prediction is ``estimate(..., framework="torchtitan")`` for the same plan on the ``cpu``
cluster.

    python benchmarks/torchtitan_cpu_memory.py [--policy op|2|full|none] [--micro-batch 2]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RANKS = 2
STEPS = 3
SEQ_LEN = 64
PORT = "29617"
TIMEOUT_S = 180


def _stub_moe_kernels() -> None:
    """torchtitan imports its MoE Triton kernels at import time (models/moe/kernels.py), and
    the CPU build of torch has no triton. The dense llama3 path never calls them: where
    triton is missing, that one module is replaced by one whose function raises if called."""
    import importlib.util
    import sys
    import types
    if importlib.util.find_spec("triton") is not None:
        return
    kernels = types.ModuleType("torchtitan.models.moe.kernels")

    def generate_permute_indices(*_args, **_kwargs):
        raise RuntimeError("MoE Triton kernels are not available on this CPU build")

    kernels.generate_permute_indices = generate_permute_indices
    sys.modules["torchtitan.models.moe.kernels"] = kernels


def _ac_config(policy: str):
    from torchtitan.config.job_config import ActivationCheckpoint
    if policy in ("full", "none"):
        return ActivationCheckpoint(mode=policy)
    return ActivationCheckpoint(mode="selective", selective_ac_option=policy)


def _worker(rank: int, policy: str, micro_batch: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=PORT)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=RANKS,
                            timeout=dt.timedelta(seconds=60))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    _stub_moe_kernels()
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list, apply_fsdp
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    from meshplan.runtime.memory import PeakMemory

    mesh = init_device_mesh("cpu", (RANKS,), mesh_dim_names=("fsdp",))
    args = TransformerModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256,
                                multiple_of=16, max_seq_len=SEQ_LEN)
    torch.manual_seed(0)
    peak = PeakMemory(torch.device("cpu"))
    with peak:
        model = Transformer(args)
        with torch.no_grad():
            model.init_weights()
        if policy != "none":
            apply_ac(model, _ac_config(policy), op_sac_save_list=_op_sac_save_list)
        apply_fsdp(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32,
                   pp_enabled=False)
        for module in model.modules():  # gloo has no PREMUL_SUM: reduce with SUM instead
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        tokens = torch.randint(0, 256, (micro_batch, SEQ_LEN + 1),
                               generator=torch.Generator().manual_seed(rank))
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        for step in range(STEPS):
            optimizer.zero_grad()
            if step == 1:
                peak.reset()
            pred = model(inputs)
            loss = cross_entropy_loss(pred, labels)
            del pred
            loss.backward()
            optimizer.step()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"peak_bytes": peak.peak_bytes}))
    dist.destroy_process_group()


def measure(policy: str, micro_batch: int) -> list[int]:
    """Per-rank peak bytes of torchtitan's step under ``policy``."""
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(_worker, args=(policy, micro_batch, tmp), nprocs=RANKS,
                                     join=False, start_method="spawn")
        deadline = time.monotonic() + TIMEOUT_S
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:  # join returns once per exited process
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                raise RuntimeError(f"torchtitan CPU run did not finish in {TIMEOUT_S} s")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text())["peak_bytes"]
                for r in range(RANKS)]


def predict(policy: str, micro_batch: int) -> float:
    from meshplan.costmodel import ParallelConfig, estimate, load_cluster, load_model
    recompute = policy if policy in ("full", "none") else "selective"
    selective_ac = "op" if policy in ("full", "none") else policy
    config = ParallelConfig(dp=RANKS, zero_stage=3, recompute=recompute,
                            selective_ac=selective_ac, micro_batch_size=micro_batch,
                            global_batch_size=RANKS * micro_batch, seq_len=SEQ_LEN,
                            dtype="fp32")
    est = estimate(load_model("tiny"), load_cluster("cpu", nodes=1, gpus_per_node=RANKS),
                   config, framework="torchtitan")
    return est.memory.peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="op", help="op, an integer N, full or none")
    parser.add_argument("--micro-batch", type=int, default=2)
    args = parser.parse_args()
    peaks = measure(args.policy, args.micro_batch)
    predicted = predict(args.policy, args.micro_batch)
    for rank, measured in enumerate(peaks):
        print(f"policy {args.policy} micro-batch {args.micro_batch} rank {rank}: measured "
              f"{measured} B, predicted {predicted:.0f} B, error {predicted / measured - 1:+.3f}")


if __name__ == "__main__":
    main()
