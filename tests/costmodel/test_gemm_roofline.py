"""Memory-bound projections (``timing._memory_bound_gemm_s``, the roofline model).

The expected seconds are derived here from the GEMM shapes, the GPU catalog's peak and HBM
bandwidth and the calibration's efficiencies: a [M, K] x [K, N] product moves
``2 (M K + K N + M N)`` bytes in bf16 and cannot finish before HBM has moved them.
"""

from __future__ import annotations

import pytest

from meshplan.costmodel import default_calibration
from meshplan.costmodel.config import ParallelConfig
from meshplan.costmodel.hardware import load_cluster
from meshplan.costmodel.models import load_model
from meshplan.costmodel.timing import layer_forward


def _parts(tp: int, **changes):
    model = load_model("llama3-8b")
    cluster = load_cluster("grand-teton-h100", nodes=1)
    config = ParallelConfig(tp=tp, dp=8 // tp, sp=tp > 1, zero_stage=3, micro_batch_size=2,
                            global_batch_size=2 * (8 // tp), seq_len=8192, **changes)
    cal = default_calibration()
    return model, cluster, config, cal, layer_forward(model, cluster, config, cal, moe=False,
                                                      framework="torchtitan")


def _flop_time(model, cluster, config, cal, tokens):
    """The GEMMs' time at the device's efficiency and the per-call cost, without roofline."""
    device = cal.device(cluster.gpu.key)
    h, q, kv, f = model.hidden_size, model.q_size, model.kv_size, model.ffn_hidden_size
    flop = 2 * tokens * h * (2 * q + 2 * kv + 3 * f) / config.tp
    rate = cluster.gpu.peak("bf16") * device.gemm_efficiency(True) * device.row_efficiency(tokens)
    return flop / rate + 5 * device.matmul_overhead_s, rate


def test_tp8_k_and_v_projections_wait_for_hbm():
    """Llama 3 8B at TP 8: k and v are 128 wide per GPU (about 125 FLOPs per byte, under the
    ridge); q (512), the output projection (K 512) and the MLP stay compute-bound."""
    model, cluster, config, cal, parts = _parts(8)
    tokens = 2 * 8192
    flop_s, rate = _flop_time(model, cluster, config, cal, tokens)
    bandwidth = cluster.gpu.hbm_bytes_per_s * cal.device(cluster.gpu.key).memory_efficiency
    m, n, k = tokens, 1024 // 8, 4096
    narrow = 2 * (m * k + k * n + m * n) / bandwidth - 2 * m * n * k / rate
    assert narrow > 0
    assert parts.gemm_s == pytest.approx(flop_s + 2 * narrow, rel=1e-9)


def test_unsharded_projections_are_compute_bound():
    model, cluster, config, cal, parts = _parts(1)
    flop_s, _ = _flop_time(model, cluster, config, cal, 2 * 8192)
    assert parts.gemm_s == pytest.approx(flop_s, rel=1e-12)
