"""The ``meshplan`` command line: DESIGN.md's contract (flags, JSON keys, exit codes, errors)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshplan.costmodel import ParallelConfig, estimate, estimate_to_dict, load_cluster, load_model
from meshplan import cli
from meshplan.cli import args as cli_args
from meshplan.cli import inputs as cli_inputs

# ----- the estimate --json schema, copied from DESIGN.md (schema_version 1) -------------------
TOP_KEYS = {"schema_version", "model", "framework", "fits", "plan", "memory", "time",
            "throughput"}
MODEL_KEYS = {"name", "num_params"}
PLAN_KEYS = {"tp", "pp", "dp", "cp", "ep", "sp", "zero_stage", "offload", "offload_device",
             "recompute", "micro_batch_size", "global_batch_size", "grad_accum_steps", "vpp",
             "seq_len", "layers_per_stage"}
MEMORY_KEYS = {"peak_bytes", "peak_reserved_bytes", "model_states_bytes", "per_stage",
               "cpu_bytes_per_node", "nvme_bytes_per_node"}
STAGE_KEYS = {"stage", "params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
              "buffers_bytes", "peak_bytes", "reserved_bytes"}
TIME_KEYS = {"step_s", "compute_s", "tp_comm_s", "cp_comm_s", "ep_comm_s", "pp_comm_s",
             "pp_bubble_s", "dp_comm_s", "offload_s", "exposed_comm_s"}
THROUGHPUT_KEYS = {"tokens_per_s", "model_flop_per_step", "model_flop_per_s_per_gpu", "mfu"}

# gpt3-175b on 4 DGX A100 80GB nodes (32 GPUs): tp 8 x pp 2 leaves dp = 2.
BASE = ["estimate", "--model", "gpt3-175b", "--cluster", "dgx-a100-80gb", "--nodes", "4"]


def run_json(capsys, *argv: str) -> dict:
    code = cli.main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert err == ""
    return json.loads(out)


def run_error(capsys, *argv: str) -> str:
    """Run a failing command under --json; return its single stderr line."""
    code = cli.main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("meshplan: error: ")
    assert "Traceback" not in err
    return lines[0]


# ----- estimate --json ---------------------------------------------------------------------------
def test_estimate_json_has_every_design_key(capsys):
    data = run_json(capsys, *BASE, "--tp", "8", "--pp", "2", "--global-batch", "64",
                    "--recompute", "full", "--sp", "--zero", "1")
    assert TOP_KEYS <= set(data)
    assert data["schema_version"] == 1
    assert MODEL_KEYS <= set(data["model"])
    assert PLAN_KEYS <= set(data["plan"])
    assert MEMORY_KEYS <= set(data["memory"])
    assert TIME_KEYS <= set(data["time"])
    assert THROUGHPUT_KEYS <= set(data["throughput"])
    for stage in data["memory"]["per_stage"]:
        assert STAGE_KEYS <= set(stage)
    assert data["model"]["name"] == "gpt3-175b"
    assert data["model"]["num_params"] == load_model("gpt3-175b").num_params
    assert data["framework"] == "meshplan"
    plan = data["plan"]
    assert (plan["tp"], plan["pp"], plan["dp"], plan["cp"], plan["ep"]) == (8, 2, 2, 1, 1)
    assert plan["sp"] is True and plan["zero_stage"] == 1 and plan["recompute"] == "full"
    assert plan["grad_accum_steps"] == 64 // (2 * 1)
    assert plan["seq_len"] == 2048 and plan["micro_batch_size"] == 1
    assert sum(plan["layers_per_stage"]) == 96


def test_estimate_json_matches_estimate_to_dict(capsys):
    data = run_json(capsys, *BASE, "--tp", "8", "--pp", "4", "--global-batch", "32")
    est = estimate(load_model("gpt3-175b"), load_cluster("dgx-a100-80gb", nodes=4),
                   ParallelConfig(tp=8, pp=4, dp=1, global_batch_size=32, seq_len=2048))
    assert data == json.loads(json.dumps(estimate_to_dict(est)))


def test_does_not_fit_still_reports_with_exit_0(capsys):
    argv = ["estimate", "--model", "gpt3-175b", "--cluster", "dgx-a100-80gb", "--tp", "8",
            "--pp", "1", "--global-batch", "8"]
    data = run_json(capsys, *argv)
    assert data["fits"] is False
    assert data["memory"]["peak_reserved_bytes"] > load_cluster("dgx-a100-80gb").gpu.hbm_bytes
    assert data["time"]["step_s"] > 0
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert "DOES NOT FIT" in out and "GiB" in out and data["why_not"] in out


def test_human_report_of_a_plan_that_fits(capsys):
    argv = ["estimate", "--model", "llama3-70b", "--cluster", "dgx-h100", "--nodes", "8",
            "--tp", "8", "--pp", "4", "--global-batch", "512", "--recompute", "full", "--sp",
            "--zero", "1"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.splitlines()[0].startswith("llama3-70b (70.55 B params) on dgx-h100")
    assert "64 GPUs" in out and "tp 8 x pp 4 x dp 2" in out
    assert len([line for line in out.splitlines() if line.split()[:2] in
                (["0", "20"], ["1", "20"], ["2", "20"], ["3", "20"])]) == 4  # stage rows
    for word in ("params", "grads", "optimizer", "activations", "buffers", "peak", "reserved",
                 "pipeline bubble", "% of step", "tokens/s", "TFLOP/s per GPU", "MFU",
                 "host memory per node", "NVMe per node"):
        assert word in out
    assert out.rstrip().endswith("FITS") and "DOES NOT FIT" not in out


@pytest.mark.parametrize("pp", [1, 2, 4, 8])
def test_one_stage_entry_per_pipeline_stage(capsys, pp):
    data = run_json(capsys, *BASE, "--tp", "4", "--pp", str(pp), "--global-batch", "64")
    stages = data["memory"]["per_stage"]
    assert [s["stage"] for s in stages] == list(range(pp))
    assert len(data["plan"]["layers_per_stage"]) == pp
    assert data["plan"]["dp"] == 32 // (4 * pp)


def test_dp_defaults_to_the_gpus_left_over(capsys):
    data = run_json(capsys, *BASE, "--tp", "2", "--pp", "2", "--cp", "2", "--global-batch", "64")
    assert data["plan"]["dp"] == 32 // (2 * 2 * 2)
    # tp and pp default to 1: dp takes every GPU.
    data = run_json(capsys, "estimate", "--model", "gpt3-1.3b", "--cluster", "dgx-h100",
                    "--nodes", "2", "--global-batch", "32")
    assert (data["plan"]["tp"], data["plan"]["pp"], data["plan"]["dp"]) == (1, 1, 16)


def test_recompute_per_stage_list(capsys):
    common = [*BASE, "--tp", "8", "--pp", "4", "--global-batch", "64"]
    mixed = run_json(capsys, *common, "--recompute", "full,full,selective,none")
    full = run_json(capsys, *common, "--recompute", "full")
    assert mixed["plan"]["recompute"] == ["full", "full", "selective", "none"]
    act = [[s["activations_bytes"] for s in d["memory"]["per_stage"]] for d in (mixed, full)]
    assert act[0][:2] == act[1][:2]  # stages 0 and 1 recompute fully in both runs
    assert act[0][2] > act[1][2] and act[0][3] > act[1][3]


def test_flags_reach_the_plan(capsys):
    data = run_json(capsys, *BASE, "--tp", "8", "--pp", "2", "--global-batch", "64",
                    "--seq-len", "4096", "--micro-batch", "2", "--zero", "3", "--offload",
                    "optimizer+params", "--offload-device", "nvme", "--vpp", "2",
                    "--framework", "ideal", "--layers-per-stage", "50,46",
                    "--mesh-order", "tp,dp,cp,pp", "--no-flash-attention", "--dtype", "fp16")
    plan = data["plan"]
    assert data["framework"] == "ideal"
    assert plan["seq_len"] == 4096 and plan["micro_batch_size"] == 2
    assert plan["grad_accum_steps"] == 64 // (2 * 2)
    assert (plan["zero_stage"], plan["offload"], plan["offload_device"]) == \
        (3, "optimizer+params", "nvme")
    assert plan["vpp"] == 2 and plan["layers_per_stage"] == [50, 46]
    assert plan["mesh_order"] == ["tp", "dp", "cp", "pp"]
    assert plan["flash_attention"] is False and plan["dtype"] == "fp16"
    assert data["memory"]["nvme_bytes_per_node"] > 0 and data["memory"]["cpu_bytes_per_node"] == 0


def test_dtype_defaults_to_fp32_on_the_cpu_cluster(capsys):
    cpu = run_json(capsys, "estimate", "--model", "tiny", "--cluster", "cpu",
                   "--global-batch", "4")
    assert cpu["plan"]["dtype"] == "fp32" and cpu["plan"]["dp"] == 2
    gpu = run_json(capsys, *BASE, "--tp", "8", "--global-batch", "64")
    assert gpu["plan"]["dtype"] == "bf16"


def test_gpus_per_node_overrides_the_catalog(capsys):
    data = run_json(capsys, "estimate", "--model", "tiny", "--cluster", "cpu", "--nodes", "2",
                    "--gpus-per-node", "4", "--global-batch", "8")
    assert data["plan"]["dp"] == 8


def test_model_and_cluster_json_files(capsys, tmp_path):
    model = tmp_path / "small.json"
    model.write_text(json.dumps({"num_layers": 4, "hidden_size": 64, "num_heads": 4,
                                 "ffn_hidden_size": 256, "vocab_size": 128, "seq_len": 32}))
    data = run_json(capsys, "estimate", "--model", str(model), "--cluster", "cpu",
                    "--global-batch", "2")
    assert data["model"]["name"] == "small" and data["plan"]["seq_len"] == 32


# ----- config translation (reused by `plan` to pin choices) ------------------------------------
def test_config_kwargs_only_holds_flags_given():
    args, _ = cli.build_parser().parse_known_args(
        [*BASE, "--tp", "8", "--global-batch", "16", "--recompute", "full,none", "--sp"])
    assert cli_args.config_kwargs_from_args(args) == {
        "tp": 8, "global_batch_size": 16, "recompute": ("full", "none"), "sp": True}


def test_fill_config_defaults():
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", nodes=2)
    config = cli_inputs.fill_config_defaults({"tp": 4, "global_batch_size": 16}, model=model,
                                      cluster=cluster)
    assert (config.tp, config.pp, config.cp, config.dp) == (4, 1, 1, 4)
    assert (config.seq_len, config.dtype, config.zero_stage, config.recompute) == \
        (8192, "bf16", 0, "none")
    assert config.micro_batch_size == 1 and config.global_batch_size == 16
    with pytest.raises(ValueError, match="does not divide"):
        cli_inputs.fill_config_defaults({"tp": 3, "global_batch_size": 16}, model=model,
                                 cluster=cluster)


# ----- catalogs ----------------------------------------------------------------------------------
def test_models_json(capsys):
    models = run_json(capsys, "models")
    by_name = {m["name"]: m for m in models}
    assert {"llama3-405b", "gpt3-175b", "mixtral-8x7b", "llama3-8b"} <= set(by_name)
    llama = by_name["llama3-405b"]
    assert llama["num_params"] == load_model("llama3-405b").num_params
    assert (llama["num_layers"], llama["hidden_size"], llama["num_kv_heads"]) == (126, 16384, 8)
    assert by_name["mixtral-8x7b"]["num_experts"] == 8


def test_models_table(capsys):
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    for column in ("name", "params (B)", "layers", "hidden", "heads", "kv heads", "ffn",
                   "vocab", "seq", "activation", "experts/top-k"):
        assert column in header
    row = next(line for line in out.splitlines() if line.split()[0] == "llama3-405b")
    assert "405.9" in row and "swiglu" in row
    assert "8/2" in next(line for line in out.splitlines() if "mixtral-8x7b" in line)


def test_clusters_json_and_table(capsys):
    clusters = run_json(capsys, "clusters")
    by_name = {c["name"]: c for c in clusters}
    assert {"dgx-a100-80gb", "dgx-h100", "dgx-h200", "cpu"} <= set(by_name)
    assert by_name["dgx-h100"]["gpus_per_node"] == 8
    assert by_name["dgx-h100"]["gpu"]["key"] == "h100-sxm"
    assert cli.main(["clusters"]) == 0
    out = capsys.readouterr().out
    for column in ("gpu", "gpus/node", "NIC GB/s", "HBM GiB", "peak bf16 TFLOP/s"):
        assert column in out.splitlines()[0]
    row = next(line for line in out.splitlines() if line.split()[:1] == ["dgx-a100-80gb"])
    assert row.split()[2:] == ["8", "25.0", "80.0", "312"]


# ----- errors: exit 2, one line on stderr, nothing on stdout --------------------------------------
@pytest.mark.parametrize("argv, word", [
    (["estimate", "--model", "gpt3-176b", "--cluster", "dgx-a100-80gb", "--global-batch", "8"],
     "gpt3-175b"),
    (["estimate", "--model", "gpt3-175b", "--cluster", "dgx-a100-8gb", "--global-batch", "8"],
     "dgx-a100-80gb"),
    ([*BASE, "--tp", "0", "--global-batch", "8"], "--tp"),
    ([*BASE, "--global-batch", "-8"], "--global-batch"),
    ([*BASE, "--nodes", "0", "--global-batch", "8"], "--nodes"),
    ([*BASE, "--micro-batch", "0", "--global-batch", "8"], "--micro-batch"),
    (["estimate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "2",
      "--tp", "16", "--global-batch", "8"], "divide"),
    ([*BASE, "--tp", "3", "--global-batch", "8"], "divide"),
    ([*BASE, "--tp", "8", "--pp", "2", "--dp", "4", "--global-batch", "8"], "32 GPUs"),
    (["estimate", "--model", "tiny", "--cluster", "cpu", "--nodes", "4", "--pp", "8",
      "--global-batch", "8"], "layers"),
    (["estimate", "--model", "mixtral-8x7b", "--cluster", "dgx-h100", "--gpus-per-node", "6",
      "--ep", "3", "--global-batch", "12"], "divide"),
    (["estimate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--ep", "2",
      "--global-batch", "8"], "MoE"),
    ([*BASE, "--tp", "8", "--global-batch", "10"], "divisible"),
    ([*BASE, "--tp", "8", "--micro-batch", "3", "--global-batch", "8"], "divisible"),
    ([*BASE, "--zero", "4", "--global-batch", "8"], "--zero"),
    ([*BASE, "--offload", "all", "--global-batch", "8"], "--offload"),
    ([*BASE, "--offload-device", "tape", "--global-batch", "8"], "--offload-device"),
    ([*BASE, "--recompute", "ful", "--global-batch", "8"], "ful"),
    ([*BASE, "--tp", "8", "--pp", "2", "--recompute", "full,none,none",
      "--global-batch", "8"], "recompute"),
    ([*BASE, "--framework", "jax", "--global-batch", "8"], "--framework"),
    ([*BASE, "--dtype", "int8", "--global-batch", "8"], "--dtype"),
    ([*BASE, "--mesh-order", "tp,dp", "--global-batch", "8"], "--mesh-order"),
    ([*BASE, "--tp", "8", "--pp", "2", "--layers-per-stage", "40,40",
      "--global-batch", "8"], "layers_per_stage"),
    ([*BASE, "--layers-per-stage", "4,x", "--global-batch", "8"], "--layers-per-stage"),
    ([*BASE, "--tp", "8", "--offload", "optimizer+params", "--global-batch", "8"], "zero"),
    ([*BASE, "--tp", "8"], "--global-batch"),
    ([*BASE, "--tp", "8", "--global-batch", "8", "--bogus", "1"], "--bogus"),
    ([*BASE, "--tp", "8", "--global-batch", "8", "--calibration", "/no/such/cal.json"],
     "cal.json"),
    (["estimate", "--cluster", "cpu", "--global-batch", "8"], "--model"),
    (["estimat"], "estimat"),
])
def test_user_errors_exit_2_with_one_line(capsys, argv, word):
    assert word in run_error(capsys, *argv)


def test_bad_model_files(capsys, tmp_path):
    malformed = tmp_path / "broken.json"
    malformed.write_text('{"num_layers": 4,')
    assert "JSON" in run_error(capsys, "estimate", "--model", str(malformed), "--cluster",
                               "cpu", "--global-batch", "2")
    unknown = tmp_path / "extra.json"
    unknown.write_text(json.dumps({"num_layers": 4, "hidden_size": 64, "num_heads": 4,
                                   "ffn_hidden_size": 256, "vocab_size": 128, "seq_len": 32,
                                   "wings": 2}))
    assert "wings" in run_error(capsys, "estimate", "--model", str(unknown), "--cluster", "cpu",
                                "--global-batch", "2")
    negative = tmp_path / "negative.json"
    negative.write_text(json.dumps({"num_layers": -4, "hidden_size": 64, "num_heads": 4,
                                    "ffn_hidden_size": 256, "vocab_size": 128, "seq_len": 32}))
    assert "num_layers" in run_error(capsys, "estimate", "--model", str(negative), "--cluster",
                                     "cpu", "--global-batch", "2")


def test_bad_cluster_and_calibration_files(capsys, tmp_path):
    cluster = tmp_path / "mine.json"
    cluster.write_text('{"gpu": "a100-80gb", "gpus_per_node": 8, "colour": "red"}')
    assert "colour" in run_error(capsys, "estimate", "--model", "tiny", "--cluster",
                                 str(cluster), "--global-batch", "2")
    partial = tmp_path / "cal.json"  # a device entry missing keys: the loader raises TypeError
    partial.write_text('{"devices": {"a100-80gb": {"matmul_efficiency": 0.5}}}')
    assert "memory_efficiency" in run_error(capsys, *BASE, "--global-batch", "32",
                                            "--calibration", str(partial))


def test_unreadable_file_is_a_user_error(capsys, monkeypatch):
    def unreadable(ref, **_):
        raise PermissionError(13, "Permission denied", ref)
    monkeypatch.setattr(cli_inputs, "load_model", unreadable)
    assert "Permission denied" in run_error(capsys, "estimate", "--model", "/x/model.json",
                                            "--cluster", "cpu", "--global-batch", "2")


def test_every_command_of_the_contract_exists(capsys):
    """DESIGN.md's command line: each subcommand answers --help."""
    for command in ("models", "clusters", "estimate", "plan", "explain", "export", "run",
                    "launch", "profile", "validate"):
        assert cli.main([command, "--help"]) == 0, command
        assert capsys.readouterr().out.startswith("usage: meshplan " + command)


def test_help_exits_0(capsys):
    assert cli.main(["estimate", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--cluster", "--nodes", "--gpus-per-node", "--tp", "--pp", "--dp",
                 "--cp", "--ep", "--sp", "--zero", "--offload", "--offload-device",
                 "--recompute", "--micro-batch", "--global-batch", "--seq-len", "--vpp",
                 "--json", "--framework", "--calibration", "--layers-per-stage",
                 "--mesh-order", "--no-flash-attention", "--dtype"):
        assert flag in out


# ----- the installed console script --------------------------------------------------------------
def _console_script() -> Path:
    script = Path(sys.executable).parent / "meshplan"
    if not script.exists():
        pytest.skip("meshplan console script not installed in this environment")
    return script


def test_console_script_user_error_has_no_traceback():
    proc = subprocess.run([str(_console_script()), "estimate", "--model", "gpt3-175b",
                           "--cluster", "dgx-a100-80gb", "--tp", "3", "--global-batch", "8",
                           "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and "divide" in proc.stderr


def test_console_script_json_is_only_json():
    proc = subprocess.run([str(_console_script()), "estimate", "--model", "tiny", "--cluster",
                           "cpu", "--global-batch", "4", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["schema_version"] == 1
