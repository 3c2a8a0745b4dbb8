"""One rank of a published torchtitan run, on one GPU: its peak memory against the cost model.

The torchtitan memory figures the cost model misses most (``costmodel/data/memory_runs.json``:
the float8 Llama 3.1 8B rows on 32 and 64 H200, the 70B 2D row, the 405B pipelined rows) were
measured on clusters of 32 to 512 GPUs. One rank of such a run can be reproduced on one GPU:
this script joins torch's fake process group (``init_process_group("fake")``, the backend
torchtitan's own ``--comm.mode fake_backend`` dry run uses) as rank 0 of the run's world
size, so every collective completes at once without moving data while every tensor the rank
holds is allocated with its real shape: FSDP2's sharded parameters, gradients and optimizer
states and its all-gather and reduce-scatter buffers, the tensor-parallel shards and the
gathered sequence. Pipelined runs are left out: a ``PipelineStage`` infers its neighbours'
tensor shapes by exchanging metadata objects over the group at its first step, which a fake
group cannot carry.

For each run it builds meshplan's plan of the run's configuration, exports it with meshplan's
torchtitan exporter (``planner.export.to_torchtitan``, the TOML a user would launch), reads
that back with torchtitan 0.2.2's ``ConfigManager`` and wires torchtitan's own components as
its ``Trainer`` does (``torchtitan/train.py``): the train spec's model class and flavour, the
model converters (float8), ``parallelize_fn`` (TP, activation checkpointing, torch.compile,
FSDP2), the loss, the optimizers with the converters' post-step hook, the train context (loss
parallelism) and ``maybe_enable_amp``, context-parallel input sharding; then its train step
(zero_grad, every
micro-batch's forward and backward, ``clip_grad_norm_``, the optimizer step) on random token
ids. After ``--warmup`` steps (compilation) the allocator's peaks are reset and read after
``--steps`` more: ``torch.cuda.max_memory_reserved`` is what torchtitan logs as its memory
and what the published tables give, compared with the model's reserved bytes less the
communicator buffers (NCCL allocates those itself, outside the allocator; ``memory_runs.
compare``); ``max_memory_allocated`` with the model's allocated peak.

What the fake group leaves out: NCCL's own buffers (outside torch's allocator on a real run
too); asynchronous TP (symmetric memory needs a real group: those rows run with it off, which
is what the model prices); any memory a collective holds only while it is in flight (each
completes at once here).

    python3 benchmarks/gpu_torchtitan_memory.py [--runs ID ...] [--out DIR]   # one GPU
    python3 benchmarks/gpu_torchtitan_memory.py --tiny [--out DIR]            # one GPU
    python benchmarks/gpu_torchtitan_memory.py --dry-run                      # this CPU

``--tiny`` runs seven of the CPU's bf16 / float8 plans (``torchtitan_cpu_mixed_memory.py``)
16 times wider on CUDA beside the model's prediction for an H200 (``tiny_rows``).

``--dry-run`` runs torchtitan-shaped plans of meshplan's ``tiny`` model on the CPU (fp32,
eager) under the live-tensor tracker, beside the peaks the same plans measured with real gloo
ranks (``memory_runs.json``'s ``torchtitan-cpu-tiny-*`` rows): what makes the fake group's
rank a faithful stand-in (``tests/costmodel/test_fake_rank_memory.py``). Needs torchtitan
0.2.2 (``pip install -e .[export]``) and, for float8 runs, torchao; on the GPU machine both
travel as wheels (benchmarks/README.md). Without CUDA and without ``--dry-run`` it stops with
one line (exit 2).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torchtitan_cpu_memory import (SEQ_LEN, AllocatorPeak,  # noqa: E402
                                   _stub_moe_kernels, _track_loss_parallel, policy_fields)

GIB = 2**30
RESULTS = Path(__file__).resolve().parent / "results"
GPU_RUNS = (
    # controls the model agrees with (bf16 and float8, eager and compiled, no TP)
    "torchtitan-llama3.1-8b-fsdp8-h100",
    "torchtitan-llama3.1-8b-fsdp128-h100-compile-float8",
    # the misses without a pipeline: float8 with the loss compiled; float8 TP
    "torchtitan-llama3.1-8b-fsdp32-h200-compile-float8",
    "torchtitan-llama3.1-8b-fsdp64-h200-compile-float8",
    "torchtitan-llama3.1-70b-fsdp32-tp8-h100",
)
"""The GPU rows run by default, cheapest first (no pipelined ones: module doc)."""
DRY_RUNS = (
    # (memory_runs.json id, dp, tp, micro-batch, policy, vocabulary)
    ("torchtitan-cpu-tiny-fsdp2-full", 2, 1, 2, "full", 256),
    ("torchtitan-cpu-tiny-fsdp4-op-mb8", 4, 1, 8, "op", 256),
    ("torchtitan-cpu-tiny-fsdp2-tp2-full-mb8", 2, 2, 8, "full", 256),
    ("torchtitan-cpu-tiny-v1024-fsdp2-tp2-op-mb8", 2, 2, 8, "op", 1024),
)
"""CPU plans with a real multi-process measurement recorded (``memory_runs.json``)."""


def _import_torchtitan():
    """torchtitan's modules this script wires, imported once (its MoE Triton kernels stubbed
    where triton is missing)."""
    _stub_moe_kernels()
    import torchtitan.models  # noqa: F401  (registers the train specs)
    from torchtitan.components.quantization import float8  # noqa: F401  (registers float8)
    return True


def job_config(plan, *, async_tp: bool = False):
    """torchtitan's JobConfig for ``plan``: meshplan's export read back by its ConfigManager
    (asynchronous TP off unless asked: it needs a real process group)."""
    from torchtitan.config import ConfigManager

    from meshplan.planner import export
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "job.toml")
        path.write_text(export.to_torchtitan(plan))
        job = ConfigManager().parse_args(["--job.config_file", str(path)])
    job.parallelism.enable_async_tensor_parallel = async_tp and \
        job.parallelism.enable_async_tensor_parallel
    return job


@dataclasses.dataclass
class RankPeak:
    allocated: int
    reserved: int | None
    step_s: float
    resting: int | None = None
    """CUDA: bytes allocated at the first measured step's start, gradients set to None
    (parameters, optimizer states, buffers, and what libraries such as cuBLAS keep)."""
    meter: object = None
    """The CPU meter (``AllocatorPeak``: its ``live_at_peak``), for the live-allocation replay."""
    live: list | None = None
    """CUDA with ``history``: the blocks alive at the trace's peak (``cuda_live_at_peak``)."""


def cuda_live_at_peak(trace: list[dict], *, top: int = 25) -> list[dict]:
    """The blocks alive at the highest point of a CUDA allocator trace (``torch.cuda.memory.
    _snapshot()["device_traces"][i]``, recorded with ``_record_memory_history``), grouped by
    size and the innermost Python frame that allocated them, largest groups first: what the
    CPU's ``--live`` replay shows (``torchtitan_cpu_memory.AllocatorPeak.live_at_peak``), for
    CUDA's kernels and Inductor. Blocks allocated before the recording began are not in it, and
    their frees are skipped; a block counts until its free completes."""
    def replay(stop: int | None) -> tuple[dict[int, dict], int]:
        """The blocks alive after entry ``stop`` (all entries: None), and the index of the
        entry at which the running total was highest."""
        live: dict[int, dict] = {}
        total = best = 0
        best_index = -1
        for index, entry in enumerate(trace):
            action, address = entry.get("action"), entry.get("addr")
            if action == "alloc":
                live[address] = entry
                total += entry["size"]
                if total > best:
                    best, best_index = total, index
            elif action == "free_completed" and address in live:
                total -= live.pop(address)["size"]
            if index == stop:
                break
        return live, best_index

    _, peak_index = replay(None)
    at_peak, _ = replay(peak_index) if peak_index >= 0 else ({}, -1)
    groups: dict[tuple[int, str], int] = {}
    for entry in at_peak.values():
        frames = entry.get("frames") or [{}]
        frame = next((f for f in frames if "/torch/" not in f.get("filename", "")), frames[0])
        label = f"{frame.get('name', '?')} ({Path(frame.get('filename', '?')).name}:" \
                f"{frame.get('line', '?')})"
        groups[entry["size"], label] = groups.get((entry["size"], label), 0) + 1
    ranked = sorted(groups.items(), key=lambda item: -item[0][0] * item[1])[:top]
    return [{"bytes": size, "count": count, "frame": label}
            for (size, label), count in ranked]


def run_rank(job, *, world: int, rank: int, device: torch.device, warmup: int, steps: int,
             args_override: dict | None = None, meter: str = "cuda",
             history: bool = False) -> RankPeak:
    """torchtitan's train step on ``rank`` of a fake group of ``world`` ranks (module doc).

    ``args_override``: model-argument fields replaced after the flavour's (the dry run's tiny
    shapes). ``meter``: ``cuda``, the CUDA allocator's peaks; on the CPU ``tracker``, live
    tensor bytes (``PeakMemory``), or ``allocator``, the CPU allocator's running total
    (``torchtitan_cpu_memory.AllocatorPeak``: it sees inside compiled graphs, which the
    tracker's dispatch mode keeps Dynamo from tracing; in one process no gloo thread adds to
    it). ``history`` (CUDA): record the allocator's trace over the measured steps and keep
    the blocks alive at its peak (``cuda_live_at_peak``) in ``RankPeak.live``."""
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.context_parallel import prepare_context_parallel_input
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.protocols.model_converter import build_model_converters
    from torchtitan.protocols.train_spec import get_train_spec
    from torchtitan.tools import utils

    from meshplan.runtime.memory import PeakMemory

    if device.type == "cpu":
        # torchtitan builds its meshes on its module's device type, and its float8 converter
        # asks for a CUDA capability; torch's CPU build runs float8 GEMMs (torch._scaled_mm)
        import torchtitan.components.quantization.float8 as float8_module
        import torchtitan.distributed.parallel_dims as parallel_dims_module
        parallel_dims_module.device_type = "cpu"
        float8_module.has_cuda_capability = lambda major, minor: True
    dist.init_process_group("fake", rank=rank, world_size=world)
    try:
        par, training = job.parallelism, job.training
        dims = ParallelDims(dp_replicate=par.data_parallel_replicate_degree,
                            dp_shard=par.data_parallel_shard_degree,
                            cp=par.context_parallel_degree, tp=par.tensor_parallel_degree,
                            pp=par.pipeline_parallel_degree, ep=par.expert_parallel_degree,
                            etp=par.expert_tensor_parallel_degree, world_size=world)
        dims.build_mesh()
        spec = get_train_spec(job.model.name)
        model_args = spec.model_args[job.model.flavor]
        model_args.update_from_config(job)
        if args_override:
            model_args = dataclasses.replace(model_args, **args_override)
        torch.manual_seed(0)
        peak = {"tracker": lambda: PeakMemory(device), "allocator": AllocatorPeak,
                "cuda": contextlib.nullcontext}[meter]()
        if meter == "tracker":
            _track_loss_parallel(peak)
        with peak:
            with torch.device("meta"), utils.set_default_dtype(TORCH_DTYPE_MAP[training.dtype]):
                model = spec.model_cls(model_args)
            converters = build_model_converters(job, dims)
            converters.convert(model)
            loss_fn = spec.build_loss_fn(job, parallel_dims=dims)
            if dims.pp_enabled:
                raise ValueError("a pipelined run cannot run under a fake group (module doc)")
            parts = [spec.parallelize_fn(model, dims, job)]
            del model
            for part in parts:
                part.to_empty(device=device)
                with torch.no_grad():
                    part.init_weights(buffer_device=None)
                part.train()
            optimizers = spec.build_optimizers_fn(parts, job.optimizer, dims)
            optimizers.register_step_post_hook(
                lambda *a, **k: converters.post_optimizer_hook(parts))
            loss_parallel = dims.tp_enabled and not par.disable_loss_parallel
            train_context = dist_utils.get_train_context(loss_parallel)
            amp = dist_utils.maybe_enable_amp(dims, training.mixed_precision_param,
                                              device.type)
            batch = (dims.dp_replicate * dims.dp_shard) if dims.dp_enabled else 1
            accumulation = training.global_batch_size // (training.local_batch_size * batch)
            vocab = model_args.vocab_size
            generator = torch.Generator().manual_seed(rank)
            started = resting = None
            for step in range(warmup + steps):
                if step == warmup:
                    if meter == "tracker":
                        peak.reset()
                    elif meter == "cuda":
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                        if history:
                            torch.cuda.memory._record_memory_history(max_entries=500_000)
                    started = time.perf_counter()
                window = peak.window() if meter == "allocator" and step >= warmup \
                    else contextlib.nullcontext()
                with window:
                    optimizers.zero_grad()
                    if step == warmup and meter == "cuda":
                        resting = torch.cuda.memory_allocated()
                    for _ in range(accumulation):
                        tokens = torch.randint(0, vocab, (training.local_batch_size,
                                                          training.seq_len + 1),
                                               generator=generator).to(device)
                        inputs, labels = tokens[:, :-1], tokens[:, 1:]
                        kwargs: dict = {}
                        if dims.cp_enabled:
                            inputs, labels, kwargs = prepare_context_parallel_input(
                                inputs, labels, kwargs, dims.get_mesh("cp"), device,
                                par.context_parallel_load_balancer)
                        with train_context():
                            with amp:
                                pred = parts[0](inputs, **kwargs)
                                loss = loss_fn(pred, labels) / labels.numel()
                            del pred
                            loss.backward()
                    dist_utils.clip_grad_norm_([p for m in parts for p in m.parameters()],
                                               training.max_norm, foreach=True,
                                               pp_mesh=dims.get_optional_mesh("pp"),
                                               ep_enabled=dims.ep_enabled)
                    optimizers.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            step_s = (time.perf_counter() - started) / max(1, steps)
        if meter == "cuda":
            live = None
            if history:
                trace = torch.cuda.memory._snapshot()["device_traces"][device.index or 0]
                torch.cuda.memory._record_memory_history(enabled=None)
                live = cuda_live_at_peak(trace)
            return RankPeak(allocated=torch.cuda.max_memory_allocated(),
                            reserved=torch.cuda.max_memory_reserved(), step_s=step_s,
                            resting=resting, live=live)
        return RankPeak(allocated=peak.peak_bytes, reserved=None, step_s=step_s, meter=peak)
    finally:
        dist.destroy_process_group()


def plan_of(model, cluster, config):
    """meshplan's plan of a configuration (its estimate, for the exporter)."""
    from meshplan.costmodel import estimate
    from meshplan.planner.plan import Plan
    est = estimate(model, cluster, config, framework="torchtitan")
    return Plan.from_estimate(est, provenance={"source": "gpu_torchtitan_memory"}), est


def gpu_rows(ids: list[str], *, warmup: int, steps: int) -> list[dict]:
    """Rank 0 of each run of ``ids`` (module doc)."""
    from meshplan.costmodel.memory_runs import compare, memory_runs
    from meshplan.costmodel import default_calibration
    runs = {run.id: run for run in memory_runs()}
    cal = default_calibration()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    rows = []
    for run_id in ids:
        run = runs[run_id]
        plan, est = plan_of(run.model, run.cluster, run.config)
        memory = est.memory.per_stage[0]
        row = {"run": run_id, "published_GiB": run.measured / GIB,
               "predicted_reserved_GiB": compare(run, cal).predicted / GIB,
               "predicted_allocated_GiB": memory.peak_bytes / GIB}
        try:
            result = run_rank(job_config(plan), world=run.config.world_size, rank=0,
                              device=device, warmup=warmup, steps=steps)
            row.update(reserved_GiB=result.reserved / GIB,
                       allocated_GiB=result.allocated / GIB, step_s=result.step_s)
        except torch.OutOfMemoryError as exc:
            row["error"] = f"out of memory: {str(exc).splitlines()[0]}"
        except Exception as exc:  # one row's failure must not lose the others
            row["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def dry_plan(dp: int, tp: int, micro_batch: int, policy: str, vocab: int, *,
             dtype: str = "fp32", float8: bool = False, compile_mode: str = "none"):
    """The dry run's plan for torchtitan's exporter (llama3 8B, the flavour the export names)
    and its estimate for meshplan's ``tiny`` model, whose shapes replace the flavour's
    arguments (``tiny_overrides``)."""
    from meshplan.costmodel import estimate, load_cluster, load_model
    tiny = dataclasses.replace(load_model("tiny"), vocab_size=vocab)
    config = tiny_config(dp, tp, micro_batch, policy, seq_len=SEQ_LEN, dtype=dtype,
                         float8=float8, compile_mode=compile_mode)
    cluster = load_cluster("cpu", nodes=1, gpus_per_node=dp * tp)
    plan, _ = plan_of(load_model("llama3-8b"), export_cluster(dp * tp), config)
    return plan, estimate(tiny, cluster, config, framework="torchtitan"), tiny


def tiny_config(dp: int, tp: int, micro_batch: int, policy: str, *, seq_len: int, dtype: str,
                float8: bool, compile_mode: str):
    """The ZeRO-3 configuration of a dry-run or ``--tiny`` plan: one micro-batch a step, SP
    with TP, recomputation by ``policy`` (``torchtitan_cpu_memory.policy_fields``)."""
    from meshplan.costmodel import ParallelConfig
    return ParallelConfig(dp=dp, tp=tp, sp=tp > 1, zero_stage=3, **policy_fields(policy),
                          micro_batch_size=micro_batch, global_batch_size=dp * micro_batch,
                          seq_len=seq_len, dtype=dtype, float8=float8, compile=compile_mode)


def export_cluster(gpus: int):
    """The cluster the dry runs' plans are exported for: the TOML does not depend on it, but
    meshplan's exporter refuses a float8 plan for the CPU, where torchtitan's converter asks
    for a float8 GPU (``run_rank`` lets torch's CPU float8 GEMMs stand in for it)."""
    from meshplan.costmodel import load_cluster
    return load_cluster("dgx-h100", nodes=1, gpus_per_node=gpus)


def tiny_overrides(tiny, *, multiple_of: int = 16) -> dict:
    """torchtitan llama3 model arguments with ``tiny``'s shapes (torchtitan_cpu_memory's; its
    SwiGLU width is 8/3 of the width rounded up to ``multiple_of``, as ``tiny``'s 176)."""
    return {"dim": tiny.hidden_size, "n_layers": tiny.num_layers, "n_heads": tiny.num_heads,
            "n_kv_heads": tiny.kv_heads, "vocab_size": tiny.vocab_size,
            "multiple_of": multiple_of, "ffn_dim_multiplier": None}


def dry_measure(dp: int, tp: int, micro_batch: int, policy: str, vocab: int, *,
                dtype: str = "fp32", float8: bool = False,
                compile_mode: str = "none", live: bool = False):
    """(fake rank 0's peak bytes, the model's peak) for a tiny plan on the CPU: live tensor
    bytes, or under ``compile_mode`` (or ``live``) the CPU allocator's (``run_rank``'s
    meters), over two steps after one (two compiling) that are not measured. ``live``: a
    third item, the allocator meter (``AllocatorPeak.live_at_peak``)."""
    _import_torchtitan()
    plan, est, tiny = dry_plan(dp, tp, micro_batch, policy, vocab, dtype=dtype, float8=float8,
                               compile_mode=compile_mode)
    compiled = compile_mode != "none"
    result = run_rank(job_config(plan), world=dp * tp, rank=0, device=torch.device("cpu"),
                      warmup=2 if compiled else 1, steps=2, args_override=tiny_overrides(tiny),
                      meter="allocator" if compiled or live else "tracker")
    measured = (result.allocated, est.memory.per_stage[0].peak_bytes)
    return (*measured, result.meter) if live else measured


def dry_rows() -> list[dict]:
    from meshplan.costmodel.memory_runs import memory_runs
    recorded = {run.id: run for run in memory_runs()}
    rows = []
    for run_id, dp, tp, micro, policy, vocab in DRY_RUNS:
        fake, predicted = dry_measure(dp, tp, micro, policy, vocab)
        rows.append({"run": run_id, "fake_rank_bytes": fake,
                     "gloo_ranks_bytes": recorded[run_id].measured,
                     "predicted_bytes": predicted})
        print(json.dumps(rows[-1]), flush=True)
    return rows


TINY_SCALE = {"hidden_size": 1024, "num_heads": 8, "num_kv_heads": 4, "ffn_hidden_size": 2816,
              "vocab_size": 8192}
"""``--tiny`` on CUDA: the CPU plans' shapes widened 16x (ffn 2.75 h, as ``tiny``'s), so that
the activations (hundreds of MiB) outweigh what libraries allocate through torch's allocator
(cuBLAS workspaces: MiB)."""


TINY_GPU_PLANS = tuple(f"torchtitan-cpu-tiny-{kind}-fsdp2-{policy}-mb8" for kind, policy in (
    ("bf16", "none"), ("bf16", "full"), ("float8", "full"), ("bf16-compile", "full"),
    ("float8-compile", "full"), ("float8-compile", "none"), ("float8-compile", "op")))
"""``--tiny``'s plans on the GPU: one for each mechanism the CPU rows found, the compiled
float8 block backward among them (2 to 3 minutes on an H200)."""


def tiny_rows(plans: dict, *, scale: dict | None = TINY_SCALE,
              device: torch.device | None = None) -> list[dict]:
    """The CPU bf16 / float8 plans (``torchtitan_cpu_mixed_memory.PLANS``) on CUDA, widened
    (``TINY_SCALE``), each beside the model's prediction for a GPU: the peak, and the peak
    above the resting bytes (``RankPeak.resting``) beside the model's peak above its
    parameters and optimizer states, which leaves the libraries' workspaces out of it. What
    the CPU measured of the composite RMSNorm, the eager float8 cast, the sharded gradients in
    backward and the compiled float8 block, on CUDA's kernels and Inductor. ``scale`` None and
    ``device`` the CPU: the plans as the CPU rows measured them (this path's own check)."""
    from meshplan.costmodel import estimate, load_cluster, load_model
    device = device or torch.device("cuda", 0)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    widen = 16 if scale else 1
    rows = []
    for plan_id, (dp, tp, micro, policy, vocab, float8, compile_mode) in plans.items():
        tiny = dataclasses.replace(load_model("tiny"), **(scale or {}))
        tiny = dataclasses.replace(tiny, vocab_size=tiny.vocab_size * vocab // 256)
        config = tiny_config(dp, tp, micro, policy, seq_len=SEQ_LEN * widen, dtype="bf16",
                             float8=float8, compile_mode=compile_mode)
        cluster = load_cluster("dgx-h200" if cuda else "cpu", nodes=1, gpus_per_node=dp * tp)
        plan, _ = plan_of(load_model("llama3-8b"), export_cluster(dp * tp), config)
        memory = estimate(tiny, cluster, config, framework="torchtitan").memory.per_stage[0]
        row = {"plan": plan_id, "scale": f"x{widen}", "predicted_bytes": memory.peak_bytes,
               "predicted_above_states_bytes": memory.peak_bytes - memory.params_bytes
               - memory.optimizer_bytes}
        try:
            meter = "cuda" if cuda else "allocator" if compile_mode != "none" else "tracker"
            result = run_rank(job_config(plan), world=dp * tp, rank=0, device=device,
                              warmup=2, steps=2, meter=meter, history=cuda,
                              args_override=tiny_overrides(tiny, multiple_of=16 * widen))
            row.update(allocated_bytes=result.allocated, reserved_bytes=result.reserved)
            if result.live is not None:
                row["live_at_peak"] = result.live
            if result.resting is not None:
                row["above_resting_bytes"] = result.allocated - result.resting
        except Exception as exc:  # one plan's failure must not lose the others
            row["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        if cuda:
            torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=list(GPU_RUNS),
                        help="memory_runs.json ids (torchtitan, peak_reserved_GiB)")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the peaks reset")
    parser.add_argument("--steps", type=int, default=2, help="steps measured")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny plans on the CPU beside their gloo measurements")
    parser.add_argument("--tiny", action="store_true",
                        help="the CPU's bf16 / float8 plans (torchtitan_cpu_mixed_memory.py), "
                        "16x wider, on CUDA")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", RESULTS)))
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_torchtitan_memory: no CUDA device (use --dry-run on the CPU)",
              file=sys.stderr)
        raise SystemExit(2)
    try:
        _import_torchtitan()
    except ImportError as exc:
        print(f"gpu_torchtitan_memory: torchtitan is not importable ({exc}); "
              f"pip install -e .[export]", file=sys.stderr)
        raise SystemExit(2) from None
    if args.dry_run:
        rows = dry_rows()
    elif args.tiny:
        from torchtitan_cpu_mixed_memory import PLANS
        rows = tiny_rows({plan_id: PLANS[plan_id] for plan_id in TINY_GPU_PLANS})
    else:
        rows = gpu_rows(args.runs, warmup=args.warmup, steps=args.steps)
    device = "cpu" if args.dry_run else torch.cuda.get_device_name().replace(" ", "-").lower()
    args.out.mkdir(parents=True, exist_ok=True)
    kind = "tiny-" if args.tiny else ""
    path = args.out / f"torchtitan-memory-{kind}{device}-{dt.date.today().isoformat()}.json"
    path.write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
