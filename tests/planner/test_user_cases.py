"""The planner on the cases users bring: one GPU with offload, pins the estimator accepts,
any time limit, load-independent answers, readable output.

Expected values come from the cost model's own ``estimate`` of configurations built here, or
from the problem's arithmetic, never from the planner's output.
"""

from __future__ import annotations

import dataclasses

import json
import re

import pytest

from meshplan.costmodel import ParallelConfig, default_calibration, estimate, load_cluster, load_model
from meshplan.planner import export
from meshplan.planner.plan import read_plan
from meshplan.planner.report import layers_summary
from meshplan.planner.search import EmptySpace, search
from meshplan.planner.space import MESHPLAN_ONE_REPLICA_ZERO, ONE_REPLICA_ZERO
from meshplan.planner.space import SearchSpace
from meshplan.testing import run_cli

CAL = default_calibration()
ONE_A100 = ["--model", "llama2-13b", "--cluster", "dgx-a100-80gb", "--nodes", "1",
            "--gpus-per-node", "1", "--host-memory-gib", "512", "--global-batch", "8",
            "--seq-len", "4096", "--deterministic"]


@pytest.mark.parametrize("framework", ["meshplan", "deepspeed"])
def test_13b_fine_tunes_on_one_a100_with_offload(tmp_path, framework):
    """ZeRO-Offload's case: 13B needs ~208 GB of model states in mixed-precision Adam (16 bytes
    per parameter), 2.6x an A100-80GB; with 512 GiB of host memory a plan exists and offloads
    (ZeRO-3 with the optimizer, and the parameters where that is faster)."""
    out = tmp_path / "plan.json"
    r = run_cli(*["plan", *ONE_A100, "--framework", framework,
                                    "-o", str(out)])
    code, stdout, stderr = r.code, r.out, r.err
    assert code == 0, stderr
    plan = read_plan(out)
    c = plan.config
    assert (c.tp, c.pp, c.dp) == (1, 1, 1)
    assert c.offload in ("optimizer", "optimizer+params")
    assert c.zero_stage == 3 or c.offload == "optimizer"
    assert 13e9 * 16 > 2.4 * plan.cluster.gpu.hbm_bytes  # the states really do not fit
    # the plan fits with the default 5% margin, by the estimator's own numbers
    est = estimate(plan.model, plan.cluster, c, framework=framework, calibration=CAL)
    assert est.fits
    assert est.memory.peak_reserved_bytes <= 0.95 * plan.cluster.gpu.hbm_bytes
    assert "ZeRO" not in stderr
    # runner-ups print '=' for a choice shared with rank 1, and the table says so
    rows = [line.split() for line in stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) >= 2 and rows[1][1] == "=" and "'=': the same choice as rank 1" in stdout


def test_13b_offload_plan_exports_to_deepspeed_and_its_parser_loads_it(tmp_path, monkeypatch):
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    monkeypatch.setenv("WORLD_SIZE", "1")
    out = tmp_path / "plan.json"
    r = run_cli(*["plan", *ONE_A100, "--framework", "deepspeed", "-o", str(out)])
    code, stderr = r.code, r.err
    assert code == 0, stderr
    plan = read_plan(out)
    path = tmp_path / "ds.json"
    path.write_text(export.render(plan, "deepspeed"))

    class OneRank:
        def get_data_parallel_world_size(self) -> int:
            return 1

    parsed = ds_config.DeepSpeedConfig(str(path), mpu=OneRank())
    assert parsed.zero_optimization_stage == plan.config.zero_stage
    assert parsed.zero_config.offload_optimizer is not None
    assert parsed.train_batch_size == 8
    assert (parsed.train_micro_batch_size_per_gpu * parsed.gradient_accumulation_steps
            == 8)


@pytest.mark.parametrize("pin", [["--vpp", "8"], ["--micro-batch", "32"], ["--cp", "3"]])
def test_every_pin_estimate_accepts_is_planned(pin):
    """Pins outside the core space (vpp above 4, micro-batches above 16, a cp that is not a
    power of two) that ``estimate`` accepts give a plan honouring the pin."""
    base = ["--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "3",
            "--global-batch", "192", "--seq-len", "8192", "--deterministic", "--json"]
    flags = {"--vpp": ["--pp", "4", "--vpp", "8", "--tp", "2"],
             "--micro-batch": ["--micro-batch", "32", "--tp", "8", "--cp", "1", "--pp", "1",
                               "--seq-len", "1024", "--recompute", "full"],
             # meshplan's runtime has no CP: Megatron-LM's (ring) for this pin
             "--cp": ["--cp", "3", "--tp", "8", "--seq-len", "6144", "--framework",
                      "megatron"]}[pin[0]]
    r = run_cli(*["estimate", *base[:-2], *flags])
    code, stdout, stderr = r.code, r.out, r.err
    assert code == 0, stderr
    r = run_cli(*["plan", *base, *flags])
    code, stdout, stderr = r.code, r.out, r.err
    assert code == 0, stderr
    best = json.loads(stdout)["plans"][0]
    key = {"--vpp": "vpp", "--micro-batch": "micro_batch_size", "--cp": "cp"}[pin[0]]
    assert best[key] == int(pin[1])


def test_deterministic_search_gives_the_same_answer_twice():
    model = load_model("llama3-8b")
    cluster = load_cluster("dgx-h100", nodes=1)
    space = SearchSpace(global_batch_size=64, seq_len=4096, tp=(2, 4))
    runs = [search(model, cluster, space, framework="megatron", calibration=CAL, top_k=3,
                   deterministic=True, max_nodes=150) for _ in range(2)]
    assert [s.estimate.config for s in runs[0].ranked] == [
        s.estimate.config for s in runs[1].ranked]
    assert runs[0].stats["nodes"] == runs[1].stats["nodes"] <= 150
    assert runs[0].status in ("OPTIMAL", "FEASIBLE")


def test_one_replica_zero_1_never_beats_zero_0_and_zero_2_only_under_meshplan():
    """The claims behind the ZeRO stages searched with one replica (``ONE_REPLICA_ZERO``,
    ``MESHPLAN_ONE_REPLICA_ZERO``):
    stage 1 shards over one rank and no framework's estimate makes it faster or smaller than
    ZeRO-0; stage 2 is neither under Megatron, DeepSpeed or torchtitan, but under meshplan's
    runtime it runs FSDP2's bf16 parameters instead of autocast over fp32 weights (whose fp32
    residual stream and cast cache ZeRO-0 keeps), so it can need less memory: it is searched."""
    model = load_model("llama3-8b")
    cluster = load_cluster("dgx-h100", nodes=1)
    assert ONE_REPLICA_ZERO == (0, 3) and MESHPLAN_ONE_REPLICA_ZERO == (0, 2, 3)
    smaller_zero_2 = []
    for framework in ("meshplan", "megatron", "deepspeed", "torchtitan"):
        for tp, pp in ((8, 1), (4, 2), (2, 4)):
            base = ParallelConfig(tp=tp, pp=pp, dp=1, sp=True, micro_batch_size=1,
                                  global_batch_size=16, seq_len=4096, zero_stage=0)
            ref = estimate(model, cluster, base, framework=framework, calibration=CAL)
            for zero in (1, 2):
                other = estimate(model, cluster, base.replace(zero_stage=zero),
                                 framework=framework, calibration=CAL)
                assert other.time.step_s >= ref.time.step_s * (1 - 1e-12)
                if not all(o.reserved_bytes >= r.reserved_bytes * (1 - 1e-12) for o, r in
                           zip(other.memory.per_stage, ref.memory.per_stage)):
                    smaller_zero_2.append((framework, zero, tp, pp))
    assert smaller_zero_2 and {(f, z) for f, z, _, _ in smaller_zero_2} == {("meshplan", 2)}


def test_layers_summary_run_length_encodes():
    assert layers_summary((12, 12, 13, 13)) == "2x12 + 2x13"
    assert layers_summary((4, 5, 5, 5, 4)) == "4 + 3x5 + 4"
    assert layers_summary((80,)) == "80"


def test_plan_table_fits_120_columns_and_names_the_sequence_source():
    """MT-NLG 530B on 280 nodes: 35 stages, whose layer list used to make a 222-column table."""
    r = run_cli(*["plan", "--model", "mt-nlg-530b", "--cluster",
                                    "dgx-a100-80gb", "--nodes", "280", "--global-batch",
                                    "1920", "--framework", "megatron", "--tp", "8", "--pp",
                                    "35", "--zero", "1", "--micro-batch", "1", "--vpp", "1",
                                    "--offload", "none", "--deterministic"])
    code, stdout, stderr = r.code, r.out, r.err
    assert code == 0, stderr
    width = max(len(line) for line in stdout.splitlines() if "|" not in line and
                not line.startswith(("mt-nlg", "global batch")))
    assert width <= 120, stdout
    assert "sequence 2048 (the model's default" in stdout
    assert "memory margin 5%" in stdout
    table = [line for line in stdout.splitlines() if re.match(r"\s+\d+\s", line)]
    assert table and "x3" in table[0]  # 105 layers on 35 stages: 35x3


def test_no_plan_fits_names_host_memory_when_it_binds():
    """13B on one A100 with 64 GiB of host memory: offloading fits the GPU, but the offloaded
    states (about 12 bytes per parameter of fp32 master and Adam moments, 145 GiB) do not fit
    the host."""
    r = run_cli("plan", "--model", "llama2-13b", "--cluster", "dgx-a100-80gb", "--nodes", "1",
                "--gpus-per-node", "1", "--host-memory-gib", "64", "--nvme-gib", "0",
                "--global-batch", "8", "--seq-len", "4096", "--deterministic")
    assert r.code == 3, r.err
    line = r.err.strip()
    assert "\n" not in line
    assert "no plan fits: host memory per node binds" in line
    need = float(re.search(r"need at least ([\d.]+) GiB of host memory", line).group(1))
    assert need > 12 * 13e9 / 2**30 * 0.9  # fp32 master + two Adam moments, at least
    assert "against 64.0 GiB" in line and "NVMe offload" in line


def test_no_plan_fits_names_gpu_memory_and_the_binding_stage():
    r = run_cli("plan", "--model", "llama3-70b", "--cluster", "dgx-a100-40gb", "--nodes", "1",
                "--global-batch", "8", "--offload", "none", "--pp", "2", "--deterministic")
    assert r.code == 3, r.err
    line = r.err.strip()
    assert "no plan fits: GPU memory binds" in line
    assert re.search(r"reserved per stage \(stage [01] binds\) against 38\.0 GiB", line), line
    assert "more GPUs (at least" in line


def test_no_plan_fits_a_long_sequence_names_the_frameworks_with_context_parallelism():
    """Llama 3 8B at 131,072 tokens on 8 H100s: meshplan's runtime has no cp, so even its
    least-memory plan keeps whole sequences; torchtitan runs the same layout with cp 2."""
    argv = ("plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "1",
            "--global-batch", "64", "--seq-len", "131072", "--deterministic")
    r = run_cli(*argv)
    assert r.code == 3, r.err
    line = r.err.strip()
    assert "no plan fits: GPU memory binds" in line and "a shorter sequence than 131072" in line
    assert line.endswith("context parallelism (cp > 1 splits the sequence; meshplan's runtime "
                         "does not run it: --framework torchtitan)"), line
    assert run_cli(*argv, "--framework", "torchtitan").code == 0


def test_empty_space_names_the_nearest_batches_and_node_counts():
    """Batch 1922 on 5 nodes of 8 GPUs with tp 8, pp 1 and cp 1 pinned: dp = 5 does not divide
    1922 = 2 x 31^2."""
    r = run_cli("plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "5",
                "--global-batch", "1922", "--tp", "8", "--pp", "1", "--cp", "1",
                "--deterministic")
    assert r.code == 2
    line = r.err.strip()
    assert "the search space is empty" in line
    # dp = 5 must divide the batch: 1920 and 1925 are the nearest below and above
    batches = re.search(r"--global-batch ([\d or]+) \(or --global-batch-tolerance\)", line)
    assert batches and {"1920", "1925"} <= set(batches.group(1).split(" or ")), line
    # 1922 = 2 x 31^2: 1 and 2 nodes (dp 1, 2) work among the smaller counts
    assert "--nodes" in line and "(or --allow-fewer-gpus)" in line
    tolerant = run_cli("plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "5",
                       "--global-batch", "1922", "--tp", "8", "--pp", "1", "--cp", "1",
                       "--deterministic", "--global-batch-tolerance", "0.01", "--json")
    assert tolerant.code == 0, tolerant.err
    assert json.loads(tolerant.out)["plans"][0]["global_batch_size"] in (1920, 1925)


def test_no_plan_fits_names_nvme_when_it_binds():
    """13B on one A100 offloading to NVMe only (pinned; DeepSpeed's ZeRO-Infinity, the one
    framework that offloads there), with 100 GiB of NVMe: the offloaded fp32 master and Adam
    moments (12 bytes per parameter, about 145 GiB) do not fit it."""
    r = run_cli("plan", "--model", "llama2-13b", "--cluster", "dgx-a100-80gb", "--nodes", "1",
                "--gpus-per-node", "1", "--host-memory-gib", "64", "--nvme-gib", "100",
                "--offload-device", "nvme", "--global-batch", "8", "--seq-len", "4096",
                "--deterministic", "--framework", "deepspeed")
    assert r.code == 3, r.err
    line = r.err.strip()
    assert "\n" not in line
    assert "no plan fits: NVMe per node binds" in line
    need = float(re.search(r"need at least ([\d.]+) GiB of NVMe", line).group(1))
    assert need > 12 * 13e9 / 2**30 * 0.9
    assert "against 100.0 GiB" in line and "host-memory offload" in line


@pytest.mark.parametrize("framework", ["meshplan", "torchtitan", "megatron"])
def test_pipelines_get_at_least_pp_micro_batches_where_the_schedules_need_them(framework):
    """torch.distributed.pipelining's 1F1B schedules (meshplan's runtime, torchtitan) refuse
    fewer than pp micro-batches per step; Megatron-LM's run any count. Global batch 4 on
    8 GPUs with pp 4 pinned: dp 1 and micro-batch 1 give 4 micro-batches (allowed everywhere),
    micro-batch 2 gives 2 (only Megatron). A single replica with tp and pp is one torchtitan
    trains in fp32 (the layout rule refuses 16 bits there), so its plans are fp32."""
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", nodes=1)
    dtype = "fp32" if framework == "torchtitan" else "bf16"
    space = SearchSpace(global_batch_size=4, seq_len=2048, pp=(4,), tp=(2,), dtype=dtype)
    result = search(model, cluster, space, framework=framework, calibration=CAL, top_k=10,
                    deterministic=True)
    counts = {s.estimate.config.grad_accum_steps for s in result.explored}
    if framework != "megatron":
        assert min(counts) >= 4
    fewer = dataclasses.replace(space, micro_batch_size=(2,))  # 2 micro-batches
    if framework == "megatron":
        got = search(model, cluster, fewer, framework=framework, calibration=CAL,
                     deterministic=True)
        assert got.ranked[0].estimate.config.grad_accum_steps == 2
    else:
        with pytest.raises(EmptySpace, match="at least pp micro-batches"):
            search(model, cluster, fewer, framework=framework, calibration=CAL,
                   deterministic=True)
    pinned = ParallelConfig(tp=2, pp=4, dp=1, micro_batch_size=2, global_batch_size=4,
                            seq_len=2048, dtype=dtype)
    est = estimate(model, cluster, pinned, framework=framework, calibration=CAL)
    assert est.fits == (framework == "megatron")
    if framework != "megatron":
        assert "at least pp = 4 micro-batches" in est.why_not


def test_empty_space_names_the_pipeline_fill_rule():
    """pp 4 and micro-batch 2 pinned with global batch 4: two micro-batches, which meshplan's
    pipeline schedules refuse; the message says so."""
    r = run_cli("plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "1",
                "--global-batch", "4", "--seq-len", "2048", "--tp", "2", "--pp", "4",
                "--micro-batch", "2", "--deterministic")
    assert r.code == 2, r.err
    line = r.err.strip()
    assert "\n" not in line and "the search space is empty" in line
    assert "need at least pp micro-batches per step" in line


def test_cost_objective_considers_every_node_count():
    """tp, pp and cp pinned to 1 on up to 8 nodes with global batch 240: dp = 8n must divide
    240, so 1, 2, 3, 5 and 6 nodes form plans (4, 7 and 8 do not). With 10,000 steps
    (9.83e9 tokens of 240 x 4096) in 0.3935 days (3.4 s per step) only 5 and 6 nodes are fast
    enough (3.3 and 2.9 s per step; 3 nodes take 5.5 s); the cheapest run is on 5 nodes, a
    count that is not a power of two."""
    tokens, days = 240 * 4096 * 10_000, 3.4 * 10_000 / 86400
    args = ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "8",
            "--global-batch", "240", "--seq-len", "4096", "--tp", "1", "--pp", "1",
            "--cp", "1", "--objective", "cost", "--train-tokens", str(tokens),
            "--gpu-hour-price", "2", "--deadline-days", str(days), "--deterministic"]
    r = run_cli(*args, "--json")
    assert r.code == 0, r.err
    plans = json.loads(r.out)["plans"]
    best = plans[0]
    assert best["dp"] == 40 and best["predicted"]["time"]["step_s"] <= 3.4
    text = run_cli(*args)  # the table names each plan's GPU count, within 120 columns
    assert text.code == 0, text.err
    table = text.out.split("\n\n")[1].splitlines()
    assert table[0].split()[:2] == ["rank", "gpus"] and table[1].split()[1] == "40"
    assert max(len(line) for line in table) <= 120
    model = load_model("llama3-8b")
    space = SearchSpace(global_batch_size=240, seq_len=4096, tp=(1,), pp=(1,), cp=(1,),
                        memory_margin=0.05)
    for nodes in (5, 6):  # the fastest plan of each count, by the time objective
        fastest = search(model, load_cluster("dgx-h100", nodes=nodes), space,
                         framework="meshplan", calibration=CAL, top_k=1,
                         deterministic=True).ranked[0]
        assert fastest.step_s <= 3.4
        cost = fastest.step_s * 10_000 * 8 * nodes * 2 / 3600
        if nodes == 5:
            assert best["predicted"]["time"]["step_s"] == pytest.approx(fastest.step_s)
            five = cost
        else:
            assert five < cost


def test_runner_ups_are_distinct_plans():
    """Inside one node both mesh orders put every group on NVLink: pp2 x dp4 in either order
    has the same estimate. With both orders asked for, the search solves both, and the top 5
    holds each such pair once (the default order); left to itself it searches the default
    order alone (``_Refiner.orders_alike``) and finds the same plans."""
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", nodes=1)
    space = SearchSpace(global_batch_size=64, seq_len=4096, pp=(2,))
    alone = search(model, cluster, space, framework="megatron", calibration=CAL, top_k=5,
                   deterministic=True)
    assert {s.estimate.config.mesh_order for s in alone.explored} == {("tp", "cp", "dp", "pp")}
    both = dataclasses.replace(space, mesh_order=(("tp", "cp", "dp", "pp"),
                                                  ("tp", "cp", "pp", "dp")))
    result = search(model, cluster, both, framework="megatron", calibration=CAL, top_k=5,
                    deterministic=True)
    assert [s.estimate for s in result.ranked] == [s.estimate for s in alone.ranked]

    def key(solved):
        c, est = solved.estimate.config, solved.estimate
        return (c.replace(mesh_order=("tp", "cp", "dp", "pp")), est.time.step_s,
                est.memory.peak_reserved_bytes)

    ranked = [key(s) for s in result.ranked]
    assert len(ranked) == 5 and len(set(ranked)) == 5
    explored = [key(s) for s in result.explored]
    assert len(set(explored)) < len(explored)  # equivalent twins were solved
    assert all(s.estimate.config.mesh_order == ("tp", "cp", "dp", "pp") or
               key(s) not in {key(t) for t in result.explored if t is not s}
               for s in result.ranked)
