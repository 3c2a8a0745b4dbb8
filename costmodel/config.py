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
import operator
from dataclasses import dataclass
from typing import Any, Literal

Recompute = Literal["none", "selective", "full"]
RECOMPUTE_MODES = ("none", "selective", "full")
OFFLOAD_MODES = ("none", "optimizer", "optimizer+params")
OFFLOAD_DEVICES = ("cpu", "nvme")
FRAMEWORKS = ("meshplan", "megatron", "deepspeed", "torchtitan", "ideal")
MESH_AXES = ("tp", "cp", "dp", "pp")
DTYPES = ("bf16", "fp16", "fp32")
COMPILE_MODES = ("none", "model", "model+loss")
FLOAT8_RECIPES = ("tensorwise", "delayed")
"""Float8 scaling recipes (``ParallelConfig.float8_recipe``): per-tensor scales from the
current tensor (a max-abs pass before each cast), or Transformer Engine's delayed scaling."""
"""What torch.compile covers (``ParallelConfig.compile``): nothing, the transformer blocks, or
the blocks and the loss."""
ATTENTION_KERNELS = ("auto", "triton")
"""Fused attention kernels a configuration can name (``ParallelConfig.attention_kernel``): the
framework's own, or the Triton flash-attention kernel llm-foundry's ``attn_impl: triton`` runs."""
CP_COMM_TYPES = ("auto", "p2p", "all_gather", "a2a")
"""How context parallelism exchanges keys and values (``ParallelConfig.cp_comm_type``), as
Megatron-LM's ``--cp-comm-type`` names them; ``auto`` is the framework's own."""
GRAD_REDUCE_DTYPES = ("fp32", "bf16", "fp16")
"""Dtypes a sharded data-parallel gradient reduction runs in
(``ParallelConfig.grad_reduce_dtype``)."""
CPU_DEVICE_KEY = "cpu"
"""GPU catalog key of the CPU pseudo-device."""


def default_dtype(device_key: str) -> str:
    """The compute dtype a plan uses unless told: bf16 on GPUs; fp32 on the CPU pseudo-device
    (``cpu``), where torch has no fast bf16/fp16 GEMM and the runtime's tests compare fp32
    losses."""
    return "fp32" if device_key == CPU_DEVICE_KEY else "bf16"


def check_run_settings(*, compile_mode: str, float8: bool, float8_head: bool, async_tp: bool,
                       dtype: str, float8_recipe: str = "tensorwise",
                       grad_reduce_dtype: str = "fp32", attention_kernel: str = "auto",
                       flash_attention: bool = True, cp_comm_type: str = "auto") -> None:
    """Raise ValueError (one line) for run settings that cannot go together: an unknown
    torch.compile mode, float8 outside bf16, a float8 head without float8 blocks, async TP
    without torch.compile, a gradient reduction in a 16-bit dtype other than the compute one,
    an unknown attention kernel or a fused one without flash attention, an unknown context-
    parallel exchange (``ParallelConfig`` and the planner's ``SearchSpace`` both check)."""
    for name, value, choices in (("attention_kernel", attention_kernel, ATTENTION_KERNELS),
                                 ("cp_comm_type", cp_comm_type, CP_COMM_TYPES),
                                 ("grad_reduce_dtype", grad_reduce_dtype, GRAD_REDUCE_DTYPES),
                                 ("compile", compile_mode, COMPILE_MODES),
                                 ("float8_recipe", float8_recipe, FLOAT8_RECIPES)):
        if value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    if attention_kernel != "auto" and not flash_attention:
        raise ValueError(f"--attention-kernel {attention_kernel} names a fused attention "
                         f"kernel; it cannot go with --no-flash-attention")
    if grad_reduce_dtype != "fp32" and grad_reduce_dtype != dtype:
        raise ValueError(f"grad_reduce_dtype {grad_reduce_dtype} (--grad-reduce-dtype) must be "
                         f"fp32 or the compute dtype ({dtype})")
    if float8 and dtype != "bf16":
        raise ValueError(f"float8 training needs dtype bf16 (its casts start from bf16), "
                         f"got {dtype!r}")
    if float8_recipe != "tensorwise" and not float8:
        raise ValueError(f"float8_recipe {float8_recipe} (--float8-recipe) needs float8 "
                         f"training (--float8)")
    if float8_head and not float8:
        raise ValueError("float8_head (--float8-head) needs float8 training of the blocks "
                         "too (--float8)")
    if async_tp and compile_mode == "none":
        raise ValueError("async_tp (--async-tp) needs torch.compile (--compile model or "
                         "model+loss): micro-pipelined TP is a compiler pass")


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
    selective_ac: str = "op"
    """What selective recompute means under --framework torchtitan (its
    activation_checkpoint.selective_ac_option): ``op``, its per-op policy (keeps the outputs of
    every other matmul, of attention and of TP reduce-scatters, recomputes the rest), or a
    positive integer N, every Nth transformer block fully recomputed and the others not at all.
    Other frameworks have one selective policy and ignore it."""
    recompute_early_stop: bool = False
    """Whether full recomputation stops once backward has every tensor it needs (torch's
    non-reentrant checkpoint ``early_stop``; torchtitan's activation_checkpoint.early_stop):
    the block's last matmul, whose output backward never reads, is not run again. meshplan's
    runtime always stops early (torch's default); Megatron-LM and DeepSpeed recompute the
    whole layer and ignore it."""
    compile: str = "none"
    """torch.compile under --framework torchtitan (its compile.enable and compile.components):
    ``none``; ``model``, every transformer block compiled (its element-wise operators run as
    fused kernels; torchtitan before 2025 compiled nothing else); or ``model+loss``, the loss
    too (torchtitan 0.2.2's default components)."""
    float8: bool = False
    """Float8 training of the transformer blocks' linears (torchtitan's quantize.linear.float8
    converter: torchao Float8Linear, tensorwise dynamic scaling, float8 FSDP all-gather of their
    weights); the LM head stays in the compute dtype unless ``float8_head``. Modelled under
    --framework torchtitan and, as Transformer Engine's linears, --framework megatron, on GPUs
    with float8 tensor cores, with dtype bf16."""
    float8_recipe: str = "tensorwise"
    """With float8, how the casts are scaled: ``tensorwise``, per-tensor scales from the tensor
    being cast (a max-abs pass before each activation and gradient cast: torchao's tensorwise
    recipe, Transformer Engine's current scaling, the export's ``--fp8-recipe tensorwise``), or
    ``delayed``, Transformer Engine's delayed scaling under --framework megatron (scales from
    an amax history the cast kernels update, no pass of their own; NeMo's default)."""
    grad_reduce_dtype: str = "fp32"
    """Under --framework torchtitan with ZeRO-2/3 (FSDP), the dtype the gradients are
    reduce-scattered in: ``fp32``, as torchtitan runs it (FSDP2's
    ``MixedPrecisionPolicy(reduce_dtype=torch.float32)``; 0.2.2's
    ``training.mixed_precision_reduce`` takes float32 alone, so ``meshplan export --to
    torchtitan`` refuses the other), or the compute dtype, as FSDP trainers that reduce in
    bf16 run it (FSDP1 ``MixedPrecision(reduce_dtype=bf16)``: IBM's fms-fsdp, Composer's
    ``PURE`` mixed precision): half the bytes on the ring, and the unsharded gradients and the
    reduce-scatter input in the compute dtype instead of fp32. Changes nothing without
    ZeRO-2/3."""
    float8_head: bool = False
    """With float8, the LM head (torchtitan's ``output`` linear) in float8 too, as torchtitan
    0.2.2 converts it by default (an empty ``filter_fqns``); off leaves it in bf16, as
    torchtitan's December 2024 benchmarks ran it. Needs float8 and an untied head."""
    async_tp: bool = False
    """Asynchronous tensor parallelism under --framework torchtitan (its
    parallelism.enable_async_tensor_parallel: torch's micro-pipelined TP, which fuses each
    sequence-parallel all-gather with the matmuls that read its output and each reduce-scatter
    with the matmul that produces its input, and overlaps their chunks). Needs torch.compile;
    changes nothing where no TP with sequence parallelism runs (tp 1, or no --sp)."""
    tp_comm_overlap: bool = False
    """Under --framework megatron with sequence parallelism, Transformer Engine's overlap of the
    TP collectives with the GEMMs beside them (Megatron-LM ``--tp-comm-overlap``): each
    all-gather and reduce-scatter is split into TP steps that run beside the chunks of the
    GEMM that reads or produces it, in the forward (the block inputs with QKV and FC1, the
    outputs of the attention projection and FC2) and in the backward (the output gradients
    with the input-gradient GEMMs of those two, the input gradients' reduce-scatters with the
    weight-gradient GEMMs of QKV and FC1; ``timing.tp_comm_parts_s``). Changes nothing where
    no TP with sequence parallelism runs; torchtitan's counterpart is ``async_tp``."""
    attention_kernel: str = "auto"
    """Which fused attention kernel the framework calls: ``auto``, its own (Megatron-LM:
    Transformer Engine's cuDNN kernels; the FSDP trainers torchtitan stands for and meshplan's
    runtime: torch's SDPA flash kernel, FlashAttention-2), or ``triton``, the Triton port of
    FlashAttention that llm-foundry's ``attn_impl: triton`` runs (its default until 2024-03; the
    kernel that takes an ALiBi bias), priced at the device's ``triton_attention_efficiency``.
    Applies with flash attention on."""
    cross_entropy_fusion: bool = False
    """Under --framework megatron, Megatron-LM's ``--cross-entropy-loss-fusion``: its
    vocabulary-parallel cross entropy as megatron-core's fused kernels (``jit_fuser``: the fp32
    upcast with the maximum, the shift with the exponential and its sum, the normalisation,
    and in backward the gradient with its cast to bf16; ``timing.MEGATRON_FUSED_CE_BYTES``)
    instead of its separate operators (``timing.MEGATRON_CE_BYTES``); off, as Megatron-LM's
    own default. Under --framework torchtitan (the FSDP trainers it stands for), a fused
    cross-entropy kernel on the 16-bit logits in place of ``F.cross_entropy(logits.float())``:
    llm-foundry's default ``fused_crossentropy`` (flash-attn's, since its first MPT release),
    OLMo-core's ``fused_loss``. It reads the logits and writes their gradient in one pass
    each (``eager.FUSED_LOSS_BYTES_PER_LOGIT``) and keeps the logits and that gradient, no fp32
    copy (``frameworks.COMPILED_LOSS_LOGIT_COPIES``), as torchtitan's compiled loss does;
    wherever a configuration runs without TP (under TP torchtitan's loss is its
    vocabulary-parallel one, and the setting changes nothing there). torchtitan 0.2.2 has no
    such option, so ``meshplan export --to torchtitan`` refuses it
    (``--compile model+loss`` is torchtitan's way to the same kernel)."""
    overlap_comm: bool = True
    """Under --framework megatron, megatron-core's overlap of data-parallel and pipeline
    traffic with compute, as ``meshplan export --to megatron`` asks for it: the gradient
    reduction runs bucket by bucket during the step's last micro-batch backward
    (``--overlap-grad-reduce``) and the distributed optimizer's parameter all-gather during the
    next step's first forward (``--overlap-param-gather``; ``timing.dp_step_s``); with an
    interleaved pipeline (vpp > 1) each chunk's sends and receives run beside the next chunk's
    compute (``--overlap-p2p-communication``, Megatron-LM's default; ``timing._pp_comm_s``).
    False: Megatron-LM as it ran before megatron-core (the 2021-2022 papers' runs), the
    reduction after the backward and blocking pipeline sends. Other frameworks overlap by
    their own rules and ignore it."""
    cp_comm_type: str = "auto"
    """How context parallelism (cp > 1) exchanges keys and values, as Megatron-LM's
    ``--cp-comm-type`` names it: ``p2p``, a ring: each step attends the rank's queries to one
    received chunk while the next one moves, and merges the partial results (torch's
    context_parallel under torchtitan; Transformer Engine's default under Megatron-LM);
    ``all_gather``, K and V all-gathered, then one attention per local query chunk over the
    whole sequence, the gather exposed (Megatron-LM; Llama 3's context parallelism);
    ``a2a``, all-to-alls from a sequence split to a head split and back around a
    full-sequence attention (DeepSpeed-Ulysses; Megatron-LM); ``auto``, the framework's own:
    ``a2a`` under DeepSpeed, ``p2p`` under the others (``meshplan plan`` then searches every
    exchange the framework runs; a named one pins it)."""
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
        if self.selective_ac != "op" and not (self.selective_ac.isdigit()
                                              and int(self.selective_ac) > 0):
            raise ValueError(f"selective_ac must be op or a positive integer (every Nth layer), "
                             f"got {self.selective_ac!r}")
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
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be bf16, fp16 or fp32, got {self.dtype!r}")
        check_run_settings(compile_mode=self.compile, float8=self.float8,
                           float8_head=self.float8_head, async_tp=self.async_tp,
                           dtype=self.dtype, float8_recipe=self.float8_recipe,
                           grad_reduce_dtype=self.grad_reduce_dtype,
                           attention_kernel=self.attention_kernel,
                           flash_attention=self.flash_attention,
                           cp_comm_type=self.cp_comm_type)

    def __hash__(self) -> int:
        """The fields' hash, computed once: configurations key the planner's caches, which
        one search reads hundreds of thousands of times."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(_field_values(self.__dict__))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __eq__(self, other: object) -> bool:
        """Field by field, as the generated one, read in one call (dictionary lookups of
        equal but distinct configurations compare them)."""
        if self is other:
            return True
        if other.__class__ is not self.__class__:
            return NotImplemented
        return _field_values(self.__dict__) == _field_values(other.__dict__)

    def __getstate__(self) -> dict[str, Any]:
        """The fields only: string hashes differ between processes."""
        return dict(zip(_FIELD_NAMES, _field_values(self.__dict__)))

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

    @property
    def selective_every_n_layers(self) -> int:
        """N of torchtitan's every-Nth-layer selective policy; 0 for its per-op policy."""
        return 0 if self.selective_ac == "op" else int(self.selective_ac)

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        """Layers on each pipeline stage."""
        if self.layers_per_stage is not None:
            return self.layers_per_stage
        return even_split(num_layers, self.pp)

    @property
    def bytes_per_activation(self) -> int:
        return 4 if self.dtype == "fp32" else 2

    @property
    def grad_reduce_bytes(self) -> int:
        """Bytes per element of the gradients FSDP reduce-scatters (``grad_reduce_dtype``)."""
        return 4 if self.grad_reduce_dtype == "fp32" else 2

    @property
    def fused_loss_kernel(self) -> bool:
        """Whether an FSDP trainer (--framework torchtitan, meshplan) runs its loss as one
        fused kernel on the 16-bit logits: torchtitan's compiled loss (``compile``
        ``model+loss``), or a fused cross-entropy kernel wherever no TP runs
        (``cross_entropy_fusion``; under TP torchtitan's loss is its vocabulary-parallel
        one)."""
        return self.compile == "model+loss" or (self.cross_entropy_fusion and self.tp == 1)

    def replace(self, **changes) -> "ParallelConfig":
        return dataclasses.replace(self, **changes)

    def with_split(self, layers_per_stage: tuple[int, ...] | None,
                   recompute: str | tuple[str, ...]) -> "ParallelConfig":
        """``replace(layers_per_stage=..., recompute=...)`` that re-checks only those two
        fields (the planner builds many such copies of one valid configuration)."""
        modes = (recompute,) if isinstance(recompute, str) else recompute
        if (not modes or not _known_modes(modes)
                or (not isinstance(recompute, str) and len(recompute) != self.pp)):
            return self.replace(layers_per_stage=layers_per_stage, recompute=recompute)
        copy = object.__new__(ParallelConfig)
        copy.__dict__.update(self.__dict__)  # the fields, and the hash dropped below
        copy.__dict__.update(layers_per_stage=layers_per_stage, recompute=recompute)
        copy.__dict__.pop("_hash", None)
        return copy


_FIELD_NAMES = tuple(ParallelConfig.__dataclass_fields__)
_field_values = operator.itemgetter(*_FIELD_NAMES)


def _known_modes(modes) -> bool:
    """Every entry of ``modes`` is a recompute mode; tuples of strings are checked once each
    (``with_split`` checks the same few tuples many times)."""
    try:
        return _known_mode_tuple(modes)
    except TypeError:  # a list, or entries that are not hashable
        return all(m in RECOMPUTE_MODES for m in modes)


@functools.lru_cache(maxsize=4096)
def _known_mode_tuple(modes: tuple) -> bool:
    return all(m in RECOMPUTE_MODES for m in modes)


REMAINDER_ORDERS = ("middle", "first")
"""Which parts of an ``even_split`` take the left-over items first."""


@functools.cache
def even_split(total: int, parts: int, *, remainder: str = "middle") -> tuple[int, ...]:
    """``total`` items (layers) over ``parts`` as evenly as possible: each part gets
    ``total // parts`` and the ``total % parts`` left over go one each, in this order:

    * ``middle`` (pipeline stages, ``ParallelConfig.stage_layers``): the middle stages first,
      then the first and the last, which also carry the embedding and the LM head;
    * ``first`` (a pipeline rank's virtual chunks, ``runtime.pipeline``; the planner's filler
      stages around a probed one): the first parts. Each chunk of a rank holds the same kind
      of layers (the cost model charges a chunk 1/v of the rank's layers, whatever the order).

    ``even_split(10, 4) == (2, 3, 3, 2)``; ``even_split(10, 4, remainder="first") ==
    (3, 3, 2, 2)``. ValueError for fewer than one part or an unknown order.
    """
    if parts < 1 or remainder not in REMAINDER_ORDERS:
        raise ValueError(f"even_split needs parts >= 1 and remainder in {REMAINDER_ORDERS}, "
                         f"got parts={parts!r}, remainder={remainder!r}")
    base, extra = divmod(total, parts)
    order = list(range(parts))
    if remainder == "middle":
        order.sort(key=lambda i: (i in (0, parts - 1), i))
    counts = [base] * parts
    for i in order[:extra]:
        counts[i] += 1
    return tuple(counts)
