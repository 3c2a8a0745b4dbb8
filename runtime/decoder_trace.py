"""Trace the runtime's decoder for a ``ModelSpec`` without allocating its weights.

``costmodel.tracing`` is generic and may not import ``runtime`` (tests/test_architecture.py);
this module joins the two. The decoder is built straight from ``Decoder`` on the meta device:
``build_decoder`` would run ``init_weights``, which draws every weight on the CPU.
"""

from __future__ import annotations

import torch

from meshplan.costmodel.model import ModelSpec
from meshplan.costmodel.tracing import LayerGraph, trace_module
from meshplan.runtime.model import Decoder


def trace_decoder(spec: ModelSpec, *, batch_size: int, seq_len: int | None = None,
                    dtype: torch.dtype = torch.bfloat16) -> LayerGraph:
    """Layer graph of the whole decoder for ``spec`` on ``batch_size`` sequences of token ids.

    ``seq_len`` defaults to ``spec.seq_len``; with learned positions it may not exceed it.
    """
    seq = spec.seq_len if seq_len is None else seq_len
    if batch_size <= 0 or seq <= 0:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq}")
    if spec.position_embedding == "learned" and seq > spec.seq_len:
        raise ValueError(f"seq_len {seq} exceeds the learned position table of {spec.seq_len}")
    return trace_module(
        lambda: Decoder(spec, layer_ids=range(spec.num_layers), first=True, last=True),
        example_input_shape=(batch_size, seq), input_dtype=torch.long, dtype=dtype)
