"""Where each rank sits and whether a configuration can run a model: the one home of the rank
layout (``mesh_dims``, ``rank_of``; the runtime builds its DeviceMesh from ``mesh_dims``) and of
the layout checks (``check_fits_model``).

Degrees follow Megatron-LM: world = tp * cp * dp * pp, ranks laid out by ``mesh_order`` from
fastest- to slowest-varying axis (``costmodel/config.py``).
"""

from __future__ import annotations

import numpy as np

from meshplan.costmodel import traced
from meshplan.costmodel.config import ParallelConfig
from meshplan.costmodel.model import ModelSpec


def check_fits_model(config: ParallelConfig, model: ModelSpec, *, num_gpus: int) -> None:
    """Raise ValueError naming the first way ``config`` cannot run ``model`` on ``num_gpus``."""
    if config.world_size != num_gpus:
        raise ValueError(f"tp*cp*dp*pp = {config.tp}*{config.cp}*{config.dp}*{config.pp} = "
                         f"{config.world_size} but the cluster has {num_gpus} GPUs")
    if model.is_traced:
        traced.check_config(config, model)
    if model.num_heads % config.tp or model.kv_heads % config.tp:
        raise ValueError(f"tp {config.tp} must divide the attention heads ({model.num_heads}) "
                         f"and kv heads ({model.kv_heads})")
    if config.pp * config.vpp > model.num_layers:
        raise ValueError(f"pp*vpp = {config.pp * config.vpp} exceeds the model's "
                         f"{model.num_layers} layers")
    layers = config.stage_layers(model.num_layers)
    if len(layers) != config.pp or sum(layers) != model.num_layers or min(layers) < 1:
        raise ValueError(f"layers_per_stage {list(layers)} must list {config.pp} positive "
                         f"counts summing to {model.num_layers}")
    if config.vpp > 1 and min(layers) < config.vpp:
        raise ValueError(f"with vpp {config.vpp} every stage needs at least vpp layers (one per "
                         f"virtual chunk); got {list(layers)}")
    if config.ep > 1:
        if not model.is_moe:
            raise ValueError(f"ep {config.ep} > 1 needs an MoE model; {model.name} is dense")
        if model.num_experts % config.ep:
            raise ValueError(f"ep {config.ep} must divide the {model.num_experts} experts")
        if (config.dp * config.cp) % config.ep:
            raise ValueError(f"ep {config.ep} must divide dp*cp = {config.dp * config.cp}")


FRAMEWORK_MESH_ORDERS: dict[str, tuple[tuple[str, ...], ...]] = {
    "deepspeed": (("tp", "cp", "dp", "pp"),),
    "torchtitan": (("tp", "cp", "dp", "pp"),),
}
"""Rank layouts (``ParallelConfig.mesh_order``, fastest-varying axis first) of the frameworks
that build only some: torchtitan's ``ParallelDims`` mesh (pp, dp, cp, tp from slowest to
fastest) and DeepSpeed's pipe / data / model topology. Megatron-LM builds both of the
planner's orders (``--use-tp-pp-dp-mapping`` for the second), meshplan's runtime any."""

FRAMEWORK_NAMES = {"deepspeed": "DeepSpeed", "megatron": "Megatron-LM",
                   "torchtitan": "torchtitan", "meshplan": "meshplan's runtime"}


def framework_layout_error(framework: str, config: ParallelConfig,
                           model: ModelSpec) -> str | None:
    """The first reason ``framework`` cannot run the layout of ``config`` for ``model``: one
    line that says what to change; None when it can.

    One rule for the planner, which searches only the layouts the plan's framework runs
    (``planner.search``), and for the exports and ``meshplan run``, which refuse the rest
    (``planner.export``, ``runtime.mesh.check_supported``). What no framework can run is
    ``check_fits_model``'s; run settings (compile, float8, ...) are
    ``frameworks.check_framework_options``'s. ``ideal`` runs everything.

    * DeepSpeed: its pipeline engine runs ZeRO 0 and 1 only, with one schedule (no
      interleaving); it offloads only under ZeRO, to NVMe only under ZeRO-3 (ZeRO-Infinity);
      its sequence parallelism is DeepSpeed-Ulysses (``deepspeed.sequence.layer``), whose
      all-to-all scatters the attention heads over the group, so cp must divide the heads of
      a tensor-parallel rank (Megatron-DeepSpeed repeats k and v to the query heads first;
      DeepSpeed's path for uneven head counts is not modelled).
    * Megatron-LM: offloads the optimizer only, through its distributed optimizer, to host
      memory.
    * torchtitan: offloads only through FSDP2's CPU offload (dp x cp > 1), which moves the
      parameters and gradients with the optimizer states, to host memory.
    * meshplan's runtime: no context parallelism, offload to host memory only, tensor
      parallelism that splits the MLP and the (padded) vocabulary evenly, and no parameter
      offload of embeddings tied across pipeline stages. What it cannot run for any layout
      (MoE, ALiBi, ...) stays ``runtime.mesh.check_supported``'s.
    """
    name = FRAMEWORK_NAMES.get(framework)
    if name is None:
        return None
    offload, device, zero = config.offload, config.offload_device, config.zero_stage
    if framework == "deepspeed":
        if config.pp > 1 and zero >= 2:
            return (f"DeepSpeed's pipeline engine runs only ZeRO stage 0 or 1 (pp {config.pp}, "
                    f"zero_stage {zero}); use zero 1 or pp 1")
        if config.vpp > 1:
            return (f"DeepSpeed's pipeline engine has no interleaved schedule (vpp "
                    f"{config.vpp}); use vpp 1")
        if offload != "none" and zero == 0:
            return (f"DeepSpeed offloads only under ZeRO (offload {offload!r}, zero_stage 0); "
                    f"use zero 1, 2 or 3")
        if offload != "none" and device == "nvme" and zero != 3:
            return (f"DeepSpeed offloads to NVMe only under ZeRO-3 (ZeRO-Infinity); got "
                    f"zero_stage {zero} with offload device nvme")
        heads = model.num_heads // config.tp
        if config.cp > 1 and heads % config.cp:
            return (f"DeepSpeed's sequence parallelism (Ulysses) splits the attention heads: cp "
                    f"{config.cp} must divide the {heads} heads of each of the {config.tp} "
                    f"tensor-parallel ranks; use a cp that does, or a smaller tp")
        return None
    if offload != "none" and device == "nvme":
        if framework == "meshplan":
            return ("offload to nvme is not in meshplan's runtime, which offloads to host "
                    "memory (offload device cpu); use offload device cpu, or --framework "
                    "deepspeed (ZeRO-Infinity) and export the plan")
        return (f"{name} cannot offload to NVMe (offload {offload!r}, device nvme); use "
                f"offload device cpu, or export to deepspeed (ZeRO-Infinity)")
    if framework == "megatron":
        if offload == "optimizer+params":
            return ("Megatron-LM cannot offload parameters (offload 'optimizer+params'); use "
                    "offload 'optimizer', or export to deepspeed")
        if offload == "optimizer" and zero == 0:
            return ("Megatron-LM offloads the optimizer only through its distributed optimizer "
                    "(offload 'optimizer', zero_stage 0); use zero >= 1")
    elif framework == "torchtitan":
        if offload == "optimizer":
            return ("torchtitan offloads only through FSDP2's CPUOffloadPolicy, which moves "
                    "the parameters and gradients to the host with the optimizer states; use "
                    "offload 'optimizer+params' (ZeRO-3) or none")
        if offload != "none" and config.dp * config.cp == 1:
            return (f"torchtitan offloads only through FSDP2, which needs dp x cp > 1 (offload "
                    f"{offload!r}, dp {config.dp}, cp {config.cp})")
    elif framework == "meshplan":
        if config.cp > 1:
            return (f"context parallelism (cp {config.cp}) is not in meshplan's runtime; use "
                    f"cp 1, or --framework torchtitan or megatron and export the plan")
        for what, size in (("ffn_hidden_size", model.ffn_hidden_size),
                           ("the (padded) vocabulary", model.vocab_rows)):
            if size % config.tp:
                return (f"tp {config.tp} must divide {what} ({size}) for the runtime's even "
                        f"tensor-parallel split")
        if model.tied_embeddings and config.pp > 1 and offload == "optimizer+params":
            return ("tied embeddings across pipeline stages with parameter offload are not "
                    "implemented (their gradients would sit in host memory); use --offload "
                    "optimizer or none")
    return None


def axis_sizes(config: ParallelConfig) -> dict[str, int]:
    """Degree of each mesh axis."""
    return {"tp": config.tp, "cp": config.cp, "dp": config.dp, "pp": config.pp}


def mesh_dims(config: ParallelConfig) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(names, sizes) of the rank grid, slowest-varying axis first: ``mesh_order`` reversed.

    Ranks are the row-major (C-order) indices of this grid, which is how
    ``torch.distributed.device_mesh.init_device_mesh`` numbers a mesh of this shape, so the
    runtime's DeviceMesh is built from these dims and ``rank_of`` holds for it.
    """
    names = tuple(reversed(config.mesh_order))
    sizes = axis_sizes(config)
    return names, tuple(sizes[n] for n in names)


def rank_of(config: ParallelConfig, coords: dict[str, int]) -> int:
    """Global rank of mesh coordinates ``coords`` (tp, cp, dp, pp; missing axes are 0).

    The row-major index in ``mesh_dims``: rank = sum_k c[axis_k] * prod_{j<k} size[axis_j]
    with k running over ``mesh_order`` (fastest first), Megatron-LM's ``RankGenerator`` rule.
    Example, order tp-cp-dp-pp with tp=2, cp=1, dp=2, pp=2: coordinates (tp=1, dp=1, pp=1)
    give 1 + 2*(0 + 1*(1 + 2*1)) = 7.
    """
    stride = strides(config)
    return sum(step * coords.get(name, 0) for name, step in stride.items())


def strides(config: ParallelConfig) -> dict[str, int]:
    """Rank distance between neighbours along each axis: 1 for the first of ``mesh_order``,
    then the product of the sizes of the axes before it (``rank_of`` is the sum of
    coordinate times stride)."""
    return order_strides(config.mesh_order, axis_sizes(config))


def order_strides(mesh_order, sizes: dict[str, int]) -> dict[str, int]:
    """``strides`` from the mesh order and the axis sizes alone (no configuration built)."""
    out, step = {}, 1
    for name in mesh_order:
        out[name] = step
        step *= sizes[name]
    return out


def axis_group(config: ParallelConfig, axis: str, *, stage: int = 0) -> tuple[int, ...]:
    """Ranks of the ``axis`` group that contains the first rank of pipeline stage ``stage``."""
    stride = strides(config)
    base = stage * stride["pp"]
    return tuple(base + i * stride[axis] for i in range(axis_sizes(config)[axis]))


def dp_cp_ranks(config: ParallelConfig, *, stage: int = 0) -> tuple[int, ...]:
    """Ranks of the dp x cp group of the first rank of ``stage``, ascending."""
    stride = strides(config)
    base = stage * stride["pp"]
    ranks = np.add.outer(np.arange(config.dp) * stride["dp"],
                         np.arange(config.cp) * stride["cp"]).ravel() + base
    return tuple(np.sort(ranks).tolist())


def ep_group(config: ParallelConfig) -> tuple[int, ...]:
    """The expert-parallel group of rank 0: the first ``ep`` ranks of its dp x cp group."""
    if config.ep == 1:
        return (0,)  # rank 0 alone (its dp x cp group is not built)
    return dp_cp_ranks(config)[:config.ep]
