"""The cost of node failures (planner/elasticity.py, ``explain --node-mtbf-hours``): Young's and
Daly's intervals against their published formulas and Daly's figures, the expected loss against
Daly's wall-time model, the optimum against its neighbours, the checkpoint's bytes against a
count by hand, and the command line.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from meshplan.costmodel import estimate
from meshplan.planner import elasticity as el
from meshplan.planner.plan import read_plan
from meshplan.testing import run_cli, usage_error

HOUR_S = 3600.0
MTBF_HOURS = 10_000
EVERY_STEPS = 1000
EXPLAIN_KEYS = {"plan", "binding", "runners_up", "what_if"}
REL = 1e-9
REGIMES = [(30.0, 120.0, 4 * 86400.0), (600.0, 300.0, 6 * HOUR_S), (300.0, 600.0, 900.0)]
"""(delta, R, M) in seconds: a save far shorter than the MTBF, a long save, Daly's Fig. 5."""


def young_by_hand(delta: float, mtbf: float) -> float:
    """Young 1974: tau = sqrt(2 delta M)."""
    return math.sqrt(2 * delta * mtbf)


def daly_by_hand(delta: float, mtbf: float) -> float:
    """Daly 2006, for delta < 2M: sqrt(2 delta M) [1 + (delta/2M)^(1/2) / 3 + (delta/2M) / 9]
    - delta."""
    return math.sqrt(2 * delta * mtbf) * (1 + (delta / (2 * mtbf)) ** 0.5 / 3
                                          + delta / (2 * mtbf) / 9) - delta


def loss_by_hand(tau: float, delta: float, restart: float, mtbf: float) -> float:
    """1 - T_s / T_w, Daly 2006: T_w = M e^(R/M) (e^((tau+delta)/M) - 1) T_s / tau, T_s = 1."""
    wall = mtbf * math.exp(restart / mtbf) * (math.exp((tau + delta) / mtbf) - 1) / tau
    return 1 - 1 / wall


def loss(tau: float, delta: float, restart: float, mtbf: float) -> float:
    return el.loss_fraction(interval_s=tau, save_s=delta, recovery_s=restart, mtbf_s=mtbf)


# ----- the formulas -------------------------------------------------------------------------------
@pytest.mark.parametrize("delta, mtbf", [(30.0, 3.6e5), (300.0, 86400.0), (5.0, 60.0)])
def test_young_is_sqrt_2_delta_m(delta, mtbf):
    assert el.young_interval_s(save_s=delta, mtbf_s=mtbf) == pytest.approx(
        young_by_hand(delta, mtbf), rel=REL)
    assert el.young_interval_s(save_s=30.0, mtbf_s=3.6e5) == pytest.approx(math.sqrt(2.16e7))


@pytest.mark.published(kind="checkpoint_interval")
def test_daly_reproduces_his_figures(published_case):
    inputs, expected = published_case["inputs"], published_case["expected"]["tau_opt_min"]
    delta, mtbf = 60.0 * inputs["dump_min"], 60.0 * inputs["mtbf_min"]
    tau_min = el.daly_interval_s(save_s=delta, mtbf_s=mtbf) / 60
    assert tau_min == pytest.approx(daly_by_hand(delta, mtbf) / 60, rel=REL)
    decimals = len(str(expected).partition(".")[2])  # as the caption prints it
    assert round(tau_min, decimals) == expected


def test_daly_is_the_mtbf_once_a_save_takes_two_mtbfs():
    assert el.daly_interval_s(save_s=200.0, mtbf_s=100.0) == 100.0
    assert el.daly_interval_s(save_s=199.0, mtbf_s=100.0) == pytest.approx(
        daly_by_hand(199.0, 100.0), rel=REL)


@pytest.mark.parametrize("delta, restart, mtbf", REGIMES)
def test_loss_fraction_is_dalys_wall_time(delta, restart, mtbf):
    for tau in (10.0, 1000.0, 20_000.0):
        assert loss(tau, delta, restart, mtbf) == pytest.approx(
            loss_by_hand(tau, delta, restart, mtbf), rel=1e-9)


def test_loss_fraction_to_first_order_is_saves_plus_failures():
    tau, delta, restart, mtbf = 3600.0, 20.0, 130.0, 1e8
    first_order = delta / (tau + delta) + (restart + (tau + delta) / 2) / mtbf
    assert loss(tau, delta, restart, mtbf) == pytest.approx(first_order, rel=1e-4)


def test_loss_fraction_of_a_tiny_mtbf_is_all_time_not_an_overflow():
    assert loss(1.0, 10.0, 120.0, 1e-3) == 1.0


@pytest.mark.parametrize("delta, restart, mtbf", REGIMES)
def test_daly_optimum_minimises_the_loss(delta, restart, mtbf):
    tau = el.daly_interval_s(save_s=delta, mtbf_s=mtbf)
    best = loss(tau, delta, restart, mtbf)
    for factor in (0.99, 1.01, 0.9, 1.1, 0.5, 2.0):
        assert loss(tau * factor, delta, restart, mtbf) > best
    grid = [tau * (0.5 + i / 10_000) for i in range(15_001)]
    exact = min(grid, key=lambda t: loss(t, delta, restart, mtbf))
    assert exact == pytest.approx(tau, rel=5e-3)  # Daly's estimate is that close to the optimum


def test_young_is_worse_than_daly_when_saves_are_long():
    delta, restart, mtbf = 600.0, 300.0, 6 * HOUR_S
    young = el.young_interval_s(save_s=delta, mtbf_s=mtbf)
    daly = el.daly_interval_s(save_s=delta, mtbf_s=mtbf)
    assert loss(young, delta, restart, mtbf) > loss(daly, delta, restart, mtbf)


# ----- a plan -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plan_path(tmp_path_factory) -> Path:
    """megatron-1.7b on two DGX A100 nodes, pinned to ZeRO-1 data parallelism over 16 GPUs (the
    pins keep plan and explain under two seconds each)."""
    path = tmp_path_factory.mktemp("elasticity") / "plan.json"
    result = run_cli("plan", "--model", "megatron-1.7b", "--cluster", "dgx-a100-80gb",
                     "--nodes", "2", "--global-batch", "64", "--deterministic", "--tp", "1",
                     "--pp", "1", "--cp", "1", "--zero", "1", "--micro-batch", "4",
                     "--recompute", "none", "--offload", "none", "-o", path)
    assert result.code == 0, result.err
    return path


@pytest.fixture(scope="module")
def plan_estimate(plan_path):
    plan = read_plan(plan_path)
    assert (plan.config.tp, plan.config.pp, plan.config.dp, plan.config.zero_stage) == (1, 1, 16, 1)
    return estimate(plan.model, plan.cluster, plan.config, framework=plan.framework)


def params_by_hand() -> int:
    """megatron-1.7b (models.json: L 24, h 2304, V 51200, s 2048, GPT with biases, LayerNorm,
    learned positions, tied head): per layer QKV 3h^2 + 3h, projection h^2 + h, MLP 8h^2 + 5h,
    two LayerNorms 4h; embeddings (V + s) h; final LayerNorm 2h (Narayanan et al. 2021, Eq. 2)."""
    layers, h, vocab, seq = 24, 2304, 51200, 2048
    return layers * (12 * h * h + 13 * h) + (vocab + seq) * h + 2 * h


def test_checkpoint_bytes_of_a_catalog_plan(plan_estimate):
    """meshplan's runtime keeps fp32 parameters (4 bytes, the master weights) and two fp32 Adam
    moments (8): 12 bytes per parameter, each replica written once. Under ZeRO-1 over 16 ranks
    on two nodes, each node holds the whole parameters and half of the moments."""
    params = params_by_hand()
    assert params == plan_estimate.model.num_params == 1_652_230_656
    ckpt = el.checkpoint_bytes(plan_estimate)
    assert ckpt.total_bytes == pytest.approx(12 * params, rel=REL)
    assert ckpt.write_bytes_per_node == pytest.approx(12 * params / 2, rel=REL)
    assert ckpt.load_bytes_per_node == pytest.approx(4 * params + 8 * params * 8 / 16, rel=REL)


@pytest.mark.parametrize("changes, load_per_param", [
    ({"zero_stage": 0}, 12.0),              # every node holds all states
    ({"zero_stage": 3}, 6.0),               # nothing is replicated: a node loads what it wrote
    ({"tp": 2, "dp": 8, "zero_stage": 1}, 4.0 + 8.0 * 4 / 8),  # both tp halves, 4 of 8 shards
])
def test_checkpoint_bytes_follow_the_replicas(plan_estimate, changes, load_per_param):
    config = plan_estimate.config.replace(**changes)
    est = estimate(plan_estimate.model, plan_estimate.cluster, config)
    ckpt = el.checkpoint_bytes(est)
    params = params_by_hand()
    assert ckpt.total_bytes == pytest.approx(12 * params, rel=REL)  # the plan does not matter
    assert ckpt.write_bytes_per_node == pytest.approx(6 * params, rel=REL)
    assert ckpt.load_bytes_per_node == pytest.approx(load_per_param * params, rel=REL)


def test_failure_cost_adds_up(plan_estimate):
    failures = el.FailureModel(node_mtbf_s=MTBF_HOURS * HOUR_S, restart_s=100.0, replan_s=2.0,
                               read_bytes_per_s=4e9, write_bytes_per_s=1e9,
                               checkpoint_every=EVERY_STEPS)
    e = el.failure_cost(plan_estimate, failures)
    params = params_by_hand()
    assert e.job_mtbf_s == MTBF_HOURS * HOUR_S / 2
    assert e.save_s == pytest.approx(6 * params / 1e9 + 6 * params / 4e9, rel=REL)
    assert e.reshard_s == pytest.approx(6 * params / 4e9 + 8 * params / 4e9, rel=REL)
    assert e.recovery_s == pytest.approx(102.0 + e.reshard_s, rel=REL)
    assert e.daly_interval_s == pytest.approx(daly_by_hand(e.save_s, e.job_mtbf_s), rel=REL)
    chosen = e.chosen
    assert chosen.interval_s == pytest.approx(EVERY_STEPS * plan_estimate.time.step_s, rel=REL)
    assert chosen.lost_per_failure_s == pytest.approx(
        e.recovery_s + (chosen.interval_s + e.save_s) / 2, rel=REL)
    assert chosen.loss_fraction == pytest.approx(
        loss_by_hand(chosen.interval_s, e.save_s, e.recovery_s, e.job_mtbf_s), rel=1e-9)


def test_optimal_steps_beat_their_neighbours(plan_estimate):
    e = el.failure_cost(plan_estimate, el.FailureModel(node_mtbf_s=MTBF_HOURS * HOUR_S))
    k = e.optimal.every_steps
    assert abs(k * e.step_s - e.daly_interval_s) <= e.step_s
    for other in (k - 1, k + 1, k // 2, 2 * k):
        assert loss(other * e.step_s, e.save_s, e.recovery_s, e.job_mtbf_s) > \
            e.optimal.loss_fraction


def test_an_optimum_under_one_step_saves_every_step(plan_estimate):
    e = el.failure_cost(plan_estimate, el.FailureModel(node_mtbf_s=0.5))
    assert e.daly_interval_s == e.job_mtbf_s < e.step_s  # a save takes over 2 MTBFs: tau = M
    assert e.optimal.every_steps == 1


@pytest.mark.parametrize("field, value", [("node_mtbf_s", 0.0), ("node_mtbf_s", -1.0),
                                          ("node_mtbf_s", math.inf), ("restart_s", -1.0),
                                          ("read_bytes_per_s", 0.0), ("replan_s", math.nan),
                                          ("checkpoint_every", 0)])
def test_failure_model_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        el.FailureModel(**{"node_mtbf_s": 1.0, field: value})


def test_failure_detection_is_the_runtime_timeout():
    """The default restart counts the runtime's process-group timeout (read from its source:
    importing runtime/mesh.py would import torch)."""
    source = (Path(__file__).parents[2] / "runtime" / "mesh.py").read_text()
    timeout = re.search(r"^DEFAULT_TIMEOUT_S = ([0-9.]+)$", source, re.M)
    assert float(timeout.group(1)) == el.FAILURE_DETECTION_S


# ----- the command line ---------------------------------------------------------------------------
FLAGS = ["--time-limit", "5", "--node-mtbf-hours", str(MTBF_HOURS)]


@pytest.fixture(scope="module")
def explained(plan_path) -> dict:
    return run_cli("explain", plan_path, "--json", *FLAGS, "--checkpoint-every",
                   EVERY_STEPS).json()


def test_explain_json_adds_elasticity(explained, plan_path, plan_estimate):
    assert set(explained) == EXPLAIN_KEYS | {"elasticity"}
    got = explained["elasticity"]
    want = el.failure_cost(plan_estimate, el.FailureModel(
        node_mtbf_s=MTBF_HOURS * HOUR_S, checkpoint_every=EVERY_STEPS)).to_dict()
    assert got == json.loads(json.dumps(want))
    plan_file = json.loads(plan_path.read_text())
    assert got["step_s"] == pytest.approx(plan_file["predicted"]["time"]["step_s"], rel=REL)
    assert got["job_mtbf_s"] == MTBF_HOURS * HOUR_S / 2
    assert got["checkpoint_bytes"] == 12 * params_by_hand()
    assert got["saves_block_training"] is True
    assert got["restart_s"] == el.DEFAULT_RESTART_S == 120.0
    assert got["replan_s"] == 1.0 and got["read_bytes_per_s"] == got["write_bytes_per_s"] == 2e9
    assert got["checkpoint_every"]["every_steps"] == EVERY_STEPS
    assert got["checkpoint_every"]["loss_fraction"] > got["optimal"]["loss_fraction"]


def test_explain_without_mtbf_is_unchanged(plan_path):
    data = run_cli("explain", plan_path, "--json", "--time-limit", "5").json()
    assert set(data) == EXPLAIN_KEYS


def test_explain_text_has_the_section(plan_path, explained):
    result = run_cli("explain", plan_path, *FLAGS, "--checkpoint-every", EVERY_STEPS)
    assert result.code == 0, result.err
    section = result.out[result.out.index("\nelasticity: "):]
    e = explained["elasticity"]
    assert "node MTBF 10,000 h over 2 nodes: the job fails every 208 days" in section
    assert f"checkpoint: {12 * params_by_hand() / 1e9:,.1f} GB" in section
    assert "saves are synchronous" in section
    assert "restart 2 min + replan 1 s" in section
    optimal_s = e["optimal"]["interval_s"]
    assert f"optimal: save every {e['optimal']['every_steps']:,} steps = {optimal_s:,.0f} s" \
        in section
    assert f"--checkpoint-every {EVERY_STEPS}: save every {EVERY_STEPS:,} steps = " in section
    assert f"{100 * e['checkpoint_every']['loss_fraction']:.3g}% of the time lost" in section


@pytest.mark.parametrize("argv, words", [
    (["--node-mtbf-hours", "-1"], ["--node-mtbf-hours", "> 0", "'-1'"]),
    (["--node-mtbf-hours", "0"], ["--node-mtbf-hours", "> 0"]),
    (["--node-mtbf-hours", "inf"], ["--node-mtbf-hours", "finite"]),
    (["--node-mtbf-hours", "many"], ["--node-mtbf-hours", "must be a number"]),
    (["--node-mtbf-hours", "1", "--checkpoint-read-gb-per-s", "0"],
     ["--checkpoint-read-gb-per-s", "> 0"]),
    (["--node-mtbf-hours", "1", "--restart-s", "-5"], ["--restart-s", ">= 0"]),
    (["--node-mtbf-hours", "1", "--checkpoint-every", "0"],
     ["--checkpoint-every", "positive integer"]),
    (["--checkpoint-every", "100"], ["--checkpoint-every needs --node-mtbf-hours"]),
    (["--replan-s", "2", "--checkpoint-write-gb-per-s", "1"],
     ["--replan-s, --checkpoint-write-gb-per-s need --node-mtbf-hours"]),
], ids=["negative", "zero", "inf", "text", "zero-bandwidth", "negative-restart",
        "zero-steps", "needs-mtbf", "need-mtbf"])
def test_bad_flags_are_one_line_and_exit_2(plan_path, argv, words):
    line = usage_error("explain", plan_path, *argv)
    for word in words:
        assert word in line
