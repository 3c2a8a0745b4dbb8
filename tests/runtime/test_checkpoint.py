"""Checkpoints (runtime/checkpoint.py): resume bit for bit, reshard into another plan, survive a
killed rank, skip interrupted saves, refuse a missing checkpoint.

The multi-process cases run ``meshplan run`` (``python -m meshplan run``) on 4 CPU processes
(gloo, fp32, the ``tiny`` model, global batch 8, sequence 64). Two runs are shared, made on
first use:

* reference: tp2 x dp2 ZeRO-1, ``--steps 6``, no checkpoints;
* killed: the same plan, ``--steps 6 --checkpoint-every 2 --max-restarts 1``, rank 2 killed
  after step 5 (``test_killed_rank_restarts_from_the_last_checkpoint``). Its first attempt
  commits step-2 and step-4 before the kill, as a run of ``--steps 4`` would; the resume tests
  start from a copy of its folder cut back to that state (``Runs.saved``: step-6 removed,
  ``latest`` on step-4), which saves a launch of its own.

A resumed run must give the reference's losses: the same plan bit for bit (``==`` on the
floats), another plan within ``RESHARD_REL_TOL`` (layouts sum in other orders). At least two
steps follow every resume, because the optimizer state only shows from the second one (the
first step after a resume depends on the weights alone).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from meshplan.costmodel import load_model
from meshplan import cli
from meshplan.runtime import checkpoint, integrity, optim
from meshplan.runtime.data import DataSpec
from meshplan.runtime.fault import Fault
from meshplan.runtime.model import build_decoder
from meshplan.runtime.recipe import Recipe
from meshplan.runtime.parallelize import apply_checkpointing

TINY = load_model("tiny")
STEPS = 6
SAVED_STEPS = 4
RESHARD_REL_TOL = 1e-4
SHARD_BYTES = 4096
SAVE_PLAN = {"tp": 2, "dp": 2, "zero_stage": 1}
RESHARD_PLANS = {
    # DDP + ZeroRedundancyOptimizer over HostOffloadAdamW, 1F1B pipeline
    "pp2_dp2_zero1_offload": {"pp": 2, "dp": 2, "zero_stage": 1, "offload": "optimizer"},
    # FSDP2 inside an interleaved pipeline: two chunks per rank share one optimizer
    "pp2_vpp2_dp2_zero3": {"pp": 2, "vpp": 2, "dp": 2, "zero_stage": 3},
}


def _ok(done) -> dict[str, Any]:
    # the first rank that failed printed its error early: keep the head as well as the tail
    assert done.returncode == 0, done.stderr[:4000] + "\n[...]\n" + done.stderr[-4000:]
    return json.loads(done.stdout)


@dataclass(frozen=True)
class Killed:
    """The killed run: its completed process, checkpoint folder and fault marker."""

    done: subprocess.CompletedProcess
    folder: Path
    marker: Path


class Runs:
    """The reference run and the killed run (whose checkpoints the resume tests start from),
    made on first use."""

    def __init__(self, root: Path, *, meshplan, plan_file, make_config) -> None:
        self.root, self._meshplan = root, meshplan
        self._plan_file, self._make_config = plan_file, make_config
        self._reference: list[float] | None = None
        self._killed: Killed | None = None

    def plan(self, name: str, config: dict[str, Any]) -> Path:
        return self._plan_file(TINY, self._make_config(**config), self.root / f"{name}.json")

    def launch(self, plan: Path, *argv: str, env: dict[str, str] | None = None,
               timeout_s: float = 160):
        """``meshplan run PLAN --json ARGV`` (the completed process). 160 s: a 6-step
        4-process run took over 110 s beside a three-worker suite (load average 8-14)."""
        return self._meshplan("run", str(plan), "--json", "--oversubscribe", *argv, env=env,
                              timeout_s=timeout_s)

    def run(self, plan: Path, *argv: str) -> dict[str, Any]:
        """The report of ``launch`` (which must succeed)."""
        return _ok(self.launch(plan, *argv))

    def reference(self) -> list[float]:
        if self._reference is None:
            report = self.run(self.plan("save", SAVE_PLAN), "--steps", str(STEPS))
            self._reference = report["losses"]
        return self._reference

    def killed(self) -> Killed:
        """Rank 2 dies after step 5 (step-4 saved); torchrun restarts the job once."""
        if self._killed is None:
            folder, marker = self.root / "killed", self.root / "fault-marker"
            env = {"MESHPLAN_FAULT_AT_STEP": "5", "MESHPLAN_FAULT_RANK": "2",
                   "MESHPLAN_FAULT_MARKER": str(marker)}
            done = self.launch(self.plan("save", SAVE_PLAN), "--steps", str(STEPS),
                               "--checkpoint-dir", str(folder), "--checkpoint-every", "2",
                               "--max-restarts", "1", env=env, timeout_s=170)
            self._killed = Killed(done=done, folder=folder, marker=marker)
        return self._killed

    def saved(self, into: Path) -> Path:
        """At ``into``, the checkpoint folder a run of ``--steps 4 --checkpoint-every 2``
        leaves: the killed run's, whose first attempt committed step-2 and step-4 before the
        kill, without what came after step 4 (step-6, the metrics of steps 5 and 6)."""
        killed = self.killed()
        _ok(killed.done)
        shutil.copytree(killed.folder, into)
        shutil.rmtree(into / f"step-{STEPS}")
        (into / "latest").write_text(f"step-{SAVED_STEPS}\n")
        metrics = into / "metrics.jsonl"
        metrics.write_text("".join(line for line in metrics.read_text().splitlines(True)
                                   if json.loads(line)["step"] <= SAVED_STEPS))
        assert _committed(into) == ["step-2", "step-4"]
        saved = checkpoint.read_train_state(str(into), SAVED_STEPS)
        assert saved.losses == tuple(self.reference()[:SAVED_STEPS])
        return into


@pytest.fixture(scope="module")
def runs(tmp_path_factory, meshplan, plan_file, make_config) -> Runs:
    return Runs(tmp_path_factory.mktemp("checkpoint-runs"), meshplan=meshplan,
                plan_file=plan_file, make_config=make_config)


def _committed(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_dir())


# ----- multi-process ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(520)  # the module's first test: it also makes the reference and killed runs
def test_resume_under_the_same_plan_is_bit_for_bit(runs, tmp_path):
    folder = runs.saved(tmp_path / "ckpt")
    report = runs.run(runs.plan("save", SAVE_PLAN), "--steps", str(STEPS),
                      "--checkpoint-dir", str(folder), "--resume")
    assert report["resumed_from_step"] == SAVED_STEPS and report["restarts"] == 0
    assert report["losses"] == runs.reference()  # steps 1-4 from the checkpoint, 5-6 run again
    assert len(report["step_s"]) == STEPS
    assert _committed(folder) == ["step-2", "step-4"]  # no --checkpoint-every: nothing written


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_damaged_shard_is_refused_at_resume_and_never_trained_on(runs, tmp_path):
    folder = runs.saved(tmp_path / "ckpt")
    shard = sorted((folder / f"step-{SAVED_STEPS}").glob("*.distcp"))[-1]
    _damage(shard, "random")
    done = runs.launch(runs.plan("save", SAVE_PLAN), "--steps", str(STEPS),
                       "--checkpoint-dir", str(folder), "--resume")
    assert done.returncode == 2 and done.stdout == ""
    errors = [line for line in done.stderr.splitlines() if line.startswith("meshplan: error")]
    assert len(errors) == 1 and f"{shard.name} does not match its sha256" in errors[0], \
        done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr
    assert f"step {SAVED_STEPS} loss" not in done.stderr  # no step ran


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", sorted(RESHARD_PLANS))
def test_resume_under_another_plan_reshards(runs, tmp_path, name):
    """Saved under tp2 x dp2 ZeRO-1 (DTensor shards, states on owner ranks), loaded into a
    pipeline plan of other ZeRO stages and optimizers."""
    folder = runs.saved(tmp_path / "ckpt")
    report = runs.run(runs.plan(name, RESHARD_PLANS[name]), "--steps", str(STEPS),
                      "--checkpoint-dir", str(folder), "--resume")
    reference = runs.reference()
    assert report["resumed_from_step"] == SAVED_STEPS
    assert report["plan"]["pp"] == 2 and report["plan"]["tp"] == 1
    assert report["losses"][:SAVED_STEPS] == reference[:SAVED_STEPS]
    assert report["losses"][SAVED_STEPS:] == pytest.approx(reference[SAVED_STEPS:],
                                                           rel=RESHARD_REL_TOL, abs=0)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_killed_rank_restarts_from_the_last_checkpoint(runs):
    """Rank 2 dies after step 5 (step-4 saved); torchrun restarts the job, which resumes from
    step-4, runs steps 5 and 6 again and reports each step's loss once."""
    killed = runs.killed()
    done, folder, marker = killed.done, killed.folder, killed.marker
    report = _ok(done)
    assert marker.exists() and "fault injection: rank 2 exits after step 5" in done.stderr
    assert report["restarts"] == 1 and report["resumed_from_step"] == 4
    assert len(report["losses"]) == STEPS
    assert report["losses"] == runs.reference()
    assert _committed(folder) == ["step-2", "step-4", "step-6"]
    assert (folder / "latest").read_text() == "step-6\n"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_interrupted_save_is_ignored(runs, tmp_path):
    """What a save of step 4 interrupted before its commit leaves: ``step-4.tmp`` without DCP
    metadata and ``latest`` still on step-2; plus a stray ``step-6.tmp``. The resume starts at
    step 2, and its own saves replace the leftovers."""
    folder = runs.saved(tmp_path / "ckpt")
    (folder / "step-4").rename(folder / "step-4.tmp")
    (folder / "step-4.tmp" / ".metadata").unlink()
    (folder / "latest").write_text("step-2\n")
    (folder / "step-6.tmp").mkdir()
    (folder / "step-6.tmp" / "__0_0.distcp").write_bytes(b"partial")
    report = runs.run(runs.plan("save", SAVE_PLAN), "--steps", str(STEPS),
                      "--checkpoint-dir", str(folder), "--resume", "--checkpoint-every", "2")
    assert report["resumed_from_step"] == 2
    assert report["losses"] == runs.reference()
    assert _committed(folder) == ["step-2", "step-4", "step-6"]
    assert (folder / "latest").read_text() == "step-6\n"
    assert checkpoint.read_train_state(str(folder), 6).losses == tuple(runs.reference())


# ----- refusals before any work (exit 2, one line) ------------------------------------------

@pytest.fixture
def tp2_dp2_plan(tmp_path, plan_file, make_config) -> Path:
    return plan_file(TINY, make_config(**SAVE_PLAN), tmp_path / "plan.json")


@pytest.mark.parametrize("make_folder", [True, False], ids=["empty", "missing"])
def test_resume_without_a_checkpoint_is_refused(capsys, tmp_path, tp2_dp2_plan, make_folder):
    folder = tmp_path / "ckpt"
    if make_folder:
        folder.mkdir()
    assert cli.main(["run", str(tp2_dp2_plan), "--checkpoint-dir", str(folder),
                     "--resume"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err == (f"meshplan: error: --resume: no complete checkpoint in {folder} (no "
                   f"{folder}/latest)\n")


def test_resume_needs_a_checkpoint_dir(capsys, tp2_dp2_plan):
    assert cli.main(["run", str(tp2_dp2_plan), "--resume"]) == 2
    assert "need --checkpoint-dir" in capsys.readouterr().err


def _fake_checkpoint(folder: Path, step: int, *, seed: int = 0) -> None:
    """A committed-looking checkpoint of ``step`` steps (metadata empty) for the checks."""
    spec = DataSpec(global_batch_size=8, seq_len=64, vocab_size=TINY.vocab_size, seed=seed)
    state = checkpoint.TrainState(step=step, losses=(1.0,) * step, step_s=(0.1,) * step,
                                  grad_norms=(1.0,) * step, lrs=(1e-3,) * step,
                                  data=checkpoint.data_stream(spec),
                                  model=checkpoint.architecture(TINY), plan={})
    where = folder / f"step-{step}"
    where.mkdir(parents=True)
    (where / ".metadata").write_bytes(b"")
    (where / "__0_0.distcp").write_bytes(np.random.default_rng(step).bytes(SHARD_BYTES))
    (where / "train_state.json").write_text(state.to_json())
    integrity.write_manifest(str(where), integrity.entries(str(where),
                                                           integrity.checkpoint_files(str(where))))
    (folder / "latest").write_text(f"step-{step}\n")


def test_saving_into_a_used_folder_needs_resume(capsys, tmp_path, tp2_dp2_plan):
    _fake_checkpoint(tmp_path / "ckpt", 2)
    assert cli.main(["run", str(tp2_dp2_plan), "--checkpoint-dir", str(tmp_path / "ckpt"),
                     "--checkpoint-every", "2"]) == 2
    assert "already holds checkpoints (latest: step-2); pass --resume" in \
        capsys.readouterr().err


def test_resume_with_another_seed_is_refused(capsys, tmp_path, tp2_dp2_plan):
    _fake_checkpoint(tmp_path / "ckpt", 2, seed=0)
    assert cli.main(["run", str(tp2_dp2_plan), "--checkpoint-dir", str(tmp_path / "ckpt"),
                     "--resume", "--seed", "1"]) == 2
    assert "another data stream (seed 0 -> 1)" in capsys.readouterr().err


def test_a_checkpoint_from_before_a_model_field_still_resumes():
    """A checkpoint saved before ModelSpec had ``qk_norm`` holds a model without the key: that
    is the field's default, the same weights; a field that differs is still refused."""
    spec = DataSpec(global_batch_size=8, seq_len=64, vocab_size=TINY.vocab_size, seed=0)
    older = {k: v for k, v in checkpoint.architecture(TINY).items() if k != "qk_norm"}
    state = checkpoint.TrainState(step=1, losses=(1.0,), step_s=(0.1,), grad_norms=(1.0,),
                                  lrs=(1e-3,), data=checkpoint.data_stream(spec), model=older,
                                  plan={})
    recipe = dataclasses.asdict(Recipe())
    checkpoint.check_compatible(state, data=checkpoint.data_stream(spec),
                                model=checkpoint.architecture(TINY), recipe=recipe, steps=2,
                                where="step-1")
    with pytest.raises(ValueError, match="another model \\(qk_norm False -> True\\)"):
        checkpoint.check_compatible(
            state, data=checkpoint.data_stream(spec), recipe=recipe, steps=2, where="step-1",
            model=checkpoint.architecture(dataclasses.replace(TINY, qk_norm=True)))


def test_resume_past_the_steps_is_refused(capsys, tmp_path, tp2_dp2_plan):
    _fake_checkpoint(tmp_path / "ckpt", 4)
    assert cli.main(["run", str(tp2_dp2_plan), "--checkpoint-dir", str(tmp_path / "ckpt"),
                     "--resume", "--steps", "3"]) == 2
    assert "past --steps 3 (it holds 4 steps)" in capsys.readouterr().err


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "random":
        data[len(data) // 2:len(data) // 2 + 64] = np.random.default_rng(1).bytes(64)
    elif how == "zeroed":
        data[:1024] = bytes(1024)
    else:  # truncated
        data = data[:len(data) // 3]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how, message", [("random", "does not match its sha256"),
                                          ("zeroed", "does not match its sha256"),
                                          ("truncated", "the manifest says 4096 bytes")])
def test_damaged_shards_are_found(tmp_path, how, message):
    _fake_checkpoint(tmp_path, 2)
    folder = tmp_path / "step-2"
    assert integrity.verify_files(str(folder)) is None
    _damage(folder / "__0_0.distcp", how)
    problems = [integrity.verify_files(str(folder), rank=r, world_size=2) for r in range(2)]
    found = [p for p in problems if p]
    assert found and message in found[0], problems


def test_truncated_checkpoint_is_refused_before_launch(capsys, tmp_path, tp2_dp2_plan):
    _fake_checkpoint(tmp_path / "ckpt", 2)
    _damage(tmp_path / "ckpt" / "step-2" / "__0_0.distcp", "truncated")
    assert cli.main(["run", str(tp2_dp2_plan), "--checkpoint-dir", str(tmp_path / "ckpt"),
                     "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "__0_0.distcp is 1365 bytes" in err, err


def test_keep_last_deletes_all_but_the_newest(tmp_path):
    for step in (1, 2, 3, 4):
        _fake_checkpoint(tmp_path, step)
    (tmp_path / "step-5.tmp").mkdir()  # a save in progress is not touched
    checkpoint.prune(str(tmp_path), 2)
    assert _committed(tmp_path) == ["step-3", "step-4", "step-5.tmp"]
    assert checkpoint.latest_step(str(tmp_path)) == 4


# ----- single-process pieces ---------------------------------------------------------------------

def test_latest_follows_the_pointer_and_skips_tmp_folders(tmp_path):
    assert checkpoint.latest_step(str(tmp_path)) is None
    _fake_checkpoint(tmp_path, 2)
    (tmp_path / "step-4.tmp").mkdir()
    (tmp_path / "step-4.tmp" / ".metadata").write_bytes(b"")
    assert checkpoint.latest_step(str(tmp_path)) == 2


def test_latest_naming_an_incomplete_folder_is_an_error(tmp_path):
    _fake_checkpoint(tmp_path, 2)
    (tmp_path / "step-2" / ".metadata").unlink()
    with pytest.raises(ValueError, match="has no .metadata: not a complete checkpoint"):
        checkpoint.latest_step(str(tmp_path))


def test_optimizer_fqns_are_whole_model_names():
    """A wrapped pipeline chunk's parameter names map to the unsplit model's names."""
    full = {name for name, _ in build_decoder(TINY).named_parameters()}
    chunk = build_decoder(TINY, layer_ids=[2, 3], first=False)
    apply_checkpointing(chunk, "full")
    names = {checkpoint._fqn(name) for name, _ in chunk.named_parameters()}
    assert any("_checkpoint_wrapped_module" in n for n, _ in chunk.named_parameters())
    assert names <= full and "layers.3.attention.wq.weight" in names
    assert checkpoint._fqn("module.layers.0.attention.wq.weight") == \
        "layers.0.attention.wq.weight"  # DDP's prefix


@pytest.mark.parametrize("offload", [False, True], ids=["adamw", "host-offload"])
def test_adamw_states_are_created_without_moving_parameters(offload):
    model = build_decoder(TINY, layer_ids=[0], last=False)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer_class = optim.HostOffloadAdamW if offload else torch.optim.AdamW
    optimizer = optimizer_class(list(model.parameters()), **Recipe().adamw_kwargs())
    states = optim.adamw_states(optimizer)
    assert [p for p, _ in states] == list(model.parameters())
    for param, state in states:
        assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"]
        assert state["exp_avg"].shape == param.shape and not state["exp_avg"].any()
        assert param.grad is None
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name


def test_host_offload_states_are_the_optimizer_own_tensors():
    """Loading into the presented state (in place) changes the optimizer's next step."""
    model = build_decoder(TINY, layer_ids=[0], last=False)
    optimizer = optim.HostOffloadAdamW(list(model.parameters()), **Recipe().adamw_kwargs())
    param, state = optim.adamw_states(optimizer)[0]
    state["exp_avg"].fill_(1.0)
    assert torch.equal(optimizer.host_optimizer.state[optimizer.pairs[0][1]]["exp_avg"],
                       torch.ones_like(param))


def test_fault_needs_a_marker_and_fires_once(tmp_path):
    assert Fault.from_env({}) is None
    with pytest.raises(ValueError, match="MESHPLAN_FAULT_MARKER"):
        Fault.from_env({"MESHPLAN_FAULT_AT_STEP": "3"})
    marker = tmp_path / "marker"
    fault = Fault.from_env({"MESHPLAN_FAULT_AT_STEP": "3", "MESHPLAN_FAULT_RANK": "1",
                            "MESHPLAN_FAULT_MARKER": str(marker)})
    assert fault == Fault(step=3, rank=1, marker=str(marker))
    fault.after_step(3, rank=0)  # another rank: nothing happens
    fault.after_step(2, rank=1)  # another step
    marker.write_text("done")
    fault.after_step(3, rank=1)  # marker present: the restarted job runs through
    assert os.path.exists(marker)
