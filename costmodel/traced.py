"""Per-layer costs of a traced model (``ModelSpec.traced``) for the memory and time terms.

A traced layer records, per sequence of the traced length and at the traced dtype, what
``costmodel.tracing`` measured without weights: parameters, forward and backward FLOPs, bytes
saved for backward and output bytes. Here they become one micro-batch's numbers under a
configuration: FLOPs and bytes scale with the micro-batch size (every sequence costs the same),
bytes also with the plan's bytes per activation over the traced dtype's.

Recomputation of a traced layer is ``none`` or ``full``: a full-recompute layer keeps only its
input (the previous layer's output) and rebuilds the rest during its backward, which needs the
largest layer's saved bytes as workspace. Two quantities use the whole model rather than the
stage so that every stage term stays a sum over the stage's layers (what the planner's tables
need): that workspace and the tensor a pipeline stage sends on (the largest output of any layer
but the last).
"""

from __future__ import annotations

from collections.abc import Iterable

from meshplan.costmodel.config import ParallelConfig
from meshplan.costmodel.model import ModelSpec

TRACED_RECOMPUTE = ("none", "full")
"""Recompute modes a traced layer supports (selective needs a known attention block)."""


def _scale(model: ModelSpec, config: ParallelConfig) -> float:
    """Micro-batch sequences times the byte ratio of the plan's activations to the trace's."""
    return config.micro_batch_size * config.bytes_per_activation / model.traced_dtype_bytes


def layer_saved_bytes(model: ModelSpec, config: ParallelConfig, index: int, mode: str) -> float:
    """Bytes layer ``index`` keeps for backward for one micro-batch under ``mode``."""
    if mode == "full":
        return _scale(model, config) * (model.traced[index - 1].output_bytes if index else 0.0)
    return _scale(model, config) * model.traced[index].saved_bytes


def stage_saved_bytes(model: ModelSpec, config: ParallelConfig, layers: Iterable[int],
                      mode: str) -> float:
    return sum(layer_saved_bytes(model, config, i, mode) for i in layers)


def extra_saved_bytes(model: ModelSpec, config: ParallelConfig) -> float:
    """Held by the last stage for one micro-batch besides its layers' saved tensors: what the
    loss saves (outside any layer) and, when its backward starts, the gradient of the model's
    output (the logits' size) beside it."""
    return _scale(model, config) * (model.traced_extra_saved_bytes
                                    + model.traced[-1].output_bytes)


def layer_workspace_bytes(model: ModelSpec, config: ParallelConfig, index: int) -> float:
    """What rebuilding layer ``index`` during its backward adds to what full recomputation
    keeps: its saved bytes less its stored input."""
    return max(0.0, layer_saved_bytes(model, config, index, "none")
               - layer_saved_bytes(model, config, index, "full"))


def recompute_workspace_bytes(model: ModelSpec, config: ParallelConfig, mode: str,
                              layers: Iterable[int]) -> float:
    """Full recomputation rebuilds one layer at a time: the stage's largest rebuild."""
    if mode != "full":
        return 0.0
    return max((layer_workspace_bytes(model, config, i) for i in layers), default=0.0)


def boundary_bytes(model: ModelSpec, config: ParallelConfig) -> float:
    """Bytes a stage sends to the next per micro-batch: the largest inner layer output."""
    inner = [layer.output_bytes for layer in model.traced[:-1]] or [0.0]
    return _scale(model, config) * max(inner)


def largest_layer_params(model: ModelSpec) -> int:
    return max(layer.params for layer in model.traced)


def layer_flop(model: ModelSpec, config: ParallelConfig, index: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of layer ``index`` for one micro-batch."""
    layer = model.traced[index]
    return (config.micro_batch_size * layer.fwd_flop,
            config.micro_batch_size * layer.bwd_flop)


def step_flop(model: ModelSpec, *, global_batch_size: int, recompute: str = "none") -> float:
    """FLOPs of one training step: forward and backward of every sequence (+ forward again
    under full recomputation)."""
    fwd = sum(layer.fwd_flop for layer in model.traced)
    bwd = sum(layer.bwd_flop for layer in model.traced)
    return global_batch_size * (fwd + bwd + (fwd if recompute == "full" else 0.0))


def check_config(config: ParallelConfig, model: ModelSpec) -> None:
    """Raise ValueError if ``config`` uses what a traced model cannot take."""
    which = [f"{name} {value}" for name, value in
             (("tp", config.tp), ("cp", config.cp), ("ep", config.ep), ("vpp", config.vpp))
             if value != 1]
    if config.sp:
        which.append("sequence parallelism")
    if which:
        raise ValueError(f"{model.name} is a traced module: its layers carry no tensor-parallel "
                         f"layout, so {', '.join(which)} cannot be used (tp, cp, ep and vpp "
                         f"must be 1)")
    modes = {config.stage_recompute(s) for s in range(config.pp)}
    if not modes <= set(TRACED_RECOMPUTE):
        raise ValueError(f"{model.name} is a traced module: recompute must be one of "
                         f"{', '.join(TRACED_RECOMPUTE)} (selective needs a known attention "
                         f"block)")
    if config.seq_len != model.seq_len:
        raise ValueError(f"{model.name} was traced with sequences of {model.seq_len} tokens; "
                         f"seq_len {config.seq_len} needs a new trace (--seq-len when loading "
                         f"the model)")
