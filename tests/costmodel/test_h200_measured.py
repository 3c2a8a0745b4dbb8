"""The H200's own eager values (``DeviceCalibration.eager_flash_attention_half_seq`` and the
measured efficiencies of ``benchmarks/fit_calibration.py --stage h200``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from meshplan.costmodel import default_calibration
from meshplan.costmodel.calibration import DeviceCalibration
from tests.conftest import benchmark_module


def _device(**changes) -> DeviceCalibration:
    return dataclasses.replace(default_calibration().device("h100-sxm"), **changes)


def test_half_seq_scales_the_eager_fused_attention_only():
    device = _device(eager_flash_attention_efficiency=0.3, eager_flash_attention_half_seq=800.0)
    assert device.fused_attention_efficiency(True, 8192) == pytest.approx(0.3 * 8192 / 8992)
    assert device.fused_attention_efficiency(True, 800) == pytest.approx(0.15)
    assert device.fused_attention_efficiency(True) == 0.3  # no length: the asymptote
    assert device.fused_attention_efficiency(False, 8192) == device.flash_attention_efficiency
    flat = _device(eager_flash_attention_efficiency=0.3)
    assert flat.fused_attention_efficiency(True, 512) == 0.3
    with pytest.raises(ValueError, match="eager_flash_attention_half_seq must be positive"):
        _device(eager_flash_attention_half_seq=0.0)


def test_the_h200_values_are_what_its_measurements_give():
    """The committed calibration's H200 eager values are reproduced from the two measurement
    files by ``--stage h200`` (a fit of the SDPA kernel points and a bisection on the runtime
    step), and the fits of the other stages leave them alone."""
    fit = benchmark_module("fit_calibration")
    cal = default_calibration()
    again = fit.h200_measured(cal).device("h200")
    for name in fit.MEASURED_DEVICE_FIELDS["h200"]:
        assert getattr(again, name) == pytest.approx(getattr(cal.device("h200"), name),
                                                     rel=1e-4), name
    # the other stages copy H100's values to H200 but for the measured ones
    x = np.array([p[1] for p in fit.EAGER_PARAMETERS])
    eager = fit.eager_calibration_from_vector(cal, x)
    h200 = cal.device("h200")
    assert eager.device("h200").eager_matmul_efficiency == h200.eager_matmul_efficiency
    assert eager.device("h100-sxm").eager_matmul_efficiency == x[1]
