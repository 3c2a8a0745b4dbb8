"""Where each rank sits and whether a configuration can run a model: the one home of the rank
layout (``mesh_dims``, ``rank_of``; the runtime builds its DeviceMesh from ``mesh_dims``) and of
the layout checks (``check_fits_model``).

Degrees follow Megatron-LM: world = tp * cp * dp * pp, ranks laid out by ``mesh_order`` from
fastest- to slowest-varying axis (``costmodel/config.py``).
"""

from __future__ import annotations

import functools

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


DEEPSPEED_PARTITIONS = ("parameters", "type", "uniform")
"""DeepSpeed's ``PipelineModule`` partition methods, each of which builds one split of the
module's layer list for a number of stages (``deepspeed_splits``): ``parameters`` (its default)
balances the items' parameter counts, ``type:<regex>`` the number of items whose class matches
(here: the transformer blocks), ``uniform`` the number of items. A split it builds no other
way cannot be run without editing DeepSpeed. The items are the embedding, the blocks, the
final norm and the head (``pipeline_items``); a layer list with more items (Megatron-DeepSpeed
adds parameterless functions) builds the same ``parameters`` and ``type:`` splits, and may
build another ``uniform`` one."""


def deepspeed_partition(weights: tuple[float, ...], parts: int) -> tuple[int, ...]:
    """Boundaries (``parts + 1`` item indices, 0 first, ``len(weights)`` last) of DeepSpeed's
    balanced partition of a list of item weights into contiguous parts.

    The linear-partition dynamic programme that ``PipelineModule`` runs for its
    ``parameters`` and ``type:`` methods: over every prefix of i items cut into j parts it
    keeps the cut whose parts' largest sum less smallest sum is least, taking the later cut
    of equal ones (it scans the cut points upward and replaces on ``<=``); with no more items
    than parts, the ``uniform`` partition. ValueError for fewer than one part."""
    if parts < 1:
        raise ValueError(f"deepspeed_partition needs parts >= 1, got {parts!r}")
    return _balanced(tuple(float(w) for w in weights), parts)


@functools.lru_cache(maxsize=1024)
def _balanced(weights: tuple[float, ...], parts: int) -> tuple[int, ...]:
    n = len(weights)
    if n <= parts:
        return deepspeed_uniform(n, parts)
    prefix = np.zeros(n + 1)
    prefix[1:] = np.cumsum(weights)
    top = np.full((n + 1, parts + 1), np.inf)
    low = np.full((n + 1, parts + 1), np.inf)
    cut = np.zeros((n + 1, parts + 1), dtype=int)
    top[0, 0] = 0.0
    for i in range(1, n + 1):
        span = prefix[i] - prefix[:i]  # the last part's sum for a cut at k = 0 .. i-1
        for j in range(1, min(i, parts) + 1):
            highest = np.maximum(top[:i, j - 1], span)
            lowest = np.minimum(low[:i, j - 1], span)
            cost = highest - lowest
            least = cost.min()
            k = int(np.flatnonzero(cost == least)[-1])
            top[i, j], low[i, j], cut[i, j] = highest[k], lowest[k], k
    bounds = [n]
    for j in range(parts, 0, -1):
        bounds.append(int(cut[bounds[-1], j]))
    return tuple(reversed(bounds))


def deepspeed_uniform(items: int, parts: int) -> tuple[int, ...]:
    """Boundaries of DeepSpeed's ``uniform`` partition: ``items // parts`` items a part, the
    first ``items % parts`` parts one more; with no more items than parts, one item a part
    while they last."""
    if items <= parts:
        return tuple(min(p, items) for p in range(parts + 1))
    size, extra = divmod(items, parts)
    return tuple(p * size + min(p, extra) for p in range(parts + 1))


def pipeline_items(model: ModelSpec) -> tuple[tuple[float, ...], tuple[bool, ...]]:
    """(parameters, is a transformer block) of each item of the layer list a DeepSpeed
    ``PipelineModule`` of ``model`` holds: the embedding, the blocks, the final norm and the
    LM head (a tied head counts the embedding's matrix again: ``PipelineModule`` counts a
    ``TiedLayerSpec`` wherever it sits); a traced model's layers as traced."""
    if model.is_traced:
        return (tuple(float(model.layer_params(i)) for i in range(model.num_layers)),
                (True,) * model.num_layers)
    embedding = model.embedding_params
    blocks = [float(model.layer_params(i)) for i in range(model.num_layers)]
    head = float(model.vocab_rows * model.hidden_size)
    weights = (float(embedding), *blocks, float(model.norm_params), head)
    return weights, (False, *(True,) * model.num_layers, False, False)


def deepspeed_splits(model: ModelSpec, pp: int) -> dict[str, tuple[int, ...]]:
    """Transformer blocks per stage under each of ``DEEPSPEED_PARTITIONS`` for ``pp``
    stages (a stage may get none)."""
    weights, blocks = pipeline_items(model)
    bounds = {"parameters": deepspeed_partition(weights, pp),
              "type": deepspeed_partition(tuple(float(b) for b in blocks), pp),
              "uniform": deepspeed_uniform(len(weights), pp)}
    return {method: tuple(sum(blocks[b[s]:b[s + 1]]) for s in range(pp))
            for method, b in bounds.items()}


def framework_splits(framework: str, model: ModelSpec,
                     pp: int) -> tuple[tuple[int, ...], ...] | None:
    """The layer splits ``framework`` builds itself for ``pp`` stages when it cannot take one
    of the plan's choosing, each once, the one it builds by default first; None where it can
    (Megatron-LM's pipeline layouts, torchtitan's split points and meshplan's runtime take any
    split).

    DeepSpeed builds its split from a partition method (``DEEPSPEED_PARTITIONS``, ``parameters``
    its default): the splits of those that give every stage a block (an embedding that
    outweighs several blocks can leave an end stage without one). The planner tries each
    (``planner.search``) and ``planner.export`` names the method."""
    if framework != "deepspeed" or pp == 1:
        return None
    splits = []
    for split in deepspeed_splits(model, pp).values():
        if min(split) >= 1 and split not in splits:
            splits.append(split)
    return tuple(splits)


def framework_split(framework: str, model: ModelSpec, pp: int) -> tuple[int, ...] | None:
    """The first of ``framework_splits`` (DeepSpeed: ``parameters``, its default, where it
    gives every stage a block), what ``estimate`` prices without a split; None where the
    framework takes any split."""
    splits = framework_splits(framework, model, pp)
    return splits[0] if splits else None


def deepspeed_partition_method(model: ModelSpec, layers: tuple[int, ...]) -> str | None:
    """The first of ``DEEPSPEED_PARTITIONS`` that builds ``layers`` (blocks per stage), None
    if none does."""
    splits = deepspeed_splits(model, len(layers))
    return next((m for m in DEEPSPEED_PARTITIONS if splits[m] == tuple(layers)), None)


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
      interleaving), on a split one of its partition methods builds
      (``deepspeed_partition_method``); it offloads only under ZeRO, to NVMe only under
      ZeRO-3 (ZeRO-Infinity); its sequence parallelism is DeepSpeed-Ulysses
      (``deepspeed.sequence.layer``), whose all-to-all scatters the attention heads over the
      group, so cp must divide the heads of a tensor-parallel rank (Megatron-DeepSpeed
      repeats k and v to the query heads first; DeepSpeed's path for uneven head counts is
      not modelled).
    * Megatron-LM: offloads the optimizer only, through its distributed optimizer, to host
      memory; its context parallelism needs a sequence of whole 2 x cp chunks
      (``validate_args``, core_v0.16.1).
    * torchtitan: needs seq_len a multiple of 2 x tp x cp (``ParallelDims.seq_len_divisor``,
      asserted by every model's ``parallelize``, 0.2.2); trains in 16 bits only through FSDP2
      (dp x cp > 1) or, on one device or under DDP, AMP: with tp or pp and dp x cp = 1
      ``maybe_enable_amp`` turns mixed precision off (so a 16-bit plan there is refused);
      shards data parallelism with FSDP2 (ZeRO-3, or ZeRO-2 without resharding
      after forward) and runs DDP (ZeRO-0) only as its one parallelism; no ZeRO-1. Offloads
      only through FSDP2's CPU offload (dp x cp > 1), which moves the parameters and
      gradients with the optimizer states, to host memory.
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
        if config.pp > 1 and config.layers_per_stage is not None and \
                deepspeed_partition_method(model, config.layers_per_stage) is None:
            split = framework_split("deepspeed", model, config.pp)
            return (f"DeepSpeed's PipelineModule builds only its partition methods' splits "
                    f"({', '.join(DEEPSPEED_PARTITIONS)}), not {list(config.layers_per_stage)}; "
                    f"for pp {config.pp} it builds {list(split)} (plan or estimate with "
                    f"--framework deepspeed and no --layers-per-stage)")
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
        if config.cp > 1 and config.cp_comm_type == "a2a":
            heads, groups = model.num_heads // config.tp, max(1, model.kv_heads // config.tp)
            if heads % config.cp or groups % config.cp:
                return (f"Megatron-LM's all-to-all context parallelism (--cp-comm-type a2a) "
                        f"splits the attention heads: cp {config.cp} must divide the {heads} "
                        f"query and {groups} key/value heads of each of the {config.tp} "
                        f"tensor-parallel ranks; use a cp that does, or --cp-comm-type p2p")
        if config.cp > 1 and config.seq_len % (2 * config.cp):
            return (f"Megatron-LM's context parallelism splits each sequence into 2 x cp chunks "
                    f"(load-balanced causal attention): seq_len {config.seq_len} must be a "
                    f"multiple of 2 x cp = {2 * config.cp}")
        if offload == "optimizer+params":
            return ("Megatron-LM cannot offload parameters (offload 'optimizer+params'); use "
                    "offload 'optimizer', or export to deepspeed")
        if offload == "optimizer" and zero == 0:
            return ("Megatron-LM offloads the optimizer only through its distributed optimizer "
                    "(offload 'optimizer', zero_stage 0); use zero >= 1")
    elif framework == "torchtitan":
        divisor = 2 * config.tp * config.cp
        if config.seq_len % divisor:
            return (f"torchtitan needs seq_len to be a multiple of 2 x tp x cp = {divisor} "
                    f"(its models' parallelize asserts it: sequence-parallel shards and "
                    f"load-balanced causal chunks); seq_len {config.seq_len}")
        if config.dtype != "fp32" and config.dp * config.cp == 1 and \
                (config.tp > 1 or config.pp > 1):
            return (f"torchtitan trains in {config.dtype} only through FSDP (dp x cp > 1) or, "
                    f"without tp and pp, AMP; with tp {config.tp}, pp {config.pp} and dp x cp "
                    f"= 1 it turns mixed precision off and trains in fp32 (maybe_enable_amp); "
                    f"use dp or cp > 1, or dtype fp32")
        ddp = zero == 0 and config.tp == config.pp == config.cp == 1
        if config.dp * config.cp > 1 and zero < 2 and not ddp:
            return (f"torchtitan shards data parallelism with FSDP2 (ZeRO-2 or 3) and "
                    f"replicates it (DDP, ZeRO-0) only without tp, pp or cp; it has no "
                    f"ZeRO-1 (zero_stage {zero}, tp {config.tp}, pp {config.pp}, cp "
                    f"{config.cp}); use zero 2 or 3")
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
        if model.is_traced and not model.traced_chain and config.pp > 1:
            return (f"the runtime runs a traced module whose layers are not a chain (or share "
                    f"parameters) on one pipeline stage, not pp {config.pp}; use pp 1 (data "
                    f"parallel, ZeRO 0-3, recompute)")
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
