"""Every parallel layout trains exactly like one process: same losses and gradient norms within
1e-4 relative.

Each case is a plan run for ``STEPS`` steps on CPU (gloo, fp32, the ``tiny`` model or a
variant); its global-batch losses and global gradient norms must equal those of the single-
process run of the same model and global batch (weights and data do not depend on the layout)
over those steps. Three steps show every part of a step: the first depends on the weights
alone, the second on one update, the third on an update made from two steps of AdamW state
(the first AdamW update is nearly ``lr * sign(grad)``, blind to how a layout shards or scales
the optimizer state). The single-process references run ``REFERENCE_STEPS`` (five), enough for
their loss curves to show learning (``test_reference_runs_learn``); cases compare their first
``STEPS``.
Also checked on the same runs: the report's shape, and that measured per-rank memory falls with
more ZeRO sharding and with recomputation.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from meshplan.costmodel import ModelSpec, load_model

STEPS = 3
REFERENCE_STEPS = 5
REL_TOL = 1e-4
PLANS_PER_LAUNCH = 8
TINY = load_model("tiny")
TINY8 = dataclasses.replace(TINY, name="tiny8", num_layers=8, reported_params=None,
                            source="tiny with 8 layers, for an uneven interleaved split")
TINY_GPT = ModelSpec(name="tiny-gpt", num_layers=2, hidden_size=64, num_heads=4,
                     ffn_hidden_size=256, vocab_size=250, padded_vocab_size=256, seq_len=64,
                     activation="gelu", norm="layernorm", position_embedding="learned",
                     linear_bias=True, tied_embeddings=True, embedding_norm=True,
                     source="GPT-style test model: biases, LayerNorm, learned positions, tied")


@dataclass(frozen=True)
class Case:
    """A plan (model + configuration) and the single-process case it must match."""

    model: ModelSpec
    config: dict[str, Any]
    reference: str


CASES: dict[str, Case] = {
    # single-process references
    "ref": Case(TINY, {}, "ref"),
    "ref8": Case(TINY8, {}, "ref8"),
    "ref_gpt": Case(TINY_GPT, {}, "ref_gpt"),
    # 2 processes
    "tp2": Case(TINY, {"tp": 2}, "ref"),
    "tp2_sp_selective": Case(TINY, {"tp": 2, "sp": True, "recompute": "selective"}, "ref"),
    "pp2_1f1b": Case(TINY, {"pp": 2}, "ref"),
    "pp2_full_selective": Case(TINY, {"pp": 2, "recompute": ("full", "selective")}, "ref"),
    "pp2_interleaved_uneven": Case(TINY8, {"pp": 2, "vpp": 2, "layers_per_stage": (3, 5)},
                                   "ref8"),
    "dp2_zero0": Case(TINY, {"dp": 2, "zero_stage": 0}, "ref"),
    "dp2_zero1": Case(TINY, {"dp": 2, "zero_stage": 1}, "ref"),
    "dp2_zero2": Case(TINY, {"dp": 2, "zero_stage": 2}, "ref"),
    "dp2_zero3": Case(TINY, {"dp": 2, "zero_stage": 3}, "ref"),
    "dp2_zero3_selective": Case(TINY, {"dp": 2, "zero_stage": 3, "recompute": "selective"},
                                "ref"),
    "dp2_zero3_full": Case(TINY, {"dp": 2, "zero_stage": 3, "recompute": "full"}, "ref"),
    "dp2_zero3_offload_params": Case(TINY, {"dp": 2, "zero_stage": 3,
                                            "offload": "optimizer+params"}, "ref"),
    "dp2_zero1_offload_optimizer": Case(TINY, {"dp": 2, "zero_stage": 1,
                                               "offload": "optimizer"}, "ref"),
    "dp2_zero2_bf16_plan": Case(TINY, {"dp": 2, "zero_stage": 2, "dtype": "bf16"}, "ref"),
    "gpt_tp2_sp": Case(TINY_GPT, {"tp": 2, "sp": True}, "ref_gpt"),
    "gpt_dp2_zero3": Case(TINY_GPT, {"dp": 2, "zero_stage": 3}, "ref_gpt"),
    # 4 processes
    "tp2_dp2_zero3": Case(TINY, {"tp": 2, "dp": 2, "zero_stage": 3}, "ref"),
    "tp2_dp2_zero1_sp": Case(TINY, {"tp": 2, "dp": 2, "zero_stage": 1, "sp": True}, "ref"),
    "pp2_dp2_zero3_interleaved": Case(TINY8, {"pp": 2, "vpp": 2, "dp": 2, "zero_stage": 3,
                                              "layers_per_stage": (3, 5)}, "ref8"),
    "pp2_dp2_zero1": Case(TINY, {"pp": 2, "dp": 2, "zero_stage": 1}, "ref"),
    "pp2_dp2_zero0_interleaved": Case(TINY8, {"pp": 2, "vpp": 2, "dp": 2, "zero_stage": 0,
                                              "layers_per_stage": (3, 5)}, "ref8"),
    # 8 processes
    "pp2_dp2_tp2_zero3": Case(TINY, {"pp": 2, "dp": 2, "tp": 2, "zero_stage": 3, "sp": True,
                                     "micro_batch_size": 2}, "ref"),
    "pp2_dp2_tp2_zero1": Case(TINY, {"pp": 2, "dp": 2, "tp": 2, "zero_stage": 1}, "ref"),
}
PARALLEL = [name for name, case in CASES.items() if case.reference != name]


class Runs:
    """Reports of the cases; all cases of one world size run in one launch, on first use."""

    def __init__(self, root: Path, *, make_config, plan_file, torchrun) -> None:
        self.root = root
        self._make_config, self._plan_file, self._torchrun = make_config, plan_file, torchrun
        self._reports: dict[str, dict[str, Any]] = {}
        self._output: dict[tuple[str, ...], str] = {}

    def world_size(self, name: str) -> int:
        return self._make_config(**CASES[name].config).world_size

    def batch(self, name: str) -> tuple[str, ...]:
        """The cases launched together with ``name``: its world size's, ``PLANS_PER_LAUNCH``
        at a time (a launch must finish within the test timeout on a busy 2-core machine)."""
        names = [n for n in CASES if self.world_size(n) == self.world_size(name)]
        start = names.index(name) // PLANS_PER_LAUNCH * PLANS_PER_LAUNCH
        return tuple(names[start:start + PLANS_PER_LAUNCH])

    def report(self, name: str) -> dict[str, Any]:
        batch = self.batch(name)
        if name not in self._reports and batch not in self._output:
            self._launch(batch)
        if name not in self._reports:
            pytest.fail(f"{name}: no report; torchrun output:\n{self._output[batch]}")
        return self._reports[name]

    def output(self, name: str) -> str:
        """The exit code and output of the launch that ran ``name``."""
        self.report(name)
        return self._output[self.batch(name)]

    def _launch(self, names: tuple[str, ...]) -> None:
        size = self.world_size(names[0])
        plans = [self._plan_file(CASES[n].model, self._make_config(**CASES[n].config),
                                 self.root / f"{n}.plan.json") for n in names]
        reports = [self.root / f"{n}.report.json" for n in names]
        steps = REFERENCE_STEPS if size == 1 else STEPS  # world size 1: the references
        try:
            done = self._torchrun(plans, reports, nproc=size, steps=steps)
        except subprocess.TimeoutExpired as err:  # recorded: the other cases fail at once
            self._output[names] = f"timed out after {err.timeout} s"
            return
        self._output[names] = f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-8000:]}"
        for name, path in zip(names, reports):
            if path.exists():
                self._reports[name] = json.loads(path.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory, make_config, plan_file, torchrun) -> Runs:
    return Runs(tmp_path_factory.mktemp("runtime-runs"), make_config=make_config,
                plan_file=plan_file, torchrun=torchrun)


def max_relative_difference(losses: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["ref", "ref8", "ref_gpt"])
def test_reference_runs_learn(runs, name):
    losses = runs.report(name)["losses"]
    assert len(losses) == REFERENCE_STEPS
    assert losses[-1] < losses[0] - 0.3, losses  # a wrong gradient would show in the curve


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", PARALLEL)
def test_losses_equal_single_process(runs, name):
    reference = runs.report(CASES[name].reference)["losses"][:STEPS]
    losses = runs.report(name)["losses"]
    assert len(losses) == STEPS
    assert max_relative_difference(losses, reference) <= REL_TOL, (losses, reference)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", PARALLEL)
def test_gradient_norms_equal_single_process(runs, name):
    """AdamW cancels a constant gradient scale, so equal losses alone would not show
    gradients off by a factor (a missing average over replicas or micro-batches): the
    global gradient norm of every step, before clipping, must match one process's too."""
    reference = runs.report(CASES[name].reference)["grad_norms"][:STEPS]
    norms = runs.report(name)["grad_norms"]
    assert len(norms) == STEPS and min(norms) > 0
    assert max_relative_difference(norms, reference) <= REL_TOL, (norms, reference)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_report_has_the_design_schema(runs):
    report = runs.report("pp2_dp2_tp2_zero3")
    for key in ("schema_version", "plan", "world_size", "backend", "losses", "step_s_median",
                "tokens_per_s", "predicted", "per_rank"):
        assert key in report
    assert report["schema_version"] == 1 and report["world_size"] == 8
    assert report["backend"] == "gloo"
    assert "Warning" not in runs.output("pp2_dp2_tp2_zero3")  # e.g. FSDP2's on the TP head
    assert report["plan"]["tp"] == 2 and report["plan"]["pp"] == 2 and report["plan"]["dp"] == 2
    assert report["step_s_median"] > 0
    # the optimizer phase of every step, inside that step's time
    assert len(report["optimizer_s"]) == len(report["step_s"])
    assert all(0 < o < s for o, s in zip(report["optimizer_s"], report["step_s"]))
    assert report["tokens_per_s"] == pytest.approx(8 * 64 / report["step_s_median"])
    # the first two steps ran under the CPU live-tensor tracker, the median is the third's
    assert report["tracked_steps"] == [0, 1] and len(report["step_s"]) == 3
    assert report["step_s_median"] == report["step_s"][2]
    assert report["predicted"]["step_s"] > 0 and report["predicted"]["peak_bytes"] > 0
    # 8 processes on this machine's cores: each got cores / 8 of one
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert report["timeshare"] == max(1.0, 8 / cores)
    assert report["predicted"]["timeshared_step_s"] == pytest.approx(
        report["predicted"]["step_s"] * report["timeshare"])
    ranks = report["per_rank"]
    assert [r["rank"] for r in ranks] == list(range(8))
    # default mesh order tp-cp-dp-pp: ranks 0-3 are stage 0, 4-7 stage 1
    assert [r["stage"] for r in ranks] == [0] * 4 + [1] * 4
    for entry in ranks:
        assert entry["memory_source"] == "cpu-live-tensors"
        assert entry["peak_bytes"] > 0 and entry["peak_reserved_bytes"] >= entry["peak_bytes"]
        assert entry["predicted_peak_bytes"] > 0
        assert entry["peak_ratio"] == pytest.approx(entry["peak_bytes"]
                                                    / entry["predicted_peak_bytes"])
    assert report["ratio"]["peak_bytes"] == pytest.approx(
        max(r["peak_bytes"] for r in ranks) / report["predicted"]["peak_bytes"])


def _peak(runs, name: str) -> int:
    return max(r["peak_bytes"] for r in runs.report(name)["per_rank"])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_measured_memory_falls_with_zero_stage(runs):
    peaks = [_peak(runs, f"dp2_zero{stage}") for stage in range(4)]
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[3], peaks


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_measured_memory_falls_with_recompute(runs):
    none, selective, full = (_peak(runs, name) for name in
                             ("dp2_zero3", "dp2_zero3_selective", "dp2_zero3_full"))
    assert none > selective > full, (none, selective, full)
