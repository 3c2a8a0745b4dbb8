"""Plan files (DESIGN.md, "Plan file"): ``plan -o`` writes them, ``export`` and ``explain`` read
them, readers reject unknown / missing keys and other schema versions, and ``explain`` says what
binds with numbers recomputed here from the plan's own prediction and the cost model.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import tomllib
from pathlib import Path

import pytest

from meshplan.costmodel import estimate
from meshplan.testing import run_cli, usage_error
from meshplan.planner.plan import read_plan, write_plan

# ----- the contract, copied from DESIGN.md --------------------------------------------------------
ESTIMATE_PLAN_KEYS = {"tp", "pp", "dp", "cp", "ep", "sp", "zero_stage", "offload",
                      "offload_device", "recompute", "micro_batch_size", "global_batch_size",
                      "grad_accum_steps", "vpp", "seq_len", "layers_per_stage"}
PLAN_FILE_OTHER_KEYS = {"framework", "model", "cluster", "predicted", "provenance",
                        "schema_version"}
EXPLAIN_KEYS = {"plan", "binding", "runners_up", "what_if"}
TIME_TERMS = ("compute_s", "tp_comm_s", "cp_comm_s", "ep_comm_s", "pp_comm_s", "pp_bubble_s",
              "dp_comm_s", "offload_s", "optimizer_s")
"""The terms that add up to a step (communication as exposed)."""
TARGETS = ("deepspeed", "megatron", "torchtitan")
SUMMARY_KEYS = ("tp", "pp", "dp", "cp", "ep", "sp", "zero_stage", "offload", "offload_device",
                "recompute", "micro_batch_size", "vpp", "layers_per_stage", "mesh_order")
"""The choices that tell two configurations apart (explain's plan summaries)."""

REL = 1e-9
GLOBAL_BATCH = 64
BASE = ["--model", "megatron-1.7b", "--cluster", "dgx-a100-80gb", "--global-batch",
        str(GLOBAL_BATCH), "--time-limit", "20"]
"""megatron-1.7b: 24 layers, seq 2048; searches of it take well under a second."""


meshplan = run_cli




def write_plan_file(path: Path, *argv: str) -> dict:
    """``meshplan plan ... -o path --json``; returns the JSON output."""
    data = meshplan("plan", *BASE, *argv, "-o", path, "--json").json()
    assert path.is_file()
    return data


@pytest.fixture(scope="module")
def pinned(tmp_path_factory) -> tuple[Path, dict]:
    """A two-node plan with a pinned, uneven two-stage split (so stages differ in memory) and
    the plain 1F1B schedule (DeepSpeed has no interleaved one)."""
    path = tmp_path_factory.mktemp("pinned") / "plan.json"
    write_plan_file(path, "--nodes", "2", "--pp", "2", "--layers-per-stage", "10,14",
                    "--vpp", "1")
    return path, json.loads(path.read_text())


@pytest.fixture(scope="module")
def unpinned(tmp_path_factory) -> tuple[Path, dict]:
    """The best plan of the whole one-node space."""
    path = tmp_path_factory.mktemp("unpinned") / "plan.json"
    write_plan_file(path, "--nodes", "1")
    return path, json.loads(path.read_text())


@pytest.fixture(scope="module")
def explained(pinned) -> dict:
    path, _ = pinned
    return meshplan("explain", path, "--json", "--time-limit", "20").json()


# ----- 3. -o writes the best plan; --force; export and explain read it --------------------------
def test_output_file_holds_the_best_plan(tmp_path):
    path = tmp_path / "plan.json"
    data = write_plan_file(path, "--nodes", "1")
    written = json.loads(path.read_text())
    assert written == data["plans"][0]
    assert written["provenance"]["rank"] == 1
    assert set(written) == set(written["predicted"]["plan"]) | PLAN_FILE_OTHER_KEYS
    assert ESTIMATE_PLAN_KEYS <= set(written)
    plan = read_plan(path)
    assert plan.step_s == written["predicted"]["time"]["step_s"]
    assert plan.config.global_batch_size == GLOBAL_BATCH


def test_output_file_is_not_overwritten_without_force(tmp_path):
    path = tmp_path / "plan.json"
    write_plan_file(path, "--nodes", "1", "--zero", "1")
    before = path.read_bytes()
    line = usage_error("plan", *BASE, "--nodes", "1", "--zero", "3", "-o", path, "--json")
    assert "--force" in line and str(path) in line
    assert path.read_bytes() == before
    # the text report refuses the same way
    usage_error("plan", *BASE, "--nodes", "1", "--zero", "3", "-o", path)
    assert path.read_bytes() == before

    data = meshplan("plan", *BASE, "--nodes", "1", "--zero", "3", "-o", path, "--force",
                    "--json").json()
    written = json.loads(path.read_text())
    assert written == data["plans"][0]
    assert written["zero_stage"] == 3
    assert json.loads(before)["zero_stage"] == 1


def test_text_report_says_where_the_plan_went(tmp_path):
    path = tmp_path / "plan.json"
    result = meshplan("plan", *BASE, "--nodes", "1", "--top", "1", "-o", path)
    assert result.code == 0, result.err
    assert f"wrote the best plan to {path}" in result.out
    assert json.loads(path.read_text())["provenance"]["rank"] == 1


@pytest.mark.parametrize("target", TARGETS)
def test_export_reads_the_written_plan(pinned, unpinned, target):
    path, data = pinned
    result = meshplan("export", path, "--to", target, "--json")
    if target == "torchtitan":  # a GPT-style model (GeLU, LayerNorm) has no torchtitan flavour
        assert result.code == 2 and result.out == ""
        assert len(result.err.strip().splitlines()) == 1 and "torchtitan" in result.err
        return
    if target == "deepspeed":  # no PipelineModule partition method builds the pinned split
        assert result.code == 2 and result.out == ""
        assert len(result.err.strip().splitlines()) == 1
        assert "PipelineModule" in result.err and "[10, 14]" in result.err
        path, data = unpinned
        result = meshplan("export", path, "--to", target, "--json")
    assert result.code == 0, result.err
    export = json.loads(result.out)
    assert export["target"] == target
    config = export["config"]
    if target == "deepspeed":
        assert config["train_batch_size"] == GLOBAL_BATCH
        assert config["train_micro_batch_size_per_gpu"] == data["micro_batch_size"]
        assert config["gradient_accumulation_steps"] == data["grad_accum_steps"]
        assert config["zero_optimization"]["stage"] == data["zero_stage"]
    elif target == "megatron":
        args = dict(zip(config, config[1:]))
        assert args["--pipeline-model-parallel-size"] == str(data["pp"])
        assert args["--tensor-model-parallel-size"] == str(data["tp"])
        assert args["--global-batch-size"] == str(GLOBAL_BATCH)
        assert args["--micro-batch-size"] == str(data["micro_batch_size"])
        assert shlex.split(export["text"]) == config
    else:
        assert tomllib.loads(export["text"]) == config
        assert config["parallelism"]["pipeline_parallel_degree"] == data["pp"]


def test_explain_reads_the_written_plan_as_text(pinned):
    path, data = pinned
    result = meshplan("explain", path, "--time-limit", "20")
    assert result.code == 0, result.err
    assert "what binds" in result.out
    assert "runners-up" in result.out and "what if" in result.out
    assert "2x inter-node bandwidth" in result.out
    assert f"layers {data['layers_per_stage']}" in result.out


# ----- 6. bad plan files: exit 2, one line naming the problem ------------------------------------
def _edit(data: dict, **changes) -> dict:
    return {**json.loads(json.dumps(data)), **changes}


def _pins(data: dict, pinned) -> dict:
    """``data`` with ``provenance.pinned`` (the search's pins, which explain reuses) replaced."""
    return _edit(data, provenance={**data["provenance"], "pinned": pinned})


BAD_FILES = {
    "unknown-key": (lambda d: _edit(d, learning_rate=3e-4), ["unknown", "learning_rate"]),
    "missing-key": (lambda d: {k: v for k, v in d.items() if k != "zero_stage"},
                    ["missing", "zero_stage"]),
    "schema-2": (lambda d: _edit(d, schema_version=2), ["schema_version 2"]),
    "bad-grad-accum": (lambda d: _edit(d, grad_accum_steps=d["grad_accum_steps"] + 1),
                       ["grad_accum_steps"]),
    "model-not-object": (lambda d: _edit(d, model="megatron-1.7b"), ["model"]),
    "predicted-not-object": (lambda d: _edit(d, predicted=[]), ["predicted"]),
    "tp-string": (lambda d: _edit(d, tp="1"), ["tp"]),
    # found by mutating plan files at random: explain fed these to its searches unchecked
    "pins-not-object": (lambda d: _pins(d, ["tp"]), ["provenance", "pinned"]),
    "pins-cp-nested": (lambda d: _pins(d, {"cp": [[]]}), ["pinned cp", "positive integers"]),
    "pins-device-number": (lambda d: _pins(d, {"offload_device": 1.5}),
                           ["pinned offload_device", "cpu"]),
    "pins-unknown": (lambda d: _pins(d, {"learning_rate": [1]}), ["learning_rate"]),
    "pins-setting-type": (lambda d: _pins(d, {"float8": "yes"}), ["pinned float8", "bool"]),
}


@pytest.mark.parametrize("command", [["explain", "--json"], ["export", "--to", "megatron"]],
                         ids=["explain", "export"])
@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_plan_file_is_a_user_error(unpinned, tmp_path, command, case):
    _, data = unpinned
    make, words = BAD_FILES[case]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(make(data)))
    line = usage_error(command[0], path, *command[1:])
    for word in words:
        assert word in line, line


@pytest.mark.parametrize("command", [["explain", "--json"], ["export", "--to", "deepspeed"]],
                         ids=["explain", "export"])
@pytest.mark.parametrize("text, words", [
    ("{\"tp\": 1,", ["not valid JSON"]),
    ("", ["not valid JSON"]),
    ("[{\"tp\": 1}]", ["JSON object"]),
    ("\"plan\"", ["JSON object"]),
], ids=["truncated", "empty", "list", "string"])
def test_unreadable_plan_file_is_a_user_error(tmp_path, command, text, words):
    path = tmp_path / "plan.json"
    path.write_text(text)
    line = usage_error(command[0], path, *command[1:])
    for word in [*words, str(path)]:
        assert word in line, line


def test_missing_plan_file_is_a_user_error(tmp_path):
    path = tmp_path / "nowhere.json"
    assert "does not exist" in usage_error("explain", path)
    assert "does not exist" in usage_error("export", path, "--to", "megatron")


@pytest.mark.parametrize("key, value", [("layers_per_stage", None), ("mesh_order", 7),
                                        ("recompute", 5)])
def test_plan_file_value_of_the_wrong_type_is_a_user_error(unpinned, tmp_path, key, value):
    _, data = unpinned
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_edit(data, **{key: value})))
    assert key in usage_error("export", path, "--to", "megatron")


INCONSISTENT = {
    "degrees-vs-gpus": ({"tp": 3}, "GPUs"),
    "split-vs-layers": ({"layers_per_stage": [10]}, "24"),
    "framework": ({"framework": "nemo"}, "nemo"),
}


@pytest.mark.parametrize("command", [("explain",), ("export", "--to", "megatron")],
                         ids=["explain", "export"])
@pytest.mark.parametrize("case", list(INCONSISTENT))
def test_explain_and_export_reject_a_plan_inconsistent_with_its_model_and_cluster(
        unpinned, tmp_path, case, command):
    _, data = unpinned
    change, word = INCONSISTENT[case]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_edit(data, **change)))
    assert word in usage_error(command[0], path, *command[1:])


# ----- 7. explain -------------------------------------------------------------------------------
def test_explain_json_keys_and_plan(explained, pinned):
    _, data = pinned
    assert set(explained) == EXPLAIN_KEYS
    plan = explained["plan"]
    for key in ("tp", "pp", "dp", "cp", "zero_stage", "offload", "recompute",
                "micro_batch_size", "vpp", "layers_per_stage", "mesh_order"):
        assert plan[key] == data[key], key
    assert plan["layers_per_stage"] == [10, 14]
    assert plan["step_s"] == pytest.approx(data["predicted"]["time"]["step_s"], rel=REL)
    assert plan["mfu"] == pytest.approx(data["predicted"]["throughput"]["mfu"], rel=REL)
    assert plan["fits"] is True


def test_explain_binding_memory_is_the_fullest_stage(explained, pinned):
    _, data = pinned
    stages = data["predicted"]["memory"]["per_stage"]
    assert len(stages) == 2
    fullest = max(stages, key=lambda s: s["reserved_bytes"])
    memory = explained["binding"]["memory"]
    assert memory["stage"] == fullest["stage"]
    assert memory["reserved_bytes"] == fullest["reserved_bytes"]
    capacity = data["predicted"]["memory"]["capacity_bytes"]
    assert memory["capacity_bytes"] == capacity
    assert memory["headroom_fraction"] == pytest.approx(
        1 - fullest["reserved_bytes"] / capacity, rel=REL)
    parts = {k: fullest[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes",
                                     "activations_bytes", "buffers_bytes")}
    assert memory["largest_component"] == max(parts, key=parts.get)
    assert memory["largest_component_bytes"] == max(parts.values())


def test_explain_binding_time_is_the_largest_term(explained, pinned):
    _, data = pinned
    times = {name: data["predicted"]["time"][name] for name in TIME_TERMS}
    binding = explained["binding"]["time"]
    assert binding["dominant_term"] == max(times, key=times.get)
    assert binding["dominant_s"] == pytest.approx(max(times.values()), rel=REL)
    assert binding["dominant_fraction"] == pytest.approx(
        max(times.values()) / data["predicted"]["time"]["step_s"], rel=REL)
    assert binding["bottleneck_stage"] == data["predicted"]["time"]["bottleneck_stage"]


def test_explain_what_if_doubled_inter_node_bandwidth(explained, pinned):
    path, data = pinned
    entries = {w["change"]: w for w in explained["what_if"]}
    faster = entries["2x inter-node bandwidth"]
    assert faster["same_plan_step_s"] <= data["predicted"]["time"]["step_s"]
    plan = read_plan(path)
    doubled = dataclasses.replace(plan.cluster, nic_bytes_per_s=2 * plan.cluster.nic_bytes_per_s)
    again = estimate(plan.model, doubled, plan.config, framework=plan.framework)
    assert faster["same_plan_step_s"] == pytest.approx(again.time.step_s, rel=REL)
    # re-planned on the faster cluster: no worse than keeping this plan
    assert faster["fits"] is True
    assert faster["step_s"] <= faster["same_plan_step_s"] * (1 + REL)
    assert faster["num_gpus"] == 16


def test_explain_what_if_one_more_node_and_next_zero_stage(explained, pinned):
    path, data = pinned
    entries = {w["change"]: w for w in explained["what_if"]}
    more = entries["one more node"]
    # the plan's pins (pp 2, layers 10,14) hold for the what-if too: on 24 GPUs no dp divides
    # the global batch of 64, so the honest answer is "no plan", with the reason
    assert (more.get("num_gpus") == 24) if more["fits"] else ("24 GPUs" in more["why"])
    plan = read_plan(path)
    assert plan.config.zero_stage < 3 and plan.config.dp > 1
    nxt = entries[f"ZeRO-{plan.config.zero_stage + 1}"]
    again = estimate(plan.model, plan.cluster,
                     plan.config.replace(zero_stage=plan.config.zero_stage + 1),
                     framework=plan.framework)
    assert nxt["step_s"] == pytest.approx(again.time.step_s, rel=REL)
    assert nxt["peak_reserved_bytes"] == int(again.memory.peak_reserved_bytes)
    assert nxt["delta_peak_bytes"] == pytest.approx(  # bytes truncated to int on each side
        again.memory.peak_reserved_bytes - data["predicted"]["memory"]["peak_reserved_bytes"],
        abs=1)
    # sharding one more kind of state never needs more memory
    assert nxt["delta_peak_bytes"] <= 0


def test_explain_runners_up_of_the_best_plan_are_no_faster(unpinned):
    path, data = unpinned
    explained = meshplan("explain", path, "--json", "--time-limit", "20").json()
    step = data["predicted"]["time"]["step_s"]
    assert explained["runners_up"]
    for runner in explained["runners_up"]:
        assert runner["step_s"] >= step * (1 - REL)
        assert runner["delta_s"] == pytest.approx(runner["step_s"] - step, rel=REL, abs=1e-12)
        assert {k: runner[k] for k in SUMMARY_KEYS} != {k: data[k] for k in SUMMARY_KEYS}
    # on one node inter-node bandwidth does not matter to the plan
    faster = {w["change"]: w for w in explained["what_if"]}["2x inter-node bandwidth"]
    assert faster["same_plan_step_s"] == pytest.approx(step, rel=REL)


# ----- the typed prediction -----------------------------------------------------------------------
def test_read_plan_holds_the_prediction_typed(pinned):
    path, data = pinned
    plan = read_plan(path)
    predicted = data["predicted"]
    assert plan.prediction.time.step_s == predicted["time"]["step_s"]
    assert plan.prediction.time.bottleneck_stage == predicted["time"]["bottleneck_stage"]
    assert plan.prediction.throughput.mfu == predicted["throughput"]["mfu"]
    assert plan.prediction.memory.peak_reserved_bytes == predicted["memory"]["peak_reserved_bytes"]
    assert [s.peak_bytes for s in plan.prediction.memory.per_stage] == \
        [s["peak_bytes"] for s in predicted["memory"]["per_stage"]]
    assert [s.layers for s in plan.prediction.memory.per_stage] == [10, 14]
    assert plan.prediction.fits is predicted["fits"] is True
    assert plan.peak_bytes == predicted["memory"]["peak_bytes"]


def test_a_read_plan_writes_the_same_file_again(pinned, tmp_path):
    """Both copies of the configuration (top level and ``predicted.plan``) come back, as do
    the model, cluster and every predicted number."""
    path, data = pinned
    again = tmp_path / "again.json"
    write_plan(read_plan(path), again)
    assert json.loads(again.read_text()) == data


def test_extra_keys_inside_predicted_are_tolerated(unpinned, tmp_path):
    """DESIGN.md: extra keys may be added to the estimate document (not to the top level)."""
    path, data = unpinned
    extended = json.loads(json.dumps(data))
    extended["predicted"]["carbon"] = {"kg_per_step": 0.1}
    extended["predicted"]["time"]["zero3_gather_s"] = 0.0
    extended["predicted"]["memory"]["per_stage"][0]["fragmentation_bytes"] = 1
    extended["predicted"]["plan"]["scheduler"] = "1f1b"
    edited_path = tmp_path / "plan.json"
    edited_path.write_text(json.dumps(extended))
    assert meshplan("export", edited_path, "--to", "megatron").code == 0
    assert read_plan(edited_path).step_s == data["predicted"]["time"]["step_s"]


def test_a_plan_file_from_before_the_traced_fields_still_reads(unpinned, tmp_path):
    """Plan files written before ModelSpec had its traced fields (they have defaults)."""
    path, data = unpinned
    older = json.loads(json.dumps(data))
    for key in ("traced", "traced_dtype_bytes", "traced_extra_saved_bytes", "factory",
                "traced_chain"):
        del older["model"][key]
    older_path = tmp_path / "plan.json"
    older_path.write_text(json.dumps(older))
    assert read_plan(older_path).model == read_plan(path).model


def test_predicted_num_params_is_not_compared(unpinned, tmp_path):
    """A derived count (a later meshplan may count differently); the plan's model is read."""
    path, data = unpinned
    other = json.loads(json.dumps(data))
    other["predicted"]["model"]["num_params"] += 1
    other_path = tmp_path / "plan.json"
    other_path.write_text(json.dumps(other))
    assert read_plan(other_path).model.num_params == data["predicted"]["model"]["num_params"]


REPLAN = "the prediction must be of this plan (write the plan file again with meshplan plan -o)"


def _disagreements(data: dict) -> dict[str, tuple]:
    """Each edit of ``predicted`` and the message (after ``<file>: ``) it must give."""
    tp, name = data["tp"], data["cluster"]["name"]
    return {
        "plan-tp": (("plan", "tp", tp + 1),
                    f"predicted.plan.tp {tp + 1} disagrees with the plan's tp {tp}; {REPLAN}"),
        "plan-split": (("plan", "layers_per_stage", [14, 10]),
                       f"predicted.plan.layers_per_stage [14, 10] disagrees with the plan's "
                       f"layers_per_stage [10, 14]; {REPLAN}"),
        "plan-bool-for-int": (("plan", "cp", True),
                              f"predicted.plan.cp True disagrees with the plan's cp 1; {REPLAN}"),
        "framework": ((None, "framework", "megatron"),
                      f"predicted.framework 'megatron' disagrees with the plan's framework "
                      f"'{data['framework']}'; {REPLAN}"),
        "model-name": (("model", "name", "gpt3-175b"),
                       f"predicted.model.name 'gpt3-175b' disagrees with the plan's name "
                       f"'megatron-1.7b'; {REPLAN}"),
        "cluster-nodes": (("cluster", "nodes", 3),
                          f"predicted.cluster.nodes 3 disagrees with the plan's nodes 2; {REPLAN}"),
        "cluster-name": (("cluster", "name", "elsewhere"),
                         f"predicted.cluster.name 'elsewhere' disagrees with the plan's name "
                         f"'{name}'; {REPLAN}"),
    }


@pytest.mark.parametrize("case", ["plan-tp", "plan-split", "plan-bool-for-int", "framework",
                                  "model-name", "cluster-nodes", "cluster-name"])
def test_predicted_copies_must_agree_with_the_plan(pinned, tmp_path, case):
    _, data = pinned
    (section, key, value), message = _disagreements(data)[case]
    changed = json.loads(json.dumps(data))
    (changed["predicted"] if section is None else changed["predicted"][section])[key] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(changed))
    assert usage_error("export", path, "--to", "megatron") == f"meshplan: error: {path}: {message}"


@pytest.mark.parametrize("change, message", [
    (lambda p: p["plan"].pop("mesh_order"),
     "missing key 'mesh_order' in predicted.plan; it repeats the plan's mesh_order "),
    (lambda p: p["memory"]["per_stage"].pop(),
     "predicted.memory.per_stage lists stages [0]; the plan has pp 2, so stages [0, 1]"),
    (lambda p: p["time"].update(bottleneck_stage=2),
     "predicted.time.bottleneck_stage 2 is not one of the plan's stages 0..1"),
], ids=["plan-key-missing", "stage-missing", "bottleneck-outside"])
def test_predicted_stages_and_keys_must_match_the_plan(pinned, tmp_path, change, message):
    _, data = pinned
    changed = json.loads(json.dumps(data))
    change(changed["predicted"])
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(changed))
    line = usage_error("export", path, "--to", "megatron")
    assert line.startswith(f"meshplan: error: {path}: {message}"), line


# ----- torchtitan's settings: compile and float8 ------------------------------------------------
@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> tuple[Path, dict]:
    """A torchtitan plan with torch.compile of the blocks and the loss and float8 training (an
    H100 node: float8 tensor cores)."""
    path = tmp_path_factory.mktemp("compiled") / "plan.json"
    meshplan("plan", "--model", "megatron-1.7b", "--cluster", "dgx-h100", "--global-batch",
             str(GLOBAL_BATCH), "--framework", "torchtitan", "--compile", "model+loss",
             "--float8", "--time-limit", "20", "-o", path, "--json").json()
    return path, json.loads(path.read_text())


def test_compile_and_float8_round_trip_through_the_plan_file(compiled, tmp_path):
    path, data = compiled
    assert (data["compile"], data["float8"]) == ("model+loss", True)
    plan = read_plan(path)
    assert (plan.config.compile, plan.config.float8) == ("model+loss", True)
    again = tmp_path / "again.json"
    write_plan(plan, again)
    assert json.loads(again.read_text()) == data


def test_a_plan_without_the_settings_holds_neither_key(unpinned):
    """Written only when set, so plan files from before the settings still read."""
    path, data = unpinned
    assert "compile" not in data and "float8" not in data
    config = read_plan(path).config
    assert (config.compile, config.float8) == ("none", False)


@pytest.mark.parametrize("change, message", [
    ({"float8": 1}, "'float8': 1 is not accepted; float8 must be true or false"),
    ({"float8": "true"}, "'float8': 'true' is not accepted; float8 must be true or false"),
    ({"compile": True}, "'compile': true is not accepted; compile must be one of \"none\", "
                        "\"model\", \"model+loss\""),
    ({"compile": "all"}, "'compile': 'all' is not accepted; compile must be one of \"none\", "
                         "\"model\", \"model+loss\""),
    ({"dtype": "fp32"}, "float8 training needs dtype bf16 (its casts start from bf16), got "
                        "'fp32'"),
], ids=["float8-int", "float8-string", "compile-bool", "compile-unknown", "float8-fp32"])
def test_bad_compile_or_float8_value_is_one_line(compiled, tmp_path, change, message):
    _, data = compiled
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_edit(data, **change)))
    assert usage_error("export", path, "--to", "torchtitan") == \
        f"meshplan: error: {path}: {message}"
