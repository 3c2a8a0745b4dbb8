"""``ParallelConfig``: the execution choices the cost model evaluates.

The planner's ``Plan`` wraps one of these with predictions and provenance. Degrees follow
Megatron-LM: world = tp * cp * dp * pp; experts are split over ``ep`` ranks carved out of
dp * cp. Ranks are laid out with ``mesh_order`` from fastest- to slowest-varying axis; the
default ``tp-cp-dp-pp`` puts tensor parallel inside a node and pipeline stages furthest apart,
as Megatron's ``RankGenerator`` does (rank = tp_i + tp*(cp_i + cp*(dp_i + dp*pp_i))).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Literal

from costmodel.model import ModelSpec

Recompute = Literal["none", "selective", "full"]
RECOMPUTE_MODES = ("none", "selective", "full")
OFFLOAD_MODES = ("none", "optimizer", "optimizer+params")
OFFLOAD_DEVICES = ("cpu", "nvme")
FRAMEWORKS = ("meshplan", "megatron", "deepspeed", "torchtitan", "ideal")
MESH_AXES = ("tp", "cp", "dp", "pp")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How one training step is laid out on the cluster."""

    tp: int = 1
    """Tensor-parallel degree (Megatron column/row split inside each layer)."""
    pp: int = 1
    """Pipeline stages."""
    dp: int = 1
    """Data-parallel replicas (the ZeRO sharding group)."""
    cp: int = 1
    """Context-parallel degree (sequence split for attention, ring exchange of K/V)."""
    ep: int = 1
    """Expert-parallel degree (MoE only; divides dp * cp)."""
    sp: bool = False
    """Sequence parallelism (Korthikanti et al. 2022) over the TP group."""
    zero_stage: int = 0
    """0: replicated states; 1: optimizer sharded; 2: + gradients; 3: + parameters."""
    offload: str = "none"
    """``none``, ``optimizer`` (optimizer states and step on the host) or ``optimizer+params``."""
    offload_device: str = "cpu"
    """Where offloaded states live: host memory (``cpu``) or local ``nvme``."""
    recompute: tuple[str, ...] | str = "none"
    """Activation recomputation, one mode or one per pipeline stage."""
    micro_batch_size: int = 1
    """Sequences per micro-batch per data-parallel replica (b)."""
    global_batch_size: int = 1
    """Sequences per optimizer step over all replicas (B)."""
    vpp: int = 1
    """Virtual pipeline chunks per stage (interleaved 1F1B when > 1)."""
    seq_len: int = 2048
    """Sequence length (s)."""
    layers_per_stage: tuple[int, ...] | None = None
    """Transformer layers on each stage; None splits evenly (remainder to the middle)."""
    mesh_order: tuple[str, ...] = ("tp", "cp", "dp", "pp")
    """Rank layout, fastest-varying axis first."""
    flash_attention: bool = True
    """Fused attention (no s x s score matrix stored). False reproduces Korthikanti's eager count."""
    dtype: str = "bf16"
    """Compute dtype (``bf16``, ``fp16``, ``fp32``)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "cp", "ep", "micro_batch_size", "global_batch_size",
                     "vpp", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.offload not in OFFLOAD_MODES:
            raise ValueError(f"offload must be one of {', '.join(OFFLOAD_MODES)}, "
                             f"got {self.offload!r}")
        if self.offload_device not in OFFLOAD_DEVICES:
            raise ValueError(f"offload_device must be cpu or nvme, got {self.offload_device!r}")
        if self.offload == "optimizer+params" and self.zero_stage != 3:
            raise ValueError("offload optimizer+params needs --zero 3 (parameters are only "
                             f"sharded under ZeRO-3), got zero_stage {self.zero_stage}")
        modes = (self.recompute,) if isinstance(self.recompute, str) else self.recompute
        bad = [m for m in modes if m not in RECOMPUTE_MODES]
        if bad or not modes:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)} "
                             f"(or one per stage), got {self.recompute!r}")
        if not isinstance(self.recompute, str) and len(self.recompute) != self.pp:
            raise ValueError(f"recompute lists {len(self.recompute)} modes for "
                             f"{self.pp} pipeline stages")
        if sorted(self.mesh_order) != sorted(MESH_AXES):
            raise ValueError(f"mesh_order must be a permutation of {MESH_AXES}, "
                             f"got {self.mesh_order!r}")
        if self.global_batch_size % (self.dp * self.micro_batch_size):
            raise ValueError(f"global batch {self.global_batch_size} is not divisible by "
                             f"dp x micro-batch = {self.dp} x {self.micro_batch_size}")
        if self.vpp > 1 and self.pp == 1:
            raise ValueError("vpp > 1 (interleaved schedule) needs pp > 1")
        if self.vpp > 1 and self.grad_accum_steps % self.pp:
            raise ValueError(f"the interleaved schedule needs micro-batches "
                             f"({self.grad_accum_steps}) divisible by pp ({self.pp})")
        if self.sp and self.seq_len // self.cp % self.tp:
            raise ValueError(f"sequence parallelism needs seq_len/cp ({self.seq_len // self.cp}) "
                             f"divisible by tp ({self.tp})")
        if self.seq_len % self.cp:
            raise ValueError(f"seq_len {self.seq_len} is not divisible by cp {self.cp}")
        if self.dtype not in ("bf16", "fp16", "fp32"):
            raise ValueError(f"dtype must be bf16, fp16 or fp32, got {self.dtype!r}")

    # ----- derived ---------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per step per replica (m)."""
        return self.global_batch_size // (self.dp * self.micro_batch_size)

    def stage_recompute(self, stage: int) -> str:
        return self.recompute if isinstance(self.recompute, str) else self.recompute[stage]

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        """Layers on each pipeline stage."""
        if self.layers_per_stage is not None:
            return self.layers_per_stage
        return even_split(num_layers, self.pp)

    @property
    def bytes_per_activation(self) -> int:
        return 4 if self.dtype == "fp32" else 2

    def replace(self, **changes) -> "ParallelConfig":
        return dataclasses.replace(self, **changes)


@functools.cache
def even_split(num_layers: int, stages: int) -> tuple[int, ...]:
    """``num_layers`` over ``stages`` as evenly as possible; the remainder goes to middle stages
    (the first and last carry the embedding and the LM head)."""
    base, extra = divmod(num_layers, stages)
    order = sorted(range(stages), key=lambda i: (i in (0, stages - 1), i))
    counts = [base] * stages
    for i in order[:extra]:
        counts[i] += 1
    return tuple(counts)


def check_fits_model(config: ParallelConfig, model: ModelSpec, *, num_gpus: int) -> None:
    """Raise ValueError naming the first way ``config`` cannot run ``model`` on ``num_gpus``."""
    if config.world_size != num_gpus:
        raise ValueError(f"tp*cp*dp*pp = {config.tp}*{config.cp}*{config.dp}*{config.pp} = "
                         f"{config.world_size} but the cluster has {num_gpus} GPUs")
    if model.is_traced:
        from costmodel.traced import check_config  # costmodel.traced imports this module
        check_config(config, model)
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


def rank_of(config: ParallelConfig, coords: dict[str, int]) -> int:
    """Global rank of mesh coordinates ``coords`` (tp, cp, dp, pp) under ``mesh_order``.

    rank = sum_k coords[axis_k] * prod_{j<k} size[axis_j]. Example, order tp-cp-dp-pp with
    tp=2, cp=1, dp=2, pp=2: coordinates (tp=1, dp=1, pp=1) give 1 + 2*(0 + 1*(1 + 2*1)) = 7.
    """
    sizes = {"tp": config.tp, "cp": config.cp, "dp": config.dp, "pp": config.pp}
    rank, stride = 0, 1
    for axis in config.mesh_order:
        rank += coords.get(axis, 0) * stride
        stride *= sizes[axis]
    return rank


def axis_group(config: ParallelConfig, axis: str, *, stage: int = 0) -> tuple[int, ...]:
    """Ranks of the ``axis`` group that contains the first rank of pipeline stage ``stage``."""
    sizes = {"tp": config.tp, "cp": config.cp, "dp": config.dp, "pp": config.pp}
    base = {"pp": stage}
    return tuple(rank_of(config, {**base, axis: i}) for i in range(sizes[axis]))


def ep_group(config: ParallelConfig) -> tuple[int, ...]:
    """The expert-parallel group of rank 0: the first ``ep`` ranks of its dp x cp group."""
    members = [rank_of(config, {"cp": c, "dp": d})
               for d in range(config.dp) for c in range(config.cp)]
    return tuple(sorted(members)[:config.ep])
