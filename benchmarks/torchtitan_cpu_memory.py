"""torchtitan's own code path on this CPU: measured per-rank peak against the cost model.

Builds torchtitan 0.2.2's llama3 ``Transformer`` in a tiny flavour (the shapes of meshplan's
``tiny`` model, optionally with a larger vocabulary), applies torchtitan's ``apply_tp`` under
``--tp`` > 1 (sequence parallelism and loss parallelism, as torchtitan's defaults), its
``apply_ac`` (its selective op policy, or every Nth layer, or full) and ``apply_fsdp`` (FSDP2
over ``--dp`` gloo ranks, fp32 on CPU), and runs its train step (zero_grad, forward,
``cross_entropy_loss``, ``del pred``, backward, fused AdamW step; under TP inside
``loss_parallel()``, as torchtitan's train context). Peaks are live tensor bytes
(``meshplan.runtime.memory.PeakMemory``) over steps 2-3; the prediction is
``estimate(..., framework="torchtitan")`` for the same plan on the ``cpu`` cluster.

DTensor runs its custom op handlers with dispatch modes switched off, so the live-tensor
tracker would not see the temporaries of loss parallelism's log-softmax, NLL forward and fused
NLL-and-log-softmax backward (torch ``distributed/tensor/parallel/loss.py``), which compute
on the local shards: those functions run here with the tracker active again. Without
that the loss backward's three extra vocabulary-shard copies were missing from the
measurement (a peak 36 % lower at 1,024 vocabulary rows, 8 x 64 tokens).

Under ``--compile model|model+loss`` (each block compiled after its checkpoint wrapper, and the
loss) the tracker cannot run (Dynamo does not trace under a dispatch mode): the peak is then the
CPU allocator's, from the profiler's allocation events (``AllocatorPeak``; ``--profiler`` uses
it for an eager step too). It includes what gloo's threads allocate, so with more than one
rank it reads 1-3 % above the tracker, and under TP its ranks spread too far to use.

    python benchmarks/torchtitan_cpu_memory.py [--policy op|2|full|none] [--micro-batch 2]
        [--dp 2] [--tp 1] [--vocab 256] [--heads 4 2] [--compile none|model|model+loss]
        [--profiler]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS = 3
SEQ_LEN = 64
TINY_VOCAB = 256
TINY_HEADS = (4, 2)
"""meshplan's ``tiny`` model's attention and key/value heads (``--heads`` changes them)."""
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


def _track_loss_parallel(peak) -> None:
    """Run loss parallelism's local computations with ``peak``'s tracker active (module doc)."""
    from torch.distributed.tensor.parallel import loss as loss_parallel_ops
    tracker = peak.tracker
    for name in ("_log_softmax", "_nll_loss_forward", "_nll_loss_and_log_softmax_backward"):
        function = getattr(loss_parallel_ops, name)

        def tracked(*args, _function=function, **kwargs):
            with tracker:
                return _function(*args, **kwargs)

        setattr(loss_parallel_ops, name, tracked)


def _free_port() -> str:
    """A port nothing listens on now (a fixed one can still be held by the previous run)."""
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def _init_rank(rank: int, world_size: int, port: str) -> None:
    """Join the spawned run's gloo group as ``rank`` (rendezvous on ``port``, one thread)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=dt.timedelta(seconds=60))


def _spawn(worker, args: tuple, nprocs: int, timeout_s: float) -> None:
    """Run ``worker(rank, *args)`` on ``nprocs`` spawned processes; past ``timeout_s`` kill
    them and raise."""
    context = mp.start_processes(worker, args=args, nprocs=nprocs, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:  # join returns once per exited process
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise RuntimeError(f"torchtitan CPU run did not finish in {timeout_s} s")


def _new_model(args):
    """torchtitan's llama3 ``Transformer`` for ``args``, its weights initialised."""
    from torchtitan.models.llama3.model.model import Transformer
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    return model


def _parallelize(model, mesh, *, tp: int, policy: str, pp_enabled: bool,
                 compile_model: bool = False) -> None:
    """torchtitan's parallelisms on ``model`` (a whole model or one pipeline part), in its
    order: ``apply_tp`` under ``tp`` > 1 (sequence and loss parallelism, its defaults),
    ``apply_ac`` under ``policy``, ``apply_compile`` (each block, after its checkpoint
    wrapper) under ``compile_model``, ``apply_fsdp`` over the mesh's ``fsdp`` dimension (fp32
    parameters and reduce on the CPU), each FSDP module reducing with SUM (gloo has no
    PREMUL_SUM)."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config.job_config import Compile
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.models.llama3.infra.parallelize import (_op_sac_save_list, apply_compile,
                                                            apply_fsdp, apply_tp)
    if tp > 1:
        apply_tp(model, mesh["tp"], loss_parallel=True, enable_float8_tensorwise_tp=False)
    if policy != "none":
        apply_ac(model, _ac_config(policy), op_sac_save_list=_op_sac_save_list,
                 model_compile_enabled=compile_model)
    if compile_model:
        apply_compile(model, Compile(enable=True, components=["model"]))
    apply_fsdp(model, mesh["fsdp"], param_dtype=torch.float32, reduce_dtype=torch.float32,
               pp_enabled=pp_enabled)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


class AllocatorPeak:
    """Peak bytes held through torch's CPU allocator, from the profiler's allocation events
    (``profile_memory``): each carries the allocator's running total of the bytes allocated
    since profiling began and not yet freed. Unlike the live-tensor tracker it needs no
    dispatch mode, so it sees inside compiled graphs (Dynamo does not trace under a non-infra
    dispatch mode); the worker allocates its tensors after it starts, so the total is
    theirs. ``window()`` marks the part of the run whose peak ``peak_bytes`` reports."""

    WINDOW = "meshplan.peak_window"

    def __init__(self) -> None:
        from torch.profiler import ProfilerActivity, profile
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)

    def __enter__(self):
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profile.__exit__(*exc)

    def window(self):
        from torch.autograd.profiler import record_function
        return record_function(self.WINDOW)

    def _allocations(self) -> tuple[list[tuple[int, int]], list[tuple[int, int, int, int, object]]]:
        """(the windows' (start, end) times, every CPU allocation event as (time, address,
        bytes, running total, the profiler event: ``_ops`` names what it ran under)), by time;
        a free is an event of negative bytes."""
        from torch._C._profiler import _ExtraFields_Allocation
        events = list(self._profile.profiler.kineto_results.experimental_event_tree())
        windows, allocations = [], []
        while events:
            event = events.pop()
            events.extend(event.children)
            if event.name == self.WINDOW:
                windows.append((event.start_time_ns, event.end_time_ns))
            fields = event.extra_fields
            if isinstance(fields, _ExtraFields_Allocation) and fields.device.type == "cpu":
                allocations.append((event.start_time_ns, fields.ptr, fields.alloc_size,
                                    fields.total_allocated, event))
        allocations.sort(key=lambda a: a[0])
        return windows, allocations

    @staticmethod
    def _ops(event) -> str:
        """The ops an allocation event ran under, innermost first, ``<``-joined."""
        ops, parent = [], event.parent
        while parent is not None:
            ops.append(parent.name)
            parent = parent.parent
        return "<".join(ops)

    def _peak(self, within: str | None = None):
        windows, allocations = self._allocations()
        inside = [a for a in allocations if any(first <= a[0] <= last for first, last in windows)
                  and (within is None or within in self._ops(a[4]))]
        if not inside:
            raise ValueError("no allocation in the measured window"
                             + (f" inside an op named like {within!r}" if within else ""))
        return allocations, max(inside, key=lambda a: a[3])

    @property
    def peak_bytes(self) -> int:
        return self._peak()[1][3]

    def live_at_peak(self, within: str | None = None) -> list[tuple[int, str]]:
        """The allocations alive at the windows' peak, or at the highest point reached while
        an op whose name contains ``within`` ran: (bytes, the ops that made it, innermost
        first), largest first. What sums to ``peak_bytes``: the analysis that shows which
        tensors a compiled graph holds, which the live-tensor tracker cannot see."""
        allocations, peak = self._peak(within)
        live: dict[int, tuple[int, object]] = {}
        for time_ns, address, size, _total, event in allocations:
            if time_ns > peak[0]:
                break
            if size > 0:
                live[address] = (size, event)
            else:
                live.pop(address, None)
        return sorted(((size, self._ops(event)) for size, event in live.values()),
                      key=lambda item: -item[0])


def _worker(rank: int, policy: str, micro_batch: int, dp: int, tp: int, vocab: int,
            heads: tuple[int, int], compile_mode: str, profiler: bool, port: str,
            out_dir: str) -> None:
    _init_rank(rank, dp * tp, port)
    from torch.distributed.device_mesh import init_device_mesh
    _stub_moe_kernels()
    from torch.distributed.tensor.parallel import loss_parallel
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.models.llama3.model.args import TransformerModelArgs

    from meshplan.runtime.memory import PeakMemory

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("fsdp", "tp"))
    args = TransformerModelArgs(dim=64, n_layers=4, n_heads=heads[0], n_kv_heads=heads[1],
                                vocab_size=vocab, multiple_of=16, max_seq_len=SEQ_LEN)
    torch.manual_seed(0)
    loss_fn = (torch.compile(cross_entropy_loss) if compile_mode == "model+loss"
               else cross_entropy_loss)
    if profiler or compile_mode != "none":
        peak = AllocatorPeak()
    else:
        peak = PeakMemory(torch.device("cpu"))
        _track_loss_parallel(peak)
    with peak:
        model = _new_model(args)
        _parallelize(model, mesh, tp=tp, policy=policy, pp_enabled=False,
                     compile_model=compile_mode != "none")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        # the ranks of one TP group read the same batch
        tokens = torch.randint(0, vocab, (micro_batch, SEQ_LEN + 1),
                               generator=torch.Generator().manual_seed(rank // tp))
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        for step in range(STEPS):
            with peak.window() if step and isinstance(peak, AllocatorPeak) \
                    else contextlib.nullcontext():
                optimizer.zero_grad()
                if step == 1 and isinstance(peak, PeakMemory):
                    peak.reset()
                with loss_parallel() if tp > 1 else contextlib.nullcontext():
                    pred = model(inputs)
                    loss = loss_fn(pred, labels)
                    del pred
                    loss.backward()
                optimizer.step()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"peak_bytes": peak.peak_bytes}))
    dist.destroy_process_group()


def measure(policy: str, micro_batch: int, *, dp: int = 2, tp: int = 1,
            vocab: int = TINY_VOCAB, heads: tuple[int, int] = TINY_HEADS,
            compile_mode: str = "none", profiler: bool = False) -> list[int]:
    """Per-rank peak bytes of torchtitan's step under ``policy``: live tensor bytes, or under
    ``compile_mode`` (``model``: each block; ``model+loss``: the loss too) or ``profiler``
    the CPU allocator's (``AllocatorPeak``)."""
    with tempfile.TemporaryDirectory() as tmp:
        _spawn(_worker, (policy, micro_batch, dp, tp, vocab, heads, compile_mode, profiler,
                         _free_port(), tmp),
               dp * tp, TIMEOUT_S)
        return [json.loads(Path(tmp, f"rank{r}.json").read_text())["peak_bytes"]
                for r in range(dp * tp)]


def policy_fields(policy: str) -> dict[str, str]:
    """``ParallelConfig``'s recompute fields for an AC ``policy`` as ``_ac_config`` reads it
    (``full``, ``none``, or torchtitan's selective option: ``op`` or every Nth layer)."""
    if policy in ("full", "none"):
        return {"recompute": policy, "selective_ac": "op"}
    return {"recompute": "selective", "selective_ac": policy}


def predict(policy: str, micro_batch: int, *, dp: int = 2, tp: int = 1,
            vocab: int = TINY_VOCAB, heads: tuple[int, int] = TINY_HEADS,
            compile_mode: str = "none") -> float:
    import dataclasses

    from meshplan.costmodel import ParallelConfig, estimate, load_cluster, load_model
    config = ParallelConfig(dp=dp, tp=tp, sp=tp > 1, zero_stage=3, **policy_fields(policy),
                            micro_batch_size=micro_batch,
                            global_batch_size=dp * micro_batch, seq_len=SEQ_LEN,
                            dtype="fp32", compile=compile_mode)
    model = dataclasses.replace(load_model("tiny"), vocab_size=vocab, num_heads=heads[0],
                                num_kv_heads=heads[1])
    est = estimate(model, load_cluster("cpu", nodes=1, gpus_per_node=dp * tp), config,
                   framework="torchtitan")
    return est.memory.peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="op", help="op, an integer N, full or none")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2, help="FSDP ranks")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel ranks (SP and loss parallelism on)")
    parser.add_argument("--vocab", type=int, default=TINY_VOCAB, help="vocabulary rows")
    parser.add_argument("--heads", type=int, nargs=2, default=TINY_HEADS,
                        metavar=("Q", "KV"), help="attention and key/value heads (tp divides "
                        "both; the width stays 64)")
    parser.add_argument("--compile", default="none", choices=("none", "model", "model+loss"),
                        help="torch.compile each block (model), and the loss (model+loss)")
    parser.add_argument("--profiler", action="store_true",
                        help="measure the CPU allocator's peak (AllocatorPeak) without compile")
    args = parser.parse_args()
    shape = dict(dp=args.dp, tp=args.tp, vocab=args.vocab, heads=tuple(args.heads),
                 compile_mode=args.compile)
    peaks = measure(args.policy, args.micro_batch, profiler=args.profiler, **shape)
    predicted = predict(args.policy, args.micro_batch, **shape)
    for rank, measured in enumerate(peaks):
        print(f"policy {args.policy} compile {args.compile} micro-batch {args.micro_batch} "
              f"dp {args.dp} tp {args.tp} "
              f"vocab {args.vocab} rank {rank}: measured {measured} B, predicted "
              f"{predicted:.0f} B, error {predicted / measured - 1:+.3f}")


if __name__ == "__main__":
    main()
