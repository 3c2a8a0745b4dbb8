"""Trace any ``torch.nn.Module`` into a layer graph, without allocating weights.

The module is built on (or copied from) the meta device, its parameters and buffers are
replaced by fake CPU tensors (``torch._subclasses.fake_tensor.FakeTensorMode``), and one forward
and backward run inside the fake mode. Nothing is computed and no weight or activation memory is
allocated, so a 70B-parameter model traces in seconds on a laptop. Fake *CPU* tensors (not
meta) matter: scaled-dot-product attention then takes the fused (flash) path, which saves the
fp32 log-sum-exp instead of the s x s score matrix the math path keeps on meta
(shared/notes/torch-distributed-on-cpu.md, "Memory on meta tensors").

Per top-level layer (a direct child of the root, with ``nn.ModuleList``/``nn.ModuleDict``
containers expanded into their children; wrappers such as a HuggingFace ``LlamaForCausalLM``,
whose blocks sit one level down at ``model.layers.N``, are descended into as
``top_level_layers`` explains) the graph records:

* ``params``: parameters owned by the layer, each shared parameter counted once, by the first
  layer that runs (a tied LM head counts zero);
* ``fwd_flop`` / ``bwd_flop``: ``torch.utils.flop_counter.FlopCounterMode`` counts (matmuls,
  convolutions and attention only; elementwise ops count zero). The counter's attention
  formula ignores ``is_causal``: it counts the full ``2 * 2 * s^2 * d`` per head, like
  ``costmodel.flops.attention_flop_per_token(causal=False)``. PyTorch's CPU flash kernel
  (``_scaled_dot_product_flash_attention_for_cpu``) has no formula upstream, so this module adds
  the upstream SDPA formulas for it;
* ``saved_bytes``: bytes of the tensors autograd saves for backward while the layer runs
  (``torch.autograd.graph.saved_tensors_hooks``), each storage counted once over the whole model
  and parameters (and views of them) excluded;
* ``output_bytes``: bytes of the layer's tensor outputs;
* ``chained``: the layer's first input is the previous layer's output (the first layer: True),
  so a run of chained layers can be cut into pipeline stages anywhere;
* ``repeated``: an integer group id shared by layers of identical structure and parameter shapes
  (children of one container, or recurring elsewhere), ``None`` for a one-off layer.

Edges join consecutive layers in execution order (``order`` attribute, 0-based).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.module_tracker import ModuleTracker

logger = logging.getLogger(__name__)

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
_ATEN = torch.ops.aten


@dataclass(frozen=True, kw_only=True)
class LayerGraph:
    """A traced module: its layer graph and whole-model totals."""

    graph: nx.DiGraph
    """Layers (node names are module paths) in execution order, with per-layer attributes."""
    total_params: int
    """All trainable and frozen parameters of the module, shared ones once."""
    total_fwd_flop: float
    """Forward FLOPs of the whole module for the example input."""
    total_bwd_flop: float
    """Backward FLOPs of the whole module for the example input."""
    total_saved_bytes: int
    """Bytes saved for backward, including any saved outside a layer (root-level code)."""

    def __post_init__(self) -> None:
        for field in ("total_params", "total_fwd_flop", "total_bwd_flop", "total_saved_bytes"):
            if getattr(self, field) < 0:
                raise ValueError(f"{field} must be >= 0, got {getattr(self, field)!r}")

    @property
    def layers(self) -> list[str]:
        """Layer names in execution order."""
        return sorted(self.graph.nodes, key=lambda n: self.graph.nodes[n]["order"])


def _cpu_flash_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_flash_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args,
                             out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape,
                                                 value_shape)


_EXTRA_FLOP_FORMULAS = {
    _ATEN._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_flop,
    _ATEN._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward_flop,
}
"""FLOP formulas FlopCounterMode lacks: the CPU flash-attention kernels (same counts as the
CUDA flash/efficient kernels upstream)."""


def _expand(layers: dict[str, nn.Module], names: Sequence[str]) -> dict[str, nn.Module]:
    """``layers`` with each layer in ``names`` replaced, in place, by its named children."""
    expanded: dict[str, nn.Module] = {}
    for name, layer in layers.items():
        if name in names:
            expanded.update({f"{name}.{sub}": child for sub, child in layer.named_children()})
        else:
            expanded[name] = layer
    return expanded


def top_level_layers(module: nn.Module) -> dict[str, nn.Module]:
    """Direct children of ``module``, with ModuleList/ModuleDict/Sequential children expanded.

    Automatic descent first: while no layer is a container and exactly one layer holds a
    container somewhere below it, that layer is replaced by its own children (names keep the
    path). A HuggingFace ``LlamaForCausalLM`` (children ``model``, ``lm_head``) thus gives
    ``model.embed_tokens``, ``model.layers.0`` ... ``model.norm``, ``model.rotary_emb`` and
    ``lm_head``. A root with a container child, or with two children that hold one (an
    encoder-decoder), is not descended into.
    """
    layers = dict(module.named_children())
    while not any(isinstance(m, _CONTAINERS) for m in layers.values()):
        holders = [name for name, m in layers.items()
                   if any(isinstance(sub, _CONTAINERS) for sub in m.modules())]
        if len(holders) != 1:
            break
        layers = _expand(layers, holders)
    return _expand(layers, [name for name, m in layers.items() if isinstance(m, _CONTAINERS)])


def _signature(module: nn.Module) -> tuple:
    """Structure and parameter shapes of ``module``: equal for repeated blocks."""
    mods = tuple((name, type(m).__name__) for name, m in module.named_modules())
    params = tuple((name, tuple(p.shape), p.dtype) for name, p in module.named_parameters())
    return mods, params


def _repeated_groups(layers: dict[str, nn.Module], containers: dict[str, str]) -> dict[str, int]:
    """Group id per repeated layer: same signature within one container, or recurring."""
    keys = {name: (containers.get(name), _signature(m)) for name, m in layers.items()}
    counts: dict[Any, int] = {}
    for key in keys.values():
        counts[key] = counts.get(key, 0) + 1
    ids: dict[Any, int] = {}
    groups = {}
    for name, key in keys.items():
        if key[0] is not None or counts[key] > 1:
            groups[name] = ids.setdefault(key, len(ids))
    return groups


def _fake_copy(module: nn.Module, fake_mode: FakeTensorMode, dtype: torch.dtype) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are empty fake CPU tensors.

    ``deepcopy`` with a pre-filled memo keeps shared (tied) parameters shared and leaves the
    caller's module untouched; floating-point tensors are cast to ``dtype``.
    """
    memo: dict[int, Any] = {}
    with fake_mode:
        for p in module.parameters():
            if id(p) not in memo:
                cast = dtype if p.is_floating_point() else p.dtype
                memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=cast, device="cpu"),
                                           requires_grad=p.requires_grad)
        for b in module.buffers():
            if id(b) not in memo:
                cast = dtype if b.is_floating_point() else b.dtype
                memo[id(b)] = torch.empty(b.shape, dtype=cast, device="cpu")
    return copy.deepcopy(module, memo)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _tensor_bytes(value: Any) -> int:
    leaves, _ = tree_flatten(value)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


class _OpCounter(TorchDispatchMode):
    """ATen operators dispatched inside each top-level layer (``keys``: the module names
    ``ModuleTracker`` reports for them), forward and backward apart. Not counted: ``prim``
    queries (the fake tensors' device lookups, which an eager run does not dispatch) and
    ``aten.detach``, which the trace's saved-tensor hooks add (42 in the backward of
    ``examples.hybrid``'s transformer block against 12 in an eager run; every other operator
    count equal)."""

    def __init__(self, keys: Mapping[str, str]) -> None:
        super().__init__()
        self.keys = dict(keys)  # tracker name -> layer name
        self.tracker = ModuleTracker()
        self.fwd: dict[str, int] = {}
        self.bwd: dict[str, int] = {}

    def __enter__(self):
        self.tracker.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.tracker.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "prim" or func is torch.ops.aten.detach.default:
            return func(*args, **(kwargs or {}))
        counts = self.bwd if self.tracker.is_bw else self.fwd
        for parent in self.tracker.parents:
            name = self.keys.get(parent)
            if name is not None:
                counts[name] = counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


class _Recorder:
    """Forward hooks on the top-level layers plus the saved-tensor pack hook."""

    def __init__(self, layers: dict[str, nn.Module], param_storages: set[int]) -> None:
        self.layers = layers
        self.param_storages = param_storages
        self.order: list[str] = []
        self.saved_bytes: dict[str | None, int] = {}
        self.output_bytes: dict[str, int] = {}
        self.chained: dict[str, bool] = {}
        self._seen: set[int] = set()
        self._stack: list[str] = []
        self._last_output: Any = None

    def attach(self) -> list[Any]:
        handles = []
        for name, layer in self.layers.items():
            handles.append(layer.register_forward_pre_hook(self._pre(name)))
            handles.append(layer.register_forward_hook(self._post(name)))
        return handles

    def _pre(self, name: str) -> Callable:
        def hook(_module, args):
            if name not in self.order:
                # chained: its first input is the previous layer's output (or it runs first)
                self.chained[name] = not self.order or (
                    bool(args) and args[0] is self._last_output)
                self.order.append(name)
            self._stack.append(name)
        return hook

    def _post(self, name: str) -> Callable:
        def hook(_module, _args, output):
            self._stack.pop()
            self.output_bytes[name] = self.output_bytes.get(name, 0) + _tensor_bytes(output)
            if not self._stack:
                self._last_output = output
        return hook

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in self.param_storages and key not in self._seen:
            self._seen.add(key)
            owner = self._stack[0] if self._stack else None
            self.saved_bytes[owner] = (self.saved_bytes.get(owner, 0)
                                       + t.untyped_storage().nbytes())
        return t


def _default_loss(output: Any) -> torch.Tensor:
    leaves, _ = tree_flatten(output)
    floats = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats:
        raise ValueError("the module returned no floating-point tensor to backpropagate; "
                         "pass loss_fn")
    return sum(t.float().sum() for t in floats)


def _module_flop(counts: dict[str, dict[Any, int]], key: str) -> int:
    return sum(counts.get(key, {}).values())


def trace_module(module_or_factory: nn.Module | Callable[[], nn.Module], *,
                   example_input_shape: Sequence[int] | None = None,
                   example_inputs: Callable[[], tuple[Any, ...] | Mapping[str, Any]]
                   | None = None,
                   dtype: torch.dtype = torch.float32,
                   input_dtype: torch.dtype | None = None,
                   loss_fn: Callable[[Any], torch.Tensor] | None = None) -> LayerGraph:
    """Profile one forward and backward of a module into a ``LayerGraph`` (no weights allocated).

    ``module_or_factory``: a module (best on the meta device; it is copied, not changed) or a
    zero-argument factory, called under ``torch.device("meta")``. Inputs: either
    ``example_input_shape`` (one tensor of ``input_dtype``, default ``dtype``; integer dtypes
    suit token ids) or ``example_inputs``, a factory called inside the fake mode of the
    positional inputs (a tuple) or of keyword inputs (a mapping, e.g. ``input_ids`` and
    ``labels`` for a HuggingFace model). ``dtype``: floating-point parameters and buffers are
    cast to it. ``loss_fn`` maps the output to a scalar (default: the sum of every floating
    output, in fp32).
    """
    if (example_input_shape is None) == (example_inputs is None):
        raise ValueError("give exactly one of example_input_shape and example_inputs, got "
                         f"{example_input_shape!r} and {example_inputs!r}")
    if isinstance(module_or_factory, nn.Module):
        source = module_or_factory
    elif callable(module_or_factory):
        with torch.device("meta"):
            source = module_or_factory()
        if not isinstance(source, nn.Module):
            raise ValueError(f"the factory returned {type(source).__name__}, not an nn.Module")
    else:
        raise ValueError(f"expected an nn.Module or a factory, got {module_or_factory!r}")

    fake_mode = FakeTensorMode()
    model = _fake_copy(source, fake_mode, dtype)
    layers = top_level_layers(model)
    containers = {name: parent for name in layers
                  if (parent := name.rpartition(".")[0])
                  and isinstance(model.get_submodule(parent), _CONTAINERS)}
    param_storages = {_storage_key(p) for p in model.parameters()}
    recorder = _Recorder(layers, param_storages)
    counter = flop_counter.FlopCounterMode(display=False, custom_mapping=_EXTRA_FLOP_FORMULAS)
    ops = _OpCounter({f"{type(model).__name__}.{name}": name for name in layers})
    handles = recorder.attach()
    try:
        with fake_mode:
            inputs = (example_inputs() if example_inputs is not None
                      else (torch.zeros(tuple(example_input_shape),
                                        dtype=input_dtype or dtype),))
            with counter, ops:
                with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
                    output = (model(**inputs) if isinstance(inputs, Mapping)
                              else model(*inputs))
                fwd_counts = copy.deepcopy(counter.get_flop_counts())
                # the loss runs outside every layer: what it saves is root-level
                with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
                    loss = (loss_fn or _default_loss)(output)
                loss.backward()
            all_counts = counter.get_flop_counts()
    finally:
        for handle in handles:
            handle.remove()
    return _build_graph(model, layers, containers, recorder, fwd_counts, all_counts, ops)


def _build_graph(model: nn.Module, layers: dict[str, nn.Module], containers: dict[str, str],
                 recorder: _Recorder, fwd_counts: dict, all_counts: dict,
                 ops: _OpCounter) -> LayerGraph:
    """Assemble the DiGraph and totals from what the hooks and the FLOP counter recorded."""
    root = type(model).__name__
    groups = _repeated_groups(layers, containers)
    never_run = [name for name in layers if name not in recorder.order]
    if never_run:
        logger.debug("layers that never ran are left out of the graph: %s", never_run)
    graph = nx.DiGraph()
    counted: set[int] = set()
    for index, name in enumerate(recorder.order):
        params = tensors = 0
        for p in layers[name].parameters():
            if id(p) not in counted:
                counted.add(id(p))
                params += p.numel()
                tensors += 1
        key = f"{root}.{name}"
        fwd = _module_flop(fwd_counts, key)
        graph.add_node(name, order=index, params=params, fwd_flop=float(fwd),
                       bwd_flop=float(_module_flop(all_counts, key) - fwd),
                       saved_bytes=recorder.saved_bytes.get(name, 0),
                       output_bytes=recorder.output_bytes.get(name, 0),
                       repeated=groups.get(name), module_type=type(layers[name]).__name__,
                       chained=recorder.chained.get(name, False),
                       fwd_ops=ops.fwd.get(name, 0), bwd_ops=ops.bwd.get(name, 0),
                       tensors=tensors)
        if index:
            graph.add_edge(recorder.order[index - 1], name, order=index - 1)
    total_fwd = _module_flop(fwd_counts, "Global")
    return LayerGraph(graph=graph, total_params=sum(p.numel() for p in model.parameters()),
                      total_fwd_flop=float(total_fwd),
                      total_bwd_flop=float(_module_flop(all_counts, "Global") - total_fwd),
                      total_saved_bytes=sum(recorder.saved_bytes.values()))
