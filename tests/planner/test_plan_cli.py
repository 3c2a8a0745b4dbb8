"""``meshplan plan``: DESIGN.md's contract for the search command (JSON shape, ranking, pins,
objectives, exit codes 2 and 3) checked with numbers recomputed here from the cost model.

Every search below is small (megatron-1.7b / llama3-8b / tiny on one or two nodes) and finishes
in well under a second; the time limits are generous so that a slow CI machine still completes
the search.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshplan.costmodel import estimate, estimate_to_dict, load_model
from meshplan.testing import run_cli
from meshplan.testing import usage_error as cli_usage_error
from meshplan.planner.plan import plan_from_dict, read_plan

# ----- the contract, copied from DESIGN.md ("plan --json output", "Plan file") ----------------
PLAN_JSON_KEYS = {"schema_version", "plans", "solver", "pareto"}
SOLVER_KEYS = {"status", "wall_s", "candidates", "gap"}
"""DESIGN.md's solver keys, extended by "gap" (the proven gap of a FEASIBLE search, 0 when OPTIMAL)."""
SOLVER_STATUSES = {"OPTIMAL", "FEASIBLE"}
ESTIMATE_PLAN_KEYS = {"tp", "pp", "dp", "cp", "ep", "sp", "zero_stage", "offload",
                      "offload_device", "recompute", "micro_batch_size", "global_batch_size",
                      "grad_accum_steps", "vpp", "seq_len", "layers_per_stage"}
"""The ``plan`` object of ``estimate --json``; a plan file has these keys at its top level."""
PLAN_FILE_OTHER_KEYS = {"framework", "model", "cluster", "predicted", "provenance",
                        "schema_version"}

REL = 1e-9
SECONDS_PER_DAY = 86400.0
SECONDS_PER_HOUR = 3600.0
GIB = 2**30
ADAM_MIXED_PRECISION_BYTES_PER_PARAM = 2 + 2 + 12
"""bf16 weights + bf16 gradients + fp32 master, momentum and variance (ZeRO paper, Sec. 3.1)."""

A100 = ["--cluster", "dgx-a100-80gb"]
SMALL = ["--model", "megatron-1.7b", *A100, "--global-batch", "64", "--time-limit", "20"]
"""megatron-1.7b: 24 layers, 24 heads, seq 2048."""
SMALL_LAYERS = 24


meshplan = run_cli


def plan_json(*argv: str) -> dict:
    return meshplan("plan", *argv, "--json").json()


def usage_error(*argv: str) -> str:
    """``argv`` (with ``--json``) must fail as a user error (``meshplan.testing.usage_error``)."""
    return cli_usage_error(*argv, "--json")


def assert_close_tree(got, want, path: str = "") -> None:
    """Equal JSON trees, floats within REL relative."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (path, set(got) ^ set(want))
        for key in want:
            assert_close_tree(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close_tree(g, w, f"{path}[{i}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=REL, abs=0), path
    else:
        assert got == want, path


def step_s(plan: dict) -> float:
    return plan["predicted"]["time"]["step_s"]


def num_gpus(plan: dict) -> int:
    return plan["cluster"]["nodes"] * plan["cluster"]["gpus_per_node"]


def without_wall_time(plan: dict) -> dict:
    """A plan with its provenance's solver wall time dropped (the only part that may vary)."""
    plan = json.loads(json.dumps(plan))
    del plan["provenance"]["solver"]["wall_s"]
    return plan


@pytest.fixture(scope="module")
def small_plan() -> dict:
    """megatron-1.7b on two DGX A100 80GB nodes (16 GPUs), time objective, top 5."""
    return plan_json(*SMALL, "--nodes", "2")


# ----- 1. plan --json: shape, ranking, plan files, Pareto front ---------------------------------
def test_plan_json_has_exactly_the_design_keys(small_plan):
    assert set(small_plan) == PLAN_JSON_KEYS
    assert small_plan["schema_version"] == 1
    assert set(small_plan["solver"]) == SOLVER_KEYS
    assert small_plan["solver"]["status"] in SOLVER_STATUSES
    assert isinstance(small_plan["solver"]["candidates"], int)
    assert small_plan["solver"]["candidates"] >= len(small_plan["plans"]) > 0
    assert small_plan["solver"]["wall_s"] >= 0
    assert isinstance(small_plan["pareto"], list) and small_plan["pareto"]


def test_plans_are_ranked_best_first(small_plan):
    plans = small_plan["plans"]
    assert len(plans) == 5  # the default --top, and this space has many more candidates
    steps = [step_s(p) for p in plans]
    assert steps == sorted(steps)
    assert [p["provenance"]["rank"] for p in plans] == [1, 2, 3, 4, 5]
    for plan in plans:
        assert plan["provenance"]["solver"]["status"] == small_plan["solver"]["status"]
        assert plan["provenance"]["objective"] == "time"
        assert plan["predicted"]["fits"] is True
        # every plan uses the whole cluster under the time objective
        assert num_gpus(plan) == 16
        assert plan["tp"] * plan["pp"] * plan["dp"] * plan["cp"] == 16


def test_every_plan_is_a_plan_file_whose_prediction_is_the_cost_model(small_plan):
    for data in small_plan["plans"]:
        assert set(data) == set(data["predicted"]["plan"]) | PLAN_FILE_OTHER_KEYS
        assert ESTIMATE_PLAN_KEYS <= set(data)
        assert {"meshplan_version", "calibration", "solver"} <= set(data["provenance"])
        assert {"status", "wall_s"} <= set(data["provenance"]["solver"])
        plan = plan_from_dict(data)
        # reading and writing again gives the same document
        assert json.loads(json.dumps(plan.to_dict())) == data
        # "predicted" is the whole estimate --json document of the plan's configuration
        again = estimate(plan.model, plan.cluster, plan.config, framework=plan.framework)
        assert_close_tree(data["predicted"], json.loads(json.dumps(estimate_to_dict(again))))
        assert again.fits
        assert sum(data["layers_per_stage"]) == SMALL_LAYERS
        assert data["grad_accum_steps"] * data["dp"] * data["micro_batch_size"] == 64


def test_top_k_bounds_the_number_of_plans(small_plan):
    for k in (1, 2):
        data = plan_json(*SMALL, "--nodes", "2", "--top", str(k))
        assert len(data["plans"]) == k
        # the best plan does not depend on how many runners-up are asked for
        assert step_s(data["plans"][0]) == pytest.approx(step_s(small_plan["plans"][0]),
                                                         rel=REL)
    # a fully pinned space has one candidate: --top 5 gives it alone
    pinned = plan_json(*SMALL, "--nodes", "1", "--tp", "1", "--pp", "1", "--cp", "1", "--zero", "1",
                       "--micro-batch", "8", "--offload", "none", "--recompute", "none",
                       "--mesh-order", "tp,cp,dp,pp")
    assert len(pinned["plans"]) == 1 and pinned["solver"]["candidates"] == 1


def test_pareto_points_are_mutually_non_dominated(small_plan):
    front = small_plan["pareto"]
    points = [(p["step_s"], p["peak_reserved_bytes"]) for p in front]
    for i, (t_i, m_i) in enumerate(points):
        for j, (t_j, m_j) in enumerate(points):
            if i != j:
                assert not (t_j <= t_i and m_j <= m_i), (front[i], front[j])
    assert [t for t, _ in points] == sorted(t for t, _ in points)
    # the fastest point of the front is the best plan (nothing explored is faster)
    assert points[0][0] == pytest.approx(step_s(small_plan["plans"][0]), rel=REL)
    for point in front:
        assert point["num_gpus"] == 16
        assert point["tokens_per_s"] == pytest.approx(64 * 2048 / point["step_s"], rel=REL)


def test_plan_json_is_only_json_on_stdout_of_the_console_script():
    script = Path(sys.executable).parent / "meshplan"
    if not script.exists():
        pytest.skip("meshplan console script not installed in this environment")
    proc = subprocess.run([str(script), "plan", *SMALL, "--nodes", "1", "--top", "2", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["plans"]) == 2


# ----- 2. pins -----------------------------------------------------------------------------------
@pytest.mark.parametrize("pins, check", [
    (["--zero", "3"], lambda p: p["zero_stage"] == 3),
    (["--recompute", "full"], lambda p: p["recompute"] in ("full", ["full"] * p["pp"])),
    (["--pp", "2", "--layers-per-stage", "10,14"],
     lambda p: p["pp"] == 2 and p["layers_per_stage"] == [10, 14]
     and [s["layers"] for s in p["predicted"]["memory"]["per_stage"]] == [10, 14]),
    (["--layers-per-stage", "10,14"], lambda p: p["pp"] == 2 and p["layers_per_stage"] == [10, 14]),
    (["--pp", "2", "--recompute", "full,none"], lambda p: p["recompute"] == ["full", "none"]),
    (["--micro-batch", "2", "--mesh-order", "tp,cp,pp,dp"],
     lambda p: p["micro_batch_size"] == 2 and p["mesh_order"] == ["tp", "cp", "pp", "dp"]),
], ids=["zero3", "recompute-full", "pp2-split", "split-implies-pp", "recompute-per-stage",
        "micro-batch-and-mesh"])
def test_pins_hold_in_every_plan(pins, check):
    data = plan_json(*SMALL, "--nodes", "1", *pins)
    assert data["plans"]
    for plan in data["plans"]:
        assert check(plan), plan
        assert plan["predicted"]["plan"]["layers_per_stage"] == plan["layers_per_stage"]


def test_tp_pin_on_llama3_8b():
    data = plan_json("--model", "llama3-8b", *A100, "--nodes", "1", "--global-batch", "32",
                     "--time-limit", "20", "--tp", "8")
    assert data["plans"]
    for plan in data["plans"]:
        assert plan["tp"] == 8 and plan["dp"] * plan["pp"] * plan["cp"] == 1
        assert plan["predicted"]["plan"]["tp"] == 8


def test_pins_restrict_the_space():
    """--zero 3 leaves a subset of the configurations (the solver's candidate count is not a
    measure of that: it depends on how soon bounds prune), and no faster plan."""
    from meshplan.costmodel import load_cluster
    from meshplan.planner.space import SearchSpace, candidates

    model, cluster = load_model("megatron-1.7b"), load_cluster("dgx-a100-80gb", nodes=1)
    whole = set(candidates(model, cluster, SearchSpace(global_batch_size=64, seq_len=2048)))
    zero3 = set(candidates(model, cluster, SearchSpace(global_batch_size=64, seq_len=2048,
                                                       zero_stage=(3,))))
    assert zero3 < whole and {c.zero_stage for c in zero3} == {3}
    free = plan_json(*SMALL, "--nodes", "1")
    pinned = plan_json(*SMALL, "--nodes", "1", "--zero", "3")
    # a restricted space cannot find a faster plan
    assert step_s(pinned["plans"][0]) >= step_s(free["plans"][0]) * (1 - REL)


FULLY_PINNED = ["--model", "megatron-1.7b", *A100, "--nodes", "1", "--tp", "2", "--pp", "2",
                "--dp", "2", "--cp", "1", "--ep", "1", "--sp", "--zero", "1", "--offload", "none",
                "--offload-device", "cpu", "--recompute", "selective", "--micro-batch", "2",
                "--global-batch", "32", "--seq-len", "2048", "--vpp", "1",
                "--layers-per-stage", "11,13", "--mesh-order", "tp,cp,dp,pp", "--dtype", "bf16",
                "--framework", "meshplan"]
"""Every plan flag of ``estimate``: the space has exactly one configuration."""


def test_fully_pinned_plan_predicts_what_estimate_says():
    data = plan_json(*FULLY_PINNED, "--time-limit", "20")
    est = meshplan("estimate", *FULLY_PINNED, "--json").json()
    assert data["solver"]["candidates"] == 1
    assert len(data["plans"]) == 1
    plan = data["plans"][0]
    assert (plan["tp"], plan["pp"], plan["dp"], plan["zero_stage"], plan["recompute"],
            plan["layers_per_stage"], plan["micro_batch_size"]) == \
        (2, 2, 2, 1, "selective", [11, 13], 2)
    assert_close_tree(plan["predicted"], est)
    assert step_s(plan) == pytest.approx(est["time"]["step_s"], rel=REL)


# ----- 4. objectives -----------------------------------------------------------------------------
TOKENS = 1e12
PRICE = 2.0
COST = ["--objective", "cost", "--train-tokens", "1e12", "--gpu-hour-price", "2"]


def train_steps(plan: dict) -> int:
    return math.ceil(TOKENS / (plan["global_batch_size"] * plan["seq_len"]))


def train_days(plan: dict) -> float:
    return train_steps(plan) * step_s(plan) / SECONDS_PER_DAY


def train_cost(plan: dict) -> float:
    return train_steps(plan) * step_s(plan) * num_gpus(plan) * PRICE / SECONDS_PER_HOUR


@pytest.fixture(scope="module")
def fastest_per_node_count() -> dict[int, dict]:
    """The fastest plan of the time objective on one and on two nodes."""
    return {n: plan_json(*SMALL, "--nodes", str(n), "--top", "1")["plans"][0] for n in (1, 2)}


def test_cost_objective_reports_days_and_cost(fastest_per_node_count):
    data = plan_json(*SMALL, "--nodes", "2", *COST)
    assert set(data) == PLAN_JSON_KEYS and data["solver"]["status"] in SOLVER_STATUSES
    plans = data["plans"]
    assert plans
    for plan in plans:
        prov = plan["provenance"]
        assert prov["objective"] == "cost"
        assert prov["train_steps"] == train_steps(plan) == math.ceil(1e12 / (64 * 2048))
        assert prov["train_days"] == pytest.approx(train_days(plan), rel=REL)
        assert prov["train_cost"] == pytest.approx(train_cost(plan), rel=REL)
        assert num_gpus(plan) <= 16
        assert plan_from_dict(plan).cluster.num_gpus == num_gpus(plan)
    costs = [p["provenance"]["train_cost"] for p in plans]
    assert costs == sorted(costs)
    # the cheapest plan is at least as cheap as the fastest plan on either node count ...
    cheapest_fastest = min(fastest_per_node_count.values(), key=train_cost)
    assert costs[0] <= train_cost(cheapest_fastest) * (1 + REL)
    # ... and here it is the one-node plan: 16 GPUs are less than twice as fast as 8 for this
    # compute-bound 1.7B model, so the second node costs more than it saves
    assert train_cost(fastest_per_node_count[1]) < train_cost(fastest_per_node_count[2])
    assert num_gpus(plans[0]) == 8


def test_cost_objective_meets_a_deadline(fastest_per_node_count):
    """A deadline between the two node counts' fastest times forces the second node."""
    one, two = train_days(fastest_per_node_count[1]), train_days(fastest_per_node_count[2])
    assert two < one
    deadline = (one + two) / 2
    data = plan_json(*SMALL, "--nodes", "2", *COST, "--deadline-days", f"{deadline:.6f}")
    assert data["plans"]
    for plan in data["plans"]:
        assert plan["provenance"]["train_days"] <= deadline
        assert num_gpus(plan) == 16


def test_deadline_nothing_meets_exits_3():
    result = meshplan("plan", *SMALL, "--nodes", "2", *COST, "--deadline-days", "0.001",
                      "--json")
    assert result.code == 3
    assert result.out == ""
    lines = result.err.splitlines()
    assert len(lines) == 1 and "Traceback" not in result.err
    assert lines[0].startswith("meshplan: ")
    assert "0.001 days" in lines[0]


def test_time_objective_with_train_tokens_reports_days():
    data = plan_json(*SMALL, "--nodes", "1", "--top", "1", "--train-tokens", "1e12")
    plan = data["plans"][0]
    assert plan["provenance"]["train_days"] == pytest.approx(train_days(plan), rel=REL)
    assert "train_cost" not in plan["provenance"]  # no price given


@pytest.mark.parametrize("extra, flag", [
    ([], "--train-tokens"),
    (["--train-tokens", "1e12"], "--gpu-hour-price"),
])
def test_cost_objective_needs_tokens_and_price(extra, flag):
    line = usage_error("plan", *SMALL, "--nodes", "1", "--objective", "cost", *extra)
    assert flag in line


# ----- 5. nothing fits ---------------------------------------------------------------------------
def test_no_plan_fits_exits_3_naming_the_least_memory_configuration(tmp_path):
    output = tmp_path / "plan.json"
    result = meshplan("plan", "--model", "llama3-405b", "--cluster", "dgx-a100-40gb",
                      "--nodes", "1", "--global-batch", "8", "--offload", "none",
                      "--time-limit", "20", "--json", "-o", output)
    assert result.code == 3
    assert result.out == ""
    assert not output.exists()
    assert "Traceback" not in result.err
    lines = result.err.splitlines()
    assert len(lines) == 1, result.err
    line = lines[0]
    assert line.startswith("meshplan: no plan fits")
    assert "least-memory configuration" in line and "offload none" in line
    found = re.search(r"needs ([\d., ]+) GiB reserved per stage(?: \(stage \d+ binds\))? "
                      r"against ([\d.]+) GiB", line)
    assert found, line
    per_stage_gib = [float(x) for x in found.group(1).split(",")]
    assert float(found.group(2)) == 38.0  # the A100 40GB's 40 GiB, less the default 5% margin
    # without offload, the 8 GPUs together hold 16 bytes per parameter: the fullest stage needs
    # at least an eighth of that
    floor_gib = (ADAM_MIXED_PRECISION_BYTES_PER_PARAM * load_model("llama3-405b").num_params
                 / 8 / GIB)
    assert max(per_stage_gib) >= floor_gib
    assert max(per_stage_gib) > 40.0


# ----- 6. bad input: exit 2, one line, nothing on stdout -----------------------------------------
ONE_NODE = ["plan", *SMALL, "--nodes", "1"]


@pytest.mark.parametrize("argv, words", [
    ([*ONE_NODE, "--pp", "2", "--layers-per-stage", "8,8,8"], ["--layers-per-stage", "3", "--pp"]),
    ([*ONE_NODE, "--pp", "2", "--recompute", "full,full,full"], ["--recompute", "3", "--pp"]),
    ([*ONE_NODE, "--pp", "3", "--layers-per-stage", "8,8,8", "--recompute", "full,none"],
     ["--recompute", "2"]),
    ([*ONE_NODE, "--layers-per-stage", "10,10"], ["sums to 20", "24"]),
    ([*ONE_NODE, "--pp", "2", "--layers-per-stage", "12,13"], ["sums to 25", "24"]),
    ([*ONE_NODE, "--layers-per-stage", "12,0"], ["--layers-per-stage"]),
    ([*ONE_NODE, "--offload", "optimizer+params", "--zero", "1"], []),
    (["plan", "--model", "megatron-1.7b", *A100, "--nodes", "1", "--global-batch", "3",
      "--dp", "8", "--time-limit", "20"], ["global batch 3"]),
    (["plan", "--model", "megatron-1.7b", *A100, "--nodes", "1", "--global-batch", "3",
      "--tp", "1", "--pp", "1", "--cp", "1", "--time-limit", "20"], ["global batch 3"]),
    # tiny (4 layers, 2 kv heads) on 16 GPUs without context parallelism: tp <= 2 and
    # pp <= 4 leave dp >= 2, and no dp divides a global batch of 3
    (["plan", "--model", "tiny", *A100, "--nodes", "2", "--global-batch", "3", "--cp", "1",
      "--time-limit", "20"], ["global batch 3"]),
    ([*ONE_NODE, "--tp", "3"], []),
    ([*ONE_NODE, "--nodes", "0"], ["--nodes"]),
    ([*ONE_NODE, "--nodes", "-2"], ["--nodes"]),
    ([*ONE_NODE, "--gpus-per-node", "0"], ["--gpus-per-node"]),
    ([*ONE_NODE, "--gpus-per-node", "-8"], ["--gpus-per-node"]),
    ([*ONE_NODE, "--time-limit", "0"], ["--time-limit"]),
    ([*ONE_NODE, "--time-limit", "-1"], ["--time-limit"]),
    ([*ONE_NODE, "--memory-margin", "1.5"], ["--memory-margin", "1.5"]),
    ([*ONE_NODE, "--memory-margin", "1"], ["--memory-margin"]),
    ([*ONE_NODE, "--memory-margin", "-0.1"], ["--memory-margin"]),
    ([*ONE_NODE, "--top", "0"], ["--top"]),
    ([*ONE_NODE, "--recompute", "sometimes"], ["sometimes"]),
    ([*ONE_NODE, "--objective", "money"], ["--objective"]),
    ([*ONE_NODE, "--train-tokens", "-5"], ["--train-tokens"]),
    ([*ONE_NODE, "--host-memory-gib", "inf"], ["--host-memory-gib", "finite"]),
    ([*ONE_NODE, "--nvme-gib", "inf"], ["--nvme-gib", "finite"]),
    ([*ONE_NODE, "--time-limit", "inf"], ["--time-limit", "finite"]),
    # no pp x vpp fits the 24 layers: the search found nothing and blamed host memory
    ([*ONE_NODE, "--vpp", "13"], ["--vpp 13", "24 layers", "at most 12 with pp 2"]),
    ([*ONE_NODE, "--pp", "4", "--vpp", "7"], ["--vpp 7", "at most 6 with pp 4"]),
    ([*ONE_NODE, "--model", "no-such-model"], ["no-such-model"]),
    (["plan", "--model", "megatron-1.7b", *A100, "--nodes", "1"], ["--global-batch"]),
], ids=["split-vs-pp", "recompute-vs-pp", "recompute-vs-split", "split-sum",
        "split-sum-with-pp", "split-zero", "offload-params-zero1", "batch-vs-pinned-dp",
        "batch-vs-pinned-tp-pp", "batch-no-dp-divides", "tp3", "nodes-0", "nodes-negative",
        "gpus-per-node-0", "gpus-per-node-negative", "time-limit-0", "time-limit-negative",
        "margin-1.5", "margin-1", "margin-negative", "top-0", "recompute-mode",
        "objective", "train-tokens-negative", "host-memory-inf", "nvme-inf", "time-limit-inf",
        "vpp-13", "vpp-7-pp4",
        "model", "no-global-batch"])
def test_bad_input_is_a_one_line_user_error(argv, words):
    line = usage_error(*argv)
    for word in words:
        assert word in line, line


def test_offload_params_without_zero3_names_the_conflict():
    line = usage_error(*ONE_NODE, "--offload", "optimizer+params", "--zero", "1")
    assert "optimizer+params" in line and "3" in line


def test_a_time_limit_too_short_to_solve_is_not_reported_as_no_plan_fits():
    result = meshplan("plan", "--model", "llama3-8b", *A100, "--nodes", "2", "--global-batch",
                      "64", "--time-limit", "0.01", "--json")
    if result.code == 0:
        data = json.loads(result.out)
        assert data["plans"] and data["solver"]["status"] == "FEASIBLE"
    else:
        assert "no plan fits" not in result.err
        assert "time" in result.err


# ----- 8. determinism ----------------------------------------------------------------------------
def test_same_command_same_plans():
    argv = ("--model", "llama3-8b", *A100, "--nodes", "2", "--global-batch", "64",
            "--deterministic", "--seed", "7")  # work limits: the same on a busy machine
    first, second = plan_json(*argv), plan_json(*argv)
    assert first["solver"]["status"] == second["solver"]["status"] == "OPTIMAL"
    assert first["solver"]["candidates"] == second["solver"]["candidates"]
    assert [without_wall_time(p) for p in first["plans"]] == \
        [without_wall_time(p) for p in second["plans"]]
    assert first["pareto"] == second["pareto"]


def test_plan_carries_torchtitan_checkpoint_settings(tmp_path):
    """--recompute-early-stop and --selective-ac are settings of every configuration the search
    tries, recorded in the plan file: early stopping makes full recomputation cheaper."""
    args = ["--model", "megatron-1.7b", *A100, "--nodes", "1", "--global-batch", "64",
            "--framework", "torchtitan", "--tp", "1", "--pp", "1", "--recompute", "full",
            "--deterministic"]
    plain = plan_json(*args)["plans"][0]
    path = tmp_path / "plan.json"
    meshplan("plan", *args, "--recompute-early-stop", "-o", str(path))
    early = json.loads(path.read_text())
    assert early["recompute_early_stop"] is True and "recompute_early_stop" not in plain
    assert step_s(early) < step_s(plain)
    layer = plan_json(*args[:-3], "--recompute", "selective", "--selective-ac", "2",
                      "--deterministic")["plans"][0]
    assert layer["selective_ac"] == "2"


H100_TORCHTITAN = ["--model", "megatron-1.7b", "--cluster", "dgx-h100", "--nodes", "1",
                   "--global-batch", "64", "--framework", "torchtitan", "--deterministic"]
"""One H100 node (float8 tensor cores) under torchtitan, where --compile and --float8 are
modelled."""


def test_plan_carries_compile_and_float8_to_every_candidate():
    """--compile and --float8 are settings of every configuration the search tries, not
    searched: every ranked plan holds them and is priced as ``estimate`` prices it with them
    (not as without them); the plan's provenance records them for explain and replan."""
    plans = plan_json(*H100_TORCHTITAN, "--top", "3", "--compile", "model",
                      "--float8")["plans"]
    assert plans and all((p["compile"], p["float8"]) == ("model", True) for p in plans)
    pinned = plans[0]["provenance"]["pinned"]
    assert (pinned["compile"], pinned["float8"]) == ("model", True)
    for data in plans:
        plan = plan_from_dict(data)
        priced = estimate(plan.model, plan.cluster, plan.config, framework="torchtitan")
        assert priced.time.step_s == pytest.approx(step_s(data), rel=REL)
        eager = estimate(plan.model, plan.cluster,
                         plan.config.replace(compile="none", float8=False),
                         framework="torchtitan")
        assert eager.time.step_s != pytest.approx(step_s(data), rel=REL)
    plain = plan_json(*H100_TORCHTITAN, "--top", "1")["plans"][0]
    assert "compile" not in plain and "float8" not in plain
    assert "compile" not in plain["provenance"]["pinned"]


@pytest.mark.parametrize("argv, words", [
    (["--framework", "megatron", "--compile", "model"], ["--compile", "torchtitan"]),
    (["--framework", "deepspeed", "--float8"], ["--float8", "torchtitan"]),
    (["--framework", "torchtitan", "--float8", "--dtype", "fp32"], ["float8", "bf16", "fp32"]),
], ids=["compile-megatron", "float8-deepspeed", "float8-fp32"])
def test_compile_and_float8_refusals_are_one_line(argv, words):
    """A user error (exit 2, one line), not "no plan fits" (exit 3)."""
    line = usage_error("plan", *H100_TORCHTITAN[:-3], *argv)
    assert all(word in line for word in words), line


def test_explain_names_compile_and_float8(tmp_path):
    path = tmp_path / "plan.json"
    result = run_cli("plan", *H100_TORCHTITAN, "--compile", "model+loss", "--float8",
                     "-o", path)
    assert result.code == 0, result.err
    result = run_cli("explain", path, "--time-limit", "5")
    assert result.code == 0, result.err
    first = result.out.splitlines()[0]
    assert first.startswith("plan: ") and first.endswith(
        ", torch.compile model+loss, float8 linears"), first


def _what_ifs(path) -> dict[str, dict]:
    """``explain PATH --json``'s what-ifs by change."""
    result = run_cli("explain", path, "--time-limit", "5", "--json")
    assert result.code == 0, result.err
    return {w["change"]: w for w in json.loads(result.out)["what_if"]}


def _assert_priced(entries: dict[str, dict], path, change: str, *,
                   framework: str = "torchtitan", **settings) -> None:
    """The what-if ``change`` is the plan at ``path`` with ``settings``, as ``estimate``
    prices it under ``framework``, and it is faster."""
    plan = read_plan(path)
    again = estimate(plan.model, plan.cluster, plan.config.replace(**settings),
                     framework=framework)
    assert entries[change]["step_s"] == pytest.approx(again.time.step_s, rel=REL)
    assert entries[change]["delta_s"] < 0


def test_explain_prices_the_torchtitan_settings_a_plan_leaves_off(tmp_path):
    """Under torchtitan, explain's what-ifs hold the same plan with torch.compile (blocks and
    loss) and with float8 linears, each as ``estimate`` prices it; a plan that sets both gets
    neither line."""
    path = tmp_path / "plan.json"
    assert run_cli("plan", *H100_TORCHTITAN, "-o", path).code == 0
    entries = _what_ifs(path)
    _assert_priced(entries, path, "--compile model+loss", compile="model+loss")
    _assert_priced(entries, path, "--float8", float8=True)
    both = tmp_path / "both.json"
    assert run_cli("plan", *H100_TORCHTITAN, "--compile", "model+loss", "--float8",
                   "-o", both).code == 0
    changes = set(_what_ifs(both))
    assert not changes & {"--compile model+loss", "--float8"}
    # a float8 head is offered beside float8 blocks, where the model's head is its own
    assert read_plan(both).model.tied_embeddings and "--float8-head" not in changes


def test_explain_prices_float8_for_a_megatron_plan(tmp_path):
    """Under Megatron-LM only float8 (Transformer Engine) is offered, priced as ``estimate``
    prices the same plan with it under megatron; compile, a float8 head and async TP are
    torchtitan's."""
    path = tmp_path / "plan.json"
    argv = [*H100_TORCHTITAN[:-2], "megatron", "--deterministic"]
    assert argv[argv.index("--framework") + 1] == "megatron"
    assert run_cli("plan", *argv, "-o", path).code == 0
    entries = _what_ifs(path)
    _assert_priced(entries, path, "--float8", framework="megatron", float8=True)
    assert not set(entries) & {"--compile model+loss", "--float8-head", "--async-tp"}


def test_megatron_tp_overlap_is_a_setting_of_plan_and_a_what_if_of_explain(tmp_path):
    """``plan --tp-comm-overlap`` gives it to every candidate (recorded in the plan file);
    a Megatron-LM plan with sequence-parallel TP that leaves it off is offered it, priced as
    ``estimate`` prices the same plan with it; ``--no-overlap-comm`` is recorded too."""
    path, fused, plain = (tmp_path / name for name in ("plan.json", "fused.json", "plain.json"))
    argv = ["--model", "llama3-70b", "--cluster", "dgx-h100", "--nodes", "2", "--tp", "8",
            "--sp", "--global-batch", "64", "--framework", "megatron", "--deterministic"]
    assert run_cli("plan", *argv, "-o", path).code == 0
    _assert_priced(_what_ifs(path), path, "--tp-comm-overlap", framework="megatron",
                   tp_comm_overlap=True)
    assert run_cli("plan", *argv, "--tp-comm-overlap", "-o", fused).code == 0
    assert read_plan(fused).config.tp_comm_overlap
    assert "--tp-comm-overlap" not in _what_ifs(fused)
    assert run_cli("plan", *argv, "--no-overlap-comm", "-o", plain).code == 0
    assert read_plan(plain).config.overlap_comm is False


def test_explain_prices_the_other_context_parallel_exchanges(tmp_path):
    """A Megatron-LM plan with cp > 1 is offered the exchanges other than its own that its
    layout runs, each priced as ``estimate`` prices the same plan with it; the planner
    searched them, so none is faster."""
    from meshplan.costmodel.frameworks import cp_exchange
    path = tmp_path / "plan.json"
    argv = ["--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "1", "--tp", "2",
            "--sp", "--cp", "4", "--global-batch", "8", "--seq-len", "32768",
            "--framework", "megatron", "--deterministic"]
    assert run_cli("plan", *argv, "-o", path).code == 0
    entries, plan = _what_ifs(path), read_plan(path)
    own = cp_exchange("megatron", plan.config.cp_comm_type)
    others = [x for x in ("p2p", "all_gather", "a2a") if x != own]
    assert len(others) == 2
    step = estimate(plan.model, plan.cluster, plan.config, framework="megatron").time.step_s
    for exchange in others:
        again = estimate(plan.model, plan.cluster, plan.config.replace(cp_comm_type=exchange),
                         framework="megatron")
        entry = entries[f"--cp-comm-type {exchange}"]
        assert entry["step_s"] == pytest.approx(again.time.step_s, rel=REL)
        assert entry["step_s"] >= step * (1 - REL)
    assert f"--cp-comm-type {own}" not in entries


def test_explain_prices_a_float8_head_for_an_untied_model(tmp_path):
    path = tmp_path / "plan.json"
    argv = ["--model", "llama3-8b", *H100_TORCHTITAN[2:]]
    assert run_cli("plan", *argv, "--float8", "-o", path).code == 0
    _assert_priced(_what_ifs(path), path, "--float8-head", float8_head=True)


def test_explain_prices_async_tp_for_a_compiled_tp_plan(tmp_path):
    """A compiled torchtitan plan with sequence-parallel TP is offered ``--async-tp`` (priced
    as the same plan with it); a plan with it already set is not."""
    path = tmp_path / "plan.json"
    argv = ["--model", "llama3-70b", "--cluster", "grand-teton-h100", "--nodes", "4",
            "--global-batch", "16", "--framework", "torchtitan", "--compile", "model",
            "--tp", "8", "--sp", "--deterministic"]
    assert run_cli("plan", *argv, "-o", path).code == 0
    _assert_priced(_what_ifs(path), path, "--async-tp", async_tp=True)
    fused = tmp_path / "fused.json"
    assert run_cli("plan", *argv, "--async-tp", "-o", fused).code == 0
    assert read_plan(fused).config.async_tp
    assert "--async-tp" not in _what_ifs(fused)


def test_planning_a_model_the_runtime_cannot_train_warns_for_its_framework_only():
    """An MoE model planned for meshplan's runtime (the default framework) is planned, with a
    one-line warning that ``meshplan run`` will refuse it (``runtime/support.py``); for a
    framework the plan is exported to, nothing is said."""
    argv = ("--model", "mixtral-8x7b", "--cluster", "dgx-h100", "--nodes", "2",
            "--global-batch", "64", "--seq-len", "4096", "--time-limit", "20")
    ours = meshplan("plan", *argv, "--json")
    assert ours.code == 0 and json.loads(ours.out)["plans"]
    warnings = [line for line in ours.err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "meshplan run will refuse this plan: MoE" in warnings[0]
    theirs = meshplan("plan", *argv, "--framework", "torchtitan", "--json")
    assert theirs.json()["plans"]  # nothing on stderr
