"""Parameter offload under FSDP2's ``CPUOffloadPolicy`` (meshplan's runtime, torchtitan) on a
GPU: what crosses PCIe each micro-batch and what the host does, read from torch's FSDP2
(``_fsdp_param.py`` ``all_gather_inputs``: the fp32 host shard is copied, then cast;
``_fsdp_collectives.py`` ``foreach_reduce``: each backward copies its fp32 gradient shard to
the host and, when gradients accumulate, adds it there).

The numbers below are worked from the model's parameter count and the cluster's catalogue
rates, not read back from the cost model's own terms."""

from __future__ import annotations

import pytest

from meshplan.costmodel import ParallelConfig, default_calibration, estimate, load_cluster, load_model
from meshplan.costmodel.estimate import stage_micro

CAL = default_calibration()
MODEL = load_model("llama3.2-1b")


def _config(micro_batch: int, **fields) -> ParallelConfig:
    return ParallelConfig(**{**dict(global_batch_size=8, micro_batch_size=micro_batch,
                                    seq_len=2048, dtype="bf16", zero_stage=3,
                                    offload="optimizer+params", recompute="full"), **fields})


def _micro(framework: str, config: ParallelConfig, cluster):
    return stage_micro(MODEL, cluster, config, 0, framework=framework, calibration=CAL)


def _raw(framework: str, config: ParallelConfig, cluster) -> float:
    return _micro(framework, config, cluster).offload_raw_s


@pytest.mark.parametrize("framework", ["meshplan", "torchtitan"])
def test_fsdp2_moves_fp32_params_twice_and_fp32_grads_once_per_micro_batch(framework):
    cluster = load_cluster("dgx-h200", nodes=1, gpus_per_node=1)
    pcie = CAL.host_copy_rate(cluster.pcie_bytes_per_s, pinned=True)
    host = CAL.host_memory_bytes_per_s["h200"]
    params = MODEL.num_params  # one rank holds every parameter at dp 1
    # one micro-batch: forward and backward gathers of the fp32 masters and one fp32
    # gradient shard back, all of which compute may hide; nothing accumulates
    one = _micro(framework, _config(8), cluster)
    assert one.offload_raw_s == pytest.approx((2 * 4 + 4) * params / pcie, rel=0.01)
    assert one.offload_wait_s == 0.0
    # four micro-batches: three of them copy their gradient back blocking, into pageable
    # memory (``foreach_reduce`` copies with non_blocking=False while accumulating), and add
    # it to the earlier ones' on the host (read both, write one, fp32) while the device waits
    pageable = CAL.host_copy_rate(cluster.pcie_bytes_per_s, pinned=False)
    assert pageable < pcie
    four = _micro(framework, _config(2), cluster)
    assert four.offload_raw_s == pytest.approx((2 * 4 + 4 / 4) * params / pcie, rel=0.01)
    assert four.offload_wait_s == pytest.approx(
        3 / 4 * (4 * params / pageable + 12 * params / host), rel=0.01)
    # the wait adds to the work that does not overlap, and is all the offload adds there
    plain = _micro(framework, _config(2, offload="none"), cluster)
    assert four.linear_s == pytest.approx(plain.linear_s + four.offload_wait_s, rel=1e-9)


def test_deepspeed_and_the_cpu_device_keep_their_own_offload_path():
    """DeepSpeed moves 16-bit parameters (its own offload, not FSDP2's); on the CPU device
    FSDP2's host-device copies are no-ops, so the meshplan CPU plans keep the old term."""
    gpu = load_cluster("dgx-h200", nodes=1, gpus_per_node=1)
    pcie = CAL.host_copy_rate(gpu.pcie_bytes_per_s, pinned=True)
    assert _raw("deepspeed", _config(2), gpu) == pytest.approx(
        2 * 2 * MODEL.num_params / pcie, rel=0.01)
    cpu = load_cluster("cpu", nodes=1, gpus_per_node=1)
    config = _config(2, dtype="fp32")
    assert _raw("meshplan", config, cpu) == _raw("deepspeed", config, cpu)


def test_fsdp2_offload_has_no_once_per_step_pcie_and_costs_more_than_before():
    """The optimizer step finds the gradients on the host and leaves the parameters there: its
    offload term is the host AdamW (the same as an optimizer-only plan's host part) and the
    gradient clipping, in host memory too: meshplan's runtime reads the fp32 gradients for the
    global norm, reads and writes them to scale them, and reads them again for the norm it
    logs after clipping (runtime/recipe.py, runtime/train.py): 16 bytes per parameter;
    torchtitan's clip_grad_norm_ the first two, 12."""
    from meshplan.costmodel.estimate import stage_once

    cluster = load_cluster("dgx-h200", nodes=1, gpus_per_node=1)
    config = _config(2)
    flop = CAL.host_adam_flop_per_param * MODEL.num_params / cluster.host_flop_per_s
    adam = CAL.host_memory_s("h200", CAL.host_adam_bytes_per_param * MODEL.num_params)
    for framework, clip_bytes in (("meshplan", 4 + 8 + 4), ("torchtitan", 4 + 8)):
        _, _, _, step = stage_once(MODEL, cluster, config, 0, framework=framework,
                                   calibration=CAL, compute_s=1.0)
        clip = CAL.host_memory_s("h200", clip_bytes * MODEL.num_params)
        assert step == pytest.approx(max(adam, flop) + clip, rel=0.01)
    est = estimate(MODEL, cluster, config, framework="meshplan", calibration=CAL)
    assert est.time.offload_s > 0.5  # 0.25 s with 16-bit transfers and no gradient copies
