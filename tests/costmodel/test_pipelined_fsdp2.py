"""FSDP2 inside a pipeline stage syncs once per step (meshplan's runtime, torchtitan).

``torch.distributed.pipelining`` turns FSDP2's gradient sync and resharding off for every
micro-batch's backward and reduce-scatters each group once, after the stage's last backward;
parameters stay gathered from the first micro-batch's forward on. The worker counts what torch
really issues; the cost model must charge the same: no ZeRO traffic per micro-batch, one
un-hideable reduce-scatter of the stage's fp32 gradients per step, and the fp32 gradient
accumulation per micro-batch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshplan.costmodel import ParallelConfig, default_calibration, load_cluster, load_model
from meshplan.costmodel import collectives as coll
from meshplan.costmodel.calls import collective_calls_per_microbatch, fsdp2_syncs_once_per_step
from meshplan.costmodel.estimate import stage_terms
from meshplan.costmodel.memory import stage_params
from meshplan.costmodel.timing import calibrated_links, fsdp2_accumulate_s, stage_links

WORKER = Path(__file__).with_name("fsdp2_pipeline_worker.py")
BLOCKS, MICRO_BATCHES = 3, 4  # as in the worker


@pytest.mark.timeout(240)
def test_torch_pipelining_reduces_fsdp2_gradients_once_per_step():
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
                          "--standalone", str(WORKER)],
                         capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-2000:]
    # the ranks share one stdout, so their lines may run together
    counts = [tuple(map(int, found))
              for found in re.findall(r"counts (\d+) (\d+) (\d+) (\d+)", out.stdout)]
    assert sorted({rank for rank, *_ in counts}) == [0, 1, 2, 3]
    steady = [(scatters, gathers) for _, step, scatters, gathers in counts if step > 0]
    # one per block and step, where syncing every micro-batch would issue BLOCKS x 4
    assert steady and set(steady) == {(BLOCKS, BLOCKS)}
    # the cost model's count for such a stage: no calls per micro-batch, one group per block
    model = load_model("tiny")
    config = ParallelConfig(pp=2, dp=2, zero_stage=3, micro_batch_size=1,
                            global_batch_size=2 * MICRO_BATCHES, seq_len=64)
    assert fsdp2_syncs_once_per_step("meshplan", config)
    calls = collective_calls_per_microbatch(model, config, 1, framework="meshplan",
                                            recompute="none")
    assert calls.zero_all_gather == calls.zero_reduce_scatter == 0


MODEL = load_model("llama3-8b")
CLUSTER = load_cluster("dgx-h100", nodes=4)


def _config(**fields) -> ParallelConfig:
    base = dict(tp=8, pp=2, dp=2, zero_stage=3, micro_batch_size=1, global_batch_size=16,
                seq_len=4096, dtype="bf16", flash_attention=True, recompute="full")
    return ParallelConfig(**{**base, **fields})


def _terms(config: ParallelConfig, framework: str = "torchtitan", stage: int = 0):
    return stage_terms(MODEL, CLUSTER, config, stage, framework=framework,
                       calibration=default_calibration())


@pytest.mark.parametrize("framework", ["torchtitan", "meshplan"])
def test_no_zero_traffic_per_micro_batch_and_the_step_traffic_does_not_grow_with_them(framework):
    few, many = _terms(_config(), framework), _terms(_config(global_batch_size=64), framework)
    assert few.micro.zero_comm_s == many.micro.zero_comm_s == 0.0
    assert few.dp_comm_s == many.dp_comm_s > 0
    # without a pipeline FSDP2 gathers and reduces every micro-batch
    assert _terms(_config(pp=1), framework).micro.zero_comm_s > 0


def test_the_step_reduce_scatter_is_not_hidden():
    """The stage's fp32 gradients are reduce-scattered after its last backward: at least that
    long is exposed, whatever the compute."""
    config = _config()
    terms = _terms(config)
    calibration = default_calibration()
    link = calibrated_links(stage_links(CLUSTER, config, 0), calibration, CLUSTER.gpu.key).dp
    params = stage_params(MODEL, config, 0)
    scatter = coll.reduce_scatter_s(link, 4 * (params.dense + params.expert),
                                    intra_eff=calibration.nvlink_efficiency,
                                    inter_eff=calibration.network_efficiency)
    assert terms.dp_exposed_s >= scatter > 0


def test_fp32_gradient_accumulation_per_micro_batch():
    """FSDP2 converts the first micro-batch's bf16 gradients to fp32 (read 2, write 4 bytes per
    parameter) and adds the others in place (read 2 and 4, write 4): over 4 micro-batches
    (6 + 3 x 10) / 4 = 9 bytes per parameter and micro-batch through HBM."""
    calibration = default_calibration()
    config = _config(global_batch_size=8)  # dp 2 x 4 micro-batches
    assert config.grad_accum_steps == 4
    params = stage_params(MODEL, config, 0)
    bandwidth = CLUSTER.gpu.hbm_bytes_per_s * calibration.device(CLUSTER.gpu.key).memory_efficiency
    got = fsdp2_accumulate_s(config, CLUSTER, calibration, params=params, framework="torchtitan")
    assert got == pytest.approx(9 * (params.dense + params.expert) / bandwidth)
    for other in (_config(dtype="fp32"), _config(pp=1)):
        assert fsdp2_accumulate_s(other, CLUSTER, calibration,
                                  params=stage_params(MODEL, other, 0), framework="torchtitan") == 0
    assert fsdp2_accumulate_s(config, CLUSTER, calibration, params=params,
                              framework="deepspeed") == 0
