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


# ----- meshplan's ZeRO-1: DDP's gradient all-reduce, then a broadcast per parameter tensor ---

def _runtime_tensors(spec, *, layers, first: bool, last: bool) -> int:
    """Parameter tensors of the runtime's own module for a stage (built on the meta device)."""
    import torch

    from meshplan.runtime.model import Decoder

    with torch.device("meta"):
        module = Decoder(spec, layer_ids=list(layers), first=first, last=last)
    return len(list(module.parameters()))


@pytest.mark.parametrize("name, changes", [
    ("tiny", {}), ("tiny", {"qk_norm": True}), ("tiny", {"qkv_bias": True}),
    ("tiny", {"linear_bias": True, "norm": "layernorm", "activation": "gelu",
              "position_embedding": "learned", "tied_embeddings": True,
              "embedding_norm": True}),
    ("gpt3-125m", {})])
def test_stage_tensor_count_is_the_runtime_modules(name, changes):
    """``StageParams.tensors`` (what ZeRO-1's per-tensor broadcasts count) against the
    runtime's real modules: a one-stage model, and each stage of a 2-stage split (a tied head
    is its own copy on the last stage)."""
    spec = dataclasses.replace(load_model(name), **changes)
    n = spec.num_layers
    one = ParallelConfig(global_batch_size=4, seq_len=64)
    assert stage_params(spec, one, 0).tensors == \
        _runtime_tensors(spec, layers=range(n), first=True, last=True)
    two = ParallelConfig(pp=2, global_batch_size=4, seq_len=64)
    half = n // 2
    assert stage_params(spec, two, 0).tensors == \
        _runtime_tensors(spec, layers=range(half), first=True, last=False)
    assert stage_params(spec, two, 1).tensors == \
        _runtime_tensors(spec, layers=range(half, n), first=False, last=True)


def test_meshplan_zero1_broadcasts_every_parameter_tensor_in_its_optimizer_step():
    """With a host cost of 1 s per collective call, meshplan's ZeRO-1 step is the tiny model's
    39 parameter tensors' broadcasts (39 s, one latency step each over 2 ranks) slower than its
    ZeRO-1 without them; Megatron's ZeRO-1 (the distributed optimizer's one all-gather) has
    none. Its gradient traffic is a ring all-reduce of the fp32 gradients: twice ZeRO-1's
    reduce-scatter in Megatron's accounting."""
    model, cluster = load_model("tiny"), load_cluster("cpu", nodes=1, gpus_per_node=2)
    config = ParallelConfig(dp=2, zero_stage=1, global_batch_size=4, seq_len=64, dtype="fp32")
    assert _runtime_tensors(model, layers=range(model.num_layers), first=True, last=True) == 39
    slow = dataclasses.replace(default_calibration(), collective_call_s=1.0)
    from meshplan.costmodel.estimate import estimate

    def optimizer_s(zero: int, framework: str) -> float:  # the logged loss's all-reduce too
        return estimate(model, cluster, config.replace(zero_stage=zero), framework=framework,
                        calibration=slow).time.optimizer_s

    # beside the 39 s: the CPU's own 0.8 ms per call, the bytes, ZeRO-1 stepping half the
    # parameters: tens of milliseconds
    assert optimizer_s(1, "meshplan") - optimizer_s(0, "meshplan") == pytest.approx(39, abs=0.1)
    assert optimizer_s(1, "megatron") - optimizer_s(0, "megatron") == pytest.approx(0, abs=0.1)
    params = stage_params(model, config, 0)
    link = timing.stage_links(cluster, config, 0).dp

    def dp_comm(zero: int, framework: str) -> float:  # bf16: Megatron gathers 16-bit params
        return timing.dp_step_s(config.replace(zero_stage=zero, dtype="bf16"),
                                default_calibration(),
                                params=params, link=link, last_backward_s=0.0,
                                framework=framework, gpu_key="cpu")[0]

    # 2 ranks: the ring all-reduce of ZeRO-0 (its tree is slower there)
    assert dp_comm(1, "meshplan") == pytest.approx(dp_comm(0, "meshplan"), rel=1e-9)
    assert dp_comm(1, "megatron") < dp_comm(1, "meshplan")
