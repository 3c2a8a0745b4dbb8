"""Run one plan on this rank: build the model chunk(s), apply the plan, train, measure.

``run_plan`` is what every torchrun worker calls (``worker.py``). Order of application
(DESIGN.md, Runtime): DeviceMesh -> tensor/sequence parallel -> pipeline split -> activation
checkpointing -> ZeRO / data parallel (+ offload) -> optimizer -> pipeline schedule.

Each step: zero gradients; forward and backward over the plan's grad_accum_steps
micro-batches (a loop, or the pipeline schedule); optimizer step. The loss logged is the mean
over the global batch: the last pipeline stage's first tensor-parallel rank of every replica
contributes its replica mean / dp, and one all-reduce over all ranks adds them up, so every
layout reports the same number.

Checkpoints (``checkpoint.py``): with ``checkpoint_every`` N every N-th step is saved into
``checkpoint_dir``; a run asked to ``resume``, or restarted by torchrun (``--max-restarts``,
seen as TORCHELASTIC_RESTART_COUNT > 0), first loads the latest checkpoint and continues after
its step, taking the earlier steps' losses from it. Saves run inside the measured memory window
(their buffers count in the per-rank peak); loading runs before it. ``fault.py`` can end one
rank after a step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from meshplan.costmodel.estimate import config_to_dict
from meshplan.planner.plan import Plan
from meshplan.runtime import checkpoint
from meshplan.runtime import data as data_mod
from meshplan.runtime import elastic
from meshplan.runtime import hf
from meshplan.runtime import materialize
from meshplan.runtime import mesh as mesh_mod
from meshplan.runtime import pipeline
from meshplan.runtime import prefork
from meshplan.runtime import preflight
from meshplan.runtime import recipe as recipe_mod
from meshplan.runtime.metrics import MetricsLog, StepMetrics, mfu
from meshplan.runtime.recipe import Recipe
from meshplan.runtime.fault import Fault
from meshplan.runtime.memory import PeakMemory, RssGrowth, peak_rss_bytes
from meshplan.runtime.model import Decoder, build_decoder
from meshplan.runtime.report import RankReport, RunReport

# parallelize.py and optim.py (FSDP2, tensor parallelism, ZeRO: torch.distributed.tensor and
# torch.distributed.optim) and chain.py (the cost model's tracing, networkx) are imported by
# the functions that build a rank's model: ``meshplan run``'s launching process imports this
# module for ``RunOptions`` only. A worker imports them before it starts
# (``worker.import_training``).

logger = logging.getLogger(__name__)

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """What to run besides the plan."""

    steps: int = 5
    """Optimizer steps; the first is a warm-up left out of the median step time."""
    seed: int = 0
    """Seed of the weights and of the synthetic data."""
    data: str | None = None
    """Token file (numpy memmap) instead of synthetic data."""
    shuffle: bool = False
    """Read the token file's windows in a seeded order (text corpora, corpus.py)."""
    timeout_s: float = mesh_mod.DEFAULT_TIMEOUT_S
    """Process-group timeout once the first step is done (``--timeout``)."""
    init_timeout_s: float = mesh_mod.DEFAULT_INIT_TIMEOUT_S
    """Process-group timeout until then (``--init-timeout``): construction, loading a
    checkpoint and the first step, which take longest."""
    recipe: Recipe = Recipe()
    """Learning-rate schedule, AdamW hyperparameters and clipping (recipe.py)."""
    metrics: str | None = None
    """JSONL file of per-step metrics (metrics.py), written by rank 0; None: console only."""
    track_memory: bool = True
    """Count live tensor bytes on the CPU (memory.py); costs dispatch time on every op."""
    memory_steps: int = 2
    """On the CPU, the steps (of those this attempt runs) counted by the live-tensor tracker:
    the warm-up and one step with the optimizer states in place, which peaks as every later
    step does. The rest run without the tracker's dispatch overhead (about twice a small
    model's step time here), and the median step time is theirs (``RunReport.tracked_steps``).
    A checkpoint saved between those steps counts in the peak, one saved after them does not.
    CUDA's counters cost nothing and count every step."""
    checkpoint_dir: str | None = None
    """Folder of the checkpoints (checkpoint.py), shared by all nodes; None: no checkpoints."""
    checkpoint_every: int = 0
    """Save after every this many steps; 0: never save (the folder is only read)."""
    resume: bool = False
    """Start from the latest checkpoint in ``checkpoint_dir`` (it must exist)."""
    keep_last: int = 0
    """Keep only this many newest checkpoints (``--keep-last``); 0: keep all."""
    elastic: bool = False
    """An elastic job (``--nnodes MIN:MAX``, elastic.py): every attempt resumes from the latest
    checkpoint of this run, under a plan for the world size it finds (replanned on rank 0)."""
    run_id: str | None = None
    """The job's rendezvous id: the checkpoints and membership records of this run carry it."""
    replan_time_limit_s: float = 30.0
    """Wall-clock bound of one replan of an elastic job (``--replan-time-limit``)."""
    init_from: str | None = None
    """HF checkpoint directory to take the initial weights from (``--init-from``, hf.py)."""
    save_hf: str | None = None
    """Directory to write an HF checkpoint of the trained model into (``--save-hf``)."""
    save_hf_every: int = 0
    """Also write one every this many steps, into ``save_hf``/step-<k> (0: at the end only)."""

    def __post_init__(self) -> None:
        if self.steps < 1 and not (self.steps == 0 and self.save_hf):
            raise ValueError(f"steps must be >= 1 (0 only with --save-hf: convert the weights), "
                             f"got {self.steps}")
        if self.save_hf_every < 0 or (self.save_hf_every and not self.save_hf):
            raise ValueError(f"--save-hf-every must be >= 1 and needs --save-hf DIR, got "
                             f"{self.save_hf_every}")
        if self.memory_steps < 1:
            raise ValueError(f"memory_steps must be >= 1, got {self.memory_steps}")
        if self.keep_last < 0:
            raise ValueError(f"--keep-last must be >= 1 (0: keep all), got {self.keep_last}")
        if self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every must be >= 1 (0: never save), got "
                             f"{self.checkpoint_every}")
        if (self.checkpoint_every or self.resume) and not self.checkpoint_dir:
            raise ValueError("--checkpoint-every and --resume need --checkpoint-dir DIR")
        if self.elastic and not (self.checkpoint_dir and self.checkpoint_every):
            raise ValueError("an elastic run (--nnodes MIN:MAX) needs --checkpoint-dir DIR and "
                             "--checkpoint-every N: a new membership continues from the last "
                             "checkpoint")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.timeout_s <= 0 or self.init_timeout_s <= 0:
            raise ValueError(f"--timeout and --init-timeout must be > 0, got {self.timeout_s} "
                             f"and {self.init_timeout_s}")
        if isinstance(self.recipe, dict):  # from the job's JSON
            object.__setattr__(self, "recipe", Recipe(**self.recipe))
        object.__setattr__(self, "recipe", self.recipe.for_run(self.steps))


def plan_data(plan: Plan, options: RunOptions) -> data_mod.DataSpec:
    """The data stream of ``plan`` run with ``options``."""
    return data_mod.DataSpec(global_batch_size=plan.config.global_batch_size,
                             seq_len=plan.config.seq_len, vocab_size=plan.model.vocab_size,
                             seed=options.seed, token_file=options.data,
                             shuffle=options.shuffle)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over a micro-batch (fp32)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


CPU_PLAN_DTYPE_ENV = "MESHPLAN_CPU_PLAN_DTYPE"
"""Set to 1: run the plan's dtype on the CPU too (bf16 autocast, or FSDP2's bf16 parameters),
slowly. For measuring the low-precision path's memory where no GPU is lent (its tensors are
the ones a CUDA run keeps, but for kernels that differ by device, e.g. a fused RMSNorm)."""


def compute_dtype(plan: Plan, device: torch.device) -> torch.dtype:
    """The plan's dtype on CUDA; fp32 on the CPU (no fast low-precision kernels there) unless
    ``MESHPLAN_CPU_PLAN_DTYPE=1``."""
    if device.type == "cuda" or os.environ.get(CPU_PLAN_DTYPE_ENV) == "1":
        return _DTYPES[plan.config.dtype]
    return torch.float32


@dataclass
class RankModel:
    """This rank's part of the model, wrapped for the plan, and how to step it."""

    modules: list[nn.Module]
    optimizer: torch.optim.Optimizer
    schedule: Any | None
    stage_indices: list[int]
    coords: mesh_mod.MeshCoords
    autocast_dtype: torch.dtype | None
    pp_mesh: DeviceMesh | None = None
    """The pipeline axis (gradient norms add up over it)."""
    num_stages: int = 1
    tied: nn.Parameter | None = None
    """A tied embedding split over pipeline stages: this rank's word embedding (first stage) or
    its LM-head copy (last stage); None otherwise."""
    tied_group: Any = None
    """The two ranks (first and last stage, same dp and tp coordinates) that sum its gradient."""
    tied_is_copy: bool = False
    """``tied`` is the LM-head copy: left out of the gradient norm (counted once, on the first
    stage, as Megatron does)."""

    @property
    def first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def last(self) -> bool:
        return self.num_stages - 1 in self.stage_indices


def _chunk_modules(plan: Plan, mesh: DeviceMesh, *, seed: int, device: torch.device,
                   init_from: str | None = None) -> tuple[list[nn.Module], list[int]]:
    """Build, tensor-parallelise and checkpoint-wrap this rank's (virtual) stage modules:
    the decoder's on ``meta`` (``materialize.py`` fills them once sharded), a traced module's
    initialised on ``device`` (a transformers module run whole: from ``init_from``'s
    weights, ``hf.load_traced_weights``)."""
    from meshplan.runtime import parallelize
    from meshplan.runtime.chain import build_chain, build_whole

    config, spec = plan.config, plan.model
    pp_rank = mesh.get_local_rank("pp")
    layers = pipeline.virtual_stage_layers(config, spec.num_layers)
    indices = pipeline.rank_stage_indices(config, pp_rank)
    modules = []
    for index in indices:
        if spec.is_traced and not spec.traced_chain:  # one stage (mesh.check_supported)
            module = build_whole(spec, seed=seed, device=device)
            if init_from:  # hf.check_directory took only a transformers module run whole
                hf.load_traced_weights(module.module, init_from)
        elif spec.is_traced:
            module = build_chain(spec, layer_ids=layers[index], seed=seed, device=device)
        else:
            module = build_decoder(spec, layer_ids=layers[index], first=index == 0,
                                   last=index == len(layers) - 1, device="meta")
        if config.tp > 1:
            parallelize.apply_tensor_parallel(module, mesh["tp"], sp=config.sp)
        parallelize.apply_checkpointing(module, config.stage_recompute(pp_rank))
        modules.append(module)
    return modules, indices


def _fill(module: nn.Module, plan: Plan, *, seed: int, init_from: str | None):
    """Where a decoder chunk's values come from: the HF checkpoint, else the initial values."""
    if init_from:
        return hf.SliceReader(init_from)
    return materialize.random_fill(num_layers=plan.model.num_layers, seed=seed,
                                   tied_copy=any(getattr(sub, "tied_copy", False)
                                                 for sub in module.modules()))


def host_work_threads(offload: str, device: torch.device) -> int | None:
    """Intra-op threads for a GPU rank whose host does per-micro-batch work: under FSDP2's CPU
    offload (``optimizer+params``) every backward copies the gradient shards to host memory and
    adds them there to the earlier micro-batches', and the optimizer steps there too; on the
    one thread the workers start with (runtime/launch.py) a 1.24 B-parameter step took 16-24 s
    on an H200 (``benchmarks/results/gpu-h200-2026-12-04.md``). The node's cores over its
    local ranks (``optim.host_threads``); None (keep one) otherwise, and on the CPU, whose
    ranks share the cores for their compute."""
    from meshplan.runtime.optim import host_threads

    if offload != "optimizer+params" or device.type != "cuda":
        return None
    return host_threads()


def build_rank_model(plan: Plan, mesh: DeviceMesh, *, seed: int, device: torch.device,
                     recipe: Recipe, init_from: str | None = None) -> RankModel:
    """Everything this rank needs to train ``plan``."""
    from meshplan.runtime import optim as optim_mod
    from meshplan.runtime import parallelize

    config = plan.config
    dtype = compute_dtype(plan, device)
    modules, indices = _chunk_modules(plan, mesh, seed=seed, device=device,
                                      init_from=init_from)
    choice = parallelize.DataParallelChoice(
        zero_stage=config.zero_stage, offload=config.offload, dp=config.dp,
        tensor_parallel=config.tp > 1, pipelined=config.pp > 1, interleaved=config.vpp > 1,
        param_dtype=dtype if dtype != torch.float32 else None)
    # FSDP2's CPU offload keeps the sharded parameters on the CPU
    where = torch.device("cpu") if choice.offload == "optimizer+params" else device
    threads = host_work_threads(choice.offload, device)
    if threads is not None:
        torch.set_num_threads(threads)
    built = []
    for module in modules:
        meta = any(p.is_meta for p in module.parameters())
        fill = _fill(module, plan, seed=seed, init_from=init_from) if meta else None
        if meta and not choice.uses_fsdp:  # DDP and replicate need real tensors
            materialize.materialize(module, where, fill)
        module = parallelize.apply_data_parallel(module, mesh["dp"], choice)
        if meta and choice.uses_fsdp:  # sharded on meta: each rank fills only its shards
            materialize.materialize(module, where, fill)
        built.append(module)
    modules = built
    optimizer = optim_mod.build_optimizer(modules, zero_stage=config.zero_stage,
                                          offload=config.offload, dp_mesh=mesh["dp"],
                                          recipe=recipe)
    schedule = None
    if config.pp > 1:
        schedule = pipeline.build_schedule(modules, indices, config=config, device=device,
                                           pp_group=mesh["pp"].get_group(), loss_fn=lm_loss)
    autocast = dtype if dtype != torch.float32 and not choice.uses_fsdp else None
    tied, group, is_copy = _tied_embedding(plan, mesh, modules)
    return RankModel(modules=modules, optimizer=optimizer, schedule=schedule,
                     stage_indices=indices, coords=mesh_mod.coords(mesh),
                     autocast_dtype=autocast, pp_mesh=mesh["pp"],
                     num_stages=config.pp * config.vpp, tied=tied, tied_group=group,
                     tied_is_copy=is_copy)


def _tied_embedding(plan: Plan, mesh: DeviceMesh, modules: list[nn.Module]):
    """(parameter, group, is the copy) of a tied embedding split over pipeline stages, else
    (None, None, False). Every rank creates every pair's group (``new_group`` is collective)."""
    if not plan.model.tied_embeddings or plan.config.pp == 1 or plan.model.is_traced:
        return None, None, False
    names = mesh.mesh_dim_names
    ranks = mesh.mesh.movedim(names.index("pp"), 0)
    mine = None
    for first, last in zip(ranks[0].flatten().tolist(), ranks[-1].flatten().tolist()):
        group = dist.new_group([first, last])
        if dist.get_rank() in (first, last):
            mine = group
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, Decoder) and sub.tied_copy:
                return sub.output.weight, mine, True
            if isinstance(sub, Decoder) and sub.tok_embeddings is not None:
                return sub.tok_embeddings.weight, mine, False
    return None, mine, False


def sync_tied_grads(rank_model: RankModel) -> None:
    """Sum the gradients of a tied embedding's two copies (first and last stage), so both
    take the same update: the embedding's gradient of the whole model."""
    param = rank_model.tied
    if param is None:
        return
    grad = param.grad
    if hasattr(grad, "placements") and grad.placements != param.placements:
        # a tensor-parallel embedding's gradient comes back replicated: shard it like the
        # weight (and like the LM-head copy's) so the two local tensors match
        grad = grad.redistribute(placements=param.placements)
        param.grad = grad
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    dist.all_reduce(local, group=rank_model.tied_group)


def _autocast(rank_model: RankModel, device: torch.device):
    if rank_model.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=rank_model.autocast_dtype)


def _no_sync(module: nn.Module, last: bool):
    """DDP's ``no_sync`` for all but the last micro-batch (one all-reduce per step)."""
    if isinstance(module, DistributedDataParallel) and not last:
        return module.no_sync()
    return contextlib.nullcontext()


def _loop_step(rank_model: RankModel, inputs: torch.Tensor, targets: torch.Tensor,
               microbatches: int) -> torch.Tensor:
    """Forward/backward over ``microbatches`` equal slices; returns the replica's mean loss."""
    model = rank_model.modules[0]
    total = torch.zeros((), device=inputs.device)
    pairs = zip(inputs.chunk(microbatches), targets.chunk(microbatches))
    for index, (x, y) in enumerate(pairs):
        with _no_sync(model, last=index == microbatches - 1):
            with _autocast(rank_model, inputs.device):
                loss = lm_loss(model(x), y)
            (loss / microbatches).backward()
        total += loss.detach()
    return total / microbatches


def _pipeline_step(rank_model: RankModel, inputs: torch.Tensor, targets: torch.Tensor,
                   microbatches: int) -> torch.Tensor:
    """One pass of the pipeline schedule; the replica's mean loss on the last stage, else 0."""
    losses: list[torch.Tensor] = []
    args = (inputs,) if rank_model.first else ()
    with _autocast(rank_model, inputs.device):
        rank_model.schedule.step(*args, target=targets if rank_model.last else None,
                                 losses=losses if rank_model.last else None,
                                 return_outputs=False)
    if not rank_model.last:
        return torch.zeros((), device=inputs.device)
    return torch.stack([loss.detach().float() for loss in losses]).mean()


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm of a step is NaN or infinite (the step is not applied)."""


@dataclass(frozen=True)
class StepResult:
    """What ``train_step`` returns: the same numbers on every rank."""

    loss: float
    """Global mean loss."""
    grad_norm: float
    """Global L2 norm of the gradients before clipping."""
    grad_norm_clipped: float | None
    """... measured after clipping (None without ``max_grad_norm``)."""
    lr: float
    optimizer_s: float = 0.0
    """Seconds of clipping and the optimizer step on this rank (offload copies included)."""


def _clip(rank_model: RankModel, recipe: Recipe, grad_norm: torch.Tensor,
          device: torch.device) -> float | None:
    """Clip to ``recipe.max_grad_norm`` and return the norm measured after clipping.

    Clipping is branch-free (a factor min(1, max / norm) applied every step, as torch's
    ``clip_grad_norm_``): ranks may see norms that differ in the last bit (replicated
    parameters' gradients reduced in other orders), and a rank that skipped a step's
    collectives while its peers ran them would hang the job.
    """
    if recipe.max_grad_norm is None:
        return None
    params = [p for m in rank_model.modules for p in m.parameters()]
    recipe_mod.clip_grads(params, total_norm=grad_norm, max_norm=recipe.max_grad_norm)
    return float(recipe_mod.global_grad_norm(_normed(rank_model, params), device=device,
                                             pp_mesh=rank_model.pp_mesh))


def _normed(rank_model: RankModel, params: list[nn.Parameter]) -> list[nn.Parameter]:
    """The parameters whose gradients make the global norm: all but a tied LM-head copy."""
    if not rank_model.tied_is_copy:
        return params
    return [p for p in params if p is not rank_model.tied]


def train_step(rank_model: RankModel, plan: Plan, batch: torch.Tensor, device: torch.device,
               *, recipe: Recipe, step: int) -> StepResult:
    """Optimizer step ``step`` (0-based) on global batch ``batch`` [B, s + 1].

    Order: learning rate of the step; forward and backward; the global loss (one all-reduce);
    the global gradient norm, checked (``TrainingDiverged`` before anything is applied) and
    clipped; the optimizer step.
    """
    from meshplan.runtime import optim as optim_mod

    config = plan.config
    lr = recipe_mod.lr_at(recipe, step + 1)
    optim_mod.set_lr(rank_model.optimizer, lr)
    rows = data_mod.replica_rows(batch, dp_rank=rank_model.coords.dp, dp=config.dp)
    inputs, targets = (t.to(device) for t in data_mod.split_inputs_targets(rows))
    rank_model.optimizer.zero_grad(set_to_none=True)
    run = _pipeline_step if rank_model.schedule is not None else _loop_step
    replica_loss = run(rank_model, inputs, targets, config.grad_accum_steps)
    sync_tied_grads(rank_model)
    reports = rank_model.last and rank_model.coords.tp == 0
    contribution = replica_loss / config.dp if reports else torch.zeros((), device=device)
    dist.all_reduce(contribution)
    params = [p for m in rank_model.modules for p in m.parameters()]
    grad_norm = recipe_mod.global_grad_norm(_normed(rank_model, params), device=device,
                                            pp_mesh=rank_model.pp_mesh)
    loss, norm = float(contribution), float(grad_norm)
    if not (math.isfinite(loss) and math.isfinite(norm)):
        raise TrainingDiverged(f"step {step + 1}: loss {loss}, gradient norm {norm}: training "
                               "diverged (the step was not applied; checkpoints before it "
                               "are intact)")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    clipped = _clip(rank_model, recipe, grad_norm, device)
    rank_model.optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return StepResult(loss=loss, grad_norm=norm, grad_norm_clipped=clipped, lr=lr,
                      optimizer_s=time.perf_counter() - start)


def _timed_step(rank_model: RankModel, plan: Plan, batch: torch.Tensor, device: torch.device,
                memory: PeakMemory, *, recipe: Recipe, step: int) -> StepMetrics:
    """``train_step`` with the slowest rank's step time and the largest rank's memory."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = train_step(rank_model, plan, batch, device, recipe=recipe, step=step)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    allocated, reserved = memory.allocated_bytes, memory.reserved_bytes
    gathered = torch.tensor([time.perf_counter() - start, allocated or 0, reserved or 0,
                             result.optimizer_s], dtype=torch.float64, device=device)
    dist.all_reduce(gathered, op=dist.ReduceOp.MAX)
    step_s, allocated_max, reserved_max, optimizer_s = (float(v) for v in gathered)
    tokens = plan.config.global_batch_size * plan.config.seq_len
    return StepMetrics(step=step + 1, loss=result.loss, grad_norm=result.grad_norm,
                       grad_norm_clipped=result.grad_norm_clipped, lr=result.lr,
                       step_s=step_s, tokens_per_s=tokens / step_s, mfu=mfu(plan, step_s),
                       allocated_bytes=None if allocated is None else int(allocated_max),
                       reserved_bytes=None if reserved is None else int(reserved_max),
                       optimizer_s=optimizer_s)


def run_plan(plan: Plan, options: RunOptions, *, backend: str,
             chosen: elastic.Chosen | None = None) -> RunReport | None:
    """Train ``plan`` for ``options.steps`` steps; the report on global rank 0, else None.

    An elastic attempt (``options.elastic``; ``chosen``: how its plan was chosen) resumes
    from the run's latest checkpoint whenever one exists and records the membership change
    (elastic.py).

    The mesh's sub-groups stay alive until the job ends: DTensor caches redistribution plans
    by mesh *layout*, so a later plan of the same launch with an equal mesh may reach a group
    of an earlier one (same ranks, so still correct) and must not find it destroyed.
    """
    config = plan.config
    mesh_mod.check_supported(config, plan.model)
    mesh_mod.check_world_size(config, dist.get_world_size())
    device = mesh_mod.device_for_rank()
    recipe_mod.check_dtype(config.dtype)
    mesh = mesh_mod.build_mesh(config, backend=backend, timeout_s=options.init_timeout_s)
    if compute_dtype(plan, device) != _DTYPES[config.dtype] and dist.get_rank() == 0:
        logger.warning("the plan's dtype %s runs in fp32 on the CPU", config.dtype)
    data_spec = plan_data(plan, options)
    restarts = checkpoint.torchrun_restarts()
    with PeakMemory(device, cpu_tracking=options.track_memory) as memory:
        with RssGrowth() as building:
            rank_model = build_rank_model(plan, mesh, seed=options.seed, device=device,
                                          recipe=options.recipe, init_from=options.init_from)
        started = time.perf_counter()
        history = _resume(rank_model, plan, options, data_spec,
                          restarted=restarts > 0 or options.elastic)
        reshard_s = time.perf_counter() - started
        if options.elastic and dist.get_rank() == 0:
            elastic.record_start(options.checkpoint_dir, run_id=options.run_id,
                                 chosen=chosen or elastic.Chosen(plan, 0.0, "given"),
                                 resumed_step=history.step if history else 0,
                                 reshard_s=reshard_s if history else 0.0)
        memory.reset()
        log = _Log(plan, options, history)
        _train(rank_model, plan, data_spec, options, device, memory, mesh, log)
    if options.save_hf:
        _save_hf(rank_model, plan, options, options.save_hf)
    if options.steps == 0:  # a conversion (--save-hf): no step, no report
        dist.barrier()
        return None
    report = _report(plan, backend, rank_model, memory, log, build_rss=building.growth_bytes)
    if report is not None:
        changes = (elastic.report_changes(options.checkpoint_dir, options.run_id, log.step_s)
                   if options.elastic else ())
        report = dataclasses.replace(
            report, compute_dtype=_DTYPE_NAMES[compute_dtype(plan, device)], restarts=restarts,
            membership_changes=changes)
    dist.barrier()  # every rank is done with this plan's mesh (never on an error path)
    return report


def _resume(rank_model: RankModel, plan: Plan, options: RunOptions,
            data_spec: data_mod.DataSpec, *, restarted: bool) -> checkpoint.TrainState | None:
    """Load the checkpoint to continue from, if any (``RunOptions.resume`` or a restart)."""
    step = checkpoint.resume_step(options.checkpoint_dir, resume=options.resume,
                                  restarted=restarted)
    if step is None:
        return None
    state = checkpoint.read_train_state(options.checkpoint_dir, step)
    checkpoint.check_compatible(state, data=checkpoint.data_stream(data_spec),
                                model=checkpoint.architecture(plan.model),
                                recipe=dataclasses.asdict(options.recipe), steps=options.steps,
                                where=checkpoint.step_dir(options.checkpoint_dir, step))
    checkpoint.load(rank_model.modules, rank_model.optimizer, options.checkpoint_dir, step)
    if dist.get_rank() == 0:
        logger.info("resumed from %s", checkpoint.step_dir(options.checkpoint_dir, step))
    return state


class _Log:
    """Per-step series of the run (the steps of a resumed checkpoint first) and their sinks."""

    def __init__(self, plan: Plan, options: RunOptions,
                 history: checkpoint.TrainState | None) -> None:
        self.losses = list(history.losses) if history else []
        self.step_s = list(history.step_s) if history else []
        self.grad_norms = list(history.grad_norms) if history else []
        self.lrs = list(history.lrs) if history else []
        self.optimizer_s: list[float] = []  # this attempt's steps only (not checkpointed)
        self.tracked: list[int] = []  # this attempt's steps timed under the CPU tracker
        self.resumed_from = history.step if history is not None else None
        self.recipe = dataclasses.asdict(options.recipe)
        self.run_id = options.run_id
        self.sink = MetricsLog(options.metrics, rank=dist.get_rank(),
                               resumed_from=self.resumed_from)

    def add(self, metrics: StepMetrics) -> None:
        self.losses.append(metrics.loss)
        self.step_s.append(metrics.step_s)
        self.grad_norms.append(metrics.grad_norm)
        self.lrs.append(metrics.lr)
        self.optimizer_s.append(metrics.optimizer_s)
        self.sink.write(metrics)

    def state(self, plan: Plan, data_spec: data_mod.DataSpec) -> checkpoint.TrainState:
        return checkpoint.TrainState(
            step=len(self.losses), losses=tuple(self.losses), step_s=tuple(self.step_s),
            grad_norms=tuple(self.grad_norms), lrs=tuple(self.lrs), recipe=self.recipe,
            data=checkpoint.data_stream(data_spec), model=checkpoint.architecture(plan.model),
            plan=config_to_dict(plan.config, plan.model), run_id=self.run_id)


def _save_hf(rank_model: RankModel, plan: Plan, options: RunOptions, directory: str) -> None:
    """Write the HF checkpoint of the model as it is now into ``directory`` (hf.save)."""
    hf.save(rank_model.modules, directory, spec=plan.model,
            stage_indices=rank_model.stage_indices, num_stages=rank_model.num_stages,
            writer=rank_model.coords.dp == 0 and rank_model.coords.tp == 0,
            source=options.init_from)
    if dist.get_rank() == 0:
        logger.info("wrote the HF checkpoint %s", directory)


def hf_step_dir(directory: str, step: int) -> str:
    """Where ``--save-hf-every`` writes the HF checkpoint after ``step`` steps."""
    return os.path.join(directory, f"step-{step}")


def _train(rank_model: RankModel, plan: Plan, data_spec: data_mod.DataSpec,
           options: RunOptions, device: torch.device, memory: PeakMemory, mesh: DeviceMesh,
           log: _Log) -> None:
    """Steps after the resumed ones (all when none), logged into ``log``. After the first
    step run here the process groups take the tighter ``options.timeout_s``."""
    fault = Fault.from_env()
    first = len(log.losses)
    try:
        for step in range(first, options.steps):
            if fault is not None:
                fault.before_step(step + 1, dist.get_rank(), rank_model.modules)
            if memory.cpu_tracking:
                log.tracked.append(step)
            log.add(_timed_step(rank_model, plan, data_mod.global_batch(data_spec, step),
                                device, memory, recipe=options.recipe, step=step))
            if step == first:
                mesh_mod.set_timeout(mesh, options.timeout_s)
            done = step + 1
            if done - first == options.memory_steps:  # the peak is in; time the rest bare
                memory.stop_cpu_tracking()
            if options.checkpoint_every and done % options.checkpoint_every == 0:
                checkpoint.save(rank_model.modules, rank_model.optimizer,
                                options.checkpoint_dir, log.state(plan, data_spec),
                                keep_last=options.keep_last)
            if options.save_hf_every and done % options.save_hf_every == 0 and \
                    done < options.steps:
                _save_hf(rank_model, plan, options, hf_step_dir(options.save_hf, done))
            if options.elastic and dist.get_rank() == 0:
                elastic.write_progress(options.checkpoint_dir, run_id=options.run_id,
                                       step=done, plan=plan)
            if fault is not None:
                fault.after_step(done, dist.get_rank())
    finally:
        log.sink.close()


def _report(plan: Plan, backend: str, rank_model: RankModel, memory: PeakMemory,
            log: _Log, *, build_rss: int | None = None) -> RunReport | None:
    """The run report (``runtime/report.py``), gathered on rank 0 (None elsewhere)."""
    mine = {"rank": dist.get_rank(), "stage": rank_model.coords.pp,
            "peak_bytes": memory.peak_bytes, "peak_reserved_bytes": memory.peak_reserved_bytes,
            "rss_peak_bytes": peak_rss_bytes(), "memory_source": memory.source,
            "build_rss_bytes": build_rss}
    gathered: list[dict[str, Any]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() != 0:
        return None
    report = build_report(plan, backend=backend, losses=log.losses, times_s=log.step_s,
                          per_rank=gathered)
    return dataclasses.replace(report, grad_norms=tuple(log.grad_norms), lrs=tuple(log.lrs),
                               optimizer_s=tuple(log.optimizer_s), recipe=log.recipe,
                               tracked_steps=tuple(log.tracked),
                               resumed_from_step=log.resumed_from,
                               worker_start=prefork.started_as,
                               timeshare=node_timeshare(memory.device))


def node_timeshare(device: torch.device) -> float:
    """``RunReport.timeshare``: this node's processes (torchrun's ``LOCAL_WORLD_SIZE``) per
    CPU core they may use, when above 1 on the CPU; 1 on GPUs (one GPU per process)."""
    if device.type != "cpu":
        return 1.0
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1.0, local / preflight.usable_cores())


def build_report(plan: Plan, *, backend: str, losses: list[float], times_s: list[float],
                 per_rank: list[dict[str, Any]]) -> RunReport:
    """The report of measurements ``per_rank`` (per rank a dict of the ``RankReport`` fields
    but the prediction) next to the plan's predictions."""
    stage_peak = {s.stage: s.peak_bytes for s in plan.prediction.memory.per_stage}
    ranks = tuple(RankReport(**entry, predicted_peak_bytes=stage_peak.get(entry["stage"]))
                  for entry in sorted(per_rank, key=lambda e: e["rank"]))
    return RunReport(plan=config_to_dict(plan.config, plan.model),
                     world_size=plan.config.world_size, backend=backend, losses=tuple(losses),
                     step_s=tuple(times_s), predicted_step_s=plan.step_s,
                     predicted_peak_bytes=plan.peak_bytes, per_rank=ranks)
