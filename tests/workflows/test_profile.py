"""``meshplan.workflows.profile`` as a library: its checks before measuring, and one quick
single-process profile in this process; and ``meshplan profile``'s text."""

from __future__ import annotations

import json

import pytest

from meshplan.cli.profile import profile_lines
from meshplan.testing import usage_error
from meshplan.costmodel import load_calibration
from meshplan.workflows import profile as wf


def test_measurements_file_sits_next_to_the_calibration():
    assert wf.measurements_path("out/cal.json") == "out/cal-measurements.json"
    assert wf.measurements_path("cal.json", "raw.json") == "raw.json"


def test_missing_folder_and_cpu_fp16_are_refused_before_measuring(tmp_path):
    with pytest.raises(ValueError, match="--out .*: its folder does not exist"):
        wf.profile(out=str(tmp_path / "no" / "c.json"), quick=True)
    with pytest.raises(ValueError, match="--measurements .*: its folder does not exist"):
        wf.profile(out=str(tmp_path / "c.json"), measurements=str(tmp_path / "no" / "m.json"))
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("fp16 is refused on the CPU only")
    with pytest.raises(ValueError, match="fp16 on the CPU"):
        wf.profile(out=str(tmp_path / "c.json"), dtype="fp16", quick=True)
    assert list(tmp_path.iterdir()) == []


def test_existing_calibration_is_kept_without_force(tmp_path):
    out, raw = tmp_path / "c.json", tmp_path / "c-measurements.json"
    out.write_text("{}\n")
    line = usage_error("profile", "--quick", "--out", out)
    assert line.endswith(f"--out {str(out)!r} exists; pass --force to overwrite it")
    out.unlink()
    raw.write_text("{}\n")
    line = usage_error("profile", "--quick", "--out", out)
    assert line.endswith(f"--measurements {str(raw)!r} exists; pass --force to overwrite it")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c-measurements.json"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_one_process_quick_profile_writes_both_files(tmp_path):
    out = tmp_path / "c.json"
    result = wf.profile(out=str(out), quick=True, nproc_per_node=1)
    assert result.out == str(out) and result.measurements == str(tmp_path / "c-measurements.json")
    assert result.fit.matmul_flop_per_s > 0 and result.fit.links == {}  # one process
    written = load_calibration(str(out))
    assert written.device(result.device_key) == result.calibration.device(result.device_key)
    raw = json.loads((tmp_path / "c-measurements.json").read_text())
    assert raw["measurements"]["collectives"] == [] and raw["wall_s"] == result.wall_s
    lines = profile_lines(result).splitlines()
    cpu = result.device_key == "cpu"  # thin GEMMs and fresh pages: one more line
    assert lines[0].startswith("topology   ") and len(lines) == 7 + cpu
    if cpu:
        assert lines[3].startswith("small ops  GEMMs at half rate at ") and "GB/s" in lines[3]
    assert lines[4 + cpu].startswith("host adam  ") and "M params/s on 1 thread" in lines[4 + cpu]
    assert lines[5 + cpu] == "intra      not measured (one process)"
    assert lines[6 + cpu] == "inter      not measured (one node; run under torchrun --nnodes N " \
                             "to measure it)"
