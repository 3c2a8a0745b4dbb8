"""The memory model's caches (``memory._layer_bytes`` by ``LAYER_FIELDS``, ``memory.stage_params``
by degrees and layer range) serve the planner's thousands of stage probes: a memory estimate
read through warm caches must equal the same estimate computed from cold ones, and the cache
key must hold every configuration field the cached values read."""

from __future__ import annotations

import ast
import importlib
import inspect
import itertools

import pytest

from meshplan.costmodel import ParallelConfig, estimate, load_cluster, load_model

memory = importlib.import_module("meshplan.costmodel.memory")
activations = importlib.import_module("meshplan.costmodel.activations")

DERIVED = {"bytes_per_activation": {"dtype"},
           "grad_accum_steps": {"global_batch_size", "dp", "micro_batch_size"},
           "world_size": {"tp", "cp", "dp", "pp"}}
"""``ParallelConfig`` properties and the fields they read."""


def _reads(function_name: str, seen: set[str]) -> set[str]:
    """The config fields ``activations.<function_name>`` reads, with those of the module's
    functions it calls (followed through the module)."""
    if function_name in seen:
        return set()
    seen.add(function_name)
    tree = ast.parse(inspect.getsource(getattr(activations, function_name)))
    fields: set[str] = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "config"):
            fields |= DERIVED.get(node.attr, {node.attr})
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and inspect.isfunction(getattr(activations, node.func.id, None)):
            fields |= _reads(node.func.id, seen)
    return fields


def test_the_layer_key_holds_every_field_a_layer_reads():
    seen: set[str] = set()
    read = _reads("layer_activation_bytes", seen) | _reads("op_policy_layer_bytes", seen)
    assert {"tp", "micro_batch_size", "seq_len", "dtype"} <= read  # the scan sees through calls
    assert read <= set(memory.LAYER_FIELDS), read - set(memory.LAYER_FIELDS)


CASES = (  # model, cluster, nodes, config, framework
    ("llama3-8b", "dgx-h100", 2,
     ParallelConfig(tp=2, pp=4, dp=2, sp=True, micro_batch_size=1, global_batch_size=16,
                    seq_len=4096, vpp=2, recompute=("full", "none", "selective", "none")),
     "megatron"),
    ("mixtral-8x7b", "dgx-h100", 4,
     ParallelConfig(tp=2, pp=2, dp=4, cp=2, ep=4, micro_batch_size=1, global_batch_size=32,
                    seq_len=4096, recompute=("selective", "full")),
     "torchtitan"),
    ("llama3-8b", "dgx-h100", 1,
     ParallelConfig(tp=1, pp=2, dp=4, micro_batch_size=2, global_batch_size=32,
                    seq_len=2048, recompute=("selective", "none")),
     "meshplan"),
    ("gpt3-175b", "dgx-a100-80gb", 8,
     ParallelConfig(tp=8, pp=8, dp=1, micro_batch_size=1, global_batch_size=32, seq_len=2048,
                    recompute="full"),
     "deepspeed"),
)
VARIANTS = [dict(zero_stage=z, offload=o, micro_batch_size=b) for z, o, b in
            itertools.product((0, 1, 3), ("none", "optimizer"), (1, 2))]


def _reserved(model, cluster, config, framework) -> list[float]:
    result = estimate(model, cluster, config, framework=framework).memory
    return [s.reserved_bytes for s in result.per_stage] + [result.peak_bytes]


def _clear() -> None:
    memory._LAYER_BYTES.clear()
    memory._STAGE_PARAMS.clear()


def _layouts(model, config: ParallelConfig) -> list[ParallelConfig]:
    """``config``'s variants (ZeRO, offload, micro-batch) and, beside each, layouts that share
    some cache entries with it: sequence parallelism off, another split and mode, tensor
    parallelism off, one stage."""
    p = config.pp
    out = []
    for variant in (config.replace(**v) for v in VARIANTS):
        v, tp = variant.vpp, variant.tp
        out += [variant,
                variant.replace(sp=False, recompute="none"),
                variant.replace(layers_per_stage=(v,) * (p - 1) + (
                    model.num_layers - v * (p - 1),), recompute="selective"),
                variant.replace(tp=1, sp=False, dp=variant.dp * tp,
                                global_batch_size=variant.global_batch_size * tp),
                variant.replace(tp=1, sp=False, pp=1, vpp=1, recompute="full",
                                dp=variant.dp * tp * p,
                                global_batch_size=variant.global_batch_size * tp * p)]
    return out


@pytest.mark.parametrize("name,cluster_name,nodes,config,framework", CASES,
                         ids=[f"{c[0]}-{c[4]}" for c in CASES])
def test_warm_memory_caches_give_the_cold_answer(name, cluster_name, nodes, config, framework):
    model, cluster = load_model(name), load_cluster(cluster_name, nodes=nodes)
    layouts = _layouts(model, config)
    wanted = []
    for layout in layouts:
        _clear()
        wanted.append(_reserved(model, cluster, layout, framework))
    # in turn through warm caches: each reads what the ones before it left
    _clear()
    got = [_reserved(model, cluster, layout, framework) for layout in layouts]
    assert memory._LAYER_BYTES and memory._STAGE_PARAMS, "the caches were not used"
    assert got == wanted
