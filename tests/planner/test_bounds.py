"""The search's split-aware lower bounds (``planner/bounds.py``) never exceed what a split
achieves, and the rule they rest on (a middle stage needs no less memory than a later one)
holds in the cost model.

Expected values come from enumerating every split and mode choice of small instances, and
from ``stage_memory`` / ``build_tables`` of the cost model itself, not from the bound code.
"""

from __future__ import annotations

import itertools
import random

import pytest

from meshplan.costmodel import (ParallelConfig, default_calibration, estimate, load_cluster,
                                load_model)
from meshplan.costmodel.calls import fsdp2_syncs_once_per_step
from meshplan.costmodel.memory import stage_memory
from meshplan.planner import search as search_module
from meshplan.planner import tables as tables_module
from meshplan.planner.bounds import sampled_stages, split_bound, stage_caps
from meshplan.planner.space import SearchSpace
from meshplan.planner.tables import build_tables, stage_config

CAL = default_calibration()


def _time(pieces, n, lo):
    return max(base + slope * (n - lo) for base, slope in pieces)


def _random_rows(rng: random.Random, p: int, lo: int):
    rows = []
    for _ in range(p):
        forms = []
        for _ in range(rng.randint(1, 3)):
            pieces = tuple((rng.uniform(0, 5), rng.uniform(-0.5, 3))
                           for _ in range(rng.randint(1, 3)))
            forms.append((pieces, rng.randint(lo - 1, lo + 5)))
        rows.append((lo, forms))
    return rows


def test_split_bound_is_below_every_split_of_random_instances():
    """Every split of L layers and every choice of form per stage: the slowest stage takes
    at least the bound's top, the stages together at least its sum; None only when no split
    fits (a split-free instance may still get numbers: any number bounds it)."""
    rng = random.Random(7)
    checked = 0
    for _ in range(300):
        p, lo = rng.randint(1, 4), rng.randint(1, 2)
        total = rng.randint(p * lo, p * lo + 8)
        rows = _random_rows(rng, p, lo)
        best_top = best_sum = float("inf")
        for counts in itertools.product(range(lo, total + 1), repeat=p):
            if sum(counts) != total:
                continue
            per_stage = []
            for (low, forms), n in zip(rows, counts):
                per_stage.append([_time(pieces, n, low) for pieces, most in forms if n <= most])
            if any(not times for times in per_stage):
                continue
            for times in itertools.product(*per_stage):
                best_top, best_sum = min(best_top, max(times)), min(best_sum, sum(times))
        got = split_bound(rows, total)
        if got is None:  # only when no split fits
            assert best_top == float("inf")
            continue
        if best_top == float("inf"):
            continue
        top, sums = got
        assert top <= best_top + 1e-9 and sums <= best_sum + 1e-9
        checked += 1
    assert checked > 100


CONFIGS = [  # model, cluster, nodes, config, framework
    ("llama3-70b", "dgx-h100", 8, dict(tp=4, pp=16, dp=1, micro_batch_size=1,
                                       global_batch_size=64, seq_len=8192, zero_stage=1),
     "megatron"),
    ("llama3-70b", "dgx-h100", 8, dict(tp=2, pp=10, dp=1, cp=2, micro_batch_size=2, vpp=2,
                                       global_batch_size=80, seq_len=8192, zero_stage=0),
     "megatron"),
    ("gpt3-175b", "dgx-a100-80gb", 12, dict(tp=8, pp=12, dp=1, micro_batch_size=1,
                                            global_batch_size=48, seq_len=2048,
                                            zero_stage=1, sp=True), "meshplan"),
    ("llama3-8b", "dgx-h100", 2, dict(tp=1, pp=16, dp=1, micro_batch_size=1,
                                      global_batch_size=32, seq_len=8192, zero_stage=0),
     "torchtitan"),
    ("llama3-8b", "dgx-h100", 2, dict(tp=1, pp=8, dp=2, micro_batch_size=2,
                                      global_batch_size=32, seq_len=4096, zero_stage=3,
                                      offload="optimizer"), "deepspeed"),
]


@pytest.mark.parametrize("case", CONFIGS, ids=[f"{c[0]}-{c[4]}-pp{c[3]['pp']}" for c in CONFIGS])
def test_middle_stages_need_no_less_memory_than_later_ones(case):
    """For every layer count and mode, a middle stage's reserved bytes are at least those of
    every later middle stage (what ``stage_caps`` uses for the stages it does not sample)."""
    name, cluster_name, nodes, kwargs, framework = case
    model, cluster = load_model(name), load_cluster(cluster_name, nodes=nodes)
    config = ParallelConfig(**kwargs)
    p = config.pp
    for mode in ("none", "selective", "full"):
        for n in (config.vpp, config.vpp + 1, model.num_layers // p + 2):
            need = [stage_memory(model, cluster, stage_config(config, model, i, n, mode), i,
                                 framework=framework, calibration=CAL).reserved_bytes
                    for i in range(1, p - 1)]
            assert all(a >= b for a, b in zip(need, need[1:])), (mode, n, need)


@pytest.mark.parametrize("case", CONFIGS, ids=[f"{c[0]}-{c[4]}-pp{c[3]['pp']}" for c in CONFIGS])
def test_sampled_capacities_are_at_least_the_tables_exact_ones(case, monkeypatch):
    """The capacities ``capacity_bound`` reads at a few stages and carries to the others are
    at least the tables' exact per-stage capacities, at a capacity where memory binds. Over
    every split, as the bound is: the tables of a framework that builds its own split (DeepSpeed)
    cap each stage at that split's count, so here they take any."""
    monkeypatch.setattr(tables_module, "framework_split", lambda *args: None)
    name, cluster_name, nodes, kwargs, framework = case
    model, cluster = load_model(name), load_cluster(cluster_name, nodes=nodes)
    config = ParallelConfig(**kwargs)
    tables = build_tables(model, cluster, config, modes=("none", "selective", "full"),
                          framework=framework, calibration=CAL, memory_margin=0.35)
    p = config.pp
    for mode in ("none", "full"):
        exact = {i: tables.most(i, mode) for i in sampled_stages(model, p)}
        caps = stage_caps(model, p, exact)
        assert all(caps[i] >= tables.most(i, mode) for i in range(p))
    assert len(sampled_stages(model, 16)) < 16  # the sampling does skip stages


@pytest.mark.parametrize("case", CONFIGS, ids=[f"{c[0]}-{c[4]}-pp{c[3]['pp']}" for c in CONFIGS])
def test_capacity_bound_is_below_the_tables_bound(case):
    """A candidate's capacity bound (a few stages' capacities) is at most its tables' bound
    (every stage's exact capacity, the same time forms)."""
    name, cluster_name, nodes, kwargs, framework = case
    model, cluster = load_model(name), load_cluster(cluster_name, nodes=nodes)
    config = ParallelConfig(**kwargs)
    margin = 0.35
    space = SearchSpace(global_batch_size=config.global_batch_size, seq_len=config.seq_len,
                        memory_margin=margin)
    refiner = search_module._Refiner(model, cluster, space, framework=framework,
                                     calibration=CAL)
    split = refiner.capacity_split(config, config)
    tables = build_tables(model, cluster, config, modes=space.recompute_modes,
                          framework=framework, calibration=CAL, memory_margin=margin)
    exact = search_module.tables_bound(tables)
    if split is None:
        assert exact is None
        return
    lo = search_module.layer_bounds(model, config, None)
    piece = search_module.bound(model, cluster, config, framework=framework,
                                calibration=CAL, lo=lo[0][0], hi=max(lo[1][0], lo[0][0] + 1))
    light = search_module.Bound(per_micro_s=0.0, once_s=0.0, stages=piece.stages,
                                micro_batches=piece.micro_batches,
                                vpp=piece.vpp).with_split(*split)
    assert exact is not None and light <= exact * (1 + 1e-6)
    relaxed = refiner.capacity_split(config, config, relaxed=True)  # the degree level's
    assert relaxed is not None
    assert relaxed[0] <= split[0] * (1 + 1e-9) and relaxed[1] <= split[1] * (1 + 1e-9)
    # without capacities (what ``roomy`` layouts read): below both, whatever the memory
    for level in (False, True):
        free = refiner.capacity_split(config, config, relaxed=level, roomy=True)
        assert free is not None
        assert free[0] <= relaxed[0] * (1 + 1e-9) and free[1] <= relaxed[1] * (1 + 1e-9)


INVARIANT_CASES = [  # model, cluster, nodes, degrees and knobs, framework
    ("llama3-70b", "dgx-h100", 4, dict(tp=4, pp=4, dp=2, zero_stage=3, seq_len=8192),
     "megatron"),
    ("llama3-8b", "dgx-h100", 2, dict(tp=1, pp=4, dp=4, zero_stage=3, seq_len=4096,
                                      offload="optimizer+params"), "deepspeed"),
    ("gpt3-13b", "dgx-a100-80gb", 2, dict(tp=2, pp=4, dp=2, zero_stage=2, seq_len=2048),
     "meshplan"),
    ("llama3-8b", "dgx-h100", 2, dict(tp=2, pp=4, dp=2, zero_stage=3, seq_len=4096),
     "torchtitan"),
]


@pytest.mark.parametrize("case", INVARIANT_CASES, ids=[c[0] + "-" + c[4] for c in INVARIANT_CASES])
def test_the_invariants_the_search_bounds_rest_on(case):
    """``search._Refiner``'s invariants, on the cost model's own stage terms: (1) linear
    work does not depend on ZeRO or offload; (2) a stage's linear work and time per
    micro-batch do not fall with v, nor does its memory; (3) per sample, linear work does not
    grow with the micro-batch and memory does not fall with it; (4) memory does not grow with
    the ZeRO stage or offload; (5) compute per micro-batch depends on neither v nor the ZeRO
    stage and offload; (6) full recomputation needs the least memory."""
    from meshplan.costmodel.estimate import stage_terms

    name, cluster_name, nodes, kwargs, framework = case
    model, cluster = load_model(name), load_cluster(cluster_name, nodes=nodes)
    batch = 8 * kwargs["dp"] * kwargs["pp"]

    def terms(n, mode, **over):
        config = ParallelConfig(**dict(kwargs, global_batch_size=batch, **over))
        staged = stage_config(config, model, 1, n, mode)
        time = stage_terms(model, cluster, staged, 1, framework=framework, calibration=CAL)
        memory = stage_memory(model, cluster, staged, 1, framework=framework,
                              calibration=CAL).reserved_bytes
        return time.micro, memory

    for mode in ("none", "full"):
        for n in (2, 4):
            (t1, m1), (t2, m2) = terms(n, mode, vpp=1), terms(n, mode, vpp=2)
            assert t2.linear_s >= t1.linear_s and t2.total_s >= t1.total_s and m2 >= m1
            plain, _ = terms(n, mode, zero_stage=0, offload="none")
            assert plain.linear_s <= t1.linear_s * (1 + 1e-12)
            # (5) compute depends on neither v nor ZeRO / offload (``_Refiner.once_bounds``)
            assert t2.compute_s == t1.compute_s == plain.compute_s
            lean = terms(n, mode)[1]
            # the lowest ZeRO stage the framework runs here: torchtitan has no ZeRO-1 and runs
            # DDP only as its one parallelism (``layout.framework_layout_error``)
            lowest = 2 if framework == "torchtitan" else 1
            assert terms(n, mode, zero_stage=lowest, offload="none")[1] >= lean
            # (6) full recomputation needs the least memory (``capacity_bound(relaxed=True)``)
            assert terms(n, "full")[1] <= terms(n, mode)[1]
            (a, ma), (b, mb) = terms(n, mode, micro_batch_size=1), terms(n, mode,
                                                                         micro_batch_size=4)
            assert b.linear_s / 4 <= a.linear_s * (1 + 1e-12) and mb >= ma
            # (7) raw ZeRO and offload traffic: below the stage's time, the same for every
            # micro-batch, not less under recomputation (``_Refiner.traffic_floor``)
            for t in (t1, t2, a, b):
                assert t.total_s >= max(t.zero_comm_s, t.offload_raw_s) * (1 - 1e-12)
            assert (a.zero_comm_s, a.offload_raw_s) == (b.zero_comm_s, b.offload_raw_s)
            # (8) nor on where the optimizer runs (the optimizer-offload choices share it)
            if kwargs.get("offload", "none") != "optimizer+params":
                for device in ("cpu", "nvme"):
                    moved = terms(n, mode, offload="optimizer", offload_device=device)[0]
                    assert (moved.zero_comm_s, moved.offload_raw_s) == (t1.zero_comm_s,
                                                                        t1.offload_raw_s)
            none = terms(n, "none")[0]
            assert t1.zero_comm_s >= none.zero_comm_s * (1 - 1e-12)
            assert t1.offload_raw_s >= none.offload_raw_s * (1 - 1e-12)
    # the property has something to check: these cases' raw traffic is not 0, except where
    # FSDP2 inside a pipeline stage syncs once per step (none per micro-batch)
    assert (terms(4, "none")[0].zero_comm_s > 0 or kwargs["zero_stage"] < 2
            or fsdp2_syncs_once_per_step(framework,
                                         ParallelConfig(**kwargs, global_batch_size=batch)))



@pytest.mark.parametrize("case", INVARIANT_CASES, ids=[c[0] + "-" + c[4] for c in INVARIANT_CASES])
def test_once_per_step_terms_given_the_compute(case):
    """What ``search._Refiner.once_terms`` rests on: given a stage's compute, its
    once-per-step terms (``estimate.stage_once``) do not depend on the micro-batch, and the
    part of the data-parallel traffic it hides is proportional to the compute."""
    from meshplan.costmodel.estimate import stage_once

    name, cluster_name, nodes, kwargs, framework = case
    model, cluster = load_model(name), load_cluster(cluster_name, nodes=nodes)
    batch = 8 * kwargs["dp"] * kwargs["pp"]
    hiding = 0
    for zero, offload in ((0, "none"), (1, "none"), (1, "optimizer"), (2, "none"),
                          (kwargs["zero_stage"], kwargs.get("offload", "none"))):
        seen = set()
        for b, compute in itertools.product((1, 2, 4), (0.25, 1.0, 3.0)):
            config = ParallelConfig(**dict(kwargs, global_batch_size=batch, zero_stage=zero,
                                           offload=offload, micro_batch_size=b))
            staged = stage_config(config, model, 1, 4, "none")
            comm, hidden, opt, off = stage_once(model, cluster, staged, 1, framework=framework,
                                                calibration=CAL, compute_s=compute)
            _, per_second, _, _ = stage_once(model, cluster, staged, 1, framework=framework,
                                             calibration=CAL, compute_s=1.0)
            assert hidden == pytest.approx(compute * per_second, rel=1e-12, abs=0.0)
            seen.add((comm, opt, off))
            hiding += hidden > 0
        assert len(seen) == 1, (zero, offload, seen)
    assert hiding  # the proportionality has something to check


PER_MICRO_CASES = [  # model, cluster, nodes, framework (a MoE model with dense layers too)
    ("mt-nlg-530b", "dgx-a100-80gb", 280, "megatron"),
    ("llama3-70b", "dgx-h100", 5, "meshplan"),
    ("mixtral-8x7b", "dgx-h100", 4, "deepspeed"),
    ("llama3-8b", "dgx-h100", 3, "torchtitan"),
]


@pytest.mark.parametrize("case", PER_MICRO_CASES, ids=[c[0] + "-" + c[3] for c in PER_MICRO_CASES])
def test_per_micro_sum_equals_the_full_bounds(case):
    """``search.per_micro_s`` (what the per-micro-batch levels of the tree read) is the very
    number ``search.bound`` composes, on every kind of candidate of a space (degrees, ZeRO,
    offload, micro-batch, vpp, layout), whichever of the two fills the shared cache first."""
    from meshplan.planner.space import candidates
    from meshplan.planner.tables import layer_bounds

    name, cluster_name, nodes, framework = case
    model, cluster = load_model(name), load_cluster(cluster_name, nodes=nodes)
    space = SearchSpace(global_batch_size=2 * cluster.num_gpus, seq_len=4096)
    configs = candidates(model, cluster, space)
    rng = random.Random(11)
    checked = 0
    for config in rng.sample(configs, min(120, len(configs))):
        lows, highs = layer_bounds(model, config, None)
        lo, hi = lows[0], max(highs[0], lows[0] + 1)
        args = dict(framework=framework, calibration=CAL, lo=lo)
        first: dict = {}
        alone = search_module.per_micro_s(model, cluster, config, cache=first, **args)
        after = search_module.bound(model, cluster, config, hi=hi, cache=first, **args)
        fresh = search_module.bound(model, cluster, config, hi=hi, **args)
        again = search_module.per_micro_s(model, cluster, config, **args)
        assert alone == after.per_micro_s == fresh.per_micro_s == again
        assert after == fresh
        checked += 1
    assert checked >= 30



ONCE_CASES = [  # model, cluster, nodes, framework, global batch, sequence length
    ("llama3-70b", "dgx-h100", 5, "megatron", 480, 8192),
    ("llama3-8b", "dgx-h100", 2, "deepspeed", 64, 4096),
    ("mixtral-8x7b", "dgx-h100", 4, "torchtitan", 128, 4096),
    ("gpt3-13b", "dgx-a100-80gb", 2, "meshplan", 64, 2048),
]


def _once_case(case):
    """(model, cluster, the framework's space, a refiner over it) of a ``ONCE_CASES`` row."""
    name, cluster_name, nodes, framework, batch, seq = case
    model, cluster = load_model(name), load_cluster(cluster_name, nodes=nodes)
    space = search_module.framework_space(SearchSpace(global_batch_size=batch, seq_len=seq),
                                          framework)
    return model, cluster, space, search_module._Refiner(model, cluster, space,
                                                          framework=framework, calibration=CAL)


def _random_splits(model, config, space, rng, count):
    """``count`` copies of ``config`` with the even split perturbed (a few layers moved
    between random stages, each keeping at least v) and a random recompute mode per stage."""
    from meshplan.costmodel.config import even_split

    p, lo = config.pp, max(1, config.vpp)
    for _ in range(count):
        counts = list(even_split(model.num_layers, p))
        for _ in range(rng.randint(0, 4) if p > 1 else 0):  # move layers between stages
            a, b = rng.randrange(p), rng.randrange(p)
            if counts[a] > lo:
                counts[a] -= 1
                counts[b] += 1
        modes = tuple(rng.choice(space.recompute_modes) for _ in range(p))
        yield config.with_split(tuple(counts), modes)


@pytest.mark.parametrize("case", ONCE_CASES, ids=[c[0] + "-" + c[3] for c in ONCE_CASES])
def test_once_per_step_bound_is_below_every_member(case):
    """``_Refiner.once_bounds`` (what the search adds to its ZeRO / offload nodes) is at most
    the once-per-step terms of every member of the space it bounds: any vpp, any split, any
    recompute mode per stage. The members' terms are the cost model's own
    (``estimate.stage_terms`` of every stage, composed as ``compose_step`` does)."""
    from meshplan.costmodel import composition
    from meshplan.costmodel.estimate import stage_terms
    from meshplan.planner.space import candidates

    model, cluster, space, refiner = _once_case(case)
    framework = case[3]
    rng = random.Random(5)
    configs = [c for c in candidates(model, cluster, space) if c.dp * c.cp > 1]
    checked = tight = 0
    for config in rng.sample(configs, min(40, len(configs))):
        degrees = (config.tp, config.cp, config.pp, config.dp, config.ep)
        choice = (config.zero_stage, config.offload, config.offload_device)
        want = refiner.once_bounds(degrees, config.micro_batch_size, config.sp,
                                   config.mesh_order, [choice])[choice]
        p = config.pp
        for staged in _random_splits(model, config, space, rng, 3):
            terms = [stage_terms(model, cluster, staged, s, framework=framework,
                                 calibration=CAL) for s in range(p)]
            once = composition.once_per_step(
                dp_exposed=max(t.dp_exposed_s for t in terms),
                optimizer=max(t.optimizer_s for t in terms),
                offload_step=max(t.offload_s for t in terms))
            assert want <= once * (1 + 1e-9) + 1e-12, (staged, want, once)
            checked += 1
            tight += want > 0.5 * once
    assert checked >= 60
    assert tight >= checked // 4  # the bound is not vacuous


@pytest.mark.parametrize("case", ONCE_CASES, ids=[c[0] + "-" + c[3] for c in ONCE_CASES])
def test_traffic_floor_is_below_every_member(case):
    """``_Refiner.traffic_floor`` (the summed raw ZeRO or offload traffic a layout's (ZeRO,
    offload) choice adds to its bound, cached per degrees, sp and rank layout whichever
    micro-batch asked first) is at most the summed time per micro-batch of every member: any
    micro-batch, vpp, split and recompute mode per stage (``estimate.stage_terms``)."""
    from meshplan.costmodel.estimate import stage_terms
    from meshplan.planner.space import candidates

    model, cluster, space, refiner = _once_case(case)
    framework = case[3]
    rng = random.Random(7)
    configs = [c for c in candidates(model, cluster, space)
               if c.zero_stage >= 2 or c.offload == "optimizer+params"]
    checked = tight = 0
    for config in rng.sample(configs, min(40, len(configs))):
        degrees = (config.tp, config.cp, config.pp, config.dp, config.ep)
        choice = (config.zero_stage, config.offload, config.offload_device)
        # another micro-batch of the layout may have filled the cache first
        sizes = [b for b, sp, order in refiner.layouts(degrees)
                 if (sp, order) == (config.sp, config.mesh_order)] or [config.micro_batch_size]
        first = rng.choice(sizes)
        want = refiner.traffic_floor(degrees, first, config.sp, config.mesh_order, choice)
        p = config.pp
        for staged in _random_splits(model, config, space, rng, 2):
            summed = sum(stage_terms(model, cluster, staged, s, framework=framework,
                                     calibration=CAL).micro.total_s for s in range(p))
            assert want <= summed * (1 + 1e-9), (staged, first, want, summed)
            checked += 1
            tight += want > 0.3 * summed
    assert checked >= 40
    assert tight >= 1  # the floor is not vacuous


SHORTCUT_CASES = [  # model, cluster, nodes, framework, global batch, sequence length
    ("mixtral-8x7b", "dgx-h100", 16, "megatron", 1024, 4096),
    ("llama3-8b", "dgx-h100", 8, "torchtitan", 256, 4096),
]


@pytest.mark.parametrize("case", SHORTCUT_CASES, ids=[c[0] + "-" + c[3] for c in SHORTCUT_CASES])
def test_capacity_bound_over_none_alone_when_it_fits_everywhere(case, monkeypatch):
    """Where every sampled stage holds the most layers without recomputation,
    ``capacity_bound`` reads mode ``none`` alone (``bounds.fastest_mode_fits``): its value is
    the one over every mode, on every kind of candidate of a space, and the shortcut is
    taken on some of them."""
    from meshplan.planner import bounds
    from meshplan.planner.space import candidates

    name, cluster_name, nodes, framework, batch, seq = case
    model, cluster = load_model(name), load_cluster(cluster_name, nodes=nodes)
    space = SearchSpace(global_batch_size=batch, seq_len=seq)
    configs = [c for c in candidates(model, cluster, space, core=True) if c.pp > 1]
    rng = random.Random(3)
    sample = rng.sample(configs, min(60, len(configs)))

    def splits():
        refiner = search_module._Refiner(model, cluster, space, framework=framework,
                                         calibration=CAL)
        return [refiner.capacity_split(c, c) for c in sample]

    taken = []
    real = bounds.fastest_mode_fits

    def spy(*args):
        taken.append(real(*args))
        return taken[-1]

    monkeypatch.setattr(bounds, "fastest_mode_fits", spy)
    fast = splits()
    monkeypatch.setattr(bounds, "fastest_mode_fits", lambda *args: False)
    for got, want in zip(fast, splits()):  # the same forms, summed in another order
        assert (got is None) == (want is None)
        assert got is None or got == pytest.approx(want, rel=1e-12)
    assert any(taken)


ORDER_CASES = [  # model, cluster, nodes, framework, global batch, sequence length
    ("llama3-405b", "dgx-h100", 64, "megatron", 1024, 8192),
    ("mixtral-8x7b", "dgx-h100", 16, "torchtitan", 1024, 4096),
    ("llama3-70b", "dgx-h100", 8, "meshplan", 512, 8192),
    ("gpt3-175b", "dgx-a100-80gb", 16, "deepspeed", 1536, 2048),
]


@pytest.mark.parametrize("case", ORDER_CASES, ids=[c[0] + "-" + c[3] for c in ORDER_CASES])
def test_rank_layouts_the_search_treats_as_alike_estimate_alike(case):
    """``_Refiner.orders_alike`` (the search then keeps the first rank layout only): every
    member of such a degree tuple, under the other layout, has the same estimate to the bit
    (step, its terms, per-stage memory), whatever its micro-batch, vpp, ZeRO stage, offload
    and recompute."""
    from meshplan.planner.space import MESH_ORDERS, candidates

    name, cluster_name, nodes, framework, batch, seq = case
    model, cluster = load_model(name), load_cluster(cluster_name, nodes=nodes)
    space = search_module.framework_space(SearchSpace(global_batch_size=batch, seq_len=seq),
                                          framework)
    refiner = search_module._Refiner(model, cluster, space, framework=framework,
                                     calibration=CAL)
    configs = [c for c in candidates(model, cluster, space, framework=framework)
               if c.pp > 1 and c.dp > 1 and c.mesh_order == MESH_ORDERS[0]]
    alike = [c for c in configs if refiner.orders_alike((c.tp, c.cp, c.pp, c.dp, c.ep))]
    rng = random.Random(13)
    checked = 0
    for config in rng.sample(alike, min(25, len(alike))):
        mode = rng.choice(space.recompute_modes)
        ests = [estimate(model, cluster, config.replace(mesh_order=order, recompute=mode),
                         framework=framework, calibration=CAL) for order in MESH_ORDERS]
        assert ests[0].time == ests[1].time, config
        assert ests[0].memory.per_stage == ests[1].memory.per_stage
        checked += 1
    if name == "llama3-405b":  # the large cluster has such tuples; 70B on 8 nodes none
        assert checked >= 10
    # and the check is not trivially true: some tuples' layouts differ
    assert len(alike) < len(configs)
