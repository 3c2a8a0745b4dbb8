"""What an overlapped FSDP collective costs the compute beside it (``timing.prefetch_contention``).

The expected fractions are built here from the catalog's link and memory rates (NVLink
450 GB/s, one 50 GB/s NIC per GPU, 2.4 TB/s HBM2e on Grand Teton) and the calibration's
efficiencies: a ring that moves ``bus`` bytes per second costs ``k * bus / hbm`` of its time.
"""

from __future__ import annotations

import dataclasses

import pytest

from meshplan.costmodel import default_calibration, estimate
from meshplan.costmodel.config import ParallelConfig
from meshplan.costmodel.hardware import load_cluster
from meshplan.costmodel.models import load_model
from meshplan.costmodel.timing import prefetch_contention, stage_links


def _fraction(cluster, config, calibration):
    return prefetch_contention(cluster, calibration, stage_links(cluster, config, 0).dp)


def _config(tp: int, dp: int) -> ParallelConfig:
    return ParallelConfig(tp=tp, dp=dp, sp=tp > 1, zero_stage=3, micro_batch_size=2,
                          global_batch_size=2 * dp, seq_len=8192)


def test_a_ring_inside_the_node_costs_its_nvlink_rate_in_hbm_time():
    cal = default_calibration()
    cluster = load_cluster("grand-teton-h100", nodes=1)
    device = cal.device(cluster.gpu.key)
    hbm = 2.4e12 * device.memory_efficiency
    expected = device.prefetch_contention_bytes * 450e9 * cal.nvlink_efficiency / hbm
    assert _fraction(cluster, _config(tp=1, dp=8), cal) == pytest.approx(expected, rel=1e-9)
    assert 0.4 < expected < 1


def test_one_rank_per_node_runs_at_one_nic_and_costs_little():
    """FSDP 16 under TP 8 (torchtitan's 405B 2D layout): each FSDP ring hop leaves the node
    through one 50 GB/s NIC, a fiftieth of HBM's rate; the same 16 ranks on 2 nodes (8 NICs
    each in parallel) cost several times more."""
    cal = default_calibration()
    cluster = load_cluster("grand-teton-h100", nodes=16)
    device = cal.device(cluster.gpu.key)
    expected = (device.prefetch_contention_bytes * 50e9 * cal.network_efficiency
                / (2.4e12 * device.memory_efficiency))
    fraction = _fraction(cluster, _config(tp=8, dp=16), cal)
    assert fraction == pytest.approx(expected, rel=1e-9)
    assert fraction < 0.1 < _fraction(load_cluster("grand-teton-h100", nodes=2),
                                      _config(tp=1, dp=16), cal)


def test_without_the_byte_rate_the_fixed_fraction_holds():
    cal = default_calibration()
    cluster = load_cluster("grand-teton-h100", nodes=16)
    device = dataclasses.replace(cal.device(cluster.gpu.key), prefetch_contention_bytes=None,
                                 prefetch_contention=0.3)
    fixed = dataclasses.replace(cal, devices=dict(cal.devices, **{cluster.gpu.key: device}))
    assert _fraction(cluster, _config(tp=8, dp=16), fixed) == 0.3
    with pytest.raises(ValueError, match="prefetch_contention_bytes"):
        dataclasses.replace(device, prefetch_contention_bytes=-1.0)


def test_the_step_pays_the_contention_of_the_traffic_it_hides():
    """The same 405B 2D step with the contention doubled: the exposed FSDP time grows by the
    fraction's change times the traffic the compute hides (the overlapped part costs that
    fraction of itself)."""
    cal = default_calibration()
    model, cluster = load_model("llama3-405b"), load_cluster("grand-teton-h100", nodes=16)
    config = dataclasses.replace(_config(tp=8, dp=16), recompute="full")
    key = cluster.gpu.key
    doubled = dataclasses.replace(cal, devices=dict(cal.devices, **{key: dataclasses.replace(
        cal.device(key), prefetch_contention_bytes=2 * cal.device(key).prefetch_contention_bytes)}))
    one = estimate(model, cluster, config, framework="torchtitan", calibration=cal).time
    two = estimate(model, cluster, config, framework="torchtitan", calibration=doubled).time
    f1 = _fraction(cluster, config, cal)
    f2 = _fraction(cluster, config, doubled)
    assert f2 == pytest.approx(2 * f1)
    assert two.dp_comm_s > one.dp_comm_s
    assert two.compute_s == one.compute_s


def _with_device(cal, key, **changes):
    return dataclasses.replace(cal, devices=dict(cal.devices, **{
        key: dataclasses.replace(cal.device(key), **changes)}))


def _hidden_zero3():
    """Megatron 1.7B, ZeRO-3 over one DGX A100's 8 GPUs: compute hides every prefetched
    gather and reduce-scatter, so only their contention shows."""
    model, cluster = load_model("megatron-1.7b"), load_cluster("dgx-a100-80gb", nodes=1)
    config = ParallelConfig(dp=8, zero_stage=3, micro_batch_size=1, global_batch_size=8,
                            seq_len=2048)
    return model, cluster, config


@pytest.mark.parametrize("framework", ["torchtitan", "meshplan"])
def test_hidden_traffic_costs_its_hbm_time_at_any_link_rate(framework):
    """A fully hidden ring's bytes cost their HBM time, k bytes per byte at HBM's rate,
    whatever the link's rate: halving NVLink leaves the step as it was."""
    model, cluster, config = _hidden_zero3()
    slow = dataclasses.replace(cluster, gpu=dataclasses.replace(
        cluster.gpu, nvlink_bytes_per_s=cluster.gpu.nvlink_bytes_per_s / 2))
    fast_t = estimate(model, cluster, config, framework=framework).time
    slow_t = estimate(model, slow, config, framework=framework).time
    assert fast_t.dp_comm_s > 0
    assert slow_t.step_s == pytest.approx(fast_t.step_s, rel=1e-9)


def test_hidden_latency_costs_the_link_independent_share():
    """The calls' latency moves no bytes: beside compute it costs ``prefetch_contention`` of
    itself, so the step grows linearly in that share (and not at all at 0 beyond the bytes'
    HBM time)."""
    model, cluster, config = _hidden_zero3()
    cal = default_calibration()
    key = cluster.gpu.key
    steps = [estimate(model, cluster, config, framework="torchtitan",
                      calibration=_with_device(cal, key, prefetch_contention=s)).time.step_s
             for s in (0.0, 0.1, 0.2)]
    assert steps[0] < steps[1] < steps[2]
    assert steps[2] - steps[0] == pytest.approx(2 * (steps[1] - steps[0]), rel=1e-9)
