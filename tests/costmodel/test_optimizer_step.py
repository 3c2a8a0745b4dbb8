"""The device optimizer step: a measured rate where the bandwidth formula does not hold (the CPU
device), and expert weights sharded over their expert group's replicas."""

from __future__ import annotations

import dataclasses

import pytest

from meshplan.costmodel import ParallelConfig, default_calibration, load_cluster, load_model
from meshplan.costmodel import timing
from meshplan.costmodel.memory import stage_params


def test_cpu_device_step_runs_at_the_measured_foreach_rate():
    """On the CPU device the step is the sharded parameters over the calibrated AdamW rate;
    without a rate it falls back to 36 bytes per parameter at the device's bandwidth."""
    calibration = default_calibration()
    model, cluster = load_model("tiny"), load_cluster("cpu", nodes=1, gpus_per_node=2)
    config = ParallelConfig(dp=2, zero_stage=3, global_batch_size=4, seq_len=64, dtype="fp32")
    params = stage_params(model, config, 0)
    rate = calibration.device("cpu").optimizer_params_per_s
    step, offload = timing.optimizer_step_s(config, cluster, calibration, params=params,
                                            framework="meshplan")
    loss_only, _ = timing.optimizer_step_s(config.replace(offload="optimizer"), cluster,
                                           calibration, params=params, framework="meshplan")
    local = (params.dense + params.expert) / 2
    assert offload == 0.0 and step - loss_only == pytest.approx(local / rate, rel=1e-12)
    devices = dict(calibration.devices)
    devices["cpu"] = dataclasses.replace(devices["cpu"], optimizer_params_per_s=None)
    formula, _ = timing.optimizer_step_s(config, cluster,
                                         dataclasses.replace(calibration, devices=devices),
                                         params=params, framework="meshplan")
    bandwidth = cluster.gpu.hbm_bytes_per_s * calibration.device("cpu").memory_efficiency
    assert formula - loss_only == pytest.approx(
        local * timing.OPTIMIZER_BYTES_PER_PARAM / bandwidth, rel=1e-12)


def test_expert_weights_step_on_their_expert_group_shard():
    """With ep 8 over dp 8, each rank updates 1/8 of the dense weights and all of its local
    experts' weights (their shard degree is dp / ep = 1), as memory counts them."""
    calibration = default_calibration()
    model, cluster = load_model("mixtral-8x7b"), load_cluster("dgx-h100", nodes=1)
    config = ParallelConfig(dp=8, ep=8, zero_stage=1, global_batch_size=8, seq_len=4096)
    params = stage_params(model, config, 0)
    step, _ = timing.optimizer_step_s(config, cluster, calibration, params=params,
                                      framework="megatron")
    loss_only, _ = timing.optimizer_step_s(config.replace(offload="optimizer"), cluster,
                                           calibration, params=params, framework="megatron")
    bandwidth = cluster.gpu.hbm_bytes_per_s * calibration.device("h100-sxm").memory_efficiency
    local = params.dense / 8 + params.expert / 1
    assert step - loss_only == pytest.approx(
        local * timing.OPTIMIZER_BYTES_PER_PARAM / bandwidth, rel=1e-12)
