"""Step time: compute per stage and micro-batch, communication, pipeline bubble, DP and offload.

Per micro-batch, a stage runs its layers forward and backward (backward = 2x forward, as the
FLOP convention has it) plus recomputation. Matmul time is FLOPs over peak times a calibrated
efficiency plus a fixed cost per GEMM call, so small matrices (high tp, small micro-batches)
run less efficiently; element-wise kernels move calibrated multiples of the activation bytes
through HBM. TP/SP, CP, EP and PP communication per micro-batch use the alpha-beta costs of
``collectives.py`` on the groups' links in the cluster graph.

How a step is composed from these per-stage terms (the pipeline bubble of Narayanan et al.
2021, exposed traffic, once-per-step terms) is written once, in ``composition.py``; what each
framework recomputes, in ``recompute.py``; the eager frameworks' kernel traffic, in
``eager.py``.

Why one module of ~600 lines: every term of a stage's micro-batch (layer compute, TP/CP/EP/PP
traffic, ZeRO and offload traffic with what compute hides) reads the same links and
calibration, and the planner's tables call it term by term.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass

from meshplan.costmodel import activations as act
from meshplan.costmodel import collectives as coll
from meshplan.costmodel import composition
from meshplan.costmodel import eager
from meshplan.costmodel import recompute
from meshplan.costmodel.recompute import LayerForward, stops_early
from meshplan.costmodel import traced
from meshplan.costmodel.calibration import Calibration
from meshplan.costmodel.calls import (DDP_BUCKET_BYTES, LOSS_REDUCTION_CALLS, buckets,
                                      call_overhead_s, collective_calls_per_microbatch,
                                      fsdp2_groups, fsdp2_syncs_once_per_step,
                                      gradient_bucketing, latency_steps, zero3_fetch_batches,
                                      zero3_gather_passes, zero_call_latency_s)
from meshplan.costmodel.config import CPU_DEVICE_KEY, ParallelConfig
from meshplan.costmodel.frameworks import DTENSOR_TP_FRAMEWORKS, cp_exchange, eager_kernels
from meshplan.costmodel.layout import ep_group, order_strides, rank_of, strides
from meshplan.costmodel.flops import attention_flop_per_token, lm_head_flop_per_token
from meshplan.costmodel.hardware import ClusterSpec
from meshplan.costmodel.memory import (LAYER_FIELDS, StageParams, layer_modes,
                                       layer_rank_params, stage_float8_weight_elements,
                                       stage_layer_range, stage_params)
from meshplan.costmodel.model import ModelSpec

BACKWARD_FACTOR = 2.0
"""Backward costs twice the forward (weight and input gradients)."""
FLASH_BACKWARD_FACTOR = 2.5
"""Fused attention's backward recomputes the scores: 5 matmuls against the forward's 2
(Dao 2023, FlashAttention-2, arXiv:2307.08691, Sec. 3.1.2)."""
EAGER_OPS_PER_LAYER = 42
"""Operators one decoder layer dispatches in its forward in eager PyTorch (meshplan's
runtime, Llama-style): two RMSNorms of 6 ops (pow, mean, add, rsqrt, mul, mul), 7 linears,
rotary embeddings on q and k (6 each), 6 view / transpose ops, the fused attention, SiLU,
the gate product and 2 residual adds. Charged ``DeviceCalibration.op_overhead_s`` each; the
backward dispatches about twice as many (``BACKWARD_FACTOR``)."""
HOST_OP_EQUIVALENTS = {"none": 248.0, "full": 577.0, "op": 1134.0}
"""Host work of one decoder layer's forward and backward for one micro-batch in an eager
framework, in plain eager ATen ops, by what the layer does for backward
(``memory.layer_modes``). ``none``: the ATen ops meshplan's runtime's Llama block dispatches
under bf16 autocast, forward 95 and backward 153, counted with a dispatch mode. ``full``
(torch's non-reentrant checkpoint) and ``op`` (the per-op selective policies of meshplan's
runtime and torchtitan: torch's selective-checkpoint dispatch modes run Python for every op
of the forward and of its recomputation) scaled by their measured host time over
``none``'s: 2.33x and 4.57x for a 16-token block whose kernels cost next to nothing, on one
CPU thread (``python benchmarks/host_ops.py``,
benchmarks/results/host-ops-cpu-2026-12-04.md). Charged ``DeviceCalibration.host_op_s``
each; a GPU layer takes the larger of this and its kernels' time (``_StageCosts.layer``)."""
COMPILED_OPS_PER_LAYER = 13
"""Kernels a compiled block launches in its forward: 7 GEMMs, SDPA and 5 fused regions (the
attention norm, the rotary embeddings, the first residual add with the MLP norm, the SwiGLU
product, the second residual add); views cost nothing. Replaces ``EAGER_OPS_PER_LAYER``."""
COMPILED_HOST_OPS = {"none": 40.0, "full": 53.0, "op": 48.0}
"""``HOST_OP_EQUIVALENTS`` of a compiled block: one per kernel its compiled graphs launch, as
inductor's generated wrapper launches them without eager dispatch (and a selective-checkpoint
policy is applied when the graph is traced, not per op at run time). ``none``: the forward's
13 kernels (``COMPILED_OPS_PER_LAYER``) and the backward's 27 (14 GEMMs, the SDPA backward and
about 12 fused regions); ``full`` adds the forward again; ``op`` adds the recomputed half of
the matmuls and the element-wise regions between them (8)."""
EAGER_OPS_HEAD = 11
"""Forward operators outside the layers: embedding, the final norm (6), LM head and the
loss (log-softmax, gather, mean)."""
OPTIMIZER_BYTES_PER_PARAM = 36.0
"""HBM traffic of a fused Adam step per parameter: read and write params, grads, master, m, v."""


PINNED_HOST_BUFFERS = True
"""Host-device copies of offload buffers run at the pinned rate for every framework modelled:
DeepSpeed's offload buffers and torchtitan's FSDP2 ``CPUOffloadPolicy()`` (``pin_memory=True``)
are page-locked, and so are meshplan's on CUDA (runtime/optim.py ``HostOffloadAdamW``,
runtime/parallelize.py ``CPUOffloadPolicy``), except the gradient copies FSDP2 makes while
gradients accumulate (``_param_offload_per_microbatch_s``); on the CPU device there is nothing
to pin, since the "device" is host memory too and a copy is one memcpy with no staging
buffer.
``Calibration.host_copy_rate`` keeps the pageable rate for buffers that are not pinned."""


@dataclass(frozen=True)
class StageTime:
    """Seconds per micro-batch on one stage, by term (communication already as exposed)."""

    compute_s: float
    tp_comm_s: float
    cp_comm_s: float
    ep_comm_s: float
    pp_comm_s: float
    zero_comm_s: float
    """ZeRO-2/3 traffic of the micro-batch before overlap."""
    zero_hidden_s: float
    """How much of it compute can hide."""
    offload_raw_s: float
    """ZeRO-3 parameter offload transfers of the micro-batch before overlap."""
    offload_hidden_s: float
    zero_latency_s: float = 0.0
    """Network latency of the micro-batch's ZeRO-2/3 calls (``calls.zero_call_latency_s``):
    a latency-bound call waits on the network, not on bytes, so compute cannot hide it."""
    host_wait_s: float = 0.0
    """Part of ``compute_s``: the device waiting for the host to issue the layers' kernels
    (host-bound layers of eager frameworks, ``HOST_OP_EQUIVALENTS``)."""
    offload_wait_s: float = 0.0
    """Parameter offload the device waits out: FSDP2's blocking gradient copies and host adds
    while gradients accumulate (``_param_offload_per_microbatch_s``)."""

    @property
    def dp_comm_s(self) -> float:
        """Exposed ZeRO-2/3 traffic (``composition.exposed``) plus the calls' latency."""
        return composition.exposed(self.zero_comm_s, self.zero_hidden_s) + self.zero_latency_s

    @property
    def offload_s(self) -> float:
        """Exposed parameter-offload traffic (``composition.exposed``) beyond the exposed
        ZeRO-2/3 traffic: the stage waits for the slower of the two (``composition.
        micro_total``), so the breakdown's terms still add up to ``total_s``."""
        zero = composition.exposed(self.zero_comm_s, self.zero_hidden_s)
        return max(zero, composition.exposed(self.offload_raw_s, self.offload_hidden_s)) - zero

    @property
    def linear_s(self) -> float:
        """The terms that add up without overlap."""
        return (self.compute_s + self.tp_comm_s + self.cp_comm_s + self.ep_comm_s
                + self.pp_comm_s + self.zero_latency_s + self.offload_wait_s)

    @property
    def total_s(self) -> float:
        """Seconds per micro-batch on the stage (``composition.micro_total``)."""
        return composition.micro_total(linear=self.linear_s, zero_comm=self.zero_comm_s,
                                       zero_hidden=self.zero_hidden_s,
                                       offload_raw=self.offload_raw_s,
                                       offload_hidden=self.offload_hidden_s)


@dataclass(frozen=True)
class Links:
    """Communication groups of one stage, as seen by its first rank."""

    tp: coll.GroupLink
    cp: coll.GroupLink
    dp: coll.GroupLink
    ep: coll.GroupLink
    pp_next: coll.GroupLink | None


def stage_links(cluster: ClusterSpec, config: ParallelConfig, stage: int) -> Links:
    """Communication groups of ``stage`` (cached by layout: degrees, mesh order, stage)."""
    return _stage_links(cluster, config.tp, config.cp, config.dp, config.pp, config.ep,
                        tuple(config.mesh_order), stage)


def stage_link_signature(cluster: ClusterSpec, config: ParallelConfig, stage: int) -> tuple:
    """What a stage's communication sees: its groups and the pipeline link it pays for."""
    links = stage_links(cluster, config, stage)
    return (links.tp, links.cp, links.dp, links.ep, _pp_link(cluster, config, stage, links))


def _pp_link(cluster: ClusterSpec, config: ParallelConfig, stage: int,
             links: Links) -> coll.GroupLink | None:
    """The point-to-point link ``stage`` sends over: to the next stage, or for the last stage
    (which sends gradients back) to the previous one."""
    if links.pp_next is not None or stage == 0:
        return links.pp_next
    return coll.group_link(cluster, (rank_of(config, {"pp": stage - 1}),
                                     rank_of(config, {"pp": stage})))


def link_period(cluster: ClusterSpec, config: ParallelConfig) -> int:
    """Stages ``period <= s < pp - 1`` have the links of stage ``s % period``
    (``_stage_links``)."""
    return _link_period(cluster.gpus_per_node * cluster.nodes_per_leaf, config.tp, config.cp,
                        config.dp, config.pp, tuple(config.mesh_order))


@functools.lru_cache(maxsize=16384)
def _link_period(leaf: int, tp: int, cp: int, dp: int, pp: int,
                 mesh_order: tuple[str, ...]) -> int:
    """Shifting every rank by whole leaves (``leaf``: GPUs per node x nodes per leaf) keeps
    what a group's links depend on (``collectives._group_link_cached``), so stage s sees the
    links of the stage an exact number of leaves before it: the stages repeat with this
    period (the pipeline axis's rank stride, ``layout.strides``, against the leaf)."""
    stride = order_strides(mesh_order, {"tp": tp, "cp": cp, "dp": dp, "pp": pp})["pp"]
    return leaf // math.gcd(stride, leaf)


@functools.lru_cache(maxsize=16384)
def _stage_links(cluster: ClusterSpec, tp: int, cp: int, dp: int, pp: int, ep: int,
                 mesh_order: tuple[str, ...], stage: int) -> Links:
    period = _link_period(cluster.gpus_per_node * cluster.nodes_per_leaf, tp, cp, dp, pp,
                          mesh_order)
    if period <= stage < pp - 1:
        return _stage_links(cluster, tp, cp, dp, pp, ep, mesh_order, stage % period)
    layout = ParallelConfig(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, mesh_order=mesh_order,
                            global_batch_size=dp, seq_len=cp)
    return direct_stage_links(cluster, layout, stage)


def direct_stage_links(cluster: ClusterSpec, layout: ParallelConfig, stage: int) -> Links:
    """``stage_links`` read off the stage's own ranks (without the shift by whole leaves)."""
    pp = layout.pp
    pp_next = None
    if stage + 1 < pp:
        pp_next = coll.group_link(cluster, (rank_of(layout, {"pp": stage}),
                                            rank_of(layout, {"pp": stage + 1})))
    # the groups of the stage's first rank (``layout.axis_group``, ``layout.dp_cp_ranks``),
    # read as lattices of ranks (``collectives.lattice_link``)
    stride = strides(layout)
    base = stage * stride["pp"]
    return Links(tp=coll.lattice_link(cluster, base, ((stride["tp"], layout.tp),)),
                 cp=coll.lattice_link(cluster, base, ((stride["cp"], layout.cp),)),
                 dp=coll.lattice_link(cluster, base, ((stride["dp"], layout.dp),
                                                      (stride["cp"], layout.cp))),
                 ep=coll.group_link(cluster, ep_group(layout)),
                 pp_next=pp_next)


def _gemm_s(flop: float, calls: int, *, peak: float, efficiency: float, overhead_s: float) -> float:
    return flop / (peak * efficiency) + calls * overhead_s if flop > 0 else 0.0


def fresh_pages_s(cluster: ClusterSpec, calibration: Calibration, nbytes: float) -> float:
    """Seconds of writing ``nbytes`` into freshly mapped memory beyond the write itself
    (``DeviceCalibration.fresh_page_bytes_per_s``; 0 on devices without it)."""
    rate = calibration.device(cluster.gpu.key).fresh_page_bytes_per_s
    return nbytes / rate if rate else 0.0


def link_effs(calibration: Calibration) -> dict[str, float]:
    """The calibrated link efficiencies the collectives' functions take (in-node NVLink,
    network) as keyword arguments."""
    return dict(intra_eff=calibration.nvlink_efficiency, inter_eff=calibration.network_efficiency)


def hbm_bytes_per_s(cluster: ClusterSpec, calibration: Calibration) -> float:
    """The HBM bandwidth memory-bound kernels reach on the cluster's GPU: its peak times the
    device's calibrated ``memory_efficiency``."""
    return cluster.gpu.hbm_bytes_per_s * calibration.device(cluster.gpu.key).memory_efficiency


def layer_forward(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig,
                  calibration: Calibration, *, moe: bool,
                  framework: str = "megatron") -> LayerForward:
    """Forward seconds of one layer for one micro-batch, by kind of work.

    GEMMs run at ``DeviceCalibration.gemm_efficiency``: for frameworks that launch them from
    eager PyTorch (``frameworks.eager_kernels``) the device's ``eager_matmul_efficiency``
    where it has one (H100-class GPUs, whose peak Megatron-LM's and Llama 3's kernels reach
    far better than eager FSDP trainers do), times the device's ``row_efficiency`` at the
    micro-batch's tokens, plus a fixed cost per GEMM call."""
    device = calibration.device(cluster.gpu.key)
    peak = cluster.gpu.peak(config.dtype)
    tokens = act.tokens_per_microbatch(config)
    t = config.tp
    h, q, kv = model.hidden_size, model.q_size, model.kv_size
    mats = 3 if model.activation == "swiglu" else 2
    proj_flop = 2 * tokens * h * (2 * q + 2 * kv) / t
    if moe:
        mlp_flop = 2 * tokens * model.moe_top_k * mats * h * model.expert_ffn_size / t
        mlp_flop += 2 * tokens * h * model.num_experts  # router
    else:
        mlp_flop = 2 * tokens * mats * h * model.ffn_hidden_size / t
    gemm_efficiency = (device.gemm_efficiency(eager_kernels(framework))
                       * device.row_efficiency(tokens))
    bandwidth = hbm_bytes_per_s(cluster, calibration)
    if config.float8:
        # float8 GEMMs at the float8 peak and the same efficiency (torchao's float8 roofline
        # takes one achievable fraction for both), plus their casts' HBM traffic
        fp8_flop = proj_flop + (0.0 if moe else mlp_flop)  # experts stay bf16
        gemm = (_gemm_s(fp8_flop, 2 if moe else 2 + mats, peak=cluster.gpu.peak("fp8"),
                        efficiency=gemm_efficiency, overhead_s=device.matmul_overhead_s)
                + _gemm_s(proj_flop + mlp_flop - fp8_flop, mats if moe else 0, peak=peak,
                          efficiency=gemm_efficiency, overhead_s=device.matmul_overhead_s)
                + eager.float8_cast_bytes(model, config, moe=moe, tokens=tokens,
                                          transformer_engine=framework == "megatron")
                / (1 + BACKWARD_FACTOR) / bandwidth)
    else:
        gemm = _gemm_s(proj_flop + mlp_flop, 2 + mats, peak=peak, efficiency=gemm_efficiency,
                       overhead_s=device.matmul_overhead_s)
    gemm += _memory_bound_gemm_s(model, config, tokens, moe=moe, bandwidth=bandwidth,
                                 rate=peak * gemm_efficiency,
                                 float8_rate=(cluster.gpu.peak("fp8") * gemm_efficiency
                                              if config.float8 else 0.0))
    causal = config.flash_attention  # fused kernels skip the masked half of the scores
    attention_flop = tokens * attention_flop_per_token(model, seq_len=config.seq_len,
                                                       causal=causal) / t
    efficiency = (device.fused_attention_efficiency(eager_kernels(framework),
                                                    attention_keys_per_call(config, framework),
                                                    config.attention_kernel)
                  if config.flash_attention else device.attention_efficiency)
    core = _gemm_s(attention_flop, 2, peak=peak, efficiency=efficiency,
                   overhead_s=device.matmul_overhead_s)
    core_bytes = act.attention_core_bytes(model, config) if not config.flash_attention else 0.0
    core += calibration.attention_core_traffic_factor * core_bytes / bandwidth
    if eager_kernels(framework) and config.compile != "none":
        elementwise = eager.compiled_layer_elementwise_bytes(model, config, moe=moe,
                                                             tokens=tokens) / bandwidth
    elif eager_kernels(framework):
        elementwise = eager.layer_elementwise_bytes(model, config, moe=moe,
                                                    tokens=tokens) / bandwidth
    else:
        layer_bytes = act.layer_activation_bytes(model, config, recompute="none", moe=moe)
        elementwise = (calibration.elementwise_traffic_factor * (layer_bytes - core_bytes)
                       / bandwidth)
    host_ops = (COMPILED_OPS_PER_LAYER if config.compile != "none" else EAGER_OPS_PER_LAYER) \
        * device.op_overhead_s
    fraction = (recompute.torchtitan_recomputed_mm_fraction(model, moe=moe)
                if framework == "torchtitan" else 0.0)
    last = recompute.last_mm_fraction(model, moe=moe)
    return LayerForward(gemm_s=gemm, core_s=core, rest_s=elementwise + host_ops,
                        recomputed_mm_fraction=fraction, last_mm_fraction=last)


def attention_keys_per_call(config: ParallelConfig, framework: str) -> float:
    """The sequence length one fused-attention kernel call runs over, which sets its
    efficiency where the device has a length curve (``DeviceCalibration.
    eager_flash_attention_half_seq``): the whole sequence, but under ring context parallelism
    one rank's chunk, ``s / cp``: each ring step calls the kernel on the rank's queries against
    one chunk's keys (the first step causal over its own chunk; under load balancing half the
    queries or half the keys, the work of a causal call over the chunk). The all-gather
    exchange attends each local query chunk to the gathered sequence, and the all-to-all one
    (Ulysses) the whole sequence with a share of the heads (``ParallelConfig.cp_comm_type``)."""
    if config.cp > 1 and cp_exchange(framework, config.cp_comm_type) == "p2p":
        return config.seq_len / config.cp
    return config.seq_len


def _memory_bound_gemm_s(model: ModelSpec, config: ParallelConfig, tokens: float, *,
                         moe: bool, bandwidth: float, rate: float, float8_rate: float) -> float:
    """Seconds one layer's projections take beyond their FLOPs at ``rate`` because they are
    memory-bound (the roofline model: Williams, Waterman and Patterson 2009): a [tokens, K] x
    [K, N] product reads both operands and writes its output through HBM at ``bandwidth``, so
    one whose arithmetic intensity (FLOPs per byte) is below the device's ridge point (rate /
    bandwidth) takes its bytes' time. Narrow products meet it: grouped-query attention's k and
    v projections sharded by TP (Llama 3 8B and 70B at TP 8: N = 128, about 125 FLOPs per
    byte against a ridge near 335 on a 500 W HBM2e H100). Their backward products (input and
    weight gradients) move the same three matrices, so the forward's share scales with the
    rest (``BACKWARD_FACTOR``). Float8 linears (``float8_rate`` > 0) read 1-byte operands and
    write 16-bit outputs; MoE experts are left out."""
    t = config.tp
    h = model.hidden_size
    q, kv = model.q_size / t, model.kv_size / t
    shapes = [(q, h), (kv, h), (kv, h), (h, q)]  # (N, K): wq, wk, wv, wo
    if not moe:
        f = model.ffn_hidden_size / t
        shapes += [(f, h)] * (2 if model.activation == "swiglu" else 1) + [(h, f)]
    out_bytes = config.bytes_per_activation
    in_bytes = 1 if float8_rate else out_bytes
    flop_rate = float8_rate or rate
    return sum(gemm_memory_excess_s(tokens, k, n, in_bytes=in_bytes, out_bytes=out_bytes,
                                    bandwidth=bandwidth, rate=flop_rate) for n, k in shapes)


def gemm_memory_excess_s(rows: float, k: float, n: float, *, in_bytes: float,
                         out_bytes: float, bandwidth: float, rate: float) -> float:
    """Seconds a ``[rows, k] x [k, n]`` product takes beyond ``2 rows k n / rate`` because
    moving its operands and output through HBM at ``bandwidth`` takes longer (the roofline
    model: the larger of the two times, so 0 for a product above the ridge point)."""
    moved = in_bytes * (rows * k + k * n) + out_bytes * rows * n
    return max(0.0, moved / bandwidth - 2 * rows * n * k / rate)


def layer_forward_s(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig,
                    calibration: Calibration, *, moe: bool,
                    framework: str = "megatron") -> tuple[float, float]:
    """(whole layer, attention core) forward seconds of one layer for one micro-batch
    (``layer_forward``)."""
    parts = layer_forward(model, cluster, config, calibration, moe=moe, framework=framework)
    return parts.total_s, parts.core_s


def _tp_comm_per_layer_s(model: ModelSpec, config: ParallelConfig, link: coll.GroupLink,
                         calibration: Calibration, *, recompute: str, framework: str,
                         gemm_s: float = 0.0) -> float:
    """TP/SP collectives of one layer and micro-batch that the step waits for under the layer's
    ``recompute`` mode (``memory.layer_modes``): the forward's (twice under full
    recomputation), the backward's (``tp_comm_parts_s``) and, under torchtitan's per-op policy,
    the collectives its recomputation issues again (``tp_recompute_s``)."""
    forward, backward = tp_comm_parts_s(model, config, link, calibration, framework=framework,
                                        gemm_s=gemm_s)
    if recompute == "full":
        again = forward - (_last_tp_collective_s(model, config, link, calibration,
                                                 gemm_s=gemm_s)
                           if framework in DTENSOR_TP_FRAMEWORKS
                           and stops_early(framework, config) else 0.0)
    elif recompute == "op" and framework == "torchtitan":
        again = tp_recompute_s(model, config, link, calibration, gemm_s=gemm_s)
    else:
        again = 0.0
    return forward + again + backward


RING_MERGE_BYTES = 10
"""HBM bytes per element of a running fp32 accumulator that one ring-attention step merges
another block's partial result into: read the accumulator (4), read the block's 16-bit result
(2), write the accumulator (4). Forward: each step after the first rescales the output by its
log-sum-exp and adds the block's output (torch's ``_templated_ring_attention`` with its
``_SDPAMerger``; Transformer Engine's ``flash_attn_fwd_out_correction``; Liu et al. 2023, Ring
Attention, arXiv:2310.01889). Backward: each step adds the block's query, key and value
gradients into fp32 accumulators (``_templated_ring_attention_backward``)."""
RING_ROTATE_BYTES = 8
"""HBM bytes per element of the fp32 key and value gradients that a backward ring step copies
into the buffer it sends on (read 4, write 4), beside the merge."""
RING_CAST_BYTES = 6
"""Per element, the cast of an fp32 accumulator back to 16 bits once the ring is done: read
4, write 2 (the output after the forward; the three gradients after the backward)."""
RING_BALANCED_SHARE = 0.75
"""Share of a rank's queries (forward, and query gradients) or keys (key and value
gradients) a merge touches per step under the causal ring's load balancing: each rank holds
two half chunks, and each step after the first runs either every query against the first half
of the received keys or the second half of the queries against all of them (torch's
round-robin load balancer; Megatron-LM and Transformer Engine split the sequence alike), so
averaged over the ring's ranks half the steps touch everything and half touch half."""


def ring_attention_merge_s(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig,
                           calibration: Calibration, *, recompute: str, framework: str) -> float:
    """Seconds per layer and micro-batch that ring context parallelism spends merging its
    steps' partial results, beyond the attention FLOPs the layer already prices.

    The ring runs ``cp - 1`` steps after the first per pass, each merging into fp32
    accumulators (``RING_MERGE_BYTES``, over ``RING_BALANCED_SHARE`` of the rank's elements):
    the forward the output (query width), the backward the query, key and value gradients,
    whose key and value parts it also copies into the buffer it passes on
    (``RING_ROTATE_BYTES``); each accumulator is cast back once (``RING_CAST_BYTES``). Full
    recomputation runs the forward's merges again. The bytes scale with the rank's tokens times
    ``cp - 1`` while the attention FLOPs scale with its tokens times the whole sequence: an 8B
    Llama on 8 H100s (torchtitan) spends 1 % of its step on them at 256K tokens over cp 8,
    and 6 % at 8K over cp 8, which makes a ring of short chunks slower than data parallelism
    (without them the two tied). Keys and values keep their own width
    (``ModelSpec.kv_size``; torchtitan 0.2.2 calls SDPA with ``enable_gqa``). The all-gather
    and all-to-all exchanges run one attention over the whole sequence: none. Not
    counted: the kernel launches of the steps, and the log-sum-exp's own traffic (one value
    per token and head). Only the ring merges (``ParallelConfig.cp_comm_type`` ``p2p``)."""
    if config.cp == 1 or cp_exchange(framework, config.cp_comm_type) != "p2p" \
            or not config.flash_attention:
        return 0.0
    tokens = act.tokens_per_microbatch(config)
    q = tokens * model.q_size / config.tp
    kv = tokens * model.kv_size / config.tp
    steps = (config.cp - 1) * RING_BALANCED_SHARE
    forward = steps * RING_MERGE_BYTES * q + RING_CAST_BYTES * q
    backward = (steps * (RING_MERGE_BYTES * (q + 2 * kv) + RING_ROTATE_BYTES * 2 * kv)
                + RING_CAST_BYTES * (q + 2 * kv))
    passes = 2 if recompute == "full" else 1
    bandwidth = hbm_bytes_per_s(cluster, calibration)
    return (passes * forward + backward) / bandwidth


def sp_reorder_copies_s(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig,
                        calibration: Calibration, *, recompute: str, framework: str) -> float:
    """Seconds of one layer's copies that DTensor's sequence parallelism adds on the compute
    stream, per micro-batch, under ``recompute``.

    DTensor shards the hidden state ``[b, s, h]`` on the sequence (``Shard(1)``), while NCCL
    gathers and scatters along the leading dimension: torch's functional reduce-scatter first
    concatenates the input's sequence chunks along dimension 0, and its all-gather, which
    gathers into ``[tp b, s / tp, h]``, re-concatenates the chunks along the sequence
    (``torch.cat(torch.chunk(x, tp, 0), 1)``) unless that is a view, which it is for one
    sequence per micro-batch (``torch/distributed/_functional_collectives.py``,
    ``all_gather_single``, ``reduce_scatter_single``; earlier torch copied then too): such a
    copy reads and writes the whole gathered hidden state on the compute stream
    (``tests/costmodel/test_sp_copies.py`` counts them on 2 gloo ranks). Per layer: the
    forward's two all-gathers (block inputs; 1-byte elements under float8 TP) and two
    reduce-scatters (block outputs), the backward's mirror images (in the compute dtype), and
    what the recomputation runs again (full: the forward's, the last reduce-scatter skipped
    when it stops early; torchtitan's per-op policy: the two all-gathers). Megatron-LM keeps
    the sequence first (``[s, b, h]``), so its collectives need no such copy; nor do
    all-reduces (TP without SP)."""
    if framework not in DTENSOR_TP_FRAMEWORKS or config.tp == 1 or not config.sp:
        return 0.0
    gathered, size = _sp_state_bytes(model, config)
    copies_gathers = config.micro_batch_size > 1  # one sequence: the all-gather's cat is a view
    gather_copy = 2 * gathered if copies_gathers else 0.0  # read and written once
    scatter_copy = 2 * size
    forward = 2 * gather_copy + 2 * scatter_copy
    # backward: each all-gather's gradient is reduce-scattered, each reduce-scatter's gathered
    backward = 2 * scatter_copy + (2 * scatter_copy if copies_gathers else 0.0)
    if recompute == "full":
        again = forward - (scatter_copy if stops_early(framework, config) else 0.0)
    elif recompute == "op" and framework == "torchtitan":
        again = 2 * gather_copy
    else:
        again = 0.0
    return (forward + backward + again) / hbm_bytes_per_s(cluster, calibration)


def _fused_exposed_s(comm_s: float, gemm_s: float, tp: int) -> float:
    """What a collective fused with matmuls under async TP still exposes: torch's
    micro-pipelined ``fused_all_gather_matmul`` multiplies the rank's own shard while the
    first remote shard arrives and each later shard while the next one does (and
    ``fused_matmul_reduce_scatter`` the mirror image), so ``(tp - 1) / tp`` of the matmuls'
    time runs under the transfer and the rest of the transfer is waited for."""
    return max(0.0, comm_s - gemm_s * (tp - 1) / tp)


def _projection_shares(model: ModelSpec) -> dict[str, float]:
    """Each group of a dense layer's projections' share of its GEMM FLOPs (``layer_forward``'s
    split, ``moe=False``): ``qkv``, ``k``, ``o``, ``up`` (gate and up), ``up_one`` (one of
    them) and ``down``; the MLP's are 0 in MoE models (their experts are not tensor-parallel
    matmuls that async TP fuses)."""
    h, q, kv, ffn = model.hidden_size, model.q_size, model.kv_size, model.ffn_hidden_size
    mats = 3 if model.activation == "swiglu" else 2
    total = h * (2 * q + 2 * kv) + mats * h * ffn
    mlp = 0.0 if model.is_moe else 1.0
    return {"qkv": h * (q + 2 * kv) / total, "k": h * kv / total, "o": h * q / total,
            "up": mlp * (mats - 1) * h * ffn / total, "up_one": mlp * h * ffn / total,
            "down": mlp * h * ffn / total}


def _sp_collectives_s(model: ModelSpec, config: ParallelConfig, link: coll.GroupLink,
                      calibration: Calibration, *,
                      float8_gathers: bool = True) -> tuple[float, float]:
    """(all-gather, reduce-scatter) seconds of one SP collective of the layer's hidden state
    under DTensor: under float8 training the all-gathers move 1-byte elements
    (``tp_comm_parts_s``), unless ``float8_gathers`` is off (Transformer Engine gathers the
    compute dtype and casts after)."""
    gathered, size = _sp_state_bytes(model, config)
    if not float8_gathers:
        gathered = size
    effs = link_effs(calibration)
    return coll.all_gather_s(link, gathered, **effs), coll.reduce_scatter_s(link, size, **effs)


def _sp_state_bytes(model: ModelSpec, config: ParallelConfig) -> tuple[float, float]:
    """(forward all-gather, reduce-scatter) bytes of one SP collective's gathered hidden state
    (``b s h / cp`` elements): under float8 TP the forward all-gathers carry 1-byte elements."""
    size = act.hidden_state_bytes(model, config)
    return (size / config.bytes_per_activation if config.float8 else size), size


def _hidden_all_reduce_s(model: ModelSpec, config: ParallelConfig, link: coll.GroupLink,
                         calibration: Calibration) -> float:
    """Seconds of one all-reduce of the layer's hidden state (TP without SP)."""
    return coll.all_reduce_s(link, act.hidden_state_bytes(model, config),
                             **link_effs(calibration))


def _last_tp_collective_s(model: ModelSpec, config: ParallelConfig, link: coll.GroupLink | None,
                          calibration: Calibration, *, gemm_s: float) -> float:
    """The forward's last TP collective, which a recomputation that stops early does not run
    again (backward reads the down projection's input, not its output): with SP the MLP's
    reduce-scatter (under async TP what its fusion with w2 exposes), without SP its
    all-reduce."""
    if config.tp == 1 or link is None:
        return 0.0
    if not config.sp:
        return _hidden_all_reduce_s(model, config, link, calibration)
    _, scatter = _sp_collectives_s(model, config, link, calibration)
    if config.async_tp:
        return _fused_exposed_s(scatter, _projection_shares(model)["down"] * gemm_s, config.tp)
    return scatter


def tp_recompute_s(model: ModelSpec, config: ParallelConfig, link: coll.GroupLink | None,
                   calibration: Calibration, *, gemm_s: float = 0.0) -> float:
    """Seconds of the TP collectives torchtitan's per-op policy runs again in one layer's
    recomputation. Its save list (``_save_list`` in torchtitan's llama3 ``parallelize``, the
    same from December 2024 to 0.2.2) keeps every other matmul's output, SDPA's and the
    reduce-scatters', not the all-gathers': backward reads the gathered block inputs (the
    projections' weight gradients, and the recomputed wk and w3), so with SP both all-gathers
    run again (under async TP fused with the recomputed wk and w3, ``gemm_s`` the layer's
    forward GEMM seconds); without SP, the attention block's all-reduce does (the recomputed
    wo's output feeds the MLP norm, whose backward reads its input)."""
    if config.tp == 1 or link is None:
        return 0.0
    if not config.sp:
        return _hidden_all_reduce_s(model, config, link, calibration)
    gather, _ = _sp_collectives_s(model, config, link, calibration)
    if not config.async_tp:
        return 2 * gather
    share = _projection_shares(model)
    return sum(_fused_exposed_s(gather, share[key] * gemm_s, config.tp)
               for key in ("k", "up_one"))


def tp_comm_parts_s(model: ModelSpec, config: ParallelConfig, link: coll.GroupLink | None,
                    calibration: Calibration, *, framework: str,
                    gemm_s: float = 0.0) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's TP/SP collectives that the step waits for.

    Each collective moves the layer's hidden state (b s h / cp elements). The forward runs an
    all-reduce after the attention block and one after the MLP, or with SP an all-gather
    before and a reduce-scatter after each, at the same volume (Korthikanti et al. 2022,
    Sec. 4.2.2); the backward runs their conjugates.

    - DTensor tensor parallelism (torchtitan, meshplan's runtime) waits for every one of
      them. Under float8 training, torchao's ``Float8ColwiseParallel`` and
      ``Float8RowwiseParallel`` (which torchtitan applies with float8 linears) cast before
      gathering: the forward's all-gathers of the block inputs and the backward's all-gathers
      of the output gradients move 1-byte elements; the reduce-scatters stay in bf16.
    - torchtitan's async TP (``ParallelConfig.async_tp``, with SP) fuses, by torch's
      micro-pipeline pass (``torch._inductor.fx_passes.micro_pipeline_tp``), each all-gather
      with the matmuls that take its output as their left operand and each reduce-scatter
      with the matmul whose output it scatters (``_fused_exposed_s``; ``gemm_s`` is the
      layer's forward GEMM seconds, ``layer_forward``, split by FLOPs). Forward: the gather
      with wq, wk and wv, wo with its scatter, the gather with w1 and w3, w2 with its scatter.
      Backward: the gathered output gradients with the input-gradient matmuls of wo and w2;
      the input gradients of the column-parallel projections are summed before their
      reduce-scatter, which the pass does not match, so both reduce-scatters are waited for.
    - Megatron-LM's linear layers (also under DeepSpeed-Megatron) hide part of the backward's
      traffic behind the weight-gradient GEMM (the column-parallel input gradient's
      all-reduce, or with SP its reduce-scatter and the all-gather that rebuilds the saved
      input shard, are launched asynchronously). Their count, also the ``ideal`` framework's,
      is the one this project's calibration was fitted with (``benchmarks/fit_calibration.py``,
      Korthikanti et al.'s Table 4 layer times among its targets): the backward waits as long
      as the forward, and with SP each direction waits for one all-gather and one
      reduce-scatter, half the volume of the two all-reduces.
    """
    if config.tp == 1 or link is None:
        return 0.0, 0.0
    size = act.hidden_state_bytes(model, config)
    effs = link_effs(calibration)
    if framework == "megatron" and config.tp_comm_overlap and config.sp:
        return _megatron_overlapped_tp_s(model, config, link, calibration, gemm_s=gemm_s)
    if framework not in DTENSOR_TP_FRAMEWORKS:
        one = (coll.all_gather_s(link, size, **effs) + coll.reduce_scatter_s(link, size, **effs)
               if config.sp else 2 * coll.all_reduce_s(link, size, **effs))
        return one, one
    if not config.sp:
        all_reduces = 2 * coll.all_reduce_s(link, size, **effs)
        return all_reduces, all_reduces
    gather, scatter = _sp_collectives_s(model, config, link, calibration)
    if not (config.async_tp and framework == "torchtitan"):
        both = 2 * (gather + scatter)
        return both, both
    share, t = _projection_shares(model), config.tp
    backward = (_fused_exposed_s(gather, share["o"] * gemm_s, t)
                + _fused_exposed_s(gather, share["down"] * gemm_s, t) + 2 * scatter)
    return _fused_forward_s(gather, scatter, share, gemm_s, t), backward


def _fused_forward_s(gather: float, scatter: float, share: dict[str, float], gemm_s: float,
                     tp: int) -> float:
    """A layer's forward SP collectives each pipelined with its GEMM (``_fused_exposed_s``):
    the gathered block input with QKV, the attention projection with its scatter, the
    gathered MLP input with FC1 (and the gate), FC2 with its scatter."""
    return (_fused_exposed_s(gather, share["qkv"] * gemm_s, tp)
            + _fused_exposed_s(scatter, share["o"] * gemm_s, tp)
            + _fused_exposed_s(gather, share["up"] * gemm_s, tp)
            + _fused_exposed_s(scatter, share["down"] * gemm_s, tp))


def _megatron_overlapped_tp_s(model: ModelSpec, config: ParallelConfig, link: coll.GroupLink,
                              calibration: Calibration, *, gemm_s: float) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's SP collectives that Megatron-LM still waits
    for under Transformer Engine's TP overlap (``ParallelConfig.tp_comm_overlap``; TE's
    userbuffer ring exchange, ``te.pytorch.initialize_ub``): every all-gather and
    reduce-scatter runs in TP steps beside the chunks of the GEMM that reads or produces it,
    which hides ``(tp - 1) / tp`` of that GEMM's time (``_fused_exposed_s``, the same
    pipelining as torch's async TP). Forward: the gathered block input with QKV, the
    attention projection with its scatter, the gathered MLP input with FC1, FC2 with its
    scatter. Backward: the gathered output gradients with the input-gradient GEMMs of the
    projection and FC2, and the reduce-scatters of QKV's and FC1's input gradients with their
    weight-gradient GEMMs (as many FLOPs as the forward GEMM; ``gemm_s`` is the layer's
    forward GEMM seconds, ``layer_forward``, split by FLOPs)."""
    gather, scatter = _sp_collectives_s(model, config, link, calibration, float8_gathers=False)
    share, t = _projection_shares(model), config.tp
    backward = (_fused_exposed_s(gather, share["o"] * gemm_s, t)
                + _fused_exposed_s(gather, share["down"] * gemm_s, t)
                + _fused_exposed_s(scatter, share["qkv"] * gemm_s, t)
                + _fused_exposed_s(scatter, share["up"] * gemm_s, t))
    return _fused_forward_s(gather, scatter, share, gemm_s, t), backward


def _cp_comm_per_layer_s(model: ModelSpec, config: ParallelConfig, link: coll.GroupLink,
                         calibration: Calibration, *, attention_fwd_s: float,
                         framework: str = "megatron", recompute: str = "none") -> float:
    """Context parallelism's exposed traffic per layer, by its exchange
    (``frameworks.cp_exchange``): all-to-alls (``ulysses_per_layer_s``: DeepSpeed's, or
    Megatron-LM's ``a2a``), an all-gather of K and V (``cp_all_gather_per_layer_s``), or the
    ring's exchange of K and V chunks (forward) and of K, V, dK, dV (backward).

    Each of the cp - 1 ring steps passes this rank's K and V chunk to its ring neighbour and
    overlaps with that step's attention block (Liu et al. 2023, Ring Attention).
    """
    if config.cp == 1:
        return 0.0
    exchange = cp_exchange(framework, config.cp_comm_type)
    if exchange == "a2a":
        return ulysses_per_layer_s(model, config, link, calibration, recompute=recompute,
                                   repeated_kv=framework == "deepspeed")
    chunk = (config.bytes_per_activation * act.tokens_per_microbatch(config) * 2 * model.kv_size
             / config.tp)
    if exchange == "all_gather":
        return cp_all_gather_per_layer_s(config, link, calibration, chunk_bytes=chunk,
                                         recompute=recompute)
    bandwidth = coll.effective_bytes_per_s(link, **link_effs(calibration))
    step = chunk / bandwidth + link.latency_s
    fwd = (config.cp - 1) * step
    bwd = 2 * fwd
    hidden = (1 + BACKWARD_FACTOR) * attention_fwd_s
    return composition.exposed(fwd + bwd, hidden)


ULYSSES_FORWARD_ALL_TO_ALLS = 4
"""All-to-alls of one layer's forward under DeepSpeed-Ulysses: q, k and v from a sequence
split to a head split before attention, the attention output back after it (Jacobs et al.
2023, arXiv:2309.14509, Sec. 3; ``deepspeed.sequence.layer.DistributedAttention``). Backward
runs the same four on the gradients."""


def ulysses_per_layer_s(model: ModelSpec, config: ParallelConfig, link: coll.GroupLink,
                        calibration: Calibration, *, recompute: str = "none",
                        repeated_kv: bool = True) -> float:
    """Seconds per layer and micro-batch of DeepSpeed-Ulysses, the sequence parallelism that
    DeepSpeed runs for cp > 1 (``sequence_parallel_size``): ``ULYSSES_FORWARD_ALL_TO_ALLS``
    forward and as many backward, each over the cp group on a tensor of the rank's tokens
    times the query width of its tensor-parallel shard (Megatron-DeepSpeed repeats k and v to
    the query heads before attention, so the four are alike), and the forward's again under
    full recomputation. ``DistributedAttention`` issues them on the compute stream and waits
    for each (its overlap needs an ``sp_stream`` that Megatron-DeepSpeed does not pass), so
    all of it is exposed. Selective recomputation recomputes no attention under Ulysses
    (Megatron-DeepSpeed checkpoints the core attention only without it), so only full adds
    traffic. Megatron-LM's ``--cp-comm-type a2a`` (Transformer Engine) moves k and v at their
    own width (``repeated_kv`` False: grouped-query k and v are not repeated first)."""
    per_width = config.bytes_per_activation * act.tokens_per_microbatch(config) / config.tp
    effs = link_effs(calibration)

    def one(width: float) -> float:
        return coll.all_to_all_s(link, per_width * width, **effs)

    kv = model.q_size if repeated_kv else model.kv_size
    passes = 3 if recompute == "full" else 2
    # q and the attention output at the query width, k and v at theirs
    return passes * (2 * one(model.q_size)
                     + (ULYSSES_FORWARD_ALL_TO_ALLS - 2) * one(kv))


def cp_all_gather_per_layer_s(config: ParallelConfig, link: coll.GroupLink,
                              calibration: Calibration, *, chunk_bytes: float,
                              recompute: str = "none") -> float:
    """Seconds per layer and micro-batch of the all-gather exchange (``cp_comm_type``
    ``all_gather``: Megatron-LM's ``--cp-comm-type all_gather``; the context parallelism of
    Llama 3, Dubey et al. 2024, Sec. 3.3.2): the forward all-gathers every rank's K and V
    chunk (``chunk_bytes`` a rank) before its attention, the backward gathers them again and
    reduce-scatters their gradients, and full recomputation gathers once more. The gather
    precedes the attention that reads it, so the traffic is exposed (the paper's own account:
    small under grouped-query attention, whose K and V are a fraction of Q)."""
    effs = link_effs(calibration)
    gathered = config.cp * chunk_bytes
    gather = coll.all_gather_s(link, gathered, **effs)
    scatter = coll.reduce_scatter_s(link, gathered, **effs)
    gathers = 3 if recompute == "full" else 2
    return gathers * gather + scatter


def _ep_comm_per_layer_s(model: ModelSpec, config: ParallelConfig, link: coll.GroupLink,
                         calibration: Calibration) -> float:
    """Token dispatch and combine all-to-all per MoE layer: 2 forward, 2 backward."""
    if config.ep == 1:
        return 0.0
    size = (config.bytes_per_activation * act.tokens_per_microbatch(config) * model.moe_top_k
            * model.hidden_size / config.tp)
    one = coll.all_to_all_s(link, size, **link_effs(calibration))
    return 4 * one


def _pp_comm_s(model: ModelSpec, config: ParallelConfig, link: coll.GroupLink | None,
               calibration: Calibration, *, framework: str = "megatron") -> float:
    """Activation send forward and gradient send backward per micro-batch (v per chunk).

    With tp > 1 only 1/t of the tensor crosses stages (Narayanan et al. Sec. 4.1
    scatter/gather optimisation); the all-gather after it runs over NVLink and is ignored.
    megatron-core's interleaved schedule with ``ParallelConfig.overlap_comm``
    (``--overlap-p2p-communication``, on by default; core_r0.8.0
    ``forward_backward_pipelining_with_interleaving``) posts each chunk's sends and receives
    before computing the next chunk and waits for them only when that chunk needs its input:
    the v - 1 extra chunk boundaries of an interleaved stage run beside compute, and it waits
    as long as a non-interleaved stage does (whose 1F1B blocks on them), never less, so a
    stage's time per micro-batch does not fall with v (the planner's bounds rest on that).
    """
    if link is None:
        return 0.0
    chunks = 1 if framework == "megatron" and config.overlap_comm else config.vpp
    size = (config.bytes_per_activation * act.tokens_per_microbatch(config) * model.hidden_size
            / config.tp)
    one = coll.send_recv_s(link, size, **link_effs(calibration))
    return 2 * chunks * one * (1 - calibration.pp_overlap)


def calibrated_link(link: coll.GroupLink | None, calibration: Calibration,
                    gpu_key: str | None = None) -> coll.GroupLink | None:
    """``link`` with the collective library's per-step latencies on ``gpu_key``
    (``Calibration.library_hop_latency_s``), then the calibration's measured latency
    (``link_latency_s``), where given."""
    if link is None:
        return link
    hops = calibration.library_hops(gpu_key) if gpu_key is not None else {}
    if hops:
        link = coll.with_library_latency(link, hops)
    if calibration.link_latency_s:
        link = coll.with_latency(link, calibration.link_latency_s)
    return link


_CALIBRATED: dict[tuple[int, Links, str | None], tuple[Calibration, Links]] = {}
"""``calibrated_links`` results by (id of the calibration, links, GPU); each entry keeps its
calibration alive so that the id is not reused while the entry exists."""


def calibrated_links(links: Links, calibration: Calibration,
                     gpu_key: str | None = None) -> Links:
    """Every group of ``links`` through ``calibrated_link``; the pipeline link (a
    point-to-point send) without the library's collective step latencies. Cached: a
    calibration is not changed after it is made."""
    key = (id(calibration), links, gpu_key)
    hit = _CALIBRATED.get(key)
    if hit is not None and hit[0] is calibration:
        return hit[1]
    if len(_CALIBRATED) > 65536:
        _CALIBRATED.clear()
    out = _calibrated_links(links, calibration, gpu_key)
    _CALIBRATED[key] = (calibration, out)
    return out


def _calibrated_links(links: Links, calibration: Calibration, gpu_key: str | None) -> Links:
    return Links(tp=calibrated_link(links.tp, calibration, gpu_key),
                 cp=calibrated_link(links.cp, calibration, gpu_key),
                 dp=calibrated_link(links.dp, calibration, gpu_key),
                 ep=calibrated_link(links.ep, calibration, gpu_key),
                 pp_next=calibrated_link(links.pp_next, calibration))


def stage_microbatch_time(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig,
                          calibration: Calibration, stage: int, *, params: StageParams,
                          links: Links, framework: str) -> StageTime:
    """Seconds one micro-batch spends on ``stage`` (forward, backward, recompute, comm)."""
    if model.is_traced:
        pp_link = calibrated_link(_pp_link(cluster, config, stage, links), calibration)
        return _traced_microbatch_time(model, cluster, config, calibration, stage,
                                       layer_range=stage_layer_range(model, config, stage),
                                       params=params,
                                       links=calibrated_links(links, calibration,
                                                              cluster.gpu.key),
                                       pp_link=pp_link, framework=framework)
    costs = _stage_costs(model, cluster, config, calibration, stage, links, framework)
    compute, host_wait, tp, cp, ep = _layer_totals(model, config, costs, stage, framework)
    factor = calibration.compute_factor(framework)
    layers_compute = compute * factor
    compute = (compute + costs.head_s + costs.embedding_s) * factor
    tp *= 1 - calibration.tp_overlap
    return _stage_time(model, cluster, config, calibration, stage, params=params,
                       links=costs.links, framework=framework, compute=compute, tp=tp, cp=cp,
                       ep=ep, pp=costs.pp_s, layers_compute=layers_compute,
                       host_wait=host_wait * factor)


def stage_compute_s(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig,
                    calibration: Calibration, stage: int, *, framework: str) -> float:
    """``stage_microbatch_time(...).compute_s`` (the same number) without the traffic terms:
    what the planner's bounds of the once-per-step terms read."""
    if model.is_traced:
        return stage_microbatch_time(model, cluster, config, calibration, stage,
                                     params=stage_params(model, config, stage),
                                     links=stage_links(cluster, config, stage),
                                     framework=framework).compute_s
    costs = _stage_costs(model, cluster, config, calibration, stage, None, framework)
    compute = _layer_totals(model, config, costs, stage, framework)[0]
    return (compute + costs.head_s + costs.embedding_s) * calibration.compute_factor(framework)


def _layer_totals(model: ModelSpec, config: ParallelConfig, costs: "_StageCosts", stage: int,
                  framework: str) -> tuple[float, float, float, float, float]:
    """(compute, host wait, TP, CP, EP traffic) of the stage's transformer layers per
    micro-batch, before ``compute_factor`` and TP overlap."""
    layer_range = stage_layer_range(model, config, stage)
    modes = layer_modes(config, framework, stage, len(layer_range))
    groups: dict[tuple[bool, str], int] = {}
    if not model.is_moe and len(set(modes)) == 1:  # layers alike: one group
        groups[False, modes[0]] = len(modes)
    else:
        for index, layer_mode in zip(layer_range, modes):
            key = (model.is_moe_layer(index), layer_mode)
            groups[key] = groups.get(key, 0) + 1
    compute = tp = cp = ep = host_wait = 0.0
    for key, count in groups.items():
        layer = costs.layer(key)
        compute += count * layer.compute_s
        host_wait += count * layer.host_wait_s
        tp += count * costs.tp_layer_s(key[1])
        cp += count * layer.cp_s
        if key[0]:
            ep += count * costs.ep_layer_s
    return compute, host_wait, tp, cp, ep


@dataclass(frozen=True)
class _LayerCost:
    compute_s: float
    """Forward, backward and recomputation of one layer (before ``compute_factor``)."""
    cp_s: float
    """Its exposed context-parallel ring exchange, beyond the device's wait for the host."""
    host_wait_s: float = 0.0
    """Part of ``compute_s``: waiting for the host to issue the kernels."""


class _StageCosts:
    """What a stage's micro-batch costs per layer of each kind (MoE or dense, recompute mode)
    and once (the LM head, pipeline sends), with its calibrated links. None of it depends on
    how many or which layers the stage holds, on its recompute mode (the per-layer costs are
    kept by mode), on the ZeRO stage or on offload, so one instance serves every split,
    recompute, ZeRO and offload choice of a layout (``_stage_costs``)."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig,
                 calibration: Calibration, stage: int, links: Links, framework: str):
        self._args = (model, cluster, config, calibration, framework)
        # point-to-point sends keep the path latency (the library's ring-step latencies are
        # for collectives), so a pipeline hop across the spine still costs more than one
        # under a leaf
        pp_link = calibrated_link(_pp_link(cluster, config, stage, links), calibration)
        self.links = calibrated_links(links, calibration, cluster.gpu.key)
        self.ep_layer_s = _ep_comm_per_layer_s(model, config, self.links.ep, calibration)
        self.head_s = (_lm_head_s(model, cluster, config, calibration, framework=framework)
                       if stage == config.pp - 1 else 0.0)
        self.pp_s = _pp_comm_s(model, config, pp_link, calibration, framework=framework)
        # the word embedding's backward writes a dense gradient of the whole table
        self.embedding_s = (fresh_pages_s(cluster, calibration,
                                          model.vocab_rows * model.hidden_size / config.tp
                                          * config.bytes_per_activation)
                            if stage == 0 else 0.0)
        self._layers: dict[tuple[bool, str], _LayerCost] = {}
        self._tp: dict[str, float] = {}

    def tp_layer_s(self, mode: str) -> float:
        """TP/SP traffic of one layer of the stage recomputing under ``mode``
        (``memory.layer_modes``)."""
        hit = self._tp.get(mode)
        if hit is None:
            model, cluster, config, calibration, framework = self._args
            gemm = (layer_forward(model, cluster, config, calibration, moe=False,
                                  framework=framework).gemm_s
                    if (config.async_tp or config.tp_comm_overlap) and config.tp > 1 else 0.0)
            hit = self._tp[mode] = _tp_comm_per_layer_s(model, config, self.links.tp,
                                                        calibration, recompute=mode,
                                                        framework=framework, gemm_s=gemm)
        return hit

    def layer(self, key: tuple[bool, str]) -> _LayerCost:
        hit = self._layers.get(key)
        if hit is not None:
            return hit
        model, cluster, config, calibration, framework = self._args
        moe, layer_mode = key
        compute, host_wait, core = _layer_compute(model, cluster, config, calibration,
                                                  framework, moe, layer_mode)
        ring = _cp_comm_per_layer_s(model, config, self.links.cp, calibration,
                                    attention_fwd_s=core, framework=framework,
                                    recompute=layer_mode)
        # two paths run side by side: the host issuing the layer's kernels, and the device
        # running them and stalling where the ring's exchange is late; the layer takes the
        # longer, max(host, kernels + stall) = kernels + wait + max(0, stall - wait): the
        # device's wait for the host absorbs the stall (in the scaled time of ``compute``)
        wait = host_wait * calibration.compute_factor(framework)
        cost = _LayerCost(compute_s=compute, host_wait_s=host_wait,
                          cp_s=max(0.0, ring - wait))
        self._layers[key] = cost
        return cost


LAYER_COMPUTE_FIELDS = (*LAYER_FIELDS, "ep", "recompute_early_stop", "float8_recipe",
                        "attention_kernel", "cp_comm_type")
"""The ``ParallelConfig`` fields one layer's compute (``_layer_compute``) depends on: its
activations' (``memory.LAYER_FIELDS``), the expert split of its weight gradients, whether
full recomputation stops early, which fused attention kernel runs and how context parallelism
exchanges keys and values (a ring merges, and calls the kernel on one chunk)
(tests/costmodel/test_stage_costs_cache.py checks that no other field changes it)."""
_layer_compute_fields = operator.itemgetter(*LAYER_COMPUTE_FIELDS)
_LAYER_COMPUTE: dict[tuple, tuple[tuple, tuple[float, float, float]]] = {}
"""``_layer_compute`` by (ids of model, cluster and calibration, framework, moe, mode,
``LAYER_COMPUTE_FIELDS``); each entry keeps those three objects alive so that their ids are not
reused while it exists."""


def _layer_compute(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig,
                   calibration: Calibration, framework: str, moe: bool,
                   mode: str) -> tuple[float, float, float]:
    """(compute, host wait, attention core forward) seconds of one layer and micro-batch under
    recompute ``mode``, before ``compute_factor``; cached: every stage and layout with the
    same per-layer fields shares them."""
    owners = (model, cluster, calibration)
    key = (id(model), id(cluster), id(calibration), framework, moe, mode,
           _layer_compute_fields(config.__dict__))
    hit = _held(_LAYER_COMPUTE, key, owners)
    if hit is not None:
        return hit
    parts = layer_forward(model, cluster, config, calibration, moe=moe, framework=framework)
    saves_attention = framework != "torchtitan" or cluster.gpu.key != CPU_DEVICE_KEY
    extra = recompute.recompute_s(parts, mode, framework=framework,
                                  saves_attention=saves_attention,
                                  early_stop=recompute.stops_early(framework, config))
    if config.flash_attention:
        extra += (FLASH_BACKWARD_FACTOR - BACKWARD_FACTOR) * parts.core_s
    # the backward writes the layer's weight gradients into fresh tensors
    extra += fresh_pages_s(cluster, calibration, layer_rank_params(model, config, moe=moe)
                           * config.bytes_per_activation)
    compute = (1 + BACKWARD_FACTOR) * parts.total_s + extra
    # DTensor's sequence-parallel collectives re-lay the hidden state out on the compute stream
    compute += sp_reorder_copies_s(model, cluster, config, calibration, recompute=mode,
                                   framework=framework)
    compute += ring_attention_merge_s(model, cluster, config, calibration, recompute=mode,
                                      framework=framework)
    device = calibration.device(cluster.gpu.key)
    compute += checkpoint_host_s(device.op_overhead_s, mode, framework=framework,
                                 compiled=config.compile != "none")
    host_wait = 0.0
    if device.host_op_s and eager_kernels(framework):
        # the host issues the layer's kernels while the device runs earlier ones: the
        # slower of the two sets the pace (``compute_factor`` scales kernels, not host)
        host = (COMPILED_HOST_OPS if config.compile != "none"
                else HOST_OP_EQUIVALENTS)[mode] * device.host_op_s
        host_wait = max(0.0, host / calibration.compute_factor(framework) - compute)
        compute += host_wait
    return _hold(_LAYER_COMPUTE, key, owners, (compute, host_wait, parts.core_s))


def _held(cache: dict, key: tuple, owners: tuple):
    """The value ``_hold`` keeps under ``key`` (which holds the ids of ``owners``), or None."""
    hit = cache.get(key)
    return hit[1] if hit is not None and hit[0] == owners else None


def checkpoint_host_s(op_overhead_s: float, mode: str, *, framework: str,
                      compiled: bool) -> float:
    """Host seconds the CPU device spends per layer and micro-batch in the selective-checkpoint
    dispatch modes of an eager framework's per-op policy (``op``: torch runs Python for every
    op of the forward and of its recomputation), beyond the operators it reruns.

    The layer's plain operators are priced at ``op_overhead_s`` each
    (``EAGER_OPS_PER_LAYER`` in the forward, ``BACKWARD_FACTOR`` times that in the backward,
    and the recomputed forward's again: ``recompute.recompute_s``); ``HOST_OP_EQUIVALENTS``
    gives the measured host work of ``op`` over ``none``'s on one CPU thread (4.57x,
    ``benchmarks/host_ops.py``): what that leaves over the operators already priced is
    charged here. On the CPU the host work is serial, so it adds; a GPU's host overlaps its
    kernels instead (``DeviceCalibration.host_op_s``, ``_layer_compute``). Not charged for
    ``full``: its measured 2.33x is mostly the recomputed operators, and the CPU's step
    measurements disagree on the rest (the tiny model's one-process full-recompute step was
    predicted 0.95x of its 2026-11-30 measurement, its dp 2 ZeRO-3 one 1.6-1.8x of today's,
    where the plain plans ran 0.8x and 1.4x). 0 on GPUs (``op_overhead_s`` 0) and compiled."""
    if not op_overhead_s or compiled or not eager_kernels(framework) or mode != "op":
        return 0.0
    plain = (1 + BACKWARD_FACTOR) * EAGER_OPS_PER_LAYER
    measured = plain * HOST_OP_EQUIVALENTS["op"] / HOST_OP_EQUIVALENTS["none"]
    priced = plain + EAGER_OPS_PER_LAYER  # the recomputed forward's operators
    return max(0.0, measured - priced) * op_overhead_s


def _hold(cache: dict, key: tuple, owners: tuple, value):
    """Keeps ``value`` under ``key`` with ``owners`` alive, so that their ids are not reused
    while the entry exists (models, clusters and calibrations are not changed after they are
    made); empties ``cache`` past 65,536 entries. Returns ``value``."""
    if len(cache) > 65536:
        cache.clear()
    cache[key] = (owners, value)
    return value


_SPLIT_FREE = frozenset({"layers_per_stage", "recompute", "zero_stage", "offload",
                         "offload_device"})
"""``ParallelConfig`` fields a ``_StageCosts`` does not depend on."""
_COST_FIELDS: tuple[str, ...] = tuple(f for f in ParallelConfig.__dataclass_fields__
                                      if f not in _SPLIT_FREE)
_cost_fields = operator.itemgetter(*_COST_FIELDS)
_STAGE_COSTS: dict[tuple, tuple[tuple, _StageCosts]] = {}
"""``_StageCosts`` by (ids of model, cluster and calibration, framework, stage, the fields of
the config it depends on); each entry keeps those three objects alive so that
their ids are not reused while it exists."""


def _stage_costs(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig,
                 calibration: Calibration, stage: int, links: Links | None,
                 framework: str) -> _StageCosts:
    """The cached ``_StageCosts`` of ``stage`` under ``config`` (models, clusters and
    calibrations are not changed after they are made); ``links``: the stage's
    (``stage_links``), found here if None and needed."""
    owners = (model, cluster, calibration)
    key = (id(model), id(cluster), id(calibration), framework, stage,
           _cost_fields(config.__dict__))
    hit = _held(_STAGE_COSTS, key, owners)
    if hit is not None:
        return hit
    if links is None:
        links = stage_links(cluster, config, stage)
    return _hold(_STAGE_COSTS, key, owners,
                 _StageCosts(model, cluster, config, calibration, stage, links, framework))


def prefetches_blocks(framework: str, config: ParallelConfig) -> bool:
    """Whether the framework's ZeRO-2/3 collectives are per-block and issued ahead of use on
    their own stream: FSDP2 (torchtitan; meshplan's runtime) all-gathers block k+1 while block
    k computes and reduce-scatters block k's gradients while block k-1's backward runs
    (``fully_shard``'s implicit prefetching), so their bytes and their ring latency overlap
    compute up to ``DeviceCalibration.prefetch_overlap`` of it. DeepSpeed's ZeRO-3 fetches
    module by module, one ahead of compute (``deepspeed_zero3_traffic``)."""
    return framework in ("torchtitan", "meshplan") and config.zero_stage >= 2


def _stage_time(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig,
                calibration: Calibration, stage: int, *, params: StageParams, links: Links,
                framework: str, compute: float, tp: float, cp: float, ep: float,
                pp: float, layers_compute: float | None = None,
                host_wait: float = 0.0) -> StageTime:
    """A stage's ``StageTime`` from its compute and TP/CP/EP/PP traffic: adds the ZeRO and
    parameter-offload traffic (with the part compute hides) and every collective call's cost.
    ``layers_compute``: the part of ``compute`` its transformer layers take (default all);
    ``host_wait``: the part of ``compute`` spent waiting on the host."""
    mode = config.stage_recompute(stage)
    zero = _zero_per_microbatch_s(config, calibration, params=params, link=links.dp,
                                  framework=framework, recompute=mode)
    offload, blocking = _param_offload_per_microbatch_s(config, cluster, params=params,
                                                        calibration=calibration,
                                                        framework=framework)
    calls = collective_calls_per_microbatch(model, config, stage, framework=framework,
                                            recompute=mode)
    tp_calls_s, pp_calls_s, zero_calls_s = call_overhead_s(calls, config, calibration,
                                                           cluster.gpu.key)
    tp, pp = tp + tp_calls_s, pp + pp_calls_s
    network_latency = zero_call_latency_s(calls, links.dp) if zero else 0.0
    zero_calls_s += _zero_fresh_pages_s(config, cluster, calibration, params=params,
                                        framework=framework, recompute=mode)
    zero_calls_s += fsdp2_accumulate_s(config, cluster, calibration, params=params,
                                       framework=framework)
    device = calibration.device(cluster.gpu.key)
    if zero and framework == "deepspeed" and config.zero_stage == 3:
        # DeepSpeed's own gather path, one module ahead of compute: bytes and latency alike
        zero, exposed = deepspeed_zero3_traffic(
            model, config, calibration, params=params, link=links.dp, recompute=mode,
            layers=len(stage_layer_range(model, config, stage)),
            layers_compute=compute if layers_compute is None else layers_compute)
        hidden, zero_latency = zero - exposed, zero_calls_s
    elif device.prefetch_overlap is not None and prefetches_blocks(framework, config):
        # the next block's gather is in flight while this one computes: its latency hides
        # too, and it costs the compute beside it: while it moves bytes (time b), the ring's
        # HBM traffic, rate c = ``prefetch_contention`` (c b is that traffic's HBM time, the
        # same at any link rate); over its calls' latency l, which moves no bytes, the
        # link-independent share s = ``DeviceCalibration.prefetch_contention`` (the SMs its
        # kernels hold while they wait). Paid outright: p = c b + s l; what compute h does
        # not hide is exposed: ``p + max(0, b + l - p - h)`` = ``max(p, b + l - h)``, which
        # never falls when a link gets slower
        held = device.prefetch_contention
        paid = prefetch_contention(cluster, calibration, links.dp) * zero + held * network_latency
        zero = zero + network_latency - paid
        hidden = device.prefetch_overlap * compute
        zero_latency = zero_calls_s + paid
    else:
        zero_latency = zero_calls_s + network_latency
        hidden = calibration.dp_overlap * compute
    return StageTime(compute_s=compute, tp_comm_s=tp, cp_comm_s=cp, ep_comm_s=ep,
                     pp_comm_s=pp, zero_comm_s=zero,
                     zero_hidden_s=hidden if zero else 0.0,
                     offload_raw_s=offload,
                     offload_hidden_s=calibration.offload_overlap * compute if offload else 0.0,
                     zero_latency_s=zero_latency, host_wait_s=host_wait,
                     offload_wait_s=blocking)


def prefetch_contention(cluster: ClusterSpec, calibration: Calibration,
                        link: coll.GroupLink) -> float:
    """Fraction of the time it moves bytes that an overlapped FSDP-style prefetched collective
    of the group ``link`` costs the compute it runs beside (``DeviceCalibration``).

    With ``prefetch_contention_bytes`` (k): the ring's HBM traffic, k bytes for every byte it
    moves on its links, competes with the GEMMs for the device's memory, so the cost is that
    traffic's HBM time, ``min(1, k * bus / hbm)`` of the bytes' time: ``bus`` the ring's bytes
    per second (``collectives.effective_bytes_per_s``: the slower of the in-node link and the
    node's parallel NIC channels), ``hbm`` the device's achieved HBM bandwidth. A ring inside a
    node, or one spanning nodes with every GPU's own NIC in parallel, runs at NVLink-class
    rates (0.15-0.25 of HBM's on DGX-class nodes); a group of one rank per node (FSDP under
    TP 8) runs at one NIC's rate and costs a few percent. Without it, the fixed
    ``prefetch_contention``. The calls' latency costs ``prefetch_contention`` either way
    (``_stage_time``); Megatron-LM's overlapped data-parallel traffic shrinks its window by
    this fraction (``dp_step_s``)."""
    device = calibration.device(cluster.gpu.key)
    if device.prefetch_contention_bytes is None or link.size < 2:
        return device.prefetch_contention
    bus = coll.effective_bytes_per_s(link, **link_effs(calibration))
    hbm = hbm_bytes_per_s(cluster, calibration)
    return min(1.0, device.prefetch_contention_bytes * bus / hbm)


def traced_layer_s(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig,
                   calibration: Calibration, index: int) -> tuple[float, float]:
    """(forward, backward) seconds of traced layer ``index`` for one micro-batch.

    Matmul and attention FLOPs (as traced) at the calibrated matmul efficiency; element-wise
    kernels move the layer's saved bytes through HBM (``elementwise_traffic_factor``, as for an
    analytic layer), twice as much in the backward; each ATen operator the trace counted
    (``TracedLayer.fwd_ops``, ``bwd_ops``) costs the device's ``op_overhead_s``, as an
    analytic eager layer's ``EAGER_OPS_PER_LAYER`` do."""
    device = calibration.device(cluster.gpu.key)
    peak = cluster.gpu.peak(config.dtype)
    fwd_flop, bwd_flop = traced.layer_flop(model, config, index)
    bandwidth = hbm_bytes_per_s(cluster, calibration)
    elementwise = (calibration.elementwise_traffic_factor
                   * traced.layer_saved_bytes(model, config, index, "none") / bandwidth)
    layer = model.traced[index]
    fwd = _gemm_s(fwd_flop, 0, peak=peak, efficiency=device.matmul_efficiency,
                  overhead_s=0.0) + elementwise + layer.fwd_ops * device.op_overhead_s
    bwd = _gemm_s(bwd_flop, 0, peak=peak, efficiency=device.matmul_efficiency,
                  overhead_s=0.0) + BACKWARD_FACTOR * elementwise \
        + layer.bwd_ops * device.op_overhead_s
    return fwd, bwd


def _traced_microbatch_time(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig,
                            calibration: Calibration, stage: int, *, layer_range: range,
                            params: StageParams, links: Links, pp_link: coll.GroupLink | None,
                            framework: str) -> StageTime:
    """A traced model's stage: its layers' own compute; no TP, CP or EP traffic."""
    mode = config.stage_recompute(stage)
    factor = calibration.compute_factor(framework)
    compute = host_wait = 0.0
    for i in layer_range:
        fwd, bwd = traced_layer_s(model, cluster, config, calibration, i)
        kernels = (fwd + bwd + (fwd if mode == "full" else 0.0)) * factor
        wait = max(0.0, traced_host_s(model, cluster, config, calibration, i, mode) - kernels)
        compute += kernels + wait
        host_wait += wait
    pp = 0.0
    if pp_link is not None:
        one = coll.send_recv_s(pp_link, traced.boundary_bytes(model, config),
                               **link_effs(calibration))
        pp = 2 * one * (1 - calibration.pp_overlap)
    return _stage_time(model, cluster, config, calibration, stage, params=params, links=links,
                       framework=framework, compute=compute, tp=0.0, cp=0.0, ep=0.0, pp=pp,
                       host_wait=host_wait)


def traced_host_s(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig,
                  calibration: Calibration, index: int, mode: str) -> float:
    """Host seconds of traced layer ``index``'s forward and backward for one micro-batch on a
    GPU: the ATen operators the trace counted (``TracedLayer.fwd_ops`` + ``bwd_ops``, the
    unit ``HOST_OP_EQUIVALENTS`` counts in) at ``DeviceCalibration.host_op_s`` each, times
    ``HOST_OP_EQUIVALENTS``' measured ratio of ``mode`` to ``none`` (full recomputation runs
    the forward again under torch's checkpoint). The device runs queued kernels while the
    host issues the next, so the layer takes the larger of this and its kernels' time
    (``_traced_microbatch_time``), as an analytic eager layer does. A traced model is the
    user's own eager module under every framework, so the floor holds for all of them; 0
    where it is compiled (its compiled graphs' kernel count is not traced) and on the CPU
    (``host_op_s`` 0: its serial host work is ``op_overhead_s``, in ``traced_layer_s``)."""
    host_op_s = calibration.device(cluster.gpu.key).host_op_s
    if not host_op_s or config.compile != "none":
        return 0.0
    layer = model.traced[index]
    scale = HOST_OP_EQUIVALENTS.get(mode, HOST_OP_EQUIVALENTS["none"]) \
        / HOST_OP_EQUIVALENTS["none"]
    return (layer.fwd_ops + layer.bwd_ops) * scale * host_op_s


def _lm_head_s(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig,
               calibration: Calibration, *, framework: str = "megatron") -> float:
    """LM head matmul forward + backward and the fp32 cross-entropy passes over the logits
    (Megatron-LM's vocabulary-parallel cross entropy, unfused or fused:
    ``MEGATRON_CE_BYTES``, ``MEGATRON_FUSED_CE_BYTES``; eager frameworks: the unfused loss's
    own traffic, ``eager.loss_bytes``, or a compiled or fused kernel's,
    ``eager.FUSED_LOSS_BYTES_PER_LOGIT``), and its weight gradient's fresh pages
    (``fresh_pages_s``)."""
    device = calibration.device(cluster.gpu.key)
    tokens = act.tokens_per_microbatch(config)
    flop = tokens * lm_head_flop_per_token(model) / config.tp
    # a float8 head (``ParallelConfig.float8_head``) runs at the float8 peak, as the blocks'
    # float8 linears do, and pays its casts
    gemm = _gemm_s((1 + BACKWARD_FACTOR) * flop, 3,
                   peak=cluster.gpu.peak("fp8" if config.float8_head else config.dtype),
                   efficiency=(device.gemm_efficiency(eager_kernels(framework))
                               * device.row_efficiency(tokens)),
                   overhead_s=device.matmul_overhead_s)
    logits = tokens * model.vocab_rows / config.tp
    bandwidth = hbm_bytes_per_s(cluster, calibration)
    if config.float8_head:
        gemm += eager.float8_head_cast_bytes(model, config, tokens=tokens) / bandwidth
    host_ops = (1 + BACKWARD_FACTOR) * EAGER_OPS_HEAD * device.op_overhead_s
    weight_grad = fresh_pages_s(cluster, calibration, model.vocab_rows * model.hidden_size
                                / config.tp * config.bytes_per_activation)
    if eager_kernels(framework) and config.fused_loss_kernel:
        loss = eager.FUSED_LOSS_BYTES_PER_LOGIT * logits
    elif eager_kernels(framework):
        loss = eager.loss_bytes(config, logits)
    else:  # Megatron-LM's vocabulary-parallel cross entropy (DeepSpeed-Megatron's too)
        loss = (MEGATRON_FUSED_CE_BYTES if config.cross_entropy_fusion
                else MEGATRON_CE_BYTES) * logits
    return gemm + loss / bandwidth + host_ops + weight_grad


MEGATRON_CE_BYTES = 52
"""HBM bytes per logit of Megatron-LM's vocabulary-parallel cross entropy on its bf16 logits,
operator by operator (megatron-core ``tensor_parallel/cross_entropy.py``, core_r0.8.0; the
same operators as 2021's ``vocab_parallel_cross_entropy``): forward, the fp32 upcast (read 2,
write 4), the maximum (read 4), the in-place shift (read and write 4), the in-place
exponential (8), its sum (4), the in-place normalisation (8): 38; backward, the gradient
scaled in place (8) and cast back to bf16 for the output layer (read 4, write 2): 14. Until
2026-12-06 the loss took the fitted element-wise factor's 2 bytes (0.5 x 4), which left it at
a twentieth of this and priced big-vocabulary small models too fast (Megatron-Core's 1.7B
with 131,072 rows over hidden 2048: -16 %, now -5 %)."""
MEGATRON_FUSED_CE_BYTES = 28
"""The same with ``--cross-entropy-loss-fusion`` (megatron-core
``fusions/fused_cross_entropy.py``, each step a ``jit_fuser`` region): the upcast with the
maximum (read 2, write 4), the shift with the exponential and its sum (read 4, write 4), the
normalisation (8); backward, the gradient with its cast to bf16 (read 4, write 2)."""


def grad_comm_bytes(framework: str, dtype: str, *, reduce_bytes: int = 4) -> int:
    """Bytes per gradient element on the wire: fp32 for Megatron (main grads) and meshplan's
    FSDP2/DDP; torchtitan's FSDP reduce-scatter's ``reduce_bytes``
    (``ParallelConfig.grad_reduce_bytes``; its callers pass it for ZeRO-2/3 only, fp32
    otherwise); the compute dtype for DeepSpeed and ``ideal``."""
    if framework == "torchtitan":
        return reduce_bytes
    if dtype == "fp32" or framework in ("megatron", "meshplan"):
        return 4
    return 2


def _zero_per_microbatch_s(config: ParallelConfig, calibration: Calibration, *,
                           params: StageParams, link: coll.GroupLink, framework: str,
                           recompute: str) -> float:
    """Bytes-bound ZeRO-2/3 traffic of one micro-batch: gradient reduce-scatter (2, 3) and the
    parameter all-gathers of every pass that gathers (3: ``calls.zero3_gather_passes``), at
    the ring's bandwidth. The calls' latency is charged apart (``calls.zero_call_latency_s``),
    once per call the framework issues. Up to ``dp_overlap`` of the micro-batch's compute
    can hide the traffic. None per micro-batch where FSDP2 syncs once per step inside a
    pipeline stage (``calls.fsdp2_syncs_once_per_step``; ``dp_step_s`` charges it)."""
    if (config.zero_stage < 2 or link.size == 1
            or fsdp2_syncs_once_per_step(framework, config)):
        return 0.0
    effs = link_effs(calibration)
    total = params.dense + params.expert
    comm = _bandwidth_s("reduce_scatter", link,
                        total * grad_comm_bytes(framework, config.dtype,
                                                reduce_bytes=config.grad_reduce_bytes),
                        **effs)
    if config.zero_stage == 3:
        passes = zero3_gather_passes(framework, config, recompute)
        comm += passes * _bandwidth_s("all_gather", link,
                                      zero3_gather_bytes(config, params, framework=framework),
                                      **effs)
    return comm


def zero3_gather_bytes(config: ParallelConfig, params: StageParams, *,
                       framework: str = "torchtitan") -> float:
    """Bytes one ZeRO-3 all-gather pass of a stage moves: its parameters in the compute dtype,
    except under float8 training, where torchtitan gathers the blocks' float8 linears' weights
    already cast to float8 (``enable_fsdp_float8_all_gather``; 1 byte; the blocks' norm
    weights, a few thousandths of a percent of a block, are counted with them). Experts are
    not float8 linears (``eager.float8_cast_bytes``). A float8 LM head
    (``ParallelConfig.float8_head``) is gathered in float8 too. Other frameworks gather in
    the compute dtype (Transformer Engine casts after the gather)."""
    total = params.dense + params.expert
    if config.float8 and framework == "torchtitan":
        bf16 = params.root + params.expert - (params.head if config.float8_head else 0.0)
        return bf16 * config.bytes_per_activation + (total - bf16)
    return total * config.bytes_per_activation


def deepspeed_zero3_traffic(model: ModelSpec, config: ParallelConfig, calibration: Calibration,
                            *, params: StageParams, link: coll.GroupLink, layers: int,
                            layers_compute: float, recompute: str) -> tuple[float, float]:
    """(all, exposed) seconds of one micro-batch's DeepSpeed ZeRO-3 traffic on a stage.

    DeepSpeed fetches a module's partitioned parameters when the module runs and, from its
    recorded trace, issues the next module's gathers as it starts, so each module's compute
    hides (at most) the gathers of the module after it, and the next module waits for them
    (``PartitionedParameterCoordinator.prefetch_next_sub_modules``: the prefetch stops once
    ``stage3_prefetch_bucket_size`` elements are in flight, which one linear module of a large
    model exceeds alone). A pass over a layer's fetch batches (``calls.zero3_fetch_batches``,
    forward order; backward the reverse, each module's gradient reduce-scattered while the
    next one computes) takes ``sum_k max(c_k, g_(k+1))``: compute ``c_k`` is the layer's
    split by the batches' parameter shares (GEMM FLOPs), and the last module's compute hides
    the next layer's first gather. Passes: forward, the recomputed forward of full
    recomputation, backward (``calls.zero3_gather_passes``). An end stage's embedding or head
    is gathered and reduced unhidden.

    One batch of ``e`` elements in ``k`` tensors over ``n`` ranks takes the slower of the
    library's ring (bytes at its bandwidth plus each call's ring latency) and the framework's
    own path, ``e * bytes / zero3_path_bytes_per_s + k n zero3_path_rank_s``
    (``Calibration``). Every term is linear in the stage's layers (layers alike), as the
    planner's tables need."""
    effs = link_effs(calibration)
    rate = calibration.zero3_path_bytes_per_s.get("deepspeed")
    rank_s = calibration.zero3_path_rank_s.get("deepspeed", 0.0)

    def batch(op: str, elements: float, tensors: int, width: int) -> float:
        if elements <= 0:
            return 0.0
        nbytes = elements * width
        ring = (_bandwidth_s(op, link, nbytes, **effs)
                + tensors * coll.call_latency_s(op, link))
        path = (nbytes / rate if rate else 0.0) + tensors * link.size * rank_s
        return max(ring, path)

    act, grad = config.bytes_per_activation, grad_comm_bytes("deepspeed", config.dtype)
    edges = params.root
    passes = zero3_gather_passes("deepspeed", config, recompute)
    edge_s = (passes * batch("all_gather", edges, 1, act)
              + batch("reduce_scatter", edges, 1, grad))
    if layers <= 0:
        return edge_s, edge_s
    # the layers' parameters, split in the batches' proportions (the persistent norms and
    # biases, under 1e-4 of a large layer, ride along; MoE layers' experts likewise)
    per_layer = (params.dense + params.expert - edges) / layers
    shape = ((1.0, 1),) if model.is_traced else zero3_fetch_batches(model, config)
    total = sum(e for e, _ in shape)
    shares = [e / total for e, _ in shape]
    gathers = [batch("all_gather", share * per_layer, k, act)
               for share, (_, k) in zip(shares, shape)]
    reduces = [batch("reduce_scatter", share * per_layer, k, grad)
               for share, (_, k) in zip(shares, shape)]
    compute = layers_compute / layers
    recomputed = 1 if recompute == "full" else 0
    forward = compute / (1 + recomputed + BACKWARD_FACTOR)
    backward = compute - (1 + recomputed) * forward
    size = len(shape)
    forward_pass = sum(max(forward * shares[k], gathers[(k + 1) % size])
                       for k in range(size))
    backward_pass = sum(max(backward * shares[k], gathers[k - 1] + reduces[k])
                        for k in range(size))
    exposed = (1 + recomputed) * (forward_pass - forward) + backward_pass - backward
    traffic = passes * sum(gathers) + sum(reduces)
    return layers * traffic + edge_s, layers * exposed + edge_s


def _zero_fresh_pages_s(config: ParallelConfig, cluster: ClusterSpec,
                        calibration: Calibration, *, params: StageParams, framework: str,
                        recompute: str) -> float:
    """Fresh pages of one micro-batch's ZeRO-2/3 buffers (``fresh_pages_s``): FSDP2 writes
    every gather twice (the all-gather output, then the copy out into the unsharded
    parameters) and builds every reduce-scatter input anew (``fully_shard``'s
    ``foreach_all_gather`` / ``foreach_reduce``). 0 without ZeRO-2/3 or data parallelism."""
    if (config.zero_stage < 2 or config.dp * config.cp == 1
            or calibration.device(cluster.gpu.key).fresh_page_bytes_per_s is None):
        return 0.0  # the planner's hot path: GPUs return here
    total = params.dense + params.expert
    gathers = zero3_gather_passes(framework, config, recompute) if config.zero_stage == 3 \
        else 1
    nbytes = total * (2 * gathers * config.bytes_per_activation
                      + grad_comm_bytes(framework, config.dtype,
                                        reduce_bytes=config.grad_reduce_bytes))
    if fsdp2_syncs_once_per_step(framework, config):  # once per step, spread over its
        nbytes /= config.grad_accum_steps              # micro-batches
    return fresh_pages_s(cluster, calibration, nbytes)


def _bandwidth_s(op: str, link: coll.GroupLink, size_bytes: float, *, intra_eff: float,
                 inter_eff: float) -> float:
    """The bytes-bound part of one ring ``op`` (all-gather, reduce-scatter) of ``size_bytes``:
    its time less one call's latency."""
    return (coll.link_collective_s(op, link, size_bytes, intra_eff=intra_eff,
                                   inter_eff=inter_eff) - coll.call_latency_s(op, link))


FSDP2_HOST_PARAM_BYTES = 4
"""Bytes per parameter FSDP2's CPU offload copies to the device for an all-gather: the host
shard in its own dtype, the fp32 master, cast to the compute dtype only on the device
(torch/distributed/fsdp/_fully_shard/_fsdp_param.py ``all_gather_inputs``)."""
FSDP2_HOST_GRAD_BYTES = 4
"""Bytes per parameter of the reduce-scattered gradient FSDP2's CPU offload copies to the host
each backward: the reduce dtype, fp32 for meshplan's runtime (runtime/parallelize.py) and, by
default, torchtitan (``mixed_precision_reduce`` float32; ``ParallelConfig.grad_reduce_dtype``)."""
HOST_GRAD_ADD_BYTES = 12
"""Host memory traffic per parameter of adding a micro-batch's fp32 gradient shard to the
earlier ones': both read, one written."""


HOST_CLIP_BYTES_PER_PARAM = {"meshplan": 16, "torchtitan": 12}
"""Host memory traffic per parameter of global-norm gradient clipping where FSDP2's CPU
offload leaves the fp32 gradients in host memory: the norm reads them (4 bytes), the scaling
reads and writes them (8); meshplan's runtime then reads them once more for the norm it logs
after clipping (runtime/recipe.py ``global_grad_norm``, ``clip_grads``; runtime/train.py),
torchtitan does not (``clip_grad_norm_``, ``max_norm`` 1.0 by default)."""


def fsdp2_cpu_offload(framework: str, config: ParallelConfig, cluster: ClusterSpec) -> bool:
    """Whether parameter offload is FSDP2's ``CPUOffloadPolicy`` on a GPU: meshplan's runtime
    and torchtitan. On the CPU device the host-device copies are no-ops."""
    return (config.offload == "optimizer+params" and framework in ("meshplan", "torchtitan")
            and cluster.gpu.key != CPU_DEVICE_KEY)


def _param_offload_per_microbatch_s(config: ParallelConfig, cluster: ClusterSpec, *,
                                    params: StageParams, calibration: Calibration,
                                    framework: str) -> tuple[float, float]:
    """(overlappable, blocking) seconds of one micro-batch's ZeRO-3 parameter offload.

    Parameters offloaded cross PCIe (and NVMe) for forward and backward each micro-batch, at
    the pinned host-copy rate (``PINNED_HOST_BUFFERS``); up to ``offload_overlap`` of the
    compute can hide them.

    Under FSDP2's CPU offload (``fsdp2_cpu_offload``) the parameters cross as fp32
    (``FSDP2_HOST_PARAM_BYTES``, forward and backward: resharded after forward) and each
    backward copies its fp32 gradient shard to the host (``FSDP2_HOST_GRAD_BYTES``). From a
    step's second micro-batch on, the gradient is added to the earlier ones' on the host, on
    its memory bandwidth shared by the node's ranks (``HOST_GRAD_ADD_BYTES``), and the copy
    then blocks (``_fsdp_collectives.py`` ``foreach_reduce``: the add needs the copied
    gradient, so the copy is not overlapped) and lands in pageable memory, at the pageable
    rate (there ``non_blocking`` is False, and ``Tensor.to("cpu")`` allocates its output
    pinned only for a non-blocking copy): that copy and the add are the blocking part, here
    averaged over the step's micro-batches, which the device waits out."""
    if config.offload != "optimizer+params":
        return 0.0, 0.0
    shard = (params.dense + params.expert) / (config.dp * config.cp)
    pcie = calibration.host_copy_rate(cluster.pcie_bytes_per_s, pinned=PINNED_HOST_BUFFERS)
    blocking = 0.0
    if fsdp2_cpu_offload(framework, config, cluster):
        accumulating = (config.grad_accum_steps - 1) / config.grad_accum_steps
        ranks = min(cluster.gpus_per_node, cluster.num_gpus)
        grad_bytes = (FSDP2_HOST_GRAD_BYTES if framework == "meshplan"
                      else config.grad_reduce_bytes) * shard
        pageable = calibration.host_copy_rate(cluster.pcie_bytes_per_s, pinned=False)
        transfer = (2 * FSDP2_HOST_PARAM_BYTES * shard / pcie
                    + (1 - accumulating) * grad_bytes / pcie)
        blocking = accumulating * (grad_bytes / pageable + calibration.host_memory_s(
            cluster.gpu.key, HOST_GRAD_ADD_BYTES * shard * ranks))
    else:
        transfer = 2 * shard * config.bytes_per_activation / pcie
    if config.offload_device == "nvme":
        transfer += 2 * shard * config.bytes_per_activation * cluster.gpus_per_node \
            / cluster.nvme_bytes_per_s
    return transfer, blocking


def dp_step_s(config: ParallelConfig, calibration: Calibration, *, params: StageParams,
              link: coll.GroupLink, last_backward_s: float, framework: str,
              gpu_key: str = "default", first_forward_s: float = 0.0,
              contention: float = 0.0) -> tuple[float, float]:
    """(traffic, hideable) seconds of the once-per-step data-parallel traffic of one stage.

    ZeRO 0/1: gradient all-reduce (reduce-scatter + all-gather of parameters for 1, same
    volume); ZeRO-2: the all-gather of updated parameters. The gradient reduction can hide
    behind the last micro-batch's backward up to ``dp_overlap``. FSDP2 inside a pipeline
    stage: its once-per-step reduce-scatters and all-gathers (``_pipelined_fsdp2_step_s``).

    Megatron-LM with ``ParallelConfig.overlap_comm`` (``megatron_overlap_window_s``)
    hides it behind the last micro-batch's backward and, for the distributed optimizer's
    parameter all-gather, the next step's first forward: a collective beside compute slows it
    by ``contention`` of its own time (``prefetch_contention``, the ring's HBM traffic), so it
    hides behind ``1 - contention`` of the window (traffic that hides entirely is charged
    nothing for it, a slight under-estimate kept so that the hidden part stays one linear
    term for the planner's tables).
    """
    if link.size == 1:
        return 0.0, 0.0
    effs = link_effs(calibration)
    if fsdp2_syncs_once_per_step(framework, config):
        return _pipelined_fsdp2_step_s(config, calibration, params=params, link=link,
                                       framework=framework, gpu_key=gpu_key, effs=effs)
    grad_bytes = grad_comm_bytes(framework, config.dtype)
    total_params = params.dense + params.expert
    if config.zero_stage == 0:
        comm = coll.all_reduce_s(link, total_params * grad_bytes, **effs)
    elif config.zero_stage == 1:
        # the reduce-scatter of the gradients, then the all-gather of the updated parameters;
        # meshplan's DDP all-reduces the gradients instead (``ddp_zero1``), priced as the
        # ring's reduce-scatter and all-gather of them (linear in the stage's parameters, as
        # the planner's tables need; NCCL's tree would be quicker on small buckets), and its
        # parameters follow in the optimizer step (``zero1_broadcast_s``)
        gathered = grad_bytes if ddp_zero1(framework, config) else config.bytes_per_activation
        comm = (coll.reduce_scatter_s(link, total_params * grad_bytes, **effs)
                + coll.all_gather_s(link, total_params * gathered, **effs))
    elif config.zero_stage == 2:
        comm = coll.all_gather_s(link, total_params * config.bytes_per_activation, **effs)
    else:
        return 0.0, 0.0
    terms = dp_bucket_terms(config, calibration, params=params, link=link,
                            framework=framework, gpu_key=gpu_key)
    if terms:
        # every bucket after the first pays its calls' latency (the one-call latency is in
        # the traffic above), and every bucket the host cost of its calls
        comm += sum(cost * buckets(amount, bucket) for amount, bucket, cost in terms)
        comm -= terms[0][2]
    if config.zero_stage >= 2:
        return comm, 0.0
    if framework == "megatron" and config.overlap_comm:
        window = megatron_overlap_window_s(config, last_backward_s=last_backward_s,
                                           first_forward_s=first_forward_s)
        return comm, (1 - contention) * window
    return comm, calibration.dp_overlap * last_backward_s


def ddp_zero1(framework: str, config: ParallelConfig) -> bool:
    """ZeRO-1 as meshplan's runtime runs it: DDP (or ``replicate``) all-reduces the full
    gradients, as at stage 0 (``dp_step_s`` prices it as a ring), and
    ``ZeroRedundancyOptimizer`` (``ShardedStateOptimizer`` for DTensor parameters) shards only
    the optimizer states; after the step each rank broadcasts the parameters it updated, one
    call per tensor (``zero1_broadcast_s``). Other frameworks' ZeRO-1 reduce-scatters the
    gradients and all-gathers the parameters in the compute dtype."""
    return framework == "meshplan" and config.zero_stage == 1


ZERO1_PARAM_BYTES = 4
"""Bytes per parameter ZeRO-1's broadcasts move in meshplan's runtime: its module parameters
are fp32 (the compute dtype comes from autocast)."""


def zero1_broadcast_s(config: ParallelConfig, calibration: Calibration, *,
                      params: StageParams, link: coll.GroupLink, framework: str,
                      gpu_key: str = "default") -> float:
    """Seconds of meshplan's ZeRO-1 parameter broadcasts of one stage, inside its optimizer
    step (``ddp_zero1``; torch's ``ZeroRedundancyOptimizer._sync_params`` broadcasts every
    parameter tensor from the rank that owns it, one call each, then waits for all).

    Bytes: every rank receives the parameters the others updated, as an all-gather of the
    stage's fp32 parameters moves them (NCCL's broadcast is a pipelined ring, as its
    all-gather). Calls: one per parameter tensor (``StageParams.tensors``), each paying a
    ring's latency and its host cost (``Calibration.call_s`` per latency step). On this CPU
    (gloo, 2 ranks) the 39 broadcasts of the ``tiny`` model took 9.7 ms one after another,
    0.25 ms each, where one all-reduce of the same 0.87 MB took 3.2 ms."""
    if not ddp_zero1(framework, config) or link.size == 1:
        return 0.0
    effs = link_effs(calibration)
    calls = max(1, params.tensors)
    bytes_s = coll.all_gather_s(link, (params.dense + params.expert) * ZERO1_PARAM_BYTES,
                                **effs)
    per_call = coll.call_latency_s("all_gather", link) \
        + calibration.call_s(gpu_key) * latency_steps("all_gather", link.size)
    return bytes_s + calls * per_call


def megatron_overlap_window_s(config: ParallelConfig, *, last_backward_s: float,
                              first_forward_s: float) -> float:
    """Compute time that Megatron-LM's overlapped data-parallel traffic of a pipeline stage can
    run beside (``ParallelConfig.overlap_comm``; megatron-core ``DistributedDataParallel`` and
    ``ParamAndGradBuffer``, core_r0.8.0).

    With ``--overlap-grad-reduce`` each gradient bucket (``max(40M, 1M x dp)`` parameters) is
    reduced asynchronously as soon as the last micro-batch's backward has filled it, so the
    reduction runs beside that backward; with ``--overlap-param-gather`` the distributed
    optimizer's all-gather of the updated parameters runs bucket by bucket beside the next
    step's first forward (ZeRO-1). Pipeline stages after the first keep one bucket
    (megatron-core turns bucketing off there, their traffic being off the critical path: a
    stage ``i`` finishes its last backward ``i`` backward slots before the first stage); that
    slack, at least the window counted here, is not counted beyond it, which leaves the first
    stage's exposure to set the step. The last bucket's own reduction, after the backward
    (one bucket: 1-3 % of a stage's traffic for the 1.7B-462B models of megatron-core's H100
    table at DP 48), is not charged apart."""
    return last_backward_s + (first_forward_s if config.zero_stage == 1 else 0.0)


FSDP2_ACCUMULATE_BYTES = 10
"""HBM bytes per parameter of adding a micro-batch's 16-bit gradient to FSDP2's fp32 accumulator
while gradient sync is off (``FSDPParam.accumulate_unsharded_grad_if_needed``,
``unsharded_accumulated_grad += grad``: read 4 and 2, write 4). The first micro-batch's
gradient is converted instead (``to_accumulated_grad_if_needed``: read 2, write 4)."""
FSDP2_FIRST_ACCUMULATE_BYTES = 6


def fsdp2_accumulate_s(config: ParallelConfig, cluster: ClusterSpec, calibration: Calibration,
                       *, params: StageParams, framework: str) -> float:
    """Seconds per micro-batch (the step's mean) of FSDP2's fp32 gradient accumulation inside a
    pipeline stage (``calls.fsdp2_syncs_once_per_step``): each group's post-backward adds the
    micro-batch's 16-bit unsharded gradients to fp32 accumulators on the compute stream (the
    reduce dtype is fp32 in meshplan's runtime and torchtitan), so compute cannot hide it. 0
    elsewhere, and for fp32 training (nothing to convert)."""
    if not fsdp2_syncs_once_per_step(framework, config) or config.dtype == "fp32":
        return 0.0
    m = config.grad_accum_steps
    per_param = (FSDP2_FIRST_ACCUMULATE_BYTES + (m - 1) * FSDP2_ACCUMULATE_BYTES) / m
    bandwidth = hbm_bytes_per_s(cluster, calibration)
    return per_param * (params.dense + params.expert) / bandwidth


def _pipelined_fsdp2_step_s(config: ParallelConfig, calibration: Calibration, *,
                            params: StageParams, link: coll.GroupLink, framework: str,
                            gpu_key: str, effs: dict) -> tuple[float, float]:
    """(traffic, hideable) of FSDP2's once-per-step collectives inside a pipeline stage
    (``calls.fsdp2_syncs_once_per_step``). Every group reduce-scatters its fp32 gradients after
    the stage's last backward, when no compute is left to hide them. Every group all-gathers
    its parameters in the first micro-batch's forward, where FSDP2's prefetching hides each
    gather behind the blocks before it, all but the first block's: that one is waited for
    (prefetched gathers taken as hidden outright; a micro-batch whose block computes faster
    than its gather would wait more). Each call pays its ring latency and the host cost of
    its latency steps (``Calibration.call_s``). Nothing of it is hideable: the reduce-scatter
    has no compute left beside it, and the hidden gathers are not charged."""
    groups = fsdp2_groups(params.layers, params.root)
    total = params.dense + params.expert
    scatter = coll.reduce_scatter_s(
        link, total * grad_comm_bytes(framework, config.dtype,
                                      reduce_bytes=config.grad_reduce_bytes), **effs)
    block = params.largest_block or params.largest_layer
    first_gather = coll.all_gather_s(
        link, zero3_gather_bytes(config, params, framework=framework) * block / total,
        **effs) if total else 0.0
    latency = (groups - 1) * coll.call_latency_s("reduce_scatter", link)
    host = groups * calibration.call_s(gpu_key) * (
        latency_steps("reduce_scatter", link.size) + latency_steps("all_gather", link.size))
    return scatter + first_gather + latency + host, 0.0


def dp_bucket_terms(config: ParallelConfig, calibration: Calibration, *, params: StageParams,
                    link: coll.GroupLink, framework: str,
                    gpu_key: str = "default") -> tuple[tuple[float, float, float], ...]:
    """The once-per-step data-parallel costs that come per gradient bucket (ZeRO 0/1), as
    (amount, bucket, seconds per bucket): ``dp_step_s`` adds ``seconds * buckets(amount,
    bucket)`` of each, less the first one's seconds once. First the calls' network latency
    over the framework's buckets (``calls.gradient_bucketing``), then the host cost of DDP's
    bucketed all-reduces (``Calibration.call_s``; 0 on GPUs). Empty where there are none.
    Bucket counts are ceilings, so these terms are piecewise constant in a stage's layers (the
    planner's tables carry them apart)."""
    if link.size == 1 or config.zero_stage > 1:
        return ()
    total_params = params.dense + params.expert
    grad_bytes = total_params * grad_comm_bytes(framework, config.dtype)
    amount, bucket = gradient_bucketing(framework, config, params=total_params,
                                        grad_bytes=grad_bytes)
    ops = ("all_reduce",) if config.zero_stage == 0 else ("reduce_scatter", "all_gather")
    return ((amount, bucket, sum(coll.call_latency_s(op, link) for op in ops)),
            (grad_bytes, DDP_BUCKET_BYTES,
             calibration.call_s(gpu_key) * latency_steps("all_reduce", link.size)))


def te_weight_cast_s(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig,
                     calibration: Calibration, *, stage: int) -> float:
    """Seconds of one step's float8 weight casts on ``stage`` under Megatron-LM's float8
    training (Transformer Engine): on the step's first micro-batch every float8 linear of the
    stage's layers casts its weight to float8 in both layouts and keeps them for the other
    micro-batches (``eager.float8_cast_bytes``; ``eager.FLOAT8_WEIGHT_BYTES`` per element, less
    the max-abs pass under delayed scaling), once per step whatever the number of
    micro-batches."""
    elements = stage_float8_weight_elements(model, config, stage)
    per_element = eager.FLOAT8_WEIGHT_BYTES - (eager.FLOAT8_AMAX_BYTES
                                               if config.float8_recipe == "delayed" else 0)
    return per_element * elements / hbm_bytes_per_s(cluster, calibration)


def optimizer_step_s(config: ParallelConfig, cluster: ClusterSpec, calibration: Calibration,
                     *, params: StageParams, framework: str = "megatron") -> tuple[float, float]:
    """(device optimizer, offload) seconds of the optimizer step of one stage.

    On the device: a fused Adam moves ``OPTIMIZER_BYTES_PER_PARAM`` per sharded parameter
    through HBM, or the device's measured rate (``DeviceCalibration.optimizer_params_per_s``)
    where it has one. Offloaded: gradients go down and parameters come back over PCIe (pinned or
    pageable host buffers, ``PINNED_HOST_BUFFERS``), the host runs Adam for all GPUs of the
    node at the slower of ``host_adam_flop_per_param`` FLOPs and ``host_adam_bytes_per_param``
    bytes of host memory traffic per parameter (the second binds: ~28 bytes per parameter at
    a few hundred GB/s is ~10 G parameters/s per node), and NVMe offload reads and writes the
    optimizer state once. Under FSDP2's CPU offload the gradients are clipped in host memory
    as well (``HOST_CLIP_BYTES_PER_PARAM``; both frameworks clip by default).
    """
    shard = config.dp * config.cp if config.zero_stage >= 1 else 1
    # expert weights are sharded over the replicas of their expert group, as in memory
    local = params.dense / shard + params.expert / max(1, shard // config.ep)
    device = calibration.device(cluster.gpu.key)
    loss_s = (calibration.call_s(cluster.gpu.key) * LOSS_REDUCTION_CALLS  # the logged loss
              * latency_steps("all_reduce", config.world_size))
    if config.offload == "none":
        if device.optimizer_params_per_s is not None:
            return local / device.optimizer_params_per_s + loss_s, 0.0
        bandwidth = hbm_bytes_per_s(cluster, calibration)
        return local * OPTIMIZER_BYTES_PER_PARAM / bandwidth + loss_s, 0.0
    per_node = local * min(cluster.gpus_per_node, cluster.num_gpus)
    rate = calibration.host_copy_rate(cluster.pcie_bytes_per_s,
                                      pinned=PINNED_HOST_BUFFERS)
    # FSDP2's CPU offload has the gradients on the host already and leaves the parameters
    # there (``_param_offload_per_microbatch_s`` moves both)
    fsdp2 = fsdp2_cpu_offload(framework, config, cluster)
    pcie = 0.0 if fsdp2 else local * (4 + config.bytes_per_activation) / rate
    host = max(per_node * calibration.host_adam_flop_per_param / cluster.host_flop_per_s,
               calibration.host_memory_s(cluster.gpu.key,
                                         per_node * calibration.host_adam_bytes_per_param))
    if fsdp2:  # the gradients are clipped there too
        host += calibration.host_memory_s(
            cluster.gpu.key, per_node * HOST_CLIP_BYTES_PER_PARAM[framework])
    nvme = 2 * per_node * 12 / cluster.nvme_bytes_per_s if config.offload_device == "nvme" \
        else 0.0
    return loss_s, pcie + host + nvme
