"""A traced module that is not a chain (``meshplan.runtime.examples:side_input``: token and
position embeddings both read the input) runs whole on one pipeline stage: data parallel under
ZeRO 0-3, with recompute, training like one process; pipeline stages are refused in one line."""

from __future__ import annotations

import json

import pytest

from meshplan.costmodel import load_model
from meshplan.runtime import mesh as mesh_mod

STEPS = 3
REL_TOL = 1e-4
SIDE = load_model("meshplan.runtime.examples:side_input", seq_len=64, dtype="fp32")
CASES = {"dp2_zero0": {"dp": 2, "zero_stage": 0},
         "dp2_zero2": {"dp": 2, "zero_stage": 2},
         "dp2_zero3_full": {"dp": 2, "zero_stage": 3, "recompute": "full"}}


def test_the_module_is_not_a_chain_and_pipelines_are_refused(make_config):
    assert not SIDE.traced_chain
    mesh_mod.check_supported(make_config(dp=2, zero_stage=3), SIDE)
    with pytest.raises(mesh_mod.UnsupportedPlan, match="plan it with --pp 1"):
        mesh_mod.check_supported(make_config(pp=2), SIDE)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_layouts_without_stages_train_like_one_process(tmp_path, plan_file, torchrun,
                                                       make_config):
    out = {}
    for nproc, names in ((1, ["ref"]), (2, list(CASES))):
        plans = [plan_file(SIDE, make_config(**CASES.get(n, {})), tmp_path / f"{n}.json")
                 for n in names]
        paths = [tmp_path / f"{n}.report.json" for n in names]
        done = torchrun(plans, paths, nproc=nproc, steps=STEPS)
        assert done.returncode == 0, done.stderr[-3000:]
        out |= {n: json.loads(p.read_text()) for n, p in zip(names, paths)}
    ref = out.pop("ref")["losses"]
    for name, report in out.items():
        assert all(abs(a - b) <= REL_TOL * abs(b) for a, b in zip(report["losses"], ref)), (
            name, report["losses"], ref)
