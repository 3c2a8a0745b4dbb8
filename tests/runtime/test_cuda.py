"""On an NVIDIA GPU (marked ``cuda``; skipped without one): the runtime runs on NCCL, and a bf16
plan trains like the fp32 plan of the same model within bf16's precision."""

from __future__ import annotations

import json

import pytest
import torch

from meshplan.costmodel import load_model

TINY = load_model("tiny")
STEPS = 6
BF16_REL_TOL = 2e-2
"""bf16 keeps 8 mantissa bits (relative step 2^-8 = 0.4%); a loss over a few steps of a small
model drifts by a few such steps."""

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


@pytest.mark.timeout(300)
def test_bf16_plan_trains_like_fp32_on_the_gpu(meshplan, plan_file, make_config, tmp_path):
    losses = {}
    for dtype in ("fp32", "bf16"):
        plan = plan_file(TINY, make_config(dtype=dtype), tmp_path / f"{dtype}.json")
        done = meshplan("run", str(plan), "--steps", str(STEPS), "--json", timeout_s=280)
        assert done.returncode == 0, done.stderr[-4000:]
        report = json.loads(done.stdout)
        assert report["backend"] == "nccl" and report["compute_dtype"] == dtype
        losses[dtype] = report["losses"]
    assert losses["fp32"][-1] < losses["fp32"][0] - 0.3, losses
    for bf16, fp32 in zip(losses["bf16"], losses["fp32"], strict=True):
        assert abs(bf16 - fp32) <= BF16_REL_TOL * abs(fp32), losses
