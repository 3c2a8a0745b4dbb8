"""Laws of the cost model, checked with hypothesis on random plans and catalog models.

* per-rank model states never grow with a higher ZeRO stage or a larger data-parallel group;
* activations never grow with more recomputation: none >= selective >= full per layer; per
  stage the same, up to the selective transient the model leaves out (see that test);
* step time never drops when a link gets slower, nor under full or selective recomputation,
  nor when the optimizer moves to the host, and never grows on a faster GPU (more FLOP/s or
  HBM bandwidth) or, for offloaded plans, a faster host;
* more tokens per step (micro-batches, micro-batch or sequence) never take less time or memory;
* under 1F1B, earlier stages hold at least as many micro-batches (and activations) as later ones;
* degrees whose product is not the GPU count are rejected with ValueError.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, reject, settings
from hypothesis import strategies as st

from meshplan.costmodel import activations as act
from meshplan.costmodel import load_calibration
from meshplan.costmodel.config import FRAMEWORKS, MESH_AXES, RECOMPUTE_MODES, ParallelConfig
from meshplan.costmodel.layout import check_fits_model
from meshplan.costmodel.estimate import estimate
from meshplan.costmodel.frameworks import model_state_bytes
from meshplan.costmodel.hardware import ClusterSpec, load_cluster
from meshplan.costmodel.memory import last_stage_head_bytes, stage_activation_bytes, stage_states
from meshplan.costmodel.model import ModelSpec
from meshplan.costmodel.models import load_model

FAST = settings(max_examples=100, deadline=None)
TOLERANCE = 1e-9
"""Relative slack for float rounding when comparing two evaluations."""

DENSE_MODELS = ("gpt3-125m", "megatron-1.7b", "megatron-7.5b", "megatron-22b", "llama2-7b",
                "llama3-8b", "llama2-70b")
MODELS = DENSE_MODELS + ("mixtral-8x7b",)
DEGREES = (1, 2, 4, 8)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_choices(model: ModelSpec) -> list[int]:
    return [t for t in DEGREES if model.num_heads % t == 0 and model.kv_heads % t == 0]


def _total(states) -> float:
    return states.params + states.grads + states.optimizer


def _at_most(smaller: float, larger: float) -> bool:
    return smaller <= larger * (1 + TOLERANCE)


# ----- model states: ZeRO stage and dp ---------------------------------------------------------
@FAST
@given(framework=st.sampled_from(FRAMEWORKS), params=st.floats(1e3, 1e12),
       shard=st.integers(1, 4096), growth=st.integers(2, 64), fp32=st.booleans(),
       offload=st.sampled_from(["none", "optimizer"]))
def test_model_states_never_grow_with_zero_stage_or_shard(framework, params, shard, growth,
                                                          fp32, offload):
    def total(stage: int, n: int, mode: str = offload) -> float:
        return _total(model_state_bytes(framework, params=params, shard=n, zero_stage=stage,
                                        offload=mode, fp32=fp32))

    by_stage = [total(stage, shard) for stage in range(4)]
    assert all(_at_most(b, a) for a, b in zip(by_stage, by_stage[1:])), by_stage
    for stage in range(4):
        assert _at_most(total(stage, shard * growth), total(stage, shard))
    # Offloading parameters too (ZeRO-3 only) leaves no more on the device.
    assert _at_most(total(3, shard, "optimizer+params"), total(3, shard, "optimizer"))


@st.composite
def _stage_plans(draw):
    """A catalog model, a valid plan without its dp and ZeRO stage, and a stage index."""
    model = load_model(draw(st.sampled_from(MODELS)))
    tp = draw(st.sampled_from(_tp_choices(model)))
    pp = draw(st.sampled_from([p for p in (1, 2, 4, 8) if p <= model.num_layers]))
    cp = draw(st.sampled_from([1, 2]))
    ep = draw(st.sampled_from([e for e in (1, 2, 4, 8) if model.num_experts % e == 0])
              if model.is_moe else st.just(1))
    config = ParallelConfig(tp=tp, pp=pp, cp=cp, ep=ep, seq_len=model.seq_len,
                            offload=draw(st.sampled_from(["none", "optimizer"])),
                            dtype=draw(st.sampled_from(["bf16", "fp32"])))
    return model, config, draw(st.integers(0, pp - 1))


@FAST
@given(plan=_stage_plans(), framework=st.sampled_from(FRAMEWORKS),
       dp=st.sampled_from([1, 2, 4, 8, 16, 64]), growth=st.sampled_from([2, 4, 8]))
def test_stage_model_states_never_grow_with_zero_stage_or_dp(plan, framework, dp, growth):
    model, config, stage = plan
    if (dp * config.cp) % config.ep:
        reject()

    def total(zero_stage: int, dp_size: int) -> float:
        cfg = config.replace(dp=dp_size, zero_stage=zero_stage, global_batch_size=dp_size)
        return _total(stage_states(model, cfg, stage, framework)[0])

    by_stage = [total(z, dp) for z in range(4)]
    assert all(_at_most(b, a) for a, b in zip(by_stage, by_stage[1:])), by_stage
    for zero_stage in range(4):
        assert _at_most(total(zero_stage, dp * growth), total(zero_stage, dp))


# ----- activations and recomputation -----------------------------------------------------------
@st.composite
def _activation_configs(draw, *, flash=st.booleans()):
    model = load_model(draw(st.sampled_from(MODELS)))
    tp = draw(st.sampled_from(_tp_choices(model)))
    cp = draw(st.sampled_from([1, 2, 4]))
    sp = draw(st.booleans()) if tp > 1 else False
    seq_len = draw(st.sampled_from([512, 1024, 2048, 4096, 8192]))
    mb = draw(st.sampled_from([1, 2, 4, 8]))
    config = ParallelConfig(tp=tp, cp=cp, sp=sp, micro_batch_size=mb, global_batch_size=mb,
                            seq_len=seq_len, flash_attention=draw(flash),
                            dtype=draw(st.sampled_from(["bf16", "fp32"])))
    return model, config


@FAST
@given(plan=_activation_configs(), moe=st.booleans())
def test_layer_activations_never_grow_with_more_recompute(plan, moe):
    model, config = plan
    moe = moe and model.is_moe
    none, selective, full = (act.layer_activation_bytes(model, config, recompute=mode, moe=moe)
                             for mode in RECOMPUTE_MODES)
    assert full <= selective <= none


@FAST
@given(plan=_activation_configs(), pp=st.sampled_from([1, 2, 4, 8]),
       m=st.sampled_from([1, 2, 4, 8, 16]), framework=st.sampled_from(FRAMEWORKS),
       data=st.data())
def test_stage_activations_never_grow_with_more_recompute(plan, pp, m, framework, data):
    """A stage's peak: none >= selective and none >= full always. Selective >= full holds once
    the attention core that selective recomputation rebuilds for one layer during backward is
    counted; the model leaves that transient out, as Megatron-LM's theoretical memory and
    Korthikanti's Table 2 do (golden in test_golden_memory.py), so with eager attention and
    only a few layers in flight the model's selective can sit below full by up to that core.
    meshplan's selective is its runtime's op list, which under TP also keeps the row-parallel
    matmul outputs and the TP collectives' outputs that plain autograd frees: there it can
    keep more than no recomputation (GPT-3 125M, tp 4 with SP: 5.1 against 4.5 MB a layer)."""
    model, config = plan
    try:
        config = config.replace(pp=pp, global_batch_size=m * config.micro_batch_size)
        check_fits_model(config, model, num_gpus=config.world_size)
    except ValueError:
        reject()
    stage = data.draw(st.integers(0, pp - 1))
    none, selective, full = (
        stage_activation_bytes(model, config.replace(recompute=mode), stage, framework)
        for mode in RECOMPUTE_MODES)
    assert _at_most(full, none), (none, selective, full)
    if not (framework == "meshplan" and config.tp > 1):
        assert _at_most(selective, none), (none, selective, full)
    core = act.attention_core_bytes(model, config)
    assert _at_most(full, selective + core), (none, selective, full, core)


# ----- the 1F1B schedule: earlier stages hold more ---------------------------------------------
@FAST
@given(p=st.integers(1, 16), v=st.integers(1, 4), m_per_p=st.integers(1, 8),
       extra=st.integers(0, 7))
def test_in_flight_microbatches_decrease_with_stage(p, v, m_per_p, extra):
    if v > 1 and p == 1:
        reject()
    m = m_per_p * p if v > 1 else m_per_p * p + extra  # interleaving needs m divisible by p
    config = ParallelConfig(pp=p, vpp=v, global_batch_size=m)
    held = [act.in_flight_microbatches(config, s) for s in range(p)]
    assert all(b <= a for a, b in zip(held, held[1:])), held
    assert held[-1] >= 1
    if v == 1:
        assert held == [float(min(p - s, m)) for s in range(p)]


@FAST
@given(plan=_activation_configs(flash=st.just(True)), pp=st.sampled_from([2, 4, 8]),
       v=st.sampled_from([1, 2]), m_per_p=st.sampled_from([1, 2, 4]),
       recompute=st.sampled_from(RECOMPUTE_MODES), framework=st.sampled_from(FRAMEWORKS))
def test_stage_activations_decrease_with_stage_index(plan, pp, v, m_per_p, recompute,
                                                     framework):
    """Equal layer counts per stage: stage i holds at least what stage i+1 holds, leaving out
    the last stage's logits (the LM head's own activations, not the schedule's)."""
    model, config = plan
    if model.num_layers % (pp * v):
        reject()
    config = config.replace(pp=pp, vpp=v, recompute=recompute,
                            global_batch_size=pp * m_per_p * config.micro_batch_size)
    head = last_stage_head_bytes(model, config, framework)
    by_stage = [stage_activation_bytes(model, config, s, framework) for s in range(pp)]
    by_stage[-1] -= head
    assert all(_at_most(b, a) for a, b in zip(by_stage, by_stage[1:])), by_stage


# ----- step time and link speed ----------------------------------------------------------------
@st.composite
def _runs(draw):
    """A catalog model on 1-8 DGX A100 nodes (8: two leaves, so traffic may cross the spine)
    with a random valid plan and mesh order."""
    model = load_model(draw(st.sampled_from(("megatron-1.7b", "llama2-7b", "megatron-7.5b",
                                             "mixtral-8x7b"))))
    nodes = draw(st.sampled_from([1, 2, 4, 8]))
    world = nodes * 8
    tp = draw(st.sampled_from(_tp_choices(model)))
    cp = draw(st.sampled_from([c for c in (1, 2) if tp * c <= world]))
    pp = draw(st.sampled_from([p for p in _divisors(world // (tp * cp)) if p <= 8]))
    dp = world // (tp * cp * pp)
    ep = draw(st.sampled_from([e for e in _divisors(dp * cp) if model.num_experts % e == 0])
              if model.is_moe else st.just(1))
    zero_stage = draw(st.integers(0, 3))
    offload = draw(st.sampled_from(["none", "optimizer"]
                                   + (["optimizer+params"] if zero_stage == 3 else [])))
    mb = draw(st.sampled_from([1, 2]))
    m = draw(st.sampled_from([1, 2, 4, 8]))
    vpp = draw(st.sampled_from([1, 2])) if pp > 1 and m % pp == 0 else 1
    try:
        config = ParallelConfig(
            tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, sp=tp > 1 and draw(st.booleans()),
            zero_stage=zero_stage, offload=offload,
            offload_device=draw(st.sampled_from(["cpu", "nvme"])),
            recompute=draw(st.sampled_from(RECOMPUTE_MODES)), micro_batch_size=mb,
            global_batch_size=dp * mb * m, vpp=vpp,
            seq_len=draw(st.sampled_from([1024, 2048, 4096])),
            mesh_order=tuple(draw(st.permutations(MESH_AXES))))
        check_fits_model(config, model, num_gpus=world)
    except ValueError:
        reject()
    return model, load_cluster("dgx-a100-80gb", nodes=nodes), config


def _slower(cluster: ClusterSpec, link: str, factor: float) -> ClusterSpec:
    """A fresh ClusterSpec (its graph is rebuilt) with one link ``factor`` times slower."""
    if link == "nvlink":
        gpu = dataclasses.replace(cluster.gpu,
                                  nvlink_bytes_per_s=cluster.gpu.nvlink_bytes_per_s / factor)
        return dataclasses.replace(cluster, gpu=gpu)
    changes = {"nic": {"nic_bytes_per_s": cluster.nic_bytes_per_s / factor},
               "pcie": {"pcie_bytes_per_s": cluster.pcie_bytes_per_s / factor},
               "nvme": {"nvme_bytes_per_s": cluster.nvme_bytes_per_s / factor},
               "spine": {"spine_oversubscription": cluster.spine_oversubscription * factor},
               "nic_latency": {"nic_latency_s": cluster.nic_latency_s * factor},
               "nvlink_latency": {"nvlink_latency_s": cluster.nvlink_latency_s * factor}}[link]
    return dataclasses.replace(cluster, **changes)


@FAST
@given(run=_runs(), link=st.sampled_from(["nvlink", "nic", "pcie", "nvme", "spine",
                                          "nic_latency", "nvlink_latency"]),
       factor=st.floats(1.0, 100.0), framework=st.sampled_from(FRAMEWORKS))
def test_step_time_never_drops_when_a_link_gets_slower(run, link, factor, framework):
    model, cluster, config = run
    fast = estimate(model, cluster, config, framework=framework)
    slow = estimate(model, _slower(cluster, link, factor), config, framework=framework)
    assert _at_most(fast.time.step_s, slow.time.step_s), (fast.time, slow.time)


@pytest.mark.parametrize("framework", ["meshplan", "torchtitan"])
def test_slower_nvlink_under_fsdp_counterexample(framework):
    """The counterexample the property above found on 2026-12-06: Megatron 1.7B, ZeRO-3 over
    the 8 GPUs of one DGX A100, micro-batch 1 of 2048 tokens, NVLink twice as slow. The
    prefetched gathers hide entirely, and their contention had been charged on their calls'
    latency at a share that falls with the link's rate, so the step got 0.3 % cheaper; the
    latency's share is now the link-independent ``prefetch_contention``."""
    model, cluster = load_model("megatron-1.7b"), load_cluster("dgx-a100-80gb", nodes=1)
    config = ParallelConfig(dp=8, zero_stage=3, micro_batch_size=1, global_batch_size=8,
                            seq_len=2048)
    fast = estimate(model, cluster, config, framework=framework)
    slow = estimate(model, _slower(cluster, "nvlink", 2.0), config, framework=framework)
    assert _at_most(fast.time.step_s, slow.time.step_s)


@FAST
@given(run=_runs(), part=st.sampled_from(["peak", "hbm"]), factor=st.floats(1.0, 8.0),
       framework=st.sampled_from(FRAMEWORKS))
def test_step_time_never_grows_on_a_faster_gpu(run, part, factor, framework):
    """More FLOP/s or more HBM bandwidth never slows a step, context parallelism included
    (``test_host_bound_ring_counterexample``)."""
    model, cluster, config = run
    gpu = (dataclasses.replace(cluster.gpu, peak_flop_per_s={
        k: v * factor for k, v in cluster.gpu.peak_flop_per_s.items()}) if part == "peak"
        else dataclasses.replace(cluster.gpu,
                                 hbm_bytes_per_s=cluster.gpu.hbm_bytes_per_s * factor))
    slow = estimate(model, cluster, config, framework=framework)
    fast = estimate(model, dataclasses.replace(cluster, gpu=gpu), config, framework=framework)
    assert _at_most(fast.time.step_s, slow.time.step_s), (slow.time, fast.time)


def test_host_bound_ring_counterexample():
    """Llama 2 7B on 2 DGX A100, TP 8 x CP 2, micro-batch 2 of 2,048 tokens, full
    recomputation, meshplan's runtime: the layer waits on the host issuing its kernels. The
    ring's exchange had been hidden behind the attention kernels' device time alone, so a GPU
    with 8x the FLOP/s exposed more of it (21 -> 27 ms) and the step got 0.8 % slower
    (0.590 -> 0.594 s). The device's wait for the host covers the stall too: with 91 ms of
    wait against 21 ms of exchange, none of it is exposed."""
    model, cluster = load_model("llama2-7b"), load_cluster("dgx-a100-80gb", nodes=2)
    config = ParallelConfig(tp=8, cp=2, micro_batch_size=2, global_batch_size=4,
                            seq_len=2048, recompute="full")
    gpu = dataclasses.replace(cluster.gpu, peak_flop_per_s={
        k: v * 8 for k, v in cluster.gpu.peak_flop_per_s.items()})
    slow = estimate(model, cluster, config, framework="meshplan").time
    fast = estimate(model, dataclasses.replace(cluster, gpu=gpu), config,
                    framework="meshplan").time
    assert slow.host_wait_s > 0 and fast.host_wait_s > slow.host_wait_s
    assert slow.cp_comm_s == 0.0 and fast.cp_comm_s == 0.0
    assert _at_most(fast.step_s, slow.step_s), (slow, fast)


# ----- step time and recomputation ------------------------------------------------------------
@FAST
@given(run=_runs(), framework=st.sampled_from(FRAMEWORKS))
def test_step_time_never_drops_under_full_recomputation(run, framework):
    """Full recomputation adds compute and communication; what it hides more of never pays
    for more than it adds."""
    model, cluster, config = run
    none = estimate(model, cluster, config.replace(recompute="none"), framework=framework)
    full = estimate(model, cluster, config.replace(recompute="full"), framework=framework)
    assert _at_most(none.time.step_s, full.time.step_s), (none.time, full.time)


@pytest.mark.parametrize("framework", ["meshplan", "torchtitan"])
def test_full_recomputation_under_parameter_offload_counterexample(framework):
    """The counterexample a randomised check of the estimator found on 2026-12-07: Llama 2 7B
    on 4 DGX A100 nodes, TP 8 with SP x FSDP 4, ZeRO-3 with parameters offloaded, micro-batch
    1 of 2048 tokens. The ZeRO traffic and the offload traffic were both exposed, and their
    exposed parts added up, each hidden by the same compute: full recomputation came out
    6.7 % faster than none (torchtitan: 0.917 against 0.983 s). The stage now waits for the
    slower of the two (``composition.micro_total``)."""
    model, cluster = load_model("llama2-7b"), load_cluster("dgx-a100-80gb", nodes=4)
    config = ParallelConfig(tp=8, dp=4, sp=True, zero_stage=3, offload="optimizer+params",
                            micro_batch_size=1, global_batch_size=8, seq_len=2048)
    none = estimate(model, cluster, config, framework=framework)
    full = estimate(model, cluster, config.replace(recompute="full"), framework=framework)
    assert none.time.dp_comm_s > 0 and none.time.offload_s > 0  # both chains exposed
    assert _at_most(none.time.step_s, full.time.step_s)


@FAST
@given(run=_runs(), framework=st.sampled_from(FRAMEWORKS))
def test_selective_recomputation_is_never_faster_than_none(run, framework):
    """Each framework's selective policy recomputes part of the layer: never cheaper than
    keeping everything. (It can cost more than full recomputation: meshplan's runtime's per-op
    policy on one H200 measured 0.766 s against full's 0.445 s, its host paying for every
    operator's policy check; benchmarks/results/gpu-h200-2026-12-04.md.)"""
    model, cluster, config = run
    none = estimate(model, cluster, config.replace(recompute="none"), framework=framework)
    selective = estimate(model, cluster, config.replace(recompute="selective"),
                         framework=framework)
    assert _at_most(none.time.step_s, selective.time.step_s), (none.time, selective.time)


# ----- more work ----------------------------------------------------------------------------
def _estimate_or_reject(model, cluster, config, framework):
    try:
        return estimate(model, cluster, config, framework=framework)
    except ValueError:
        reject()


@FAST
@given(run=_runs(), framework=st.sampled_from(FRAMEWORKS),
       change=st.sampled_from(["micro-batches", "micro-batch", "sequence"]))
def test_more_tokens_never_take_less_time_or_memory(run, framework, change):
    """Twice the micro-batches per step, twice the micro-batch or twice the sequence, on the
    same layout: the step never gets shorter and the peak never smaller."""
    model, cluster, config = run
    bigger = {"micro-batches": config.replace(global_batch_size=2 * config.global_batch_size),
              "micro-batch": config.replace(micro_batch_size=2 * config.micro_batch_size,
                                            global_batch_size=2 * config.global_batch_size),
              "sequence": config.replace(seq_len=2 * config.seq_len)}[change]
    small = estimate(model, cluster, config, framework=framework)
    large = _estimate_or_reject(model, cluster, bigger, framework)
    assert _at_most(small.time.step_s, large.time.step_s), (small.time, large.time)
    assert _at_most(small.memory.peak_bytes, large.memory.peak_bytes)


@FAST
@given(run=_runs(), framework=st.sampled_from(FRAMEWORKS))
def test_offloading_the_optimizer_never_speeds_a_step(run, framework):
    """The host's Adam step and the copies to and from it replace the device's Adam step:
    never a gain."""
    model, cluster, config = run
    if config.offload != "none":
        reject()
    kept = estimate(model, cluster, config, framework=framework)
    moved = _estimate_or_reject(model, cluster, config.replace(offload="optimizer"), framework)
    assert _at_most(kept.time.step_s, moved.time.step_s), (kept.time, moved.time)


@FAST
@given(run=_runs(), framework=st.sampled_from(FRAMEWORKS), factor=st.floats(1.0, 16.0),
       part=st.sampled_from(["flop", "memory"]))
def test_a_faster_host_never_slows_an_offloaded_step(run, framework, factor, part):
    """More host FLOP/s or host memory bandwidth (what bounds the host's Adam step) never
    slows a plan that offloads."""
    model, cluster, config = run
    if config.offload == "none":
        reject()
    calibration = load_calibration(None)
    fast_cluster, fast_calibration = cluster, calibration
    if part == "flop":
        fast_cluster = dataclasses.replace(cluster,
                                           host_flop_per_s=cluster.host_flop_per_s * factor)
    else:
        fast_calibration = dataclasses.replace(calibration, host_memory_bytes_per_s={
            k: v * factor for k, v in calibration.host_memory_bytes_per_s.items()})
    slow = estimate(model, cluster, config, framework=framework, calibration=calibration)
    fast = estimate(model, fast_cluster, config, framework=framework,
                    calibration=fast_calibration)
    assert _at_most(fast.time.step_s, slow.time.step_s), (slow.time, fast.time)


# ----- degrees must multiply to the GPU count --------------------------------------------------
@FAST
@given(tp=st.sampled_from(DEGREES), pp=st.sampled_from(DEGREES), cp=st.sampled_from(DEGREES),
       dp=st.integers(1, 16), nodes=st.integers(1, 4), gpus_per_node=st.sampled_from([1, 2, 4, 8]))
def test_degrees_not_matching_the_gpu_count_raise(tp, pp, cp, dp, nodes, gpus_per_node):
    if tp * pp * cp * dp == nodes * gpus_per_node:
        reject()
    model = load_model("megatron-7.5b")
    cluster = load_cluster("dgx-a100-80gb", nodes=nodes, gpus_per_node=gpus_per_node)
    config = ParallelConfig(tp=tp, pp=pp, cp=cp, dp=dp, global_batch_size=dp, seq_len=2048)
    with pytest.raises(ValueError, match=r"tp\*cp\*dp\*pp"):
        check_fits_model(config, model, num_gpus=cluster.num_gpus)
    with pytest.raises(ValueError, match=r"tp\*cp\*dp\*pp"):
        estimate(model, cluster, config)
