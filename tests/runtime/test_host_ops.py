"""The host work the cost model charges per layer (``timing.HOST_OP_EQUIVALENTS``) against
the ATen ops the runtime's own block dispatches (``benchmarks/host_ops.py``'s counter)."""

from __future__ import annotations

import dataclasses

import pytest

from meshplan.costmodel import load_model
from meshplan.costmodel.timing import HOST_OP_EQUIVALENTS
from tests.conftest import benchmark_module


@pytest.mark.timeout(120)
def test_the_runtime_block_dispatches_the_ops_the_cost_model_charges():
    # Llama-3.2-1B's block narrowed (same structure: GQA, SwiGLU, RoPE, RMSNorm): the op
    # counts do not depend on the widths, and the full-width bf16 backward takes ~50 s here
    narrow = dataclasses.replace(load_model("llama3.2-1b"), hidden_size=256, num_heads=4,
                                 num_kv_heads=1, ffn_hidden_size=1024)
    counts = benchmark_module("host_ops").count_ops(narrow, autocast=True)
    none = counts["none"]["forward"] + counts["none"]["backward"]
    assert none == pytest.approx(HOST_OP_EQUIVALENTS["none"], rel=0.05)
    for mode in ("full", "selective"):  # the recomputation dispatches the forward again
        total = counts[mode]["forward"] + counts[mode]["backward"]
        assert total >= none + 0.9 * counts["none"]["forward"]
