"""Running a plan you can stop and trust: pre-flight refusals, SIGTERM, NaN, the recipe.

Multi-process cases run ``meshplan run`` on one or two CPU processes (gloo, the ``tiny``
model); refusals run in-process through ``cli.main`` (nothing is launched).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from meshplan import cli
from meshplan.costmodel import load_model
from meshplan.planner.plan import read_plan
from meshplan.runtime import checkpoint, launch, preflight
from meshplan.runtime.recipe import Recipe, lr_at

TINY = load_model("tiny")
GIB = 2 ** 30


@pytest.fixture
def plan_3d(tmp_path, plan_file, make_config):
    return plan_file(TINY, make_config(pp=2, dp=2, tp=2, zero_stage=3), tmp_path / "3d.json")


def test_eight_processes_on_two_cores_are_refused(plan_3d):
    plan = read_plan(plan_3d)
    with pytest.raises(ValueError, match="8 processes on this node but only 2 CPU cores"):
        preflight.check_devices(plan, nproc_per_node=8, cuda_devices=0, oversubscribe=False,
                                cores=2, memory_bytes=64 * GIB)
    preflight.check_devices(plan, nproc_per_node=8, cuda_devices=0, oversubscribe=True,
                            cores=2, memory_bytes=64 * GIB)
    with pytest.raises(ValueError, match="has 4 GPUs"):
        preflight.check_devices(plan, nproc_per_node=8, cuda_devices=4, oversubscribe=False)


def test_memory_check_counts_every_rank_of_the_node(plan_3d):
    plan = read_plan(plan_3d)
    need = preflight.node_ranks_bytes(plan, 8) + 8 * preflight.RANK_OVERHEAD_BYTES
    stage_peaks = [s.peak_bytes for s in plan.prediction.memory.per_stage]
    assert need == pytest.approx(4 * sum(stage_peaks) + 8 * preflight.RANK_OVERHEAD_BYTES)
    preflight.check_devices(plan, nproc_per_node=8, cuda_devices=0, oversubscribe=True,
                            memory_bytes=int(need) + 1)
    with pytest.raises(ValueError, match="GiB of memory is available"):
        preflight.check_devices(plan, nproc_per_node=8, cuda_devices=0, oversubscribe=True,
                                memory_bytes=int(need) - 1)


def test_a_plan_this_machine_cannot_hold_is_refused_before_launch(capsys, tmp_path, plan_file,
                                                                  make_config):
    """8 ranks of a 13B-parameter model (fp32 states, ~25 GB per rank predicted)."""
    big = plan_file(load_model("gpt3-13b"),
                    make_config(dp=8, zero_stage=3, global_batch_size=8, seq_len=2048),
                    tmp_path / "big.json")
    predicted = preflight.node_ranks_bytes(read_plan(big), 8)
    available = preflight.available_memory_bytes()
    assert available is not None and predicted > available  # the premise of the test
    assert cli.main(["run", str(big), "--oversubscribe"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "GiB of memory is available" in err, err


def test_lr_schedule_values():
    """Hand-computed: lr 3e-3, 2 warm-up steps, cosine to 0 over 6 steps."""
    recipe = Recipe(lr=3e-3, warmup_steps=2, lr_schedule="cosine").for_run(6)
    expected = [1e-3, 2e-3, 3e-3 * (1 + math.cos(math.pi / 4)) / 2, 1.5e-3,
                3e-3 * (1 - math.cos(math.pi / 4)) / 2, 0.0]
    assert [lr_at(recipe, k) for k in range(1, 7)] == pytest.approx(expected, abs=1e-15)
    linear = Recipe(lr=1.0, min_lr=0.5, warmup_steps=0, lr_schedule="linear").for_run(4)
    assert [lr_at(linear, k) for k in range(1, 5)] == [0.875, 0.75, 0.625, 0.5]
    assert lr_at(Recipe(lr=1.0).for_run(1000), 1000) == 1.0


def _descendants_alive(pids: list[int]) -> list[int]:
    return [pid for pid in pids if launch._alive([pid])]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigterm_stops_torchrun_and_every_worker_and_keeps_the_checkpoint(
        tmp_path, plan_file, make_config, meshplan_env):
    plan = plan_file(TINY, make_config(dp=2, zero_stage=3), tmp_path / "dp2.json")
    folder = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-m", "meshplan", "run", str(plan), "--steps",
                             "10000", "--checkpoint-dir", str(folder), "--checkpoint-every", "1"],
                            env=meshplan_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not (folder / checkpoint.LATEST).exists() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            time.sleep(0.2)
        tree = launch._descendants(proc.pid)
        assert len(tree) >= 3, tree  # torchrun and two workers
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30
        while _descendants_alive(tree) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _descendants_alive(tree) == []
        assert "stopped by SIGTERM" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    step = checkpoint.latest_step(str(folder))  # raises unless it names a complete checkpoint
    assert step >= 1 and checkpoint.read_train_state(str(folder), step).step == step


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_nan_loss_stops_the_run_with_one_line(meshplan, tmp_path, plan_file, make_config):
    plan = plan_file(TINY, make_config(), tmp_path / "ref.json")
    env = {"MESHPLAN_FAULT_AT_STEP": "2", "MESHPLAN_FAULT_NAN": "1",
           "MESHPLAN_FAULT_MARKER": str(tmp_path / "marker")}
    done = meshplan("run", str(plan), "--steps", "4", env=env)
    assert done.returncode == 3 and "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("meshplan: error:")]
    assert len(lines) == 1 and "step 2: loss nan" in lines[0], done.stderr[-3000:]
    assert "training diverged" in lines[0]


RECIPE_ARGS = ("--lr", "3e-3", "--warmup-steps", "2", "--lr-schedule", "cosine",
               "--max-grad-norm", "0.5")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_recipe_warmup_cosine_clipping_and_an_exact_resume(meshplan, tmp_path, plan_file,
                                                           make_config, capsys):
    plan = str(plan_file(TINY, make_config(), tmp_path / "ref.json"))
    whole = meshplan("run", plan, "--steps", "6", "--json", *RECIPE_ARGS)
    assert whole.returncode == 0, whole.stderr[-3000:]
    reference = json.loads(whole.stdout)
    expected_lr = [1e-3, 2e-3, 3e-3 * (1 + math.cos(math.pi / 4)) / 2, 1.5e-3,
                   3e-3 * (1 - math.cos(math.pi / 4)) / 2, 0.0]
    assert reference["lrs"] == pytest.approx(expected_lr, abs=1e-12)
    assert min(reference["grad_norms"]) > 0.5  # clipping engages on every step

    folder = tmp_path / "ckpt"
    crash = {"MESHPLAN_FAULT_AT_STEP": "3", "MESHPLAN_FAULT_MARKER": str(tmp_path / "m")}
    first = meshplan("run", plan, "--steps", "6", *RECIPE_ARGS, "--checkpoint-dir",
                     str(folder), "--checkpoint-every", "3", env=crash)
    assert first.returncode == 1 and checkpoint.latest_step(str(folder)) == 3
    resumed = meshplan("run", plan, "--steps", "6", "--json", *RECIPE_ARGS,
                       "--checkpoint-dir", str(folder), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    report = json.loads(resumed.stdout)
    assert report["resumed_from_step"] == 3
    assert report["lrs"] == reference["lrs"] and report["losses"] == reference["losses"]
    assert report["grad_norms"] == reference["grad_norms"]

    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for record, norm in zip(records, reference["grad_norms"]):
        assert record["grad_norm"] == norm
        assert record["grad_norm_clipped"] == pytest.approx(0.5, rel=1e-5)
        assert record["tokens_per_s"] > 0 and record["mfu"] > 0

    # in this process: the refusal comes before anything is launched
    assert cli.main(["run", plan, "--steps", "6", *RECIPE_ARGS[:-2], "--checkpoint-dir",
                     str(folder), "--resume"]) == 2
    assert "another training recipe (max_grad_norm 0.5 -> 1.0)" in capsys.readouterr().err
