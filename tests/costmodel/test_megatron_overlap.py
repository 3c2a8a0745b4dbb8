"""Megatron-LM's communication overlap: data-parallel (``--overlap-grad-reduce``,
``--overlap-param-gather``) and interleaved-pipeline sends (``--overlap-p2p-communication``),
both ``ParallelConfig.overlap_comm``, Transformer Engine's TP overlap
(``ParallelConfig.tp_comm_overlap``), and its vocabulary-parallel cross entropy, unfused or
fused (``ParallelConfig.cross_entropy_fusion``).

The expected values are written out here from what megatron-core does (which compute each
collective runs beside), from the estimate's own compute and traffic terms; the published runs
that use them are the ``megatron-core-h100`` and ``nemo-h100-fp8`` families of
``costmodel/data/reference_runs.json``.
"""

from __future__ import annotations

import json

import pytest

from meshplan.costmodel import default_calibration
from meshplan.costmodel.config import ParallelConfig
from meshplan.costmodel.estimate import stage_terms
from meshplan.costmodel.hardware import load_cluster
from meshplan.costmodel.models import load_model
from meshplan.testing import run_cli, usage_error

CAL = default_calibration()


def _terms(model: str, nodes: int, stage: int = 0, **config):
    cluster = load_cluster("dgx-h100", nodes=nodes)
    return stage_terms(load_model(model), cluster, ParallelConfig(**config), stage,
                       framework="megatron", calibration=CAL), cluster


def _contention(cluster) -> float:
    """What an overlapped collective costs the compute beside it, by hand: the ring's HBM
    traffic (``prefetch_contention_bytes`` per byte on the ring) against the device's HBM rate,
    for a data-parallel group of one rank per node (TP 8 fills the node), which moves at one
    NIC's rate."""
    device = CAL.device(cluster.gpu.key)
    bus = cluster.nic_bytes_per_s * CAL.network_efficiency
    return min(1.0, device.prefetch_contention_bytes * bus
               / (cluster.gpu.hbm_bytes_per_s * device.memory_efficiency))


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_data_parallel_traffic_hides_behind_the_last_backward_and_first_forward(zero_stage):
    """ZeRO 0: the gradient all-reduce beside the last micro-batch's backward (two thirds of
    its compute); ZeRO 1 (the distributed optimizer): the reduce-scatter there and the
    parameter all-gather beside the next step's first forward, the whole micro-batch, each
    less the contention it causes. Without the overlap, the fitted ``dp_overlap`` of the
    backward, as Megatron-LM ran before megatron-core."""
    config = dict(tp=8, dp=4, zero_stage=zero_stage, sp=True, micro_batch_size=1,
                  global_batch_size=16, seq_len=8192)
    terms, cluster = _terms("llama3-70b", 4, **config)
    compute = terms.micro.compute_s
    window = compute if zero_stage == 1 else compute * 2 / 3
    assert _contention(cluster) < 0.2
    assert terms.dp_hidden_s == pytest.approx((1 - _contention(cluster)) * window, rel=1e-9)
    old, _ = _terms("llama3-70b", 4, overlap_comm=False, **config)
    assert old.dp_comm_s == terms.dp_comm_s  # the traffic is the same, only its overlap differs
    assert old.dp_hidden_s == pytest.approx(CAL.dp_overlap * compute * 2 / 3, rel=1e-9)
    assert old.dp_exposed_s > terms.dp_exposed_s


def test_other_frameworks_do_not_read_overlap_comm():
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", nodes=1)
    for framework in ("deepspeed", "torchtitan"):
        on, off = (stage_terms(model, cluster, ParallelConfig(
            dp=8, zero_stage=1, global_batch_size=16, seq_len=4096, overlap_comm=flag), 0,
            framework=framework, calibration=CAL) for flag in (True, False))
        assert (on.dp_comm_s, on.dp_hidden_s) == (off.dp_comm_s, off.dp_hidden_s)


def test_interleaved_sends_wait_as_long_as_a_non_interleaved_stage():
    """With --overlap-p2p-communication an interleaved stage's v - 1 extra chunk boundaries run
    beside compute: it waits for one send and one receive per micro-batch, as at v 1; without
    it, 2 v (the sends of every chunk)."""
    config = dict(tp=8, pp=4, dp=1, sp=True, micro_batch_size=1, global_batch_size=16,
                  seq_len=8192)
    one, cluster = _terms("llama3-70b", 4, stage=1, vpp=1, **config)
    for vpp in (2, 4):
        on, _ = _terms("llama3-70b", 4, stage=1, vpp=vpp, **config)
        off, _ = _terms("llama3-70b", 4, stage=1, vpp=vpp, overlap_comm=False, **config)
        assert one.micro.pp_comm_s > 0
        assert on.micro.pp_comm_s == pytest.approx(one.micro.pp_comm_s, rel=1e-12)
        assert off.micro.pp_comm_s == pytest.approx(vpp * one.micro.pp_comm_s, rel=1e-12)


def test_te_tp_overlap_pipelines_each_collective_with_its_gemm():
    """Under --tp-comm-overlap each of a layer's four SP collectives per direction waits only
    for what the (tp - 1) / tp of its GEMM beside it does not cover: for Llama 3 70B at TP 8
    over NVLink the GEMMs are several times longer than the transfers, so little is left of
    what Megatron-LM's own path waits for (one all-gather and one reduce-scatter per
    direction)."""
    config = dict(tp=8, dp=1, sp=True, micro_batch_size=1, global_batch_size=1, seq_len=8192)
    base, _ = _terms("llama3-70b", 1, **config)
    overlapped, _ = _terms("llama3-70b", 1, tp_comm_overlap=True, **config)
    assert base.micro.tp_comm_s > 0
    assert 0.0 <= overlapped.micro.tp_comm_s < 0.25 * base.micro.tp_comm_s
    assert overlapped.micro.compute_s == base.micro.compute_s
    # without SP the flag changes nothing (Transformer Engine's overlap needs SP)
    no_sp = dict(config, sp=False)
    plain, _ = _terms("llama3-70b", 1, **no_sp)
    flagged, _ = _terms("llama3-70b", 1, tp_comm_overlap=True, **no_sp)
    assert flagged.micro.tp_comm_s == plain.micro.tp_comm_s > 0


def test_the_cli_flags():
    """--no-overlap-comm and --tp-comm-overlap reach the estimate (its JSON plan records
    settings that differ from their defaults); --tp-comm-overlap is Megatron-LM's only."""
    args = ["estimate", "--model", "llama3-70b", "--cluster", "dgx-h100", "--nodes", "4",
            "--tp", "8", "--pp", "2", "--sp", "--zero", "1", "--global-batch", "32",
            "--framework", "megatron", "--json"]
    base = json.loads(run_cli(*args).out)
    off = json.loads(run_cli(*args, "--no-overlap-comm").out)
    fused = json.loads(run_cli(*args, "--tp-comm-overlap").out)
    assert "overlap_comm" not in base["plan"] and "tp_comm_overlap" not in base["plan"]
    assert off["plan"]["overlap_comm"] is False and fused["plan"]["tp_comm_overlap"] is True
    assert off["time"]["step_s"] > base["time"]["step_s"] > fused["time"]["step_s"]
    assert fused["time"]["tp_comm_s"] < base["time"]["tp_comm_s"]
    line = usage_error(*[a if a != "megatron" else "torchtitan" for a in args],
                       "--tp-comm-overlap")
    assert "--tp-comm-overlap is modelled for --framework megatron only" in line


def test_megatron_cross_entropy_moves_its_operators_bytes():
    """Bytes per logit, operator by operator (megatron-core core_r0.8.0): unfused, forward the
    fp32 upcast 2 + 4, the maximum 4, the in-place shift 8, the in-place exponential 8, its sum
    4, the normalisation 8; backward the scaled gradient 8 and its bf16 cast 4 + 2. Fused
    (``--cross-entropy-loss-fusion``, one ``jit_fuser`` region per step): upcast with maximum
    2 + 4, shift with exponential and sum 4 + 4, normalisation 8; backward 4 + 2. The last
    stage's head term moves by exactly those bytes at the device's HBM rate (tp 2: half the
    vocabulary per rank)."""
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", nodes=1)
    config = dict(tp=2, dp=4, sp=True, micro_batch_size=1, global_batch_size=4, seq_len=8192)
    terms = {flag: stage_terms(model, cluster, ParallelConfig(cross_entropy_fusion=flag,
                                                              **config), 0,
                               framework="megatron", calibration=CAL).micro.compute_s
             for flag in (False, True)}
    logits = 8192 * model.vocab_rows / 2
    rate = cluster.gpu.hbm_bytes_per_s * CAL.device(cluster.gpu.key).memory_efficiency
    unfused = (2 + 4) + 4 + 8 + 8 + 4 + 8 + 8 + (4 + 2)
    fused = (2 + 4) + (4 + 4) + 8 + (4 + 2)
    assert terms[False] - terms[True] == pytest.approx((unfused - fused) * logits / rate,
                                                       rel=1e-9)
