"""``meshplan.workflows.validate`` as a library: the report document, the refit's guard, the
checks before anything runs, one real run in this process; and ``meshplan validate``'s text."""

from __future__ import annotations

import json

import pytest

from meshplan.cli.validate import refit_lines, validate_summary
from meshplan.costmodel import (ParallelConfig, default_calibration, estimate,
                                load_calibration, load_cluster, load_model)
from meshplan.planner.plan import Plan, write_plan
from meshplan.testing import usage_error
from meshplan.workflows import validate as wf

CONFIG = dict(global_batch_size=4, micro_batch_size=2, seq_len=64, dtype="fp32")


def _plan(cluster: str = "cpu", gpus: int = 1) -> Plan:
    est = estimate(load_model("tiny"), load_cluster(cluster, gpus_per_node=gpus),
                   ParallelConfig(**CONFIG), framework="meshplan")
    return Plan.from_estimate(est, provenance={"source": "test"})


def _measurement(**changes) -> wf.PlanMeasurement:
    values = dict(plan="a.json", world_size=2, measured_step_s=0.03, step_s=(0.05, 0.03, 0.03),
                  predicted_step_s=0.01, foreign_cpu_cores=0.5,
                  per_rank=(wf.RankPeak(rank=0, stage=0, measured_peak_bytes=150_000_000,
                                        predicted_peak_bytes=100_000_000),
                            wf.RankPeak(rank=1, stage=1, measured_peak_bytes=None,
                                        predicted_peak_bytes=100_000_000)))
    return wf.PlanMeasurement(**{**values, **changes})


def test_report_document_keeps_its_keys():
    refit = wf.RefitSummary(out="r.json", fitted="every compute and comm cost scaled by 3.000",
                            predicted_step_s=(0.029,), calibration=default_calibration())
    result = wf.ValidationResult(calibration_name="built-in", steps=3,
                                 plans=(_measurement(),), refit=refit)
    assert result.to_dict() == {
        "calibration": "built-in", "steps": 3,
        "plans": [{"plan": "a.json", "world_size": 2, "measured_step_s": 0.03,
                   "step_s": [0.05, 0.03, 0.03], "predicted_step_s": 0.01,
                   "step_ratio": pytest.approx(3.0),
                   "per_rank": [{"rank": 0, "stage": 0, "measured_peak_bytes": 150_000_000,
                                 "predicted_peak_bytes": 100_000_000, "peak_ratio": 1.5},
                                {"rank": 1, "stage": 1, "measured_peak_bytes": None,
                                 "predicted_peak_bytes": 100_000_000, "peak_ratio": None}],
                   "foreign_cpu_cores": 0.5, "timeshare": 1.0}],
        "refit": {"out": "r.json", "fitted": "every compute and comm cost scaled by 3.000",
                  "predicted_step_s": [0.029]}}
    assert "refit" not in wf.ValidationResult(calibration_name="x", steps=1, plans=()).to_dict()


def test_cli_text_of_one_plan_and_of_the_refit():
    assert validate_summary(_measurement()).splitlines() == [
        "step time  measured 0.0300 s   predicted 0.0100 s   ratio 3.00x",
        "warning: other processes kept 0.50 cores busy during the timed run; its step time is "
        "not this plan's alone",
        "rank 0 (stage 0)  peak measured 150.00 MB   predicted 100.00 MB   ratio 1.50x"]
    quiet = validate_summary(_measurement(foreign_cpu_cores=0.25))  # at the threshold: no warning
    assert "warning" not in quiet and not _measurement(foreign_cpu_cores=None).loaded
    refit = wf.RefitSummary(out="r.json", fitted="f", predicted_step_s=(0.025,),
                            calibration=default_calibration())
    assert refit_lines(refit, (_measurement(),)).splitlines() == [
        "refit      f; wrote r.json",
        "           a.json: measured 0.0300 s   predicted now 0.0250 s   ratio 1.20x"]


def test_a_run_on_shared_cores_is_held_to_the_prediction_times_the_sharing(tmp_path):
    """4 processes on 2 cores (``timeshare`` 2): each computes at half a core, so the step is
    compared with twice the plan's one-core-per-process prediction, and a refit fits the
    plan to half the measured step."""
    shared = _measurement(timeshare=2.0, foreign_cpu_cores=0.0)
    assert shared.step_ratio == pytest.approx(1.5) and shared.one_core_step_s == 0.015
    assert validate_summary(shared).splitlines()[0] == (
        "step time  measured 0.0300 s   predicted 0.0100 s x2 for 2 processes per CPU core "
        "here = 0.0200 s   ratio 1.50x")
    plan = _plan("cpu")
    wf.refit_calibration([plan], [shared], default_calibration(),
                         out=str(tmp_path / "r.json"), steps=3)
    refitted = wf.plan_estimate(plan, load_calibration(str(tmp_path / "r.json")))
    assert refitted.time.step_s == pytest.approx(0.015, rel=0.01)


def test_refit_needs_one_device_and_framework(tmp_path):
    with pytest.raises(ValueError, match="one device and framework"):
        wf.refit_calibration([_plan("cpu"), _plan("dgx-a100-80gb")],
                             [_measurement(), _measurement()], default_calibration(),
                             out=str(tmp_path / "r.json"), steps=3)
    assert not (tmp_path / "r.json").exists()


def test_missing_folders_are_refused_before_anything_runs(tmp_path):
    plan_file = tmp_path / "plan.json"
    write_plan(_plan(), plan_file)
    with pytest.raises(ValueError, match="--report .*: its folder does not exist"):
        wf.validate([str(plan_file)], report=str(tmp_path / "no" / "r.json"))
    line = usage_error("validate", plan_file, "--refit", "--out", tmp_path / "no" / "c.json")
    assert line.endswith("c.json': its folder does not exist")
    assert usage_error("validate", tmp_path / "nope.json").endswith("nope.json' does not exist")


def test_existing_outputs_are_kept_without_force(tmp_path):
    plan_file, mine = tmp_path / "plan.json", tmp_path / "mine.json"
    write_plan(_plan(), plan_file)
    mine.write_text("{}\n")
    for flags in (["--report", mine], ["--refit", "--out", mine]):
        line = usage_error("validate", plan_file, *flags)
        assert line.endswith(f"{str(mine)!r} exists; pass --force to overwrite it")
    assert mine.read_text() == "{}\n"


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_validate_in_this_process_runs_measures_and_writes_the_report(tmp_path):
    plan_file, report = tmp_path / "plan.json", tmp_path / "report.json"
    write_plan(_plan(), plan_file)
    seen = []
    result = wf.validate([str(plan_file)], steps=3, report=str(report), on_plan=seen.append)
    (measured,) = result.plans
    assert seen == [measured] and measured.plan == str(plan_file)
    assert measured.world_size == 1 and len(measured.step_s) == 3
    assert measured.measured_step_s > 0 and measured.predicted_step_s > 0
    (rank,) = measured.per_rank
    assert rank.measured_peak_bytes > 0 and 0.2 < rank.peak_ratio < 5
    assert json.loads(report.read_text()) == json.loads(json.dumps(result.to_dict()))
