"""Traced models (``ModelSpec.traced``): loading a ``package.module:callable``, its per-layer
costs, the cost model's use of them, the JSON form and the refusals.

Expected numbers come from outside the code under test:

* parameters and output shapes: ``meshplan.runtime.examples.hybrid()`` built for real on the CPU here,
  counted with ``p.numel()`` per top-level layer of ``model.layers``;
* forward FLOPs: the analytic count of ``costmodel.flops`` for ``HYBRID_SPEC`` (non-causal:
  the counter ignores causality), and ``FlopCounterMode`` run here over the real CPU module
  with the math attention backend (CPU SDPA kernels have no FLOP formula upstream; the math
  backend is plain matmuls);
* layer kinds: the partition of the real layers by type and parameter shapes;
* stage memory: 16 bytes per parameter for the ``meshplan`` framework without ZeRO (fp32
  module parameters 4 + fp32 gradients 4 + Adam moments 8) times the real per-layer counts.

Factories that fail are written into ``tmp_path`` (the test folder is not a package).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from meshplan.costmodel import (ParallelConfig, check_fits_model, default_calibration, estimate,
                       load_cluster, load_model)
from meshplan.costmodel.flops import attention_flop_per_token, layer_matmul_flop_per_token
from meshplan.costmodel.memory import stage_params
from meshplan.costmodel.models import spec_from_dict
from meshplan.runtime import examples

HYBRID = "meshplan.runtime.examples:hybrid"
SEQ_LEN = 64
"""``Hybrid.meshplan_seq_len``, the length the example is traced at."""
NUM_LAYERS = 10
"""embedding, wide block, 3 x (transformer block, MLP-only block), norm, head."""
WIDE, BLOCKS, MLP_BLOCKS = 1, (2, 4, 6), (3, 5, 7)
TRACED_DTYPE_BYTES = 2
"""bf16, ``load_model``'s default for a factory."""
MESHPLAN_BYTES_PER_PARAM = {"params": 4, "grads": 4, "optimizer": 8}
"""meshplan trains fp32 module parameters: fp32 gradients and two fp32 Adam moments, ZeRO-0."""
REL = 0.01


@pytest.fixture(scope="module")
def hybrid():
    return load_model(HYBRID)


@pytest.fixture(scope="module")
def real():
    """The example module built for real on the CPU."""
    torch.manual_seed(0)
    return examples.hybrid()


def real_layer_params(module: nn.Module) -> list[int]:
    return [sum(p.numel() for p in layer.parameters()) for layer in module.layers]


def cluster(gpus: int):
    return load_cluster("cpu", nodes=1, gpus_per_node=gpus)


def pp2(split: tuple[int, int], **changes) -> ParallelConfig:
    values = dict(pp=2, seq_len=SEQ_LEN, global_batch_size=8, layers_per_stage=split)
    return ParallelConfig(**{**values, **changes})


# ----- loading: parameters, FLOPs, kinds ---------------------------------------------------------
def test_hybrid_has_the_real_layers_and_parameters(hybrid, real):
    assert hybrid.is_traced
    assert hybrid.num_layers == NUM_LAYERS == len(hybrid.traced) == len(real.layers)
    assert hybrid.seq_len == SEQ_LEN
    assert [layer.params for layer in hybrid.traced] == real_layer_params(real)
    assert hybrid.num_params == sum(p.numel() for p in real.parameters())
    assert [layer.name for layer in hybrid.traced] == [f"layers.{i}" for i in range(NUM_LAYERS)]


def test_parameter_tensors_are_the_real_layers(hybrid, real):
    """``TracedLayer.tensors`` (what meshplan's ZeRO-1 broadcasts one by one): each layer's
    own parameter tensors in the real module."""
    assert [layer.tensors for layer in hybrid.traced] == \
        [len(list(layer.parameters())) for layer in real.layers]
    assert all(layer.tensors for layer in hybrid.traced[:-1])


def test_output_bytes_are_the_real_outputs_at_the_traced_dtype(hybrid, real):
    x = torch.zeros((1, SEQ_LEN), dtype=torch.long)
    with torch.no_grad():
        for i, layer in enumerate(real.layers):
            x = layer(x)
            assert hybrid.traced[i].output_bytes == x.numel() * TRACED_DTYPE_BYTES, i


def block_flop(spec, seq_len: int) -> float:
    """Forward FLOPs of one sequence through a transformer block, full (non-causal) scores."""
    per_token = (layer_matmul_flop_per_token(spec, 0)
                 + attention_flop_per_token(spec, seq_len=seq_len, causal=False))
    return seq_len * per_token


def test_block_forward_flop_match_the_analytic_count(hybrid):
    normal = block_flop(examples.HYBRID_SPEC, SEQ_LEN)
    wide_spec = dataclasses.replace(examples.HYBRID_SPEC,
                                    ffn_hidden_size=4 * examples.HYBRID_SPEC.ffn_hidden_size)
    wide = block_flop(wide_spec, SEQ_LEN)
    for i in BLOCKS:
        assert hybrid.traced[i].fwd_flop == pytest.approx(normal, rel=REL)
    assert hybrid.traced[WIDE].fwd_flop == pytest.approx(wide, rel=REL)
    assert wide > normal * 2  # the two counts are not interchangeable


def test_every_layer_forward_flop_matches_a_flop_counter_on_the_real_module(hybrid, real):
    x = torch.zeros((1, SEQ_LEN), dtype=torch.long)
    measured = []
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        for layer in real.layers:
            with FlopCounterMode(display=False) as counter:
                x = layer(x)
            measured.append(counter.get_total_flops())
    assert sum(measured) > 0
    for i, flop in enumerate(measured):
        assert hybrid.traced[i].fwd_flop == pytest.approx(flop, rel=REL, abs=1.0), i


def structure(layer: nn.Module) -> tuple:
    return (type(layer).__name__,
            tuple((name, tuple(p.shape)) for name, p in layer.named_parameters()))


def test_layers_of_equal_structure_share_a_kind(hybrid, real):
    kinds = [layer.kind for layer in hybrid.traced]
    assert len({kinds[i] for i in BLOCKS}) == 1
    assert len({kinds[i] for i in MLP_BLOCKS}) == 1
    assert kinds[WIDE] != kinds[BLOCKS[0]]
    assert kinds[BLOCKS[0]] != kinds[MLP_BLOCKS[0]]
    # the kind partition is exactly the partition of the real layers by structure
    shapes = [structure(layer) for layer in real.layers]
    for i in range(NUM_LAYERS):
        for j in range(NUM_LAYERS):
            assert (kinds[i] == kinds[j]) == (shapes[i] == shapes[j]), (i, j)
    assert sorted(set(kinds)) == list(range(len(set(kinds))))


# ----- the cost model --------------------------------------------------------------------------
def test_stage_memory_holds_exactly_the_stage_layers(hybrid, real):
    counts = real_layer_params(real)
    two = cluster(2)
    seen = {}
    for split in ((4, 6), (6, 4)):
        config = pp2(split)
        est = estimate(hybrid, two, config)
        edges = (0, split[0], NUM_LAYERS)
        for stage, memory in enumerate(est.memory.per_stage):
            expected = sum(counts[edges[stage]:edges[stage + 1]])
            assert memory.layers == split[stage]
            assert stage_params(hybrid, config, stage).dense == expected
            assert memory.params_bytes == MESHPLAN_BYTES_PER_PARAM["params"] * expected
            assert memory.grads_bytes == MESHPLAN_BYTES_PER_PARAM["grads"] * expected
            assert memory.optimizer_bytes == MESHPLAN_BYTES_PER_PARAM["optimizer"] * expected
            seen[split, stage] = memory.params_bytes
    assert seen[(4, 6), 0] != seen[(6, 4), 0]
    assert seen[(4, 6), 0] + seen[(4, 6), 1] == seen[(6, 4), 0] + seen[(6, 4), 1]


def test_same_counts_different_layers_give_different_stage_memory(hybrid, real):
    """Split (3, 7) of the hybrid and of the same layers in reverse order: equal counts per
    stage, other layers, so other memory (an analytic model could not tell them apart)."""
    counts = real_layer_params(real)
    reversed_model = dataclasses.replace(hybrid, traced=tuple(reversed(hybrid.traced)))
    config = pp2((3, 7))
    forward = estimate(hybrid, cluster(2), config).memory.per_stage
    backward = estimate(reversed_model, cluster(2), config).memory.per_stage
    assert forward[0].params_bytes == 4 * sum(counts[:3])
    assert backward[0].params_bytes == 4 * sum(counts[::-1][:3])
    assert forward[0].params_bytes != backward[0].params_bytes
    assert forward[0].activations_bytes != backward[0].activations_bytes
    assert forward[0].reserved_bytes != backward[0].reserved_bytes
    # a uniform traced model (every layer a transformer block) cannot tell the splits apart
    uniform = dataclasses.replace(hybrid, traced=tuple(
        dataclasses.replace(hybrid.traced[BLOCKS[0]], name=f"layers.{i}")
        for i in range(NUM_LAYERS)))
    flipped = dataclasses.replace(uniform, traced=tuple(reversed(uniform.traced)))
    assert (estimate(uniform, cluster(2), config).memory.per_stage[0].reserved_bytes
            == estimate(flipped, cluster(2), config).memory.per_stage[0].reserved_bytes)


def test_activations_grow_with_the_micro_batch(hybrid):
    small = estimate(hybrid, cluster(2), pp2((4, 6), micro_batch_size=1)).memory.per_stage
    large = estimate(hybrid, cluster(2), pp2((4, 6), micro_batch_size=2)).memory.per_stage
    for one, two in zip(small, large):
        assert one.activations_bytes > 0
        # 8 and 4 micro-batches both fill the 2-stage pipeline: in flight is the same, and
        # every sequence of a micro-batch saves the same bytes
        assert two.activations_bytes == pytest.approx(2 * one.activations_bytes, rel=1e-12)


def test_full_recompute_lowers_activations(hybrid):
    none = estimate(hybrid, cluster(2), pp2((4, 6), recompute="none")).memory.per_stage
    full = estimate(hybrid, cluster(2), pp2((4, 6), recompute="full")).memory.per_stage
    for kept, rebuilt in zip(none, full):
        assert rebuilt.activations_bytes < kept.activations_bytes


def test_step_time_depends_on_the_split(hybrid):
    times = {split: estimate(hybrid, cluster(2), pp2(split)).time.step_s
             for split in ((2, 8), (4, 6), (5, 5), (6, 4), (8, 2))}
    assert len(set(times.values())) == len(times)
    # forward MFLOP per sequence of layers 0..9 (FlopCounterMode above): 0, 15.7, 6.3, 3.1,
    # 6.3, 3.1, 6.3, 3.1, 0, 2.1. The busier stage holds 25.2 (4, 6), 28.3 (5, 5), 34.6 (6, 4)
    # and 40.9 (8, 2): the step time follows that order.
    assert times[(4, 6)] < times[(5, 5)] < times[(6, 4)] < times[(8, 2)]


def test_each_stage_is_timed_by_its_own_layers(hybrid):
    """Four stages (1, 2, 2, 5): stages 1 and 2 hold two layers each, with the same role and
    links but other layers. Giving stage 2's layers far more FLOPs must slow the step (a time
    shared between stages of equal count would hide it)."""
    config = ParallelConfig(pp=4, seq_len=SEQ_LEN, global_batch_size=8,
                            layers_per_stage=(1, 2, 2, 5))
    heavier = list(hybrid.traced)
    for i in (3, 4):  # stage 2
        heavier[i] = dataclasses.replace(heavier[i], fwd_flop=1e9, bwd_flop=2e9)
    slow = dataclasses.replace(hybrid, traced=tuple(heavier))
    base = estimate(hybrid, cluster(4), config).time
    late = estimate(slow, cluster(4), config).time
    assert late.compute_s > base.compute_s
    assert late.step_s > base.step_s
    assert late.bottleneck_stage == 2


# ----- JSON form -------------------------------------------------------------------------------
def test_to_dict_round_trips_a_traced_spec(hybrid):
    data = json.loads(json.dumps(hybrid.to_dict()))
    assert len(data["traced"]) == NUM_LAYERS
    again = spec_from_dict(data, origin="round trip")
    assert again == hybrid
    assert again.traced == hybrid.traced
    assert again.factory == HYBRID


def one_line_error(data: dict) -> str:
    with pytest.raises(ValueError) as info:
        spec_from_dict(data, origin="model.json")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("model.json: ")
    return message


def test_a_traced_entry_missing_a_key_is_refused(hybrid):
    data = hybrid.to_dict()
    del data["traced"][3]["saved_bytes"]
    message = one_line_error(data)
    assert "traced layer 3" in message and "saved_bytes" in message


def test_a_negative_traced_number_is_refused(hybrid):
    data = hybrid.to_dict()
    data["traced"][2]["params"] = -5
    message = one_line_error(data)
    assert "params" in message and "-5" in message


def test_traced_must_be_a_list_and_match_num_layers(hybrid):
    data = hybrid.to_dict()
    assert "list" in one_line_error({**data, "traced": {"layers.0": 1}})
    assert "num_layers" in one_line_error({**data, "num_layers": NUM_LAYERS - 1})


# ----- refusals ----------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, word", [
    (dict(tp=2, dp=1, pp=1), "tp"),
    (dict(cp=2, dp=1, pp=1), "cp"),
    (dict(recompute="selective"), "recompute"),
    (dict(recompute=("none", "selective")), "recompute"),
    (dict(sp=True), "sequence parallelism"),
    (dict(vpp=2), "vpp"),
    (dict(seq_len=2 * SEQ_LEN), "seq_len"),
])
def test_check_fits_model_refuses_what_a_traced_model_cannot_take(hybrid, changes, word):
    config = pp2((5, 5)).replace(layers_per_stage=None, **changes)
    with pytest.raises(ValueError, match=word):
        check_fits_model(config, hybrid, num_gpus=config.world_size)


def test_check_fits_model_accepts_pipeline_and_full_recompute(hybrid):
    for recompute in ("none", "full", ("full", "none")):
        config = pp2((3, 7), recompute=recompute)
        check_fits_model(config, hybrid, num_gpus=2)  # no error
        assert estimate(hybrid, cluster(2), config,
                        calibration=default_calibration()).time.step_s > 0


# ----- factories that fail -----------------------------------------------------------------------
FACTORIES = '''
import torch
from torch import nn


class Chain(nn.Module):
    meshplan_seq_len = 8

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))

    def forward(self, x):
        return self.layers(x)

    def meshplan_inputs(self, batch_size, seq_len):
        return (torch.zeros(batch_size, seq_len, 16),)


class InitBoom(nn.Module):
    def __init__(self):
        super().__init__()
        raise RuntimeError("init exploded\\nsecond line of the story")


class ForwardBoom(Chain):
    def forward(self, x):
        raise RuntimeError("forward exploded\\nsecond line of the story")


class NoInputs(nn.Module):
    meshplan_seq_len = 8

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 16))

    def forward(self, x):
        return self.layers(x)


class Branches(nn.Module):
    """Two top-level layers that both read the input: not a chain."""

    meshplan_seq_len = 8

    def __init__(self):
        super().__init__()
        self.left = nn.Linear(16, 16)
        self.right = nn.Linear(16, 16)

    def forward(self, x):
        return self.left(x) + self.right(x)

    def meshplan_inputs(self, batch_size, seq_len):
        return (torch.zeros(batch_size, seq_len, 16),)


class TiedEnds(nn.Module):
    """A chain of embedding, block and head whose head is the embedding's weight: two copies
    on two pipeline stages would train apart."""

    meshplan_seq_len = 8
    vocab_size = 32

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.block = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(self.block(self.embed(x)))

    def meshplan_inputs(self, batch_size, seq_len):
        return (torch.zeros(batch_size, seq_len, dtype=torch.long),)


def good():
    return Chain()


def tied_ends():
    return TiedEnds()


def branches():
    return Branches()


def raises_in_init():
    return InitBoom()


def raises_value_error():
    raise ValueError("width 7 is odd\\nsecond line of the story")


def raises_in_forward():
    return ForwardBoom()


def not_a_module():
    return {"layers": 3}


def no_inputs():
    return NoInputs()


NOT_CALLABLE = 3
'''


@pytest.fixture
def factories(tmp_path, monkeypatch):
    """A module of small factories importable as ``meshplan_test_factories``."""
    name = "meshplan_test_factories"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(FACTORIES))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    yield name
    sys.modules.pop(name, None)


def test_the_factory_module_itself_loads(factories):
    """The control: the helper module is importable and a good factory traces."""
    spec = load_model(f"{factories}:good")
    assert spec.is_traced and spec.num_layers == 2
    assert [layer.params for layer in spec.traced] == [16 * 32 + 32, 32 * 16 + 16]


@pytest.mark.parametrize("attr, words", [
    ("raises_in_init", ("factory raised", "RuntimeError", "init exploded")),
    ("raises_value_error", ("width 7 is odd",)),
    ("raises_in_forward", ("forward", "forward exploded")),
    ("not_a_module", ("dict", "nn.Module")),
    ("nosuch", ("no attribute", "nosuch")),
    ("NOT_CALLABLE", ("not callable",)),
    ("no_inputs", ("meshplan_inputs",)),
])
def test_a_failing_factory_gives_one_line(factories, attr, words):
    ref = f"{factories}:{attr}"
    with pytest.raises(ValueError) as info:
        load_model(ref)
    message = str(info.value)
    assert "\n" not in message, message
    assert ref in message, message
    for word in words:
        assert word in message, message


def test_an_unknown_module_gives_one_line():
    ref = "nosuch_meshplan_pkg.mod:build"
    with pytest.raises(ValueError) as info:
        load_model(ref)
    message = str(info.value)
    assert "\n" not in message
    assert ref in message and "cannot import" in message


def test_a_chain_is_told_from_a_module_whose_layers_read_other_inputs(factories, hybrid):
    assert hybrid.traced_chain
    assert load_model(f"{factories}:good").traced_chain
    split = load_model(f"{factories}:branches")
    assert split.num_layers == 2 and not split.traced_chain
    from meshplan.runtime.chain import check_runnable

    with pytest.raises(ValueError, match="chain"):  # stages need a chain; one stage does not
        check_runnable(split, pp=2)


def test_layers_that_share_a_parameter_are_not_a_chain(factories):
    """An embedding and a head with one weight run on one stage: the planner's meshplan
    framework and the runtime refuse pp 2 for them."""
    from meshplan.costmodel.layout import framework_layout_error

    tied = load_model(f"{factories}:tied_ends")
    assert [layer.name for layer in tied.traced] == ["embed", "block", "head"]
    assert not tied.traced_chain
    config = ParallelConfig(pp=2, global_batch_size=4, seq_len=8)
    assert "traced module whose layers are not a chain (or share parameters)" in \
        framework_layout_error("meshplan", config, tied)
    assert framework_layout_error("meshplan", config.replace(pp=1), tied) is None


def test_layer_graph_is_the_traced_layers_in_order(hybrid, real):
    graph = hybrid.layer_graph()
    names = [f"layers.{i}" for i in range(NUM_LAYERS)]
    assert sorted(graph.nodes, key=lambda n: graph.nodes[n]["order"]) == names
    assert list(graph.edges) == list(zip(names, names[1:]))
    assert [graph.nodes[n]["params"] for n in names] == real_layer_params(real)


def test_operator_counts_equal_an_eager_run_of_the_real_module():
    """Each layer's ATen operators, forward and backward, as the fake-mode trace counts them
    and as an eager run of the real module on the CPU dispatches them (fp32, one sequence)."""
    from meshplan.costmodel.tracing import _OpCounter, top_level_layers

    module = examples.hybrid()
    layers = top_level_layers(module)
    eager = _OpCounter({f"{type(module).__name__}.{name}": name for name in layers})
    with eager:
        module(*module.meshplan_inputs(1, SEQ_LEN)).float().sum().backward()
    spec = load_model(HYBRID, seq_len=SEQ_LEN, dtype="fp32")
    assert [(layer.fwd_ops, layer.bwd_ops) for layer in spec.traced] == \
        [(eager.fwd.get(layer.name, 0), eager.bwd.get(layer.name, 0)) for layer in spec.traced]
    assert spec.traced[1].fwd_ops > 50  # a transformer block: norms, projections, attention


def test_a_small_traced_module_on_a_gpu_waits_on_its_host():
    """On a GPU the host issues each ATen operator (``DeviceCalibration.host_op_s``) while the
    device runs the ones before: the example's layers at one 64-token sequence are tiny
    kernels, so the host's work sets the pace, every traced operator of every micro-batch at
    ``host_op_s``; full recomputation costs the host 577 / 248 of it (HOST_OP_EQUIVALENTS,
    measured by benchmarks/host_ops.py). The CPU has no separate host: no wait there."""
    h100 = load_cluster("dgx-h100", nodes=1, gpus_per_node=1)
    host_op_s = default_calibration().device("h100-sxm").host_op_s
    spec = load_model(HYBRID)
    ops = sum(layer.fwd_ops + layer.bwd_ops for layer in spec.traced)
    config = ParallelConfig(global_batch_size=8, micro_batch_size=1, seq_len=SEQ_LEN)
    plain = estimate(spec, h100, config, framework="meshplan").time
    assert plain.compute_s == pytest.approx(8 * ops * host_op_s, rel=REL)
    assert plain.host_wait_s > 0.95 * plain.compute_s
    full = estimate(spec, h100, dataclasses.replace(config, recompute="full"),
                    framework="meshplan").time
    assert full.compute_s == pytest.approx(8 * ops * host_op_s * 577 / 248, rel=REL)
    cpu = estimate(spec, cluster(1), config, framework="meshplan").time
    assert cpu.host_wait_s == 0.0
