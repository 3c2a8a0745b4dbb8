"""Traced modules in the runtime: a user's module cut into pipeline stages by its layers.

A traced model (``ModelSpec.traced``, from ``--model package.module:callable``) names its
layers in execution order. The runtime runs such a module when its top-level layers form a
chain from token ids ``[b, s]`` to logits ``[b, s, vocab]`` (each layer takes the previous one's
output) and it has a ``vocab_size``: then a stage is just its layers in order, trained with the
same next-token cross entropy as the built-in decoder. Tensor, context and expert parallelism
are not available for such modules (the cost model refuses them too).

A module whose layers do not form a chain runs whole on one pipeline stage (``Whole``: data
parallelism, ZeRO 0-3, offload, recompute of each top-level layer).

Weights: the whole module is built on the CPU by its own initialisation under
``torch.manual_seed(seed)``, so every layout starts from the same weights; a stage keeps its
layers and drops the rest (like the built-in decoder, each stage is built in full first).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from meshplan.costmodel.model import ModelSpec
from meshplan.costmodel.factory import load_factory
from meshplan.costmodel.tracing import top_level_layers


class Chain(nn.Module):
    """Layers of a traced module run one after another; ``layers`` is what
    ``parallelize.apply_checkpointing`` wraps."""

    def __init__(self, layers: dict[str, nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({name.replace(".", "__"): m for name, m in layers.items()})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


def check_runnable(spec: ModelSpec, *, pp: int = 1) -> None:
    """ValueError unless the runtime can run ``spec``'s module on ``pp`` pipeline stages (see
    the module docstring): stages need a chain; one stage runs any module whole."""
    if not spec.factory:
        raise ValueError(f"{spec.name} is traced but names no factory (package.module:"
                         f"callable) for the runtime to build it")
    if not spec.traced_chain and pp > 1:
        raise ValueError(f"{spec.name}: the runtime cuts a traced module into pipeline stages "
                         f"only when its top-level layers form a chain, and some layer does not "
                         f"take the previous one's output (e.g. a position embedding fed "
                         f"separately) or two layers share a parameter (tied weights); plan it "
                         f"with --pp 1 (data parallel, ZeRO 0-3, recompute), or restructure it "
                         f"as a chain")
    if spec.vocab_size <= 1:
        raise ValueError(f"{spec.name}: the runtime runs traced modules that map token ids to "
                         f"logits; give the module a vocab_size attribute")


def build_chain(spec: ModelSpec, *, layer_ids: Sequence[int], seed: int,
                device: torch.device | str = "cpu") -> Chain:
    """The layers ``layer_ids`` of ``spec``'s module, with the module's own seeded weights."""
    check_runnable(spec)
    factory = load_factory(spec.factory)
    torch.manual_seed(seed)
    full = factory()
    layers = top_level_layers(full)
    names = [spec.traced[i].name for i in layer_ids]
    missing = [name for name in names if name not in layers]
    if missing:
        raise ValueError(f"{spec.factory} has no top-level layer(s) {missing}: the module "
                         f"changed since it was traced; plan it again")
    return Chain({name: layers[name] for name in names}).to(device)


class Whole(nn.Module):
    """A traced module run whole (one pipeline stage): token ids in, logits out (an output
    object's ``logits`` or a tuple's first entry). ``layers`` names its top-level layers, which
    ``parallelize.apply_checkpointing`` wraps in place inside ``module``."""

    def __init__(self, module: nn.Module, layer_names: Sequence[str]) -> None:
        super().__init__()
        self.module = module
        self.layer_names = tuple(layer_names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.module(x)
        if hasattr(out, "logits"):
            return out.logits
        return out[0] if isinstance(out, (tuple, list)) else out


def build_whole(spec: ModelSpec, *, seed: int, device: torch.device | str = "cpu") -> Whole:
    """``spec``'s whole module with its own seeded weights."""
    check_runnable(spec, pp=1)
    torch.manual_seed(seed)
    full = load_factory(spec.factory)()
    layers = top_level_layers(full)
    names = [layer.name for layer in spec.traced]
    missing = [name for name in names if name not in layers]
    if missing:
        raise ValueError(f"{spec.factory} has no top-level layer(s) {missing}: the module "
                         f"changed since it was traced; plan it again")
    return Whole(full, names).to(device)
