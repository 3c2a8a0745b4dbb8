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
