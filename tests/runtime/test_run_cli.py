"""``meshplan run``: refusals before any work (exit 2), an end-to-end run, a failing run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from meshplan.costmodel import ParallelConfig, estimate, load_cluster, load_model
from meshplan import cli
from meshplan.planner.plan import Plan, write_plan
from meshplan.runtime.agent import START_ENV
from meshplan.runtime.strict import ENV as STRICT_ENV

TINY = load_model("tiny")


@pytest.fixture
def dp2_plan(tmp_path, plan_file, make_config):
    return plan_file(TINY, make_config(dp=2, zero_stage=3), tmp_path / "dp2.json")


def _env_without_paths() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "PYTHONPATH", "PYTHONSAFEPATH")
    return dict({k: v for k, v in os.environ.items() if k not in drop}, OMP_NUM_THREADS="1")


DECOY = "raise ImportError('this is the user\\'s own {name} package, not meshplan\\'s')\n"


@pytest.fixture(scope="module")
def user_run(tmp_path_factory, plan_file, make_config):
    """One run of a dp2 plan, 2 steps, ``--json --report``, as a user starts it: the
    ``meshplan`` console script, without PYTHONPATH, from a project folder holding packages
    named like meshplan's parts and like meshplan itself (``DECOY``), with plain gloo (the
    suite's one run without device-only collectives). Read by the ``--json`` test and by the
    decoy test (one launch for both): (the completed process, the report path)."""
    root = tmp_path_factory.mktemp("user-run")
    for name in ("runtime", "planner", "costmodel", "meshplan"):
        (root / name).mkdir()
        (root / name / "__init__.py").write_text(DECOY.format(name=name))
        (root / name / "worker.py").write_text(DECOY.format(name=name))
    plan = plan_file(TINY, make_config(dp=2, zero_stage=3), root / "p.json")
    report = root / "report.json"
    script = Path(sys.executable).with_name("meshplan")
    done = subprocess.run([str(script), "run", plan.name, "--steps", "2", "--json", "--report",
                           str(report)], cwd=root, capture_output=True, text=True, timeout=150,
                          env=dict(_env_without_paths(), **{STRICT_ENV: "0"}))
    return done, report


def test_world_size_mismatch_is_refused_before_any_work(capsys, dp2_plan):
    assert cli.main(["run", str(dp2_plan), "--nproc-per-node", "3"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == ("meshplan: error: the plan needs tp*cp*dp*pp = 1*1*2*1 = 2 processes but "
                   "the launch has 3\n")


def test_world_size_mismatch_over_nodes_is_refused(capsys, dp2_plan):
    argv = ["run", str(dp2_plan), "--nnodes", "2", "--nproc-per-node", "2",
            "--rdzv-endpoint", "127.0.0.1:29400", "--rdzv-id", "job"]
    assert cli.main(argv) == 2
    assert "2 processes but the launch has 4" in capsys.readouterr().err


def test_multi_node_needs_a_rendezvous(capsys, dp2_plan):
    assert cli.main(["run", str(dp2_plan), "--nnodes", "2"]) == 2
    assert "--rdzv-endpoint" in capsys.readouterr().err


def test_context_parallel_plan_is_refused(capsys, tmp_path, plan_file, make_config):
    plan = plan_file(TINY, make_config(cp=2), tmp_path / "cp2.json")
    assert cli.main(["run", str(plan)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshplan: error: context parallelism") and err.count("\n") == 1


def test_compile_and_float8_plan_is_refused_before_any_worker(capsys, tmp_path, monkeypatch):
    """A torchtitan plan (H100: float8 tensor cores) with torch.compile and float8 training:
    one line naming both and the export to use, exit 2, and no worker started."""
    from meshplan.runtime import launch

    config = ParallelConfig(dp=8, global_batch_size=8, seq_len=64, compile="model+loss",
                            float8=True)
    est = estimate(TINY, load_cluster("dgx-h100"), config, framework="torchtitan")
    path = tmp_path / "compiled.json"
    write_plan(Plan.from_estimate(est, provenance={"source": "tests/runtime"}), path)
    started = []
    monkeypatch.setattr(launch, "processes_per_node", lambda *a, **k: started.append(a) or 8)
    assert cli.main(["run", str(path), "--steps", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and started == []
    assert err == ("meshplan: error: the plan's compile 'model+loss' and float8 are not run by "
                   "meshplan's runtime (eager, in the plan's dtype); export the plan to "
                   "torchtitan instead: meshplan export PLAN --to torchtitan\n")


def test_missing_data_file_is_refused(capsys, dp2_plan, tmp_path):
    assert cli.main(["run", str(dp2_plan), "--data", str(tmp_path / "none.bin")]) == 2
    assert "--data" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_run_json_prints_the_report(user_run):
    """Also the plain-gloo smoke test: the one run without device-only collectives."""
    done, report_path = user_run
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert report == json.loads(report_path.read_text())
    assert report["world_size"] == 2 and len(report["losses"]) == 2
    assert "step 1 loss" in done.stderr  # progress goes to stderr under --json
    assert "Warning" not in done.stderr, done.stderr  # e.g. runpy's, once per forked worker
    assert [r["rank"] for r in report["per_rank"]] == [0, 1]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_workers_forked_from_one_server_train_like_workers_of_their_own(user_run, meshplan):
    """On the CPU the workers are forks of one preloaded interpreter (runtime/prefork.py); the
    start method GPUs keep, an interpreter per worker, gives the same losses bit for bit."""
    done, report_path = user_run
    forked = json.loads(done.stdout)
    assert forked["worker_start"] == "forkserver"
    spawned = meshplan("run", str(report_path.with_name("p.json")), "--steps", "2", "--json",
                       env={START_ENV: "spawn"}, timeout_s=150)
    assert spawned.returncode == 0, spawned.stderr[-4000:]
    report = json.loads(spawned.stdout)
    assert report["worker_start"] == "spawn"
    assert report["losses"] == forked["losses"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_failing_workers_end_the_run_at_once(meshplan, dp2_plan, tmp_path):
    env = {"MESHPLAN_FAULT_AT_STEP": "1", "MESHPLAN_FAULT_MARKER": str(tmp_path / "fault")}
    start = time.monotonic()
    done = meshplan("run", str(dp2_plan), "--steps", "3", env=env)
    elapsed_s = time.monotonic() - start
    assert done.returncode == 1, done.stderr[-4000:]
    assert "fault injection: rank 0 exits after step 1" in done.stderr + done.stdout
    assert elapsed_s < 60  # well before the 60 s process-group timeout


@pytest.mark.parametrize("tokens, message", [
    (np.zeros(0, dtype=np.uint16), "0 tokens, fewer than one sequence of 65"),
    (np.arange(40, dtype=np.uint16), "40 tokens, fewer than one sequence of 65"),
    (np.r_[np.zeros(5000, dtype=np.uint16), [60000]].astype(np.uint16),
     "token id 60000 at position 5000 is >= the model's vocabulary size 256"),
])
def test_bad_data_files_are_refused_before_any_worker(capsys, dp2_plan, tmp_path, tokens,
                                                      message):
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    assert cli.main(["run", str(dp2_plan), "--data", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and message in err, err


def test_unusable_checkpoint_folder_is_refused(capsys, dp2_plan, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    argv = ["run", str(dp2_plan), "--checkpoint-dir", str(blocker / "ckpt"),
            "--checkpoint-every", "1"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a folder" in err, err


def test_fp16_plan_is_refused(capsys, tmp_path, plan_file, make_config):
    plan = plan_file(TINY, make_config(dtype="fp16"), tmp_path / "fp16.json")
    assert cli.main(["run", str(plan)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "loss scaler" in err and "bf16" in err, err


def test_report_folder_must_exist(capsys, dp2_plan, tmp_path):
    assert cli.main(["run", str(dp2_plan), "--report", str(tmp_path / "no" / "r.json")]) == 2
    assert "--report" in capsys.readouterr().err


def test_report_is_not_overwritten_without_force(capsys, dp2_plan, tmp_path):
    report = tmp_path / "r.json"
    report.write_text("mine\n")
    assert cli.main(["run", str(dp2_plan), "--report", str(report)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exists; pass --force to overwrite it" in err, err
    assert report.read_text() == "mine\n"
    assert cli.main(["run", str(dp2_plan), "--report", str(tmp_path)]) == 2
    assert "is a folder; give a file name" in capsys.readouterr().err
    assert cli.main(["run", str(dp2_plan), "--rdzv-conf", "join_timeout"]) == 2
    assert "must be KEY=VALUE" in capsys.readouterr().err


def test_negative_seed_is_refused(capsys, dp2_plan):
    assert cli.main(["run", str(dp2_plan), "--seed", "-1"]) == 2
    assert "seed must be >= 0" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_nodes_meet_at_the_rendezvous(dp2_plan, tmp_path, free_port):
    """Two launchers of one process each (as on two nodes) form one dp2 job on 127.0.0.1."""
    endpoint, report = f"127.0.0.1:{free_port}", tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    argv = [sys.executable, "-m", "meshplan", "run", str(dp2_plan), "--steps", "2",
            "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint,
            "--rdzv-id", "two-nodes", "--report", str(report)]
    nodes = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outputs = [node.communicate(timeout=110) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-3000:] for _, err in outputs]
    data = json.loads(report.read_text())
    assert data["world_size"] == 2 and len(data["losses"]) == 2


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_run_works_from_a_directory_with_its_own_runtime_planner_costmodel_and_meshplan(
        user_run):
    """A user project with packages named like meshplan's parts (and like meshplan itself):
    none of them may be imported by ``meshplan run`` or by its torchrun workers."""
    done, _ = user_run
    assert done.returncode == 0, done.stderr[-3000:]
    assert "not meshplan's" not in done.stderr
    report = json.loads(done.stdout)
    assert report["world_size"] == 2 and len(report["losses"]) == 2


ADOPT_ORPHANS = """
import ctypes, os, resource, subprocess, sys, time
if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
    print("no subreaper"); sys.exit(0)
def children_cpu_s():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
done = subprocess.run([sys.executable, "-m", "meshplan", "run", sys.argv[1], "--steps", "2"],
                      capture_output=True, text=True, timeout=150)
assert done.returncode == 0, done.stderr[-2000:]
waited = children_cpu_s()
deadline = time.monotonic() + 20
while time.monotonic() < deadline:  # adopt and reap every orphan the run left
    try:
        pid, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        break
    if not pid:
        time.sleep(0.1)
print(f"{waited:.3f} {children_cpu_s() - waited:.3f}")
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a child subreaper is Linux's")
def test_a_cpu_run_accounts_its_workers_cpu_time_to_itself(dp2_plan):
    """The CPU time of a run's workers counts among ``meshplan run``'s waited-for children
    (what ``meshplan validate`` subtracts from the machine's busy time): the agent stops and
    waits for multiprocessing's fork server, which reaps the workers it forked. Left an
    orphan, the server (its preload imports torch, over a CPU second) and its workers were
    reaped by whoever adopted them: here this script, a subreaper, which measures what the
    orphans it reaps used. multiprocessing's resource tracker, idle, is still left to end
    with the agent (a few hundredths of a second)."""
    done = subprocess.run([sys.executable, "-c", ADOPT_ORPHANS, str(dp2_plan)],
                          capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    if "no subreaper" in done.stdout:
        pytest.skip("prctl(PR_SET_CHILD_SUBREAPER) refused here")
    waited, orphans = map(float, done.stdout.split())
    assert orphans < 0.3 < waited, done.stdout
