"""The planner's search space: which global configurations (degrees and knobs) it considers.

Plain Python enumerates the global choices, which are few: tensor / context / pipeline / data /
expert degrees, sequence parallelism, ZeRO stage, offload, micro-batch, virtual pipeline
chunks and the rank layout. The layer-to-stage split and the per-stage recomputation are left to
the CP-SAT model (``solver.py``).

Choices a user pins (``meshplan plan --tp 8``) restrict the space. Without pins the space is
every configuration ``meshplan estimate`` accepts, except where noted:

* tp: divisors of the GPU count that divide the heads and kv heads (across nodes too);
* cp: every divisor of what is left that divides the sequence; with cp > 1, each context-parallel
  exchange the framework runs (``search.searched_exchanges``: Megatron-LM's ring, all-gather and
  all-to-all) unless one is pinned (``--cp-comm-type``);
* pp: divisors of what is left, at most the layer count; dp: the rest, dividing the batch;
* ep (MoE): divisors of the expert count that divide dp * cp;
* sp: on whenever tp > 1 (``SP_DOMINATES``: the cost model gives sequence parallelism the same
  traffic with less memory and element-wise time, so tp > 1 without it is never faster);
* ZeRO: 0, 1, 2, 3 with more than one replica; 0 and 3 with one (``ONE_REPLICA_ZERO``: stages 1
  and 2 shard over a single rank, which the estimates price as ZeRO-0 or higher; ZeRO-3 stays
  for parameter offload), and 2 as well under the ``meshplan`` framework
  (``MESHPLAN_ONE_REPLICA_ZERO``: its runtime runs ZeRO-2 with FSDP2's 16-bit parameters
  instead of autocast over fp32 weights, which keeps less at a 16-bit plan's peak);
* offload: none; optimizer to cpu or nvme; optimizer+params under ZeRO-3 (also at dp = 1, the
  ZeRO-Offload single-GPU case); NVMe only when pinned or when host memory cannot hold the
  offloaded states;
* micro-batch: every divisor of the per-replica batch;
* vpp: every v with pp * v <= layers, when pp > 1 and the micro-batches divide by pp (the
  interleaved schedule's rule);
* rank layout: tp-cp-dp-pp (Megatron's) and tp-cp-pp-dp (data parallel outermost), one of them
  when pp or dp is 1 (both orders give the same layout); tensor parallelism is always the
  innermost axis; under DeepSpeed and torchtitan the first only (``layout.
  FRAMEWORK_MESH_ORDERS``: the only one they build).

Every configuration is one the plan's framework runs (``layout.framework_layout_error``): under
DeepSpeed no pipeline with ZeRO-2/3 or interleaving, cp only where Ulysses can split the heads;
under meshplan's runtime no context parallelism; offload only as each framework offloads. A
pinned choice the framework cannot run at all is refused with that rule's reason
(``search.framework_space``).

Run settings (``SETTING_FIELDS``: torchtitan's selective policy, early-stopping recomputation,
torch.compile, float8 training, async TP) are not searched: every configuration carries the
user's. The context-parallel exchange is one of them here, and ``search.search`` searches it
over spaces that differ only in it (``search.searched_exchanges``).

Search bounds (``search.py``) then discard candidates no split can make competitive; they
never remove the optimum (tests/planner/test_brute_force.py checks that claim).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from meshplan.costmodel import ClusterSpec, ModelSpec, ParallelConfig
from meshplan.costmodel.config import (MESH_AXES, OFFLOAD_DEVICES, OFFLOAD_MODES, RECOMPUTE_MODES,
                                       check_run_settings)
from meshplan.costmodel.layout import framework_layout_error

MESH_ORDERS = (("tp", "cp", "dp", "pp"), ("tp", "cp", "pp", "dp"))
ONE_REPLICA_ZERO = (0, 3)
"""ZeRO stages searched with one data-parallel replica (module docstring)."""
MESHPLAN_ONE_REPLICA_ZERO = (0, 2, 3)
"""The same under the ``meshplan`` framework (module docstring)."""


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """Allowed values per choice; ``None`` means "search all" (see the module docstring)."""

    global_batch_size: int
    seq_len: int
    dtype: str = "bf16"
    flash_attention: bool = True
    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    dp: tuple[int, ...] | None = None
    cp: tuple[int, ...] | None = None
    ep: tuple[int, ...] | None = None
    sp: tuple[bool, ...] | None = None
    zero_stage: tuple[int, ...] | None = None
    offload: tuple[str, ...] | None = None
    offload_device: tuple[str, ...] | None = None
    micro_batch_size: tuple[int, ...] | None = None
    vpp: tuple[int, ...] | None = None
    mesh_order: tuple[tuple[str, ...], ...] | None = None
    recompute_modes: tuple[str, ...] = RECOMPUTE_MODES
    """Modes each stage may take (CP-SAT chooses per stage)."""
    recompute_pinned: tuple[str, ...] | None = None
    """A per-stage recompute list the user pinned (length must equal pp)."""
    layers_per_stage: tuple[int, ...] | None = None
    """A layer split the user pinned."""
    memory_margin: float = 0.0
    """Fraction of device memory kept free (0.05 = plan for 95% of capacity)."""
    min_micro_batches_per_stage: bool = False
    """Only pipelines with at least pp micro-batches per step (the framework's schedules need
    them: ``costmodel.frameworks.min_micro_batches``); ``search`` sets it per framework."""
    selective_ac: str = "op"
    """torchtitan's selective policy for every configuration (``ParallelConfig.selective_ac``;
    a setting of the run, not searched)."""
    recompute_early_stop: bool = False
    """Early-stopping full recomputation for every configuration
    (``ParallelConfig.recompute_early_stop``; a setting, not searched)."""
    compile: str = "none"
    """What torch.compile covers in every configuration (``ParallelConfig.compile``: none,
    model or model+loss; a setting, not searched)."""
    float8: bool = False
    """Float8 training of the blocks' linears for every configuration
    (``ParallelConfig.float8``; a setting, not searched; needs dtype bf16)."""
    float8_recipe: str = "tensorwise"
    """With float8, its scaling recipe (``ParallelConfig.float8_recipe``; a setting)."""
    float8_head: bool = False
    """With float8, the LM head in float8 too (``ParallelConfig.float8_head``; a setting)."""
    grad_reduce_dtype: str = "fp32"
    """The FSDP gradient reduce-scatter's dtype (``ParallelConfig.grad_reduce_dtype``; a
    setting, not searched: it trades numerics for traffic, the user's call)."""
    async_tp: bool = False
    """torchtitan's async TP wherever a configuration runs TP with sequence parallelism
    (``ParallelConfig.async_tp``; a setting, not searched; needs compile)."""
    tp_comm_overlap: bool = False
    """Transformer Engine's TP overlap under Megatron-LM wherever a configuration runs TP with
    sequence parallelism (``ParallelConfig.tp_comm_overlap``; a setting, not searched)."""
    cross_entropy_fusion: bool = False
    """A fused cross entropy (``ParallelConfig.cross_entropy_fusion``: Megatron-LM's, or under
    torchtitan an FSDP trainer's fused kernel wherever a configuration runs without TP; a
    setting, not searched)."""
    attention_kernel: str = "auto"
    """The fused attention kernel the framework calls (``ParallelConfig.attention_kernel``;
    a setting, not searched: it is the trainer's, not a layout choice)."""
    overlap_comm: bool = True
    """Megatron-LM's data-parallel and pipeline overlap (``ParallelConfig.overlap_comm``; a
    setting, on unless --no-overlap-comm)."""
    cp_comm_type: str = "auto"
    """How context parallelism exchanges keys and values wherever a configuration has cp > 1
    (``ParallelConfig.cp_comm_type``). The space's configurations carry it; ``auto`` (the
    framework's own) also tells ``search.search`` to search the framework's other exchanges
    (``search.searched_exchanges``), each in a space of its own; any other value pins it."""
    min_cp: int = 1
    """The smallest context-parallel degree of the space (``search.searched_exchanges``
    searches the other exchanges from 2: cp 1 runs none, and the framework's own exchange's
    space already holds it)."""
    extra: dict = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.global_batch_size <= 0 or self.seq_len <= 0:
            raise ValueError(f"global batch and sequence length must be positive, got "
                             f"{self.global_batch_size} and {self.seq_len}")
        if self.min_cp < 1:
            raise ValueError(f"min_cp must be at least 1, got {self.min_cp}")
        if not 0 <= self.memory_margin < 1:
            raise ValueError(f"memory margin must be in [0, 1), got {self.memory_margin}")
        bad = [m for m in self.recompute_modes if m not in RECOMPUTE_MODES]
        if bad or not self.recompute_modes:
            raise ValueError(f"recompute modes must be among {RECOMPUTE_MODES}, got "
                             f"{self.recompute_modes}")
        # checked once here, else every configuration of the space would be refused
        check_run_settings(compile_mode=self.compile, float8=self.float8,
                           float8_head=self.float8_head, async_tp=self.async_tp,
                           dtype=self.dtype, float8_recipe=self.float8_recipe,
                           grad_reduce_dtype=self.grad_reduce_dtype,
                           attention_kernel=self.attention_kernel,
                           flash_attention=self.flash_attention,
                           cp_comm_type=self.cp_comm_type)


PIN_FIELDS = ("tp", "pp", "dp", "cp", "ep", "sp", "zero_stage", "offload", "offload_device",
              "micro_batch_size", "vpp", "mesh_order", "recompute_pinned", "layers_per_stage")


def pins_of(space: SearchSpace) -> dict:
    """The choices ``space`` pins, as JSON-ready data (recorded in a plan's provenance)."""
    pins = {name: _listed(getattr(space, name)) for name in PIN_FIELDS
            if getattr(space, name) is not None}
    if space.recompute_modes != RECOMPUTE_MODES:
        pins["recompute_modes"] = list(space.recompute_modes)
    if space.memory_margin:
        pins["memory_margin"] = space.memory_margin
    for name in SETTING_FIELDS:
        if getattr(space, name) != getattr(SearchSpace, name):
            pins[name] = getattr(space, name)
    return pins


SETTING_FIELDS = ("selective_ac", "recompute_early_stop", "compile", "float8", "float8_recipe",
                  "float8_head", "async_tp", "tp_comm_overlap", "cross_entropy_fusion",
                  "attention_kernel", "overlap_comm", "grad_reduce_dtype", "cp_comm_type")
"""Run settings every configuration of the space carries (recorded when not the default);
each is a ``ParallelConfig`` field of the same name."""


def settings_of(space: SearchSpace) -> dict:
    """The ``ParallelConfig`` keyword arguments of ``space``'s run settings (``SETTING_FIELDS``)."""
    return {name: getattr(space, name) for name in SETTING_FIELDS}


def _listed(value):
    return [_listed(v) for v in value] if isinstance(value, (tuple, list)) else value


def _tupled(value):
    return tuple(_tupled(v) for v in value) if isinstance(value, (tuple, list)) else value


def space_with_pins(pins: dict, **fixed) -> SearchSpace:
    """A SearchSpace with ``pins`` (as ``pins_of`` writes them) and the ``fixed`` fields."""
    known = set(PIN_FIELDS) | set(SETTING_FIELDS) | {"recompute_modes", "memory_margin"}
    return SearchSpace(**fixed, **{k: _tupled(v) for k, v in pins.items() if k in known})


def _is_int(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


_PIN_ITEMS = {
    **{name: (lambda v: _is_int(v, 1), "positive integers")
       for name in ("tp", "pp", "dp", "cp", "ep", "micro_batch_size", "vpp", "layers_per_stage")},
    "sp": (lambda v: isinstance(v, bool), "true or false"),
    "zero_stage": (lambda v: _is_int(v, 0) and v <= 3, "ZeRO stages 0-3"),
    "offload": (lambda v: v in OFFLOAD_MODES, f"among {', '.join(OFFLOAD_MODES)}"),
    "offload_device": (lambda v: v in OFFLOAD_DEVICES, f"among {', '.join(OFFLOAD_DEVICES)}"),
    "mesh_order": (lambda v: isinstance(v, list) and sorted(map(str, v)) == sorted(MESH_AXES)
                   and all(isinstance(a, str) for a in v),
                   f"orders of {', '.join(MESH_AXES)}"),
    "recompute_pinned": (lambda v: v in RECOMPUTE_MODES, f"among {', '.join(RECOMPUTE_MODES)}"),
    "recompute_modes": (lambda v: v in RECOMPUTE_MODES, f"among {', '.join(RECOMPUTE_MODES)}"),
}
"""What each list of ``pins_of`` may hold."""


def check_pins(pins, *, global_batch_size: int, seq_len: int) -> None:
    """Raise ValueError, naming the first bad entry, unless ``pins`` is what ``pins_of`` writes
    (a plan file's ``provenance.pinned``, read back by ``explain`` and elastic replanning)."""
    if not isinstance(pins, dict):
        raise ValueError(f"pinned must be an object, got {pins!r}")
    for name, value in pins.items():
        if name in _PIN_ITEMS:
            accept, what = _PIN_ITEMS[name]
            if not isinstance(value, list) or not value or not all(
                    isinstance(v, (int, str, list)) and accept(v) for v in value):
                raise ValueError(f"pinned {name} must be a non-empty list of {what}, "
                                 f"got {value!r}")
        elif name == "memory_margin":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"pinned memory_margin must be a number, got {value!r}")
        elif name in SETTING_FIELDS:
            default = getattr(SearchSpace, name)
            if type(value) is not type(default):
                raise ValueError(f"pinned {name} must be {type(default).__name__}, "
                                 f"got {value!r}")
        else:
            raise ValueError(f"pinned has an unknown choice {name!r}")
    try:
        space_with_pins(pins, global_batch_size=global_batch_size, seq_len=seq_len)
    except ValueError as err:
        raise ValueError(f"pinned: {err}") from None


def pick(pinned: tuple | None, default: list) -> list:
    return [v for v in default if v in pinned] if pinned is not None else default


CORE_MAX_MICRO_BATCH = 16
CORE_MAX_VPP = 4
CORE_MAX_CP = 16
CORE_MIN_CP_SEQ_LEN = 16384


def degree_tuples(model: ModelSpec, cluster: ClusterSpec, space: SearchSpace, *,
                  core: bool = False, core_cp_seq_len: int = CORE_MIN_CP_SEQ_LEN
                  ) -> list[tuple[int, int, int, int, int]]:
    """Valid (tp, cp, pp, dp, ep) for ``model`` on all GPUs of ``cluster`` (``core``: of the
    core space, see ``candidates``)."""
    n = cluster.num_gpus
    out = []
    tps = [t for t in divisors(n) if model.num_heads % t == 0 and model.kv_heads % t == 0]
    if core and space.tp is None:
        tps = [t for t in tps if t <= cluster.gpus_per_node]
    for tp in pick(space.tp, tps):
        cps = [c for c in divisors(n // tp) if space.seq_len % c == 0 and c >= space.min_cp]
        if core and space.cp is None:
            cps = [c for c in cps if c == 1 or (c <= CORE_MAX_CP and c & (c - 1) == 0
                                                and space.seq_len >= core_cp_seq_len)]
        cps = pick(space.cp, cps)
        if model.is_traced:  # no tensor-parallel layout known (costmodel/traced.py)
            cps = [c for c in cps if c == 1]
        for cp in cps:
            for pp in pick(space.pp, [p for p in divisors(n // (tp * cp))
                                       if p <= model.num_layers]):
                dp = n // (tp * cp * pp)
                if space.dp is not None and dp not in space.dp:
                    continue
                if space.global_batch_size % dp:
                    continue
                eps = [1]
                if model.is_moe:
                    eps = [e for e in divisors(model.num_experts) if (dp * cp) % e == 0]
                for ep in pick(space.ep, eps):
                    out.append((tp, cp, pp, dp, ep))
    return out


def candidates(model: ModelSpec, cluster: ClusterSpec, space: SearchSpace, *,
               core: bool = False, framework: str = "meshplan",
               core_cp_seq_len: int = CORE_MIN_CP_SEQ_LEN) -> list[ParallelConfig]:
    """Every global configuration of the space; layer split and recompute left at defaults.

    ``core``: only the core space, from which the search takes its first plan
    (``search.py``): tp within a node, cp 1 or a power of two up to ``CORE_MAX_CP`` for
    sequences of at least ``CORE_MIN_CP_SEQ_LEN`` tokens, ZeRO 1-3 with several replicas,
    micro-batches up to ``CORE_MAX_MICRO_BATCH``, vpp up to ``CORE_MAX_VPP``. Pinned choices
    are used as given in both spaces. ``framework``: whose ZeRO stages one replica searches
    (``zero_choices``; the default, ``meshplan``, searches the most), and whose layouts are
    kept (``layout.framework_layout_error``: only what the framework runs).
    ``core_cp_seq_len``: the sequence length from which the core space has cp > 1 (the
    search's short-limit core, ``search.SHORT_LIMIT_CORE_CP_SEQ_LEN``, starts lower).
    """
    return [config for config in iter_candidates(model, cluster, space, core=core,
                                                 framework=framework,
                                                 core_cp_seq_len=core_cp_seq_len)
            if layout_error(framework, config, model, space) is None]


def layout_error(framework: str, config: ParallelConfig, model: ModelSpec,
                 space: SearchSpace) -> str | None:
    """``layout.framework_layout_error`` of a candidate as the plan would hold it: with the
    space's pinned layer split (a candidate leaves its split to the solver)."""
    if space.layers_per_stage is not None and len(space.layers_per_stage) == config.pp:
        config = config.replace(layers_per_stage=space.layers_per_stage)
    return framework_layout_error(framework, config, model)


def framework_refusal(model: ModelSpec, cluster: ClusterSpec, space: SearchSpace,
                      framework: str) -> str | None:
    """Why ``framework`` runs none of the configurations of ``space`` (its reason for the
    first, as one line for ``plan`` and ``search`` to raise), or None when it runs one
    (usually found at once) or the space has none."""
    reason = None
    for config in iter_candidates(model, cluster, space, framework=framework):
        why = layout_error(framework, config, model, space)
        if why is None:
            return None
        reason = reason or why
    if reason is None:
        return None
    return (f"{reason} (no configuration of the pinned choices runs under --framework "
            f"{framework})")


def iter_candidates(model: ModelSpec, cluster: ClusterSpec, space: SearchSpace, *,
                    core: bool = False, framework: str = "meshplan",
                    core_cp_seq_len: int = CORE_MIN_CP_SEQ_LEN) -> Iterator[ParallelConfig]:
    """``candidates`` one by one, whether or not the framework runs them."""
    for tp, cp, pp, dp, ep in degree_tuples(model, cluster, space, core=core,
                                            core_cp_seq_len=core_cp_seq_len):
        per_replica = space.global_batch_size // dp
        mbs = micro_batch_choices(space, per_replica, pp, core=core)
        sps = [tp > 1] if space.sp is None else [s for s in space.sp if tp > 1 or not s]
        zeros = zero_choices(space, dp * cp, core=core, framework=framework)
        orders = pick(space.mesh_order, list(MESH_ORDERS))
        if space.mesh_order is None and (pp == 1 or dp == 1):
            orders = orders[:1]  # both orders give the same layout
        for b in mbs:
            m = per_replica // b
            for v in vpp_choices(space, model, pp, m, core=core):
                for sp in sps:
                    for zero in zeros:
                        for offload, device in offload_choices(space, zero, model, cluster):
                            for order in orders:
                                config = _make(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, sp=sp,
                                               zero_stage=zero, offload=offload,
                                               offload_device=device, micro_batch_size=b,
                                               global_batch_size=space.global_batch_size,
                                               vpp=v, seq_len=space.seq_len,
                                               mesh_order=order, dtype=space.dtype,
                                               flash_attention=space.flash_attention,
                                               **settings_of(space))
                                if config is not None:
                                    yield config


def zero_choices(space: SearchSpace, replicas: int, *, core: bool = False,
                 framework: str = "meshplan") -> list[int]:
    """ZeRO stages for ``replicas`` data-parallel replicas (dp x cp); pinned ones as given."""
    if space.zero_stage is not None:
        return list(space.zero_stage)
    if replicas == 1:
        return pick(space.zero_stage, list(MESHPLAN_ONE_REPLICA_ZERO if framework == "meshplan"
                                           else ONE_REPLICA_ZERO))
    return pick(space.zero_stage, [1, 2, 3] if core else [0, 1, 2, 3])


def micro_batch_choices(space: SearchSpace, per_replica: int, pp: int, *,
                        core: bool = False) -> list[int]:
    """Micro-batch sizes that divide a replica's ``per_replica`` sequences, ascending; with
    ``min_micro_batches_per_stage`` only those giving at least ``pp`` micro-batches."""
    mbs = divisors(per_replica)
    if space.min_micro_batches_per_stage and pp > 1:
        mbs = [b for b in mbs if per_replica // b >= pp]
    if core and space.micro_batch_size is None:
        mbs = [b for b in mbs if b <= CORE_MAX_MICRO_BATCH]
    return pick(space.micro_batch_size, mbs)


def vpp_choices(space: SearchSpace, model: ModelSpec, pp: int, micro_batches: int, *,
                core: bool = False) -> list[int]:
    """Virtual chunks per stage: 1, and every v with pp * v <= layers when the micro-batches
    divide by pp (the interleaved schedule's rule)."""
    top = model.num_layers // pp
    if space.layers_per_stage is not None:
        top = min(top, min(space.layers_per_stage))
    if core and space.vpp is None:
        top = min(top, CORE_MAX_VPP)
    values = [1] + [v for v in range(2, top + 1)
                    if pp > 1 and micro_batches % pp == 0 and not model.is_traced]
    return pick(space.vpp, values)


HOST_BYTES_PER_PARAM = 16
"""Upper bound of offloaded bytes per parameter (fp32 master, Adam moments, fp32 gradient)."""


def offload_choices(space: SearchSpace, zero: int, model: ModelSpec,
              cluster: ClusterSpec) -> list[tuple[str, str]]:
    """Offload choices. NVMe is searched only when pinned or when host memory could not hold
    the offloaded states: it frees no more device memory than host memory and is slower."""
    modes = pick(space.offload, ["none", "optimizer", "optimizer+params"])
    devices = pick(space.offload_device, list(OFFLOAD_DEVICES))
    per_node = (model.num_params * HOST_BYTES_PER_PARAM / cluster.num_gpus
                * min(cluster.gpus_per_node, cluster.num_gpus))
    if space.offload_device is None and per_node <= cluster.host_bytes:
        devices = ["cpu"]
    out = []
    for mode in modes:
        if mode == "optimizer+params" and zero != 3:
            continue
        if mode == "none":
            out.append(("none", devices[0] if space.offload_device else "cpu"))
        else:
            out.extend((mode, d) for d in devices)
    return out


def _make(**values) -> ParallelConfig | None:
    try:
        return ParallelConfig(**values)
    except ValueError:  # e.g. sequence not divisible for SP under this cp
        return None
