"""Tied embeddings across pipeline stages: the last stage's LM head is a copy of the first
stage's word embedding whose gradient is summed with it, so every pipelined layout trains
like one process (losses and gradient norms), and the published MT-NLG plan (tied, pp 35) is
accepted by the runtime's checks."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest

from meshplan.costmodel import ParallelConfig, load_model
from meshplan.planner.plan import read_plan
from meshplan.runtime import mesh as mesh_mod
from meshplan.runtime.train import RunOptions

STEPS = 5
TOL = 1e-4
TIED = dataclasses.replace(load_model("tiny"), name="tiny-tied", tied_embeddings=True)
LAYOUTS = {1: {"single": {}},
           2: {"pp2": dict(pp=2), "pp2_vpp2": dict(pp=2, vpp=2)},
           4: {"pp2_tp2": dict(pp=2, tp=2), "pp2_dp2_zero3": dict(pp=2, dp=2, zero_stage=3)}}


def _launch(root: Path, layouts: dict, plan_file, env) -> dict[str, dict]:
    from meshplan.runtime.launch import Launch, torchrun_command
    from meshplan.runtime.worker import Job

    plans = [plan_file(TIED, ParallelConfig(global_batch_size=8, seq_len=64, dtype="fp32",
                                            micro_batch_size=2, **fields), root / f"{k}.json")
             for k, fields in layouts.items()]
    reports = [root / f"{k}-report.json" for k in layouts]
    job = Job(plans=tuple(map(str, plans)), reports=tuple(map(str, reports)),
              options=RunOptions(steps=STEPS, timeout_s=60.0))
    world = read_plan(plans[0]).config.world_size
    done = subprocess.run(torchrun_command(job, Launch(), nproc_per_node=world),
                          capture_output=True, text=True, timeout=200, env=env)
    assert done.returncode == 0, done.stderr[-5000:]
    return {k: json.loads(p.read_text()) for k, p in zip(layouts, reports)}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tied_embeddings_train_alike_under_pipelines(tmp_path, plan_file, meshplan_env):
    reports = {}
    for layouts in LAYOUTS.values():
        reports |= _launch(tmp_path, layouts, plan_file, meshplan_env)
    single = reports.pop("single")
    for name, report in reports.items():
        for key in ("losses", "grad_norms"):
            worst = max(abs(a - b) for a, b in zip(report[key], single[key]))
            assert worst <= TOL, (name, key, report[key], single[key])
    assert single["losses"][-1] < single["losses"][0]


def test_the_published_mt_nlg_plan_passes_the_runtime_checks():
    model = load_model("mt-nlg-530b")
    assert model.tied_embeddings
    config = ParallelConfig(tp=8, pp=35, dp=8, zero_stage=1, recompute="full",
                            micro_batch_size=1, global_batch_size=1920, seq_len=2048)
    mesh_mod.check_supported(config, model)


def test_tied_pipelines_with_parameter_offload_are_refused():
    config = ParallelConfig(pp=2, dp=2, zero_stage=3, offload="optimizer+params",
                            global_batch_size=8, seq_len=64, dtype="fp32")
    with pytest.raises(mesh_mod.UnsupportedPlan, match="parameter offload"):
        mesh_mod.check_supported(config, TIED)
