"""The parts of elastic training that need no process group: flags, records, replans, tables."""

from __future__ import annotations

import argparse
import json

import pytest

from meshplan.cli.args import node_range
from meshplan.planner.plan import read_plan
from meshplan.planner.replan import TABLE_KEY, from_table, replan
from meshplan.runtime import elastic
from meshplan.runtime.launch import Launch, torchrun_command
from meshplan.runtime.metrics import _keep_through
from meshplan.runtime.train import RunOptions
from meshplan.runtime.worker import Job
from meshplan.testing import run_cli

TINY = ("--model", "tiny", "--cluster", "cpu", "--global-batch", "12", "--seq-len", "64",
        "--dtype", "fp32", "--deterministic")


@pytest.fixture(scope="module")
def table_plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("elastic") / "plan.json"
    done = run_cli("plan", *TINY, "--nodes", "2", "--gpus-per-node", "2", "--elastic", "1:3",
                   "-o", str(path))
    assert done.code == 0, done.err
    return path


@pytest.mark.parametrize("text, expected", [("1", (1, None)), ("2:4", (2, 4)), ("3:3", (3, 3))])
def test_nnodes_takes_n_or_a_range(text, expected):
    assert node_range(text) == expected


@pytest.mark.parametrize("text", ["0", "3:2", "a:b", "1:2:3", "", "0:2"])
def test_nnodes_refuses_what_is_not_a_range(text):
    with pytest.raises(argparse.ArgumentTypeError, match="MIN:MAX"):
        node_range(text)


def test_run_refuses_elastic_without_checkpoints_in_one_line(table_plan):
    done = run_cli("run", str(table_plan), "--nnodes", "1:2", "--rdzv-endpoint",
                   "127.0.0.1:1", "--rdzv-id", "x")
    assert done.code == 2 and done.err.count("\n") == 1
    assert "--checkpoint-dir DIR and --checkpoint-every N" in done.err


def test_elastic_torchrun_command_passes_the_range_and_the_rendezvous_settings():
    job = Job(plans=("p.json",), reports=(None,),
              options=RunOptions(checkpoint_dir="d", checkpoint_every=2, elastic=True))
    launch = Launch(nnodes=1, max_nnodes=3, rdzv_endpoint="h:1", rdzv_id="j",
                    rdzv_conf="join_timeout=5")
    command = torchrun_command(job, launch, nproc_per_node=2)
    assert command[command.index("--nnodes") + 1] == "1:3"
    assert command[command.index("--rdzv-conf") + 1] == "join_timeout=5"
    assert launch.elastic and not Launch(nnodes=2, max_nnodes=2, rdzv_endpoint="h:1",
                                         rdzv_id="j").elastic


def test_a_resumed_metrics_log_keeps_each_step_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3, 4)))
    _keep_through(str(path), 2)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]


def test_the_table_holds_a_plan_per_node_count_of_its_world_size(table_plan):
    plan = read_plan(table_plan)
    assert sorted(plan.provenance[TABLE_KEY]) == ["1", "2", "3"]
    for nodes in (1, 2, 3):
        entry = from_table(plan, nodes=nodes, gpus_per_node=2)
        assert entry.config.world_size == 2 * nodes and entry.cluster.nodes == nodes
        assert entry.config.global_batch_size == 12
    assert from_table(plan, nodes=2, gpus_per_node=4) is None  # another node shape: search
    assert from_table(plan, nodes=5, gpus_per_node=2) is None


def test_replan_keeps_pins_that_fit_and_drops_those_that_do_not(tmp_path):
    path = tmp_path / "pinned.json"
    done = run_cli("plan", *TINY, "--nodes", "2", "--gpus-per-node", "2", "--tp", "2", "-o",
                   str(path))
    assert done.code == 0, done.err
    plan = read_plan(path)
    kept = replan(plan, nodes=1, time_limit_s=20)
    assert kept.plan.config.tp == 2 and not kept.pins_dropped
    assert kept.plan.config.world_size == 2
    # tp 2 on one process cannot be: the pin goes, the whole space is searched
    dropped = replan(plan, nodes=1, gpus_per_node=1, time_limit_s=20)
    assert dropped.pins_dropped and dropped.plan.config.world_size == 1


def test_membership_records_carry_the_step_time_of_each_plan(tmp_path):
    records = [{"run_id": "r", "step": 3, "world_size": 2}, {"run_id": "other", "step": 1},
               {"run_id": "r", "step": 6, "world_size": 1}]
    (tmp_path / elastic.MEMBERSHIP_FILE).write_text(
        "".join(json.dumps(r) + "\n" for r in records))
    times = [9.0, 1.0, 1.0, 9.0, 2.0, 2.0, 9.0, 4.0]  # each segment's first step: warm-up
    changes = elastic.report_changes(str(tmp_path), "r", times)
    assert [c["step"] for c in changes] == [3, 6]
    assert [(c["old_measured_step_s"], c["measured_step_s"]) for c in changes] == [
        (1.0, 2.0), (2.0, 4.0)]
