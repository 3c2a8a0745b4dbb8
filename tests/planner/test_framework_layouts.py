"""The planner searches only layouts the plan's framework runs (``layout.framework_layout_
error``), so ``plan -> export`` and ``plan -> run`` never refuse a plan for its layout; the
exports and the runtime refuse with the same reasons."""

from __future__ import annotations

import json
import random

import pytest

from meshplan.costmodel import (ParallelConfig, default_calibration, estimate, load_cluster,
                               load_model)
from meshplan.costmodel.layout import (deepspeed_partition, deepspeed_splits, deepspeed_uniform,
                                       framework_layout_error, framework_split, framework_splits)
from meshplan.planner import export
from meshplan.planner.plan import Plan
from meshplan.planner.search import framework_space, search
from meshplan.planner.space import SearchSpace, candidates
from meshplan.runtime.mesh import UnsupportedPlan, check_supported
from meshplan.testing import run_cli

CAL = default_calibration()


def _plan(model, cluster, config, framework) -> Plan:
    est = estimate(model, cluster, config, framework=framework, calibration=CAL)
    return Plan.from_estimate(est, provenance={})


@pytest.mark.parametrize("config,framework,words", [
    (dict(pp=2, dp=2, zero_stage=2), "deepspeed", "runs only ZeRO stage 0 or 1"),
    (dict(pp=2, vpp=2, dp=2, zero_stage=1), "deepspeed", "no interleaved schedule"),
    (dict(dp=4, offload="optimizer"), "deepspeed", "offloads only under ZeRO"),
    (dict(dp=4, zero_stage=2, offload="optimizer", offload_device="nvme"), "deepspeed",
     "to NVMe only under ZeRO-3"),
    (dict(dp=4, zero_stage=3, offload="optimizer+params"), "megatron",
     "cannot offload parameters"),
    (dict(dp=4, offload="optimizer"), "megatron", "only through its distributed optimizer"),
    (dict(cp=8, seq_len=4104, zero_stage=1), "megatron", "multiple of 2 x cp = 16"),
    (dict(dp=4, zero_stage=1, offload="optimizer", offload_device="nvme"), "torchtitan",
     "cannot offload to NVMe"),
    (dict(dp=4, zero_stage=3, offload="optimizer"), "torchtitan",
     "moves the parameters and gradients to the host with the optimizer states"),
    (dict(cp=2, dp=2, zero_stage=1), "meshplan", "is not in meshplan's runtime"),
    (dict(cp=2, dp=2, zero_stage=3, seq_len=4100), "torchtitan",
     "multiple of 2 x tp x cp = 8"),
    (dict(pp=2, zero_stage=3), "torchtitan", "turns mixed precision off and trains in fp32"),
])
def test_the_exports_and_the_runtime_refuse_with_the_rule(config, framework, words):
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-a100-80gb", nodes=1)
    values = dict(tp=2, pp=1, dp=1, global_batch_size=16, seq_len=4096)
    values.update(config)
    values["tp"] = 8 // (values["pp"] * values["dp"] * values.get("cp", 1))
    config = ParallelConfig(**values)
    why = framework_layout_error(framework, config, model)
    assert why is not None and words in why
    assert all(framework_layout_error(other, config, model) != why
               for other in ("deepspeed", "megatron", "torchtitan", "meshplan")
               if other != framework)
    assert framework_layout_error("ideal", config, model) is None
    plan = _plan(model, cluster, config, framework)
    if framework == "meshplan":
        with pytest.raises(UnsupportedPlan, match=words):
            check_supported(config, model)
    else:
        with pytest.raises(ValueError, match=words):
            export.render(plan, framework)


@pytest.mark.parametrize("framework", ["deepspeed", "megatron", "torchtitan", "meshplan"])
def test_every_candidate_is_a_layout_the_framework_runs(framework):
    """Llama-2-70B on 4 DGX A100 at 4K tokens, every candidate of the whole space."""
    model, cluster = load_model("llama2-70b"), load_cluster("dgx-a100-80gb", nodes=4)
    space = framework_space(SearchSpace(global_batch_size=256, seq_len=4096), framework)
    configs = candidates(model, cluster, space, framework=framework)
    assert configs
    for config in configs:
        assert framework_layout_error(framework, config, model) is None, config
    seen = {(c.pp > 1, c.zero_stage, c.vpp > 1, c.cp > 1, c.mesh_order) for c in configs}
    if framework == "deepspeed":
        assert not any(pp and (zero >= 2 or v) for pp, zero, v, _, _ in seen)
        assert {order for *_, order in seen} == {("tp", "cp", "dp", "pp")}
        assert any(cp for _, _, _, cp, _ in seen)  # Ulysses where the heads split
    if framework == "meshplan":
        assert not any(cp for _, _, _, cp, _ in seen)
    if framework in ("megatron", "torchtitan"):  # both run pipelines with ZeRO-3 and CP
        assert any(pp and zero == 3 for pp, zero, *_ in seen)
        assert any(cp for _, _, _, cp, _ in seen)


def test_a_deepspeed_plan_exports_and_a_default_plan_runs(tmp_path):
    """The plans the CLI writes pass their framework's export / the runtime's check (before the
    shared rule, this DeepSpeed search chose pp 8 with ZeRO-2 and interleaving, which the
    export refused; the default framework chose cp 8 for Llama-3-8B at 32K tokens on one
    node, which ``run`` refused; now it chooses tp 2 x dp 4 with full recomputation)."""
    out = tmp_path / "ds.json"
    r = run_cli("plan", "--model", "llama2-70b", "--cluster", "dgx-a100-80gb", "--nodes", "4",
                "--framework", "deepspeed", "--global-batch", "256", "--seq-len", "4096",
                "--deterministic", "-o", str(out))
    assert r.code == 0, r.err
    r = run_cli("export", str(out), "--to", "deepspeed")
    assert r.code == 0, r.err
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", nodes=1)
    result = search(model, cluster, SearchSpace(global_batch_size=8, seq_len=32768),
                    framework="meshplan", calibration=CAL, top_k=3, deterministic=True)
    for solved in result.ranked:
        assert solved.estimate.config.cp == 1
        check_supported(solved.estimate.config, model)


@pytest.mark.parametrize("args,words", [
    (["--framework", "deepspeed", "--pp", "2", "--vpp", "2"], "no interleaved schedule"),
    (["--cp", "2"], "context parallelism (cp 2) is not in meshplan's runtime"),
    (["--framework", "megatron", "--offload-device", "nvme"], "cannot offload to NVMe"),
    # a conditional rule: no single pin is refused, their combination is
    (["--framework", "deepspeed", "--zero", "2", "--pp", "4"], "runs only ZeRO stage 0 or 1"),
    (["--framework", "deepspeed", "--pp", "2", "--layers-per-stage", "15,17"],
     "builds only its partition methods' splits"),
])
def test_a_pin_the_framework_cannot_run_is_one_line_and_exit_2(args, words):
    r = run_cli("plan", "--model", "llama2-7b", "--cluster", "dgx-a100-80gb",
                "--global-batch", "64", "--seq-len", "4096", "--deterministic", *args)
    assert r.code == 2, r.err
    line = r.err.strip()
    assert "\n" not in line and words in line and "Traceback" not in line


def test_estimate_prices_any_layout_and_notes_the_refusal():
    """``estimate`` answers for a layout the framework does not run (a what-if), with the
    rule's reason as a note after the verdict; none for one it runs."""
    base = ["estimate", "--model", "llama2-7b", "--cluster", "dgx-a100-80gb", "--pp", "2",
            "--dp", "4", "--global-batch", "64", "--framework", "deepspeed"]
    r = run_cli(*base, "--zero", "2")
    assert r.code == 0, r.err
    last = r.out.strip().splitlines()[-1]
    assert last.startswith("note: DeepSpeed's pipeline engine runs only ZeRO stage 0 or 1")
    r = run_cli(*base, "--zero", "1")
    assert r.code == 0, r.err
    assert "note:" not in r.out


def test_no_measured_run_is_a_layout_its_framework_refuses():
    """Every published step-time run and every measured memory run ran under its framework,
    so the rule refuses none of them (331 and 112 runs; DeepSpeed's pipelines with ZeRO-1,
    its ZeRO-3 without pipelines, torchtitan's 4D layouts, the runtime's offload plans)."""
    from meshplan.costmodel.memory_runs import memory_runs
    from meshplan.costmodel.reference import reference_runs

    runs = [*reference_runs(), *memory_runs()]
    assert len(runs) > 400
    refused = {run.id: why for run in runs
               if (why := framework_layout_error(run.framework, run.config, run.model))}
    assert not refused, refused


@pytest.mark.parametrize("framework", ["megatron", "torchtitan"])
def test_one_recompute_mode_for_a_framework_that_takes_one(tmp_path, framework):
    """Llama-3-70B on 8 DGX H100 at 8K tokens, where memory binds: the plan's stages share one
    recompute mode, so the export takes it as planned (before, the torchtitan plan was
    selective on its first two stages and none on the rest, which the export widened to
    selective everywhere, with a warning)."""
    out = tmp_path / "plan.json"
    r = run_cli("plan", "--model", "llama3-70b", "--cluster", "dgx-h100", "--nodes", "8",
                "--global-batch", "512", "--seq-len", "8192", "--framework", framework,
                "--deterministic", "-o", str(out))
    assert r.code == 0, r.err
    recompute = json.loads(out.read_text())["recompute"]
    assert isinstance(recompute, str) or len(set(recompute)) == 1, recompute
    r = run_cli("export", str(out), "--to", framework)
    assert r.code == 0 and "recompute mode" not in r.err, r.err


def test_a_per_stage_recompute_list_is_pinned_only_where_it_runs():
    base = ["plan", "--model", "llama2-7b", "--cluster", "dgx-a100-80gb", "--pp", "2",
            "--global-batch", "64", "--seq-len", "4096", "--deterministic",
            "--recompute", "full,none"]
    r = run_cli(*base, "--framework", "megatron")
    assert r.code == 2
    line = r.err.strip()
    assert "\n" not in line and "Megatron-LM takes one recompute mode for all pipeline " \
        "stages, got --recompute full,none" in line
    r = run_cli(*base, "--framework", "meshplan")
    assert r.code == 0, r.err


# ----- DeepSpeed builds its own pipeline split ---------------------------------------------------
def test_the_partition_is_deepspeeds_own():
    """``deepspeed_partition`` / ``deepspeed_uniform`` give the boundaries DeepSpeed's own
    partitioners give, ties included (0-1 weights, equal blocks, large ends, random reals)."""
    utils = pytest.importorskip("deepspeed.runtime.utils", reason="needs the 'export' extra")
    rng = random.Random(7)
    for _ in range(200):
        n, parts = rng.randint(1, 40), rng.randint(1, 12)
        kind = rng.random()
        weights = ([rng.randint(0, 1) for _ in range(n)] if kind < 0.3 else
                   [rng.choice([3, 5, 5, 5, 100]) for _ in range(n)] if kind < 0.6 else
                   [rng.random() * 10 for _ in range(n)])
        want = tuple(int(b) for b in utils.partition_balanced(weights, parts))
        assert deepspeed_partition(tuple(weights), parts) == want, (weights, parts)
        assert deepspeed_uniform(n, parts) == tuple(utils.partition_uniform(n, parts))


def test_deepspeed_splits_by_hand():
    """BLOOM's embedding (250,880 x 14,336 = 3.60B) weighs 1.46 of its 2.47B blocks, so by
    parameters over 12 stages the end stages take 5 blocks with it (15.9B, the middle ones
    6 blocks, 14.8B; 6 blocks and an end would be 18.4B); balanced blocks (type) put the 10
    extra first; uniform counts the 73 items (embedding, 70 blocks, norm, head) 7, 6, 6, ...
    with the extra one first, so the first stage holds the embedding and 6 blocks and the
    last the head, the norm and 4 blocks."""
    splits = deepspeed_splits(load_model("bloom-176b"), 12)
    assert splits["parameters"] == (5,) + (6,) * 10 + (5,)
    assert splits["type"] == (6,) * 10 + (5, 5)
    assert splits["uniform"] == (6,) * 11 + (4,)
    assert framework_split("deepspeed", load_model("bloom-176b"), 12) == splits["parameters"]
    for other in ("megatron", "torchtitan", "meshplan", "ideal"):
        assert framework_split(other, load_model("bloom-176b"), 12) is None


def test_a_small_model_keeps_a_block_on_every_stage():
    """Llama-3-8B's embedding (525M) outweighs two of its 218M blocks: by parameters, 16
    stages would leave the first and last without a block, so that method is not offered;
    balanced block counts (type: 2 each) are, and first, as what ``estimate`` prices."""
    model = load_model("llama3-8b")
    assert min(deepspeed_splits(model, 16)["parameters"]) == 0
    assert framework_split("deepspeed", model, 16) == (2,) * 16
    assert all(min(split) >= 1 for split in framework_splits("deepspeed", model, 16))
    assert framework_splits("megatron", model, 16) is None


def test_deepspeed_estimates_and_plans_take_its_splits():
    """``estimate`` without a split prices the split DeepSpeed builds by default (parameters:
    Llama-3-8B over 3 stages 10, 12, 10, see test_export; the other frameworks the even
    split), and the planner tries each split DeepSpeed builds and keeps one of them."""
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", nodes=3)
    config = ParallelConfig(pp=3, dp=8, global_batch_size=64, seq_len=4096, zero_stage=1)
    est = estimate(model, cluster, config, framework="deepspeed", calibration=CAL)
    assert est.config.layers_per_stage == (10, 12, 10)
    other = estimate(model, cluster, config, framework="megatron", calibration=CAL)
    assert other.config.stage_layers(32) != (10, 12, 10)
    r = run_cli("plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "3",
                "--framework", "deepspeed", "--pp", "3", "--tp", "1", "--global-batch", "64",
                "--seq-len", "4096", "--deterministic", "--json")
    assert r.code == 0, r.err
    built = set(deepspeed_splits(model, 3).values())
    assert all(tuple(p["layers_per_stage"]) in built for p in r.json()["plans"])


def test_the_planner_takes_the_fastest_of_deepspeeds_splits():
    """BLOOM-176B on 384 A100s, tp 2 x pp 12 x dp 4 x cp 4: the uniform method (73 items
    over 12 stages: 6 blocks each, the last 4 blocks with the norm and the 250,880-row head)
    takes blocks off the head's stage, and beats both balanced splits, as each priced alone
    says; the search finds it among the three."""
    model, cluster = load_model("bloom-176b"), load_cluster("jean-zay-a100", nodes=48)
    base = ParallelConfig(tp=2, pp=12, dp=4, cp=4, sp=True, zero_stage=1, micro_batch_size=1,
                          global_batch_size=2048, seq_len=2048, recompute="none",
                          flash_attention=False)
    steps = {method: estimate(model, cluster, base.replace(layers_per_stage=split),
                              framework="deepspeed", calibration=CAL).time.step_s
             for method, split in deepspeed_splits(model, 12).items()}
    assert steps["uniform"] < min(steps["parameters"], steps["type"])
    space = SearchSpace(global_batch_size=2048, seq_len=2048, tp=(2,), pp=(12,), cp=(4,),
                        zero_stage=(1,), micro_batch_size=(1,), sp=(True,),
                        flash_attention=False, recompute_modes=("none",))
    result = search(model, cluster, space, framework="deepspeed", calibration=CAL, top_k=1,
                    deterministic=True)
    best = result.ranked[0].estimate
    assert best.config.layers_per_stage == (6,) * 11 + (4,)
    assert best.time.step_s == pytest.approx(steps["uniform"], rel=1e-9)


def test_search_refuses_pins_the_framework_cannot_run():
    """The Python entry point says why, as ``meshplan plan`` does, rather than that the space
    is empty."""
    model, cluster = load_model("llama2-7b"), load_cluster("dgx-a100-80gb", nodes=1)
    space = SearchSpace(global_batch_size=64, seq_len=4096, pp=(4,), zero_stage=(2,))
    with pytest.raises(ValueError, match="runs only ZeRO stage 0 or 1"):
        search(model, cluster, space, framework="deepspeed", calibration=CAL,
               deterministic=True)
    space = SearchSpace(global_batch_size=64, seq_len=4096, tp=(2,), pp=(1,), zero_stage=(1,))
    with pytest.raises(ValueError, match="it has no ZeRO-1"):
        search(model, cluster, space, framework="torchtitan", calibration=CAL,
               deterministic=True)
