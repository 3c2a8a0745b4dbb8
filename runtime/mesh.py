"""Process group and DeviceMesh of a plan, and the plan checks the runtime makes before any work.

The plan's ``mesh_order`` lists axes fastest-varying first (Megatron's ``RankGenerator``:
rank = tp_i + tp*(cp_i + cp*(dp_i + dp*pp_i)) for the default ``tp-cp-dp-pp``).
``init_device_mesh`` lays ranks out row-major (last dimension fastest), so the mesh dimensions
are the plan's order reversed: ``("pp", "dp", "tp")`` for the default. Context parallelism is
not implemented, so ``cp`` (always 1 here) is left out of the mesh.

torch APIs: ``torch.distributed.init_process_group`` (gloo on CPU, NCCL on CUDA, with a
timeout), ``torch.distributed.device_mesh.init_device_mesh`` with ``backend_override`` carrying
the same timeout to every sub-group (sub-groups would otherwise wait 30 minutes),
``torch.distributed.distributed_c10d._set_pg_timeout`` to tighten it after the first step (as
torchtitan does). With ``MESHPLAN_STRICT_COLLECTIVES=1`` on the CPU, collectives refuse host
tensors as NCCL does (``strict.py``).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshplan.costmodel import layout
from meshplan.costmodel.config import ParallelConfig
from meshplan.costmodel.model import ModelSpec
from meshplan.runtime import strict
from meshplan.runtime.support import model_refusal

DEFAULT_TIMEOUT_S = 60.0
"""Process-group timeout once training runs (after the first step): a rank waiting this long on
a collective fails instead of hanging."""
DEFAULT_INIT_TIMEOUT_S = 600.0
"""Process-group timeout until the first step is done: building the model, loading a
checkpoint and the first step (allocator warm-up, NCCL communicator set-up) take longest
(torchtitan likewise runs a long init timeout, then a tighter training one)."""
MESH_AXES = ("pp", "dp", "tp")
"""Axes the runtime builds (cp is refused when > 1)."""


class UnsupportedPlan(ValueError):
    """The plan is valid for the cost model but this runtime cannot execute it."""


def check_supported(config: ParallelConfig, model: ModelSpec) -> None:
    """Raise ValueError for a plan that does not fit its model (``check_fits_model``), or
    ``UnsupportedPlan`` naming the first plan feature the runtime does not implement."""
    layout.check_fits_model(config, model, num_gpus=config.world_size)
    _check_settings(config)
    if model.is_traced:
        from meshplan.runtime.chain import check_runnable  # imports torch's fake-mode tracer
        try:
            check_runnable(model, pp=config.pp)
        except ValueError as err:
            raise UnsupportedPlan(str(err)) from None
    refusal = layout.framework_layout_error("meshplan", config, model)
    if refusal is not None:  # the planner searches only layouts this rule lets through
        raise UnsupportedPlan(refusal)
    if config.pp > 1 and config.grad_accum_steps < config.pp:
        raise UnsupportedPlan(f"the runtime's 1F1B schedules need at least pp = {config.pp} "
                              f"micro-batches per step, the plan has {config.grad_accum_steps}"
                              " (global batch / (dp x micro-batch)); pin a smaller "
                              "--micro-batch")
    refusal = model_refusal(model)
    if refusal is not None:
        raise UnsupportedPlan(refusal)
    if config.ep > 1:
        raise UnsupportedPlan(f"expert parallelism (ep {config.ep}) is not implemented by the "
                              f"runtime yet")
    if config.seq_len > model.seq_len and model.position_embedding == "learned":
        raise UnsupportedPlan(f"seq_len {config.seq_len} exceeds the learned position table "
                              f"({model.seq_len})")


def _check_settings(config: ParallelConfig) -> None:
    """``UnsupportedPlan`` for torch.compile, float8 training and async TP: settings the cost
    model prices as torchtitan runs them; this runtime trains eagerly in the plan's dtype. And
    for a gradient reduction in a 16-bit dtype (the runtime's FSDP2 reduces in fp32) and an
    attention kernel other than the framework's own (the runtime calls torch's SDPA)."""
    asked = [f"compile {config.compile!r}"] if config.compile != "none" else []
    if config.float8:
        asked.append("float8")
    if config.async_tp:
        asked.append("async TP")
    if asked:
        raise UnsupportedPlan(f"the plan's {' and '.join(asked)} "
                              f"{'are' if len(asked) > 1 else 'is'} not run by meshplan's "
                              f"runtime (eager, in the plan's dtype); export the plan to "
                              f"torchtitan instead: meshplan export PLAN --to torchtitan")
    if config.attention_kernel != "auto":
        raise UnsupportedPlan(f"the plan is priced with the {config.attention_kernel} "
                              f"attention kernel; meshplan's runtime calls torch's SDPA: plan "
                              f"with --attention-kernel auto")
    if config.grad_reduce_dtype != "fp32":
        raise UnsupportedPlan(f"the plan reduces gradients in {config.grad_reduce_dtype}; "
                              f"meshplan's runtime reduces them in fp32: plan with "
                              f"--grad-reduce-dtype fp32")


def check_world_size(config: ParallelConfig, world_size: int) -> None:
    """Raise ValueError when the launch does not have the plan's tp*cp*dp*pp ranks."""
    if config.world_size != world_size:
        raise ValueError(f"the plan needs tp*cp*dp*pp = {config.tp}*{config.cp}*{config.dp}*"
                         f"{config.pp} = {config.world_size} processes but the launch has "
                         f"{world_size}")


def mesh_dims(config: ParallelConfig) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(names, sizes) of the DeviceMesh: the cost model's rank grid (``layout.mesh_dims``)
    without its cp axis, which the runtime refuses above 1 (``check_supported``), so every
    rank keeps the index ``layout.rank_of`` gives it."""
    names, sizes = layout.mesh_dims(config)
    kept = [(n, s) for n, s in zip(names, sizes) if n != "cp"]
    return tuple(n for n, _ in kept), tuple(s for _, s in kept)


def device_for_rank() -> torch.device:
    """``cuda:<LOCAL_RANK>`` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(*, timeout_s: float = DEFAULT_INIT_TIMEOUT_S) -> str:
    """Join the torchrun job (env:// rendezvous); return the backend name (gloo or nccl)."""
    device = device_for_rank()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
        if strict.enabled():
            strict.install()
    if not dist.is_initialized():
        dist.init_process_group(backend=backend,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return backend


def _group_options(backend: str, timeout_s: float):
    """Backend options carrying ``timeout_s`` to the mesh's sub-groups."""
    options = (dist.ProcessGroupNCCL.Options() if backend == "nccl"
               else dist.ProcessGroupGloo._Options())
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return options


@dataclass(frozen=True)
class MeshCoords:
    """This rank's coordinates on the plan's axes."""

    pp: int
    dp: int
    tp: int


def build_mesh(config: ParallelConfig, *, backend: str,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> DeviceMesh:
    """The plan's DeviceMesh (dimensions named ``pp``, ``dp``, ``tp`` in layout order)."""
    names, sizes = mesh_dims(config)
    override = {name: (backend, _group_options(backend, timeout_s)) for name in names}
    return init_device_mesh(device_for_rank().type, sizes, mesh_dim_names=names,
                            backend_override=override)


def coords(mesh: DeviceMesh) -> MeshCoords:
    return MeshCoords(pp=mesh.get_local_rank("pp"), dp=mesh.get_local_rank("dp"),
                      tp=mesh.get_local_rank("tp"))


def set_timeout(mesh: DeviceMesh, timeout_s: float) -> None:
    """Give the default group and every sub-group of ``mesh`` the timeout ``timeout_s``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    distributed_c10d._set_pg_timeout(timeout, None)
    for name in mesh.mesh_dim_names:
        distributed_c10d._set_pg_timeout(timeout, mesh.get_group(name))
