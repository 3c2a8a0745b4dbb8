"""A ``ModelSpec`` from any ``torch.nn.Module``: trace it (``costmodel.tracing``) and keep
its per-layer costs (``ModelSpec.traced``), so the cost model, the planner and the runtime can
work with layers that are not alike (a different first block, a vision encoder in front, MoE
every other block).

Users name their module as ``package.module:callable`` (``meshplan plan --model
mypkg.models:build``). The callable takes no arguments and returns the module; it is called
under ``torch.device("meta")``, so no weights are allocated. Example inputs come from, in order:

* a ``meshplan_inputs(batch_size, seq_len)`` method of the module returning a tuple of tensors
  or a mapping of keyword inputs (called inside the fake mode, so ``torch.zeros`` is free),
  and optionally ``meshplan_loss(output)`` returning the scalar to backpropagate (a
  HuggingFace config, ``hf-config:PATH``, gets both: ``hf.training_inputs`` and the model's
  own loss, as ``hf.trace_hf`` traces it);
* for a module with a ``config.vocab_size`` (a HuggingFace causal LM a user's factory
  returns): token ids of shape ``(batch_size, seq_len)``.

``seq_len`` is the sequence length the costs hold for: given by the caller, else the module's
``meshplan_seq_len`` attribute. One sequence is traced (micro-batch 1); every sequence of a
micro-batch costs the same, so the cost model scales by the micro-batch size.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshplan.costmodel.model import ModelSpec, TracedLayer
from meshplan.costmodel.refs import HF_CONFIG_REF, is_factory_ref
from meshplan.costmodel.tracing import LayerGraph, trace_module

LEGACY_FACTORY_MODULES = {"runtime.examples": "meshplan.runtime.examples"}
"""Factory modules of meshplan 0.1 (top-level ``runtime``), as older plan files name them."""
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def load_factory(ref: str) -> Callable[[], nn.Module]:
    """Import ``package.module:callable``; ValueError naming what is missing. ``hf-config:PATH``
    builds the ``transformers`` causal LM of that config (``costmodel.hf.hf_factory``; its
    ``meshplan_seq_len`` is the config's ``max_position_embeddings``)."""
    if ref.startswith(HF_CONFIG_REF):
        return _hf_config_factory(ref)
    if not is_factory_ref(ref):
        raise ValueError(f"--model {ref!r}: expected package.module:callable")
    module_name, attr = ref.split(":")
    module_name = LEGACY_FACTORY_MODULES.get(module_name, module_name)
    here = os.getcwd()
    if not {"", ".", here} & set(sys.path):
        # modules in the working directory, found after installed ones so that nothing there
        # can shadow meshplan or its dependencies (workers run with PYTHONSAFEPATH=1)
        sys.path.append(here)
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--model {ref!r}: cannot import {module_name!r}: {err}") from None
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"--model {ref!r}: {module_name} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"--model {ref!r}: {attr} is not callable")
    return target


def _hf_config_factory(ref: str) -> Callable[[], nn.Module]:
    try:
        from meshplan.costmodel.hf import causal_lm_loss, hf_config, hf_factory, training_inputs
        config = hf_config(ref[len(HF_CONFIG_REF):])
    except (ImportError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"--model {ref!r}: {str(err).splitlines()[0] if str(err) else err!r}"
                         ) from None
    build_model = hf_factory(config)
    length = getattr(config, "max_position_embeddings", None)

    def build() -> nn.Module:
        module = build_model()
        if isinstance(length, int) and length > 0:
            module.meshplan_seq_len = length
        # traced as ``hf.trace_hf`` traces it: a training step's inputs and the model's own
        # loss (its fp32 log-softmax kept for backward), not token ids and a sum of logits
        module.meshplan_inputs = training_inputs
        module.meshplan_loss = causal_lm_loss
        return module

    return build


def build_meta(factory: Callable[[], nn.Module], *, ref: str) -> nn.Module:
    try:
        with torch.device("meta"):
            module = factory()
    except Exception as err:  # the user's factory failed, with a ValueError too: say so in a line
        raise ValueError(f"--model {ref!r}: the factory raised {type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''}") from None
    if not isinstance(module, nn.Module):
        raise ValueError(f"--model {ref!r}: the factory returned {type(module).__name__}, "
                         f"not an nn.Module")
    return module


def example_inputs(module: nn.Module, *, batch_size: int, seq_len: int,
                   ref: str) -> Callable[[], tuple[torch.Tensor, ...] | dict[str, Any]]:
    """The input factory for ``module`` (see the module docstring)."""
    if hasattr(module, "meshplan_inputs"):
        def make() -> tuple[torch.Tensor, ...] | dict[str, Any]:
            inputs = module.meshplan_inputs(batch_size, seq_len)
            if isinstance(inputs, Mapping):  # keyword inputs
                return dict(inputs)
            return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        return make
    config = getattr(module, "config", None)
    if getattr(config, "vocab_size", None):
        return lambda: (torch.zeros((batch_size, seq_len), dtype=torch.long),)
    raise ValueError(f"--model {ref!r}: {type(module).__name__} has no "
                     f"meshplan_inputs(batch_size, seq_len) method to build example inputs")


def _loss_fn(module: nn.Module) -> Callable[[Any], torch.Tensor] | None:
    if hasattr(module, "meshplan_loss"):
        return module.meshplan_loss
    if getattr(getattr(module, "config", None), "vocab_size", None):
        return lambda out: getattr(out, "logits", out).float().sum()
    return None


def spec_from_graph(graph: LayerGraph, *, name: str, seq_len: int, micro_batch: int,
                    dtype_bytes: int, factory: str = "", source: str = "") -> ModelSpec:
    """A traced ``ModelSpec`` from a layer graph of ``micro_batch`` sequences of ``seq_len``.

    Layers with equal costs and equal inputs (the previous layer's output, which full
    recomputation stores) share a kind. The architecture fields are placeholders: one head
    (so tp stays 1), ``hidden_size`` the widest inner output per token.
    """
    layers, kinds = [], {}
    previous_output = 0.0
    for node in graph.layers:
        attrs = graph.graph.nodes[node]
        costs = (attrs["params"], attrs["fwd_flop"] / micro_batch,
                 attrs["bwd_flop"] / micro_batch, attrs["saved_bytes"] / micro_batch,
                 attrs["output_bytes"] / micro_batch, attrs.get("fwd_ops", 0),
                 attrs.get("bwd_ops", 0))
        kind = kinds.setdefault((*costs, previous_output), len(kinds))
        previous_output = costs[4]
        layers.append(TracedLayer(name=node, kind=kind, params=int(costs[0]),
                                  fwd_flop=float(costs[1]), bwd_flop=float(costs[2]),
                                  saved_bytes=float(costs[3]), output_bytes=float(costs[4]),
                                  fwd_ops=float(costs[5]), bwd_ops=float(costs[6]),
                                  tensors=int(attrs.get("tensors", 0))))
    if not layers:
        raise ValueError(f"{name}: the trace found no layers (no submodule ran)")
    inner = [layer.output_bytes for layer in layers[:-1]] or [layers[-1].output_bytes]
    hidden = max(1, round(max(inner) / (seq_len * dtype_bytes)))
    extra = max(0.0, (graph.total_saved_bytes
                      - sum(graph.graph.nodes[n]["saved_bytes"] for n in graph.layers))
                / micro_batch)
    return ModelSpec(name=name, num_layers=len(layers), hidden_size=hidden, num_heads=1,
                     ffn_hidden_size=hidden, vocab_size=1, seq_len=seq_len,
                     position_embedding="rope", linear_bias=False, tied_embeddings=False,
                     traced=tuple(layers), traced_dtype_bytes=dtype_bytes,
                     traced_extra_saved_bytes=extra, factory=factory,
                     traced_chain=all(graph.graph.nodes[n].get("chained", False)
                                      for n in graph.layers),
                     reported_params=float(graph.total_params), source=source)


def _layers_share_parameters(module: nn.Module, names: list[str]) -> bool:
    """Whether two of ``module``'s layers ``names`` hold the same parameter (tied weights)."""
    from meshplan.costmodel.tracing import top_level_layers

    layers = top_level_layers(module)
    seen: set[int] = set()
    for name in names:
        ids = {id(param) for param in layers[name].parameters()} if name in layers else set()
        if ids & seen:
            return True
        seen |= ids
    return False


def model_from_factory(ref: str, *, seq_len: int | None = None,
                       dtype: str = "bf16") -> ModelSpec:
    """Trace the module ``ref`` (``package.module:callable``) into a traced ``ModelSpec``."""
    factory = load_factory(ref)
    module = build_meta(factory, ref=ref)
    length = seq_len or getattr(module, "meshplan_seq_len", None)
    if not isinstance(length, int) or length <= 0:
        raise ValueError(f"--model {ref!r}: give --seq-len (the module has no "
                         f"meshplan_seq_len)")
    torch_dtype = DTYPES[dtype]
    inputs = example_inputs(module, batch_size=1, seq_len=length, ref=ref)
    try:
        graph = trace_module(module, example_inputs=inputs, dtype=torch_dtype,
                               loss_fn=_loss_fn(module))
    except Exception as err:  # the user's code failed under the fake mode: say so in a line
        raise ValueError(f"--model {ref!r}: tracing one forward and backward failed: "
                         f"{str(err).splitlines()[0] if str(err) else type(err).__name__}"
                         ) from None
    if ref.startswith(HF_CONFIG_REF):  # the folder a config.json sits in names the model
        path = Path(ref[len(HF_CONFIG_REF):])
        name = (path.parent if path.name == "config.json" else path).resolve().name
    else:
        name = ref.split(":")[1].split(".")[-1] if ":" in ref else ref
    spec = spec_from_graph(graph, name=name, seq_len=length, micro_batch=1,
                           dtype_bytes=torch.finfo(torch_dtype).bits // 8, factory=ref,
                           source=f"traced from {ref} (meta device, FakeTensorMode, "
                                  f"{dtype}, 1 x {length})")
    if spec.traced_chain and _layers_share_parameters(module, [layer.name for layer in
                                                               spec.traced]):
        # a stage builds only its layers: a parameter of two layers (a tied embedding and
        # head) would become two copies on two stages, so such a module runs whole
        spec = dataclasses.replace(spec, traced_chain=False)
    vocab = (getattr(module, "vocab_size", None)
             or getattr(getattr(module, "config", None), "vocab_size", None))
    if isinstance(vocab, int) and vocab > 1:  # a language model: the runtime can feed it
        spec = dataclasses.replace(spec, vocab_size=vocab)
    return spec

