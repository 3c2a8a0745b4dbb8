"""``meshplan launch``: the sbatch script (its lines, and what its srun really receives, run
with stand-in srun and scontrol), the refusals before anything is written or started, --submit
with a stand-in sbatch, the local nodes' process handling with stand-in commands, and one real
2-node local run. The real SLURM job is tests/workflows/test_launch_slurm.py."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from meshplan.costmodel import ParallelConfig, estimate, load_cluster, load_model
from meshplan.planner.plan import Plan, write_plan
from meshplan.testing import run_cli, usage_error
from meshplan.workflows import local

ROOT = Path(__file__).resolve().parents[2]
SCRIPT_TIMEOUT_S = 30
NODE_TIMEOUT_S = 100
"""The real local run's process-group timeout until the first step (--init-timeout)."""


def _script(plan: Path, *argv: str) -> str:
    result = run_cli("launch", plan, "--scheduler", "slurm", *argv)
    assert result.code == 0, result.err
    return plan.with_suffix(".sbatch").read_text()


def _sbatch(script: str) -> dict[str, str]:
    """The ``#SBATCH`` options of ``script``, unquoted as sbatch does."""
    options = [shlex.split(line.removeprefix("#SBATCH "))[0]
               for line in script.splitlines() if line.startswith("#SBATCH ")]
    return dict(option.removeprefix("--").split("=", 1) for option in options)


@pytest.fixture
def gpu_plan(tmp_path) -> Path:
    """dp=16 on 2 DGX H100 nodes (8 GPUs each)."""
    config = ParallelConfig(dp=16, global_batch_size=16, seq_len=64)
    est = estimate(load_model("tiny"), load_cluster("dgx-h100", nodes=2), config)
    path = tmp_path / "gpu.json"
    write_plan(Plan.from_estimate(est, provenance={"source": "tests/workflows"}), path)
    return path


def test_script_asks_for_the_nodes_and_one_task_each(gpu_plan):
    script = _script(gpu_plan, "--nodes", "2", "--time", "01:30:00", "--partition", "gpu",
                     "--job-name", "llama", "--cpus-per-task", "16")
    assert script.startswith("#!/bin/bash\n")
    assert _sbatch(script) == {
        "job-name": "llama", "nodes": "2", "ntasks-per-node": "1", "gpus-per-node": "8",
        "cpus-per-task": "16", "time": "01:30:00", "partition": "gpu",
        "output": str(gpu_plan.with_name("gpu-%j.out")), "chdir": os.getcwd()}
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in script
    assert "rdzv_port=$((29500 + SLURM_JOB_ID % 1000))" in script
    assert ('exec srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --cpus-per-task=16 '
            '--kill-on-bad-exit=1 \\\n') in script
    assert f"    {shlex.quote(sys.executable)} -m meshplan run {gpu_plan} \\\n" in script
    assert script.endswith('    --nnodes 2 \\\n    --nproc-per-node 8 \\\n'
                           '    --rdzv-endpoint "$head_node:$rdzv_port" \\\n'
                           '    --rdzv-id "$SLURM_JOB_ID"\n')


def test_cpu_plan_asks_for_no_gpus_and_takes_its_processes_from_the_plan(dp2_plan):
    script = _script(dp2_plan)  # the cpu cluster of the plan has 2 "GPUs" per node
    options = _sbatch(script)
    assert "gpus-per-node" not in options and options["nodes"] == "1"
    assert "--nnodes 1 \\\n    --nproc-per-node 2 \\\n" in script


def test_elastic_range_asks_slurm_for_min_to_max_nodes(gpu_plan):
    script = _script(gpu_plan, "--elastic", "1:4", "--nproc-per-node", "8",
                     "--rdzv-conf", "join_timeout=600,last_call_timeout=30")
    assert _sbatch(script)["nodes"] == "1-4"
    assert "--kill-on-bad-exit=0" in script  # one node's end does not end the others
    assert "    --nnodes 1:4 \\\n" in script
    assert script.endswith("    --rdzv-conf join_timeout=600,last_call_timeout=30\n")


def _fake_programs(folder: Path, programs: dict[str, str]) -> None:
    """Executables in ``folder`` (put first on PATH) standing in for SLURM's."""
    folder.mkdir(exist_ok=True)
    for name, body in programs.items():
        path = folder / name
        path.write_text(f"#!{sys.executable}\nimport json, sys\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_srun_receives_each_word_whole(dp2_plan, tmp_path):
    """The script run by bash with stand-in srun and scontrol: paths with spaces and quotes,
    and the run flags, reach srun as single words, in order; the shell fills in the
    rendezvous."""
    folder = tmp_path / "my plans 'v2'"
    folder.mkdir()
    plan = Path(shutil.copy(dp2_plan, folder / "dp2 run.json"))
    flags = ["--steps", "20", "--checkpoint-dir", "ckpt dir/a", "--checkpoint-every", "5",
             "--lr", "3e-4", "--resume"]
    script = _script(plan, "--nodes", "2", "--nproc-per-node", "1", *flags)
    assert _sbatch(script)["output"] == str(folder / "dp2 run-%j.out")
    bin_dir = tmp_path / "bin"
    _fake_programs(bin_dir, {"srun": "print(json.dumps(sys.argv[1:]))",
                             "scontrol": "print('node-a\\nnode-b')"})
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node-[a-b]", SLURM_JOB_NUM_NODES="2")
    done = subprocess.run(["bash", str(plan.with_suffix(".sbatch"))], env=env,
                          capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [
        "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
        sys.executable, "-m", "meshplan", "run", str(plan), *flags,
        "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-endpoint", "node-a:29742", "--rdzv-id", "4242"]


def test_run_flags_may_come_before_the_plan(dp2_plan, tmp_path):
    script = tmp_path / "s.sbatch"
    result = run_cli("launch", "--steps", "3", "--report", "r.json", dp2_plan,
                     "--scheduler", "slurm", "--script", script, "--rdzv-port", "31000")
    assert result.code == 0, result.err
    text = script.read_text()
    assert "rdzv_port=31000\n" in text
    assert f"run {dp2_plan} \\\n    --steps 3 \\\n    --report r.json \\\n" in text
    assert _sbatch(text)["output"] == str(tmp_path / "s-%j.out")


def test_writing_the_script_imports_no_torch(dp2_plan):
    """A login node writes and submits the script without the seconds of torch's import."""
    code = ("import json, sys; from meshplan import cli; "
            f"code = cli.main(['launch', {str(dp2_plan)!r}, '--scheduler', 'slurm']); "
            "print(json.dumps([code, 'torch' in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=SCRIPT_TIMEOUT_S)
    assert json.loads(done.stdout.splitlines()[-1]) == [0, False], done.stderr


def test_existing_script_is_kept_without_force(dp2_plan):
    script = dp2_plan.with_suffix(".sbatch")
    script.write_text("mine\n")
    line = usage_error("launch", dp2_plan, "--scheduler", "slurm")
    assert line == f"meshplan: error: --script {str(script)!r} exists; pass --force to " \
                   f"overwrite it"
    assert script.read_text() == "mine\n"
    assert run_cli("launch", dp2_plan, "--scheduler", "slurm", "--force").code == 0
    assert script.read_text().startswith("#!/bin/bash\n")
    assert "--force" in script.read_text()  # passed to meshplan run for its --report


@pytest.mark.parametrize("argv, message", [
    (["--scheduler", "slurm", "--nodes", "2"],
     "the plan needs 2 processes but the launch has 2 nodes x 2 processes = 4"),
    (["--scheduler", "slurm", "--nnodes", "2"],
     "--nnodes is set by launch on every node: give --nodes N, or --elastic MIN:MAX"),
    (["--scheduler", "slurm", "--rdzv-id", "x"], "--rdzv-id is set by launch on every node"),
    (["--scheduler", "slurm", "--elastic", "1:2", "--nodes", "2"],
     "--nodes with --elastic: under SLURM the allocation decides"),
    (["--scheduler", "slurm", "--elastic", "3:2"],
     "argument --elastic: must be MIN:MAX with 1 <= MIN <= MAX, got '3:2'"),
    (["--scheduler", "slurm", "--time", "2h"], "argument --time: must be a SLURM time limit"),
    (["--scheduler", "slurm", "--rdzv-conf", "join_timeout"],
     "argument --rdzv-conf: must be KEY=VALUE[,KEY=VALUE...]"),
    (["--scheduler", "slurm", "--steps", "-1"],
     "argument --steps: must be an integer >= 0, got '-1' (a flag of meshplan run)"),
    (["--scheduler", "slurm", "--lr-schedule", "step"],
     "argument --lr-schedule: invalid choice: 'step'"),
    (["--scheduler", "slurm", "--stepz", "3"], "unrecognized arguments: --stepz 3"),
    (["--scheduler", "local"], "--scheduler local needs --nodes N"),
    (["--scheduler", "local", "--nodes", "2", "--time", "10"],
     "--time is not a flag of --scheduler local"),
    (["--scheduler", "local", "--nodes", "3", "--elastic", "1:2"],
     "--nodes 3 is outside --elastic 1:2"),
    (["--scheduler", "slurm", "--log-dir", "logs"], "--log-dir is not a flag of --scheduler slurm"),
    (["--scheduler", "slurm", "--script", "/no/such/folder/x.sbatch"],
     "--script '/no/such/folder/x.sbatch': its folder does not exist"),
])
def test_refusals_are_one_line_before_anything_is_written(dp2_plan, argv, message):
    assert message in usage_error("launch", dp2_plan, *argv)
    assert not dp2_plan.with_suffix(".sbatch").exists()


def test_submit_without_sbatch_is_refused_before_writing(dp2_plan, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    line = usage_error("launch", dp2_plan, "--scheduler", "slurm", "--submit")
    assert line.startswith("meshplan: error: --submit: sbatch is not on PATH")
    assert not dp2_plan.with_suffix(".sbatch").exists()


def test_submit_prints_the_job_id(dp2_plan, tmp_path, monkeypatch):
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.json"
    _fake_programs(bin_dir, {"sbatch": f"open({str(calls)!r}, 'w').write(json.dumps("
                                       f"sys.argv[1:]))\nprint('777;cluster-a')"})
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    result = run_cli("launch", dp2_plan, "--scheduler", "slurm", "--submit", "--json")
    launched = result.json()
    script = str(dp2_plan.with_suffix(".sbatch"))
    assert launched == {"schema_version": 1, "scheduler": "slurm", "script": script,
                        "output": str(dp2_plan.with_name("dp2-%j.out")), "nodes": "1",
                        "nproc_per_node": 2, "job_id": "777"}
    assert json.loads(calls.read_text()) == ["--parsable", script]
    text = run_cli("launch", dp2_plan, "--scheduler", "slurm", "--submit", "--force")
    assert text.out.splitlines()[-1] == "submitted batch job 777"


def test_sbatch_refusal_is_one_line(dp2_plan, tmp_path, monkeypatch):
    _fake_programs(tmp_path / "bin", {"sbatch": "print('sbatch: error: Batch job submission "
                                                "failed: Invalid partition name specified', "
                                                "file=sys.stderr)\nsys.exit(1)"})
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    line = usage_error("launch", dp2_plan, "--scheduler", "slurm", "--submit")
    assert line.endswith("failed with exit code 1: sbatch: error: Batch job submission "
                         "failed: Invalid partition name specified")


# ----- local nodes: the process handling, with stand-in commands ---------------------------------

def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_nodes_output_is_prefixed_and_kept_apart(capsys):
    result = local.run_nodes([_python("import sys; print('out 0'); print('err 0', "
                                      "file=sys.stderr)"),
                              _python("print('out 1', end='')")])
    assert result == local.LocalResult((0, 0), None)
    out, err = capsys.readouterr()
    assert sorted(out.splitlines()) == ["[node0] out 0", "[node1] out 1"]
    assert err == "[node0] err 0\n"


def test_log_dir_gets_one_file_per_node(tmp_path, capsys):
    logs = tmp_path / "logs"
    result = local.run_nodes([_python(f"import sys; print('out {i}'); print('err {i}', "
                                      f"file=sys.stderr)") for i in range(2)],
                             log_dir=str(logs))
    assert result.exit_code == 0
    assert sorted(p.name for p in logs.iterdir()) == ["node0.log", "node1.log"]
    assert sorted((logs / "node1.log").read_text().splitlines()) == ["err 1", "out 1"]
    assert capsys.readouterr() == ("", "")


def test_first_failure_ends_the_other_nodes(capsys):
    result = local.run_nodes([_python("import time; time.sleep(60)"),
                              _python("import sys; sys.exit(3)")])
    assert result.first_failure == 1 and result.exit_code == 3
    assert result.exit_codes == (-signal.SIGTERM, 3)


def test_elastic_nodes_outlive_a_failed_one(capsys):
    result = local.run_nodes([_python("import time; time.sleep(0.5)"),
                              _python("import sys; sys.exit(4)")], stop_on_failure=False)
    assert result.exit_codes == (0, 4) and result.exit_code == 4


def test_sigterm_is_passed_on_to_every_node(tmp_path, capsys):
    markers = [tmp_path / f"started{i}" for i in range(2)]
    nodes = [_python(f"import time; open({str(m)!r}, 'w').close(); time.sleep(60)")
             for m in markers]

    def terminate_when_started() -> None:
        deadline = time.monotonic() + SCRIPT_TIMEOUT_S
        while not all(m.exists() for m in markers) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=terminate_when_started)
    thread.start()
    result = local.run_nodes(nodes)
    thread.join()
    assert result.stopped_by == signal.SIGTERM and result.exit_code == 128 + signal.SIGTERM
    assert result.exit_codes == (-signal.SIGTERM, -signal.SIGTERM)


def test_grace_copy_matches_the_runtime():
    """Read from runtime/launch.py's source: importing it would import torch (seconds)."""
    tree = ast.parse((ROOT / "runtime" / "launch.py").read_text())
    values = [node.value.value for node in tree.body if isinstance(node, ast.Assign)
              and [getattr(t, "id", None) for t in node.targets] == ["STOP_GRACE_S"]]
    assert values == [local.RUN_STOP_GRACE_S]


def test_local_nodes_share_one_fresh_rendezvous(dp2_plan):
    from meshplan.workflows.launch import Nodes

    commands = local.local_commands(str(dp2_plan), Nodes(nodes=2, nproc_per_node=1),
                                    ["--steps", "2"])
    assert commands[0] == commands[1]
    words = commands[0]
    assert words[:6] == [sys.executable, "-m", "meshplan", "run", str(dp2_plan), "--steps"]
    endpoint = words[words.index("--rdzv-endpoint") + 1]
    assert re.fullmatch(r"127\.0\.0\.1:\d+", endpoint)
    assert words[words.index("--nnodes") + 1] == "2"
    other = local.local_commands(str(dp2_plan), Nodes(nodes=2, nproc_per_node=1), [])
    assert other[0][other[0].index("--rdzv-id") + 1] != words[words.index("--rdzv-id") + 1]


# ----- one real run ------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_local_nodes_train_one_job(dp2_plan, tmp_path):
    """Two ``meshplan run`` of one process each meet at 127.0.0.1 and train the dp2 plan."""
    report = tmp_path / "report.json"
    result = run_cli("launch", dp2_plan, "--scheduler", "local", "--nodes", "2",
                     "--nproc-per-node", "1", "--steps", "2", "--report", report,
                     "--init-timeout", NODE_TIMEOUT_S, "--timeout", "30")
    assert result.code == 0, result.err[-4000:]
    for line in (r"step 1 loss ", r"ran 2 steps on 2 processes \(gloo\)"):
        assert re.search(rf"^\[node[01]\] {line}", result.out, re.M), result.out[-4000:]
    data = json.loads(report.read_text())
    assert data["world_size"] == 2 and len(data["losses"]) == 2
