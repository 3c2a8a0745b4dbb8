"""The per-stage cost cache (``timing._stage_costs``) reuses one stage's per-layer and once-per-
micro-batch costs across layer splits, recompute modes of other stages, ZeRO stages and offload:
an estimate read through a warm cache must equal the same estimate computed from a cold one,
whatever was cached before it."""

from __future__ import annotations

import importlib
import itertools

import pytest

from meshplan.costmodel import (ParallelConfig, default_calibration, estimate, load_cluster,
                                load_model)

timing = importlib.import_module("meshplan.costmodel.timing")

CASES = (  # model, cluster, nodes, config, framework
    ("llama3-8b", "dgx-h100", 2,
     ParallelConfig(tp=2, pp=4, dp=2, sp=True, micro_batch_size=1, global_batch_size=16,
                    seq_len=4096, vpp=2, recompute=("full", "none", "selective", "none")),
     "megatron"),
    ("mixtral-8x7b", "dgx-h100", 4,
     ParallelConfig(tp=2, pp=2, dp=4, cp=2, ep=4, micro_batch_size=1, global_batch_size=32,
                    seq_len=4096, flash_attention=True, recompute=("selective", "full")),
     "torchtitan"),
    ("gpt3-175b", "dgx-a100-80gb", 8,
     ParallelConfig(tp=8, pp=8, dp=1, micro_batch_size=1, global_batch_size=32, seq_len=2048,
                    recompute="full"),
     "deepspeed"),
)
VARIANTS = [dict(zero_stage=z, offload=o) for z, o in
            itertools.product((0, 1, 3), ("none", "optimizer"))]


def _time(model, cluster, config, framework):
    return estimate(model, cluster, config, framework=framework).time


@pytest.mark.parametrize("name,cluster_name,nodes,config,framework", CASES,
                         ids=[c[0] for c in CASES])
def test_a_warm_cache_gives_the_cold_answer(name, cluster_name, nodes, config, framework):
    model, cluster = load_model(name), load_cluster(cluster_name, nodes=nodes)
    wanted = []
    for variant in VARIANTS:
        timing._STAGE_COSTS.clear()
        wanted.append(_time(model, cluster, config.replace(**variant), framework))
    # warm the cache with other splits and modes of the same layout, then read every variant
    timing._STAGE_COSTS.clear()
    p = config.pp
    for split in {(model.num_layers // p,) * (p - 1) + (model.num_layers
                                                        - (p - 1) * (model.num_layers // p),),
                  None}:
        for modes in ("none", "full"):
            _time(model, cluster, config.replace(layers_per_stage=split, recompute=modes,
                                                 zero_stage=2), framework)
    assert timing._STAGE_COSTS, "the cache was not used"
    got = [_time(model, cluster, config.replace(**variant), framework) for variant in VARIANTS]
    assert got == wanted
    # a layout that differs in a field the costs depend on does not read them: the micro-batch
    # size, with the same global batch
    bigger = config.replace(micro_batch_size=2)
    timing._STAGE_COSTS.clear()
    cold = _time(model, cluster, bigger, framework)
    timing._STAGE_COSTS.clear()
    _time(model, cluster, config, framework)
    assert _time(model, cluster, bigger, framework) == cold



@pytest.mark.parametrize("name,cluster_name,nodes,config,framework", CASES,
                         ids=[c[0] for c in CASES])
def test_compute_alone_is_the_stage_times_compute(name, cluster_name, nodes, config,
                                                  framework):
    """``timing.stage_compute_s`` (what the planner's once-per-step bounds read) is the very
    ``compute_s`` of the stage's full time terms, for every stage, recompute mode and layer
    count, whether it or the full terms filled the cache."""
    from meshplan.costmodel.estimate import stage_micro

    model, cluster = load_model(name), load_cluster(cluster_name, nodes=nodes)
    p, cal = config.pp, default_calibration()
    checked = 0
    for stage, mode, layers in itertools.product(range(p), ("none", "selective", "full"),
                                                 (1, 3)):
        rest = model.num_layers - layers  # shared evenly by the other stages
        others = [rest // (p - 1) + (k < rest % (p - 1)) for k in range(p - 1)]
        split = tuple(others[:stage] + [layers] + others[stage:])
        staged = config.replace(layers_per_stage=split,
                                recompute=tuple(mode if s == stage else "none"
                                                for s in range(p)))
        for first in ("compute", "full"):
            timing._STAGE_COSTS.clear()
            if first == "full":
                full = stage_micro(model, cluster, staged, stage, framework=framework,
                                   calibration=cal).compute_s
                alone = timing.stage_compute_s(model, cluster, staged, cal, stage,
                                               framework=framework)
            else:
                alone = timing.stage_compute_s(model, cluster, staged, cal, stage,
                                               framework=framework)
                full = stage_micro(model, cluster, staged, stage, framework=framework,
                                   calibration=cal).compute_s
            assert alone == full > 0
            checked += 1
    assert checked == 12 * p


def test_compute_alone_of_a_traced_model():
    """The traced path (``timing.stage_compute_s`` of a module traced without weights)."""
    from meshplan.costmodel.estimate import stage_micro

    model = load_model("meshplan.runtime.examples:hybrid")
    cluster, cal = load_cluster("cpu", nodes=1, gpus_per_node=2), default_calibration()
    config = ParallelConfig(pp=2, global_batch_size=4, seq_len=model.seq_len, dtype="fp32",
                            recompute=("full", "none"))
    for stage in range(2):
        full = stage_micro(model, cluster, config, stage, framework="meshplan",
                           calibration=cal).compute_s
        assert timing.stage_compute_s(model, cluster, config, cal, stage,
                                      framework="meshplan") == full > 0


OTHER_VALUES = {  # a second value of each field outside timing.LAYER_COMPUTE_FIELDS
    "pp": 4, "dp": 4, "vpp": 2, "global_batch_size": 128, "zero_stage": 3,
    "offload": "optimizer", "offload_device": "nvme", "recompute": "full", "selective_ac": "2",
    "layers_per_stage": (9, 7, 8, 8), "mesh_order": ("tp", "cp", "pp", "dp"),
    "float8_head": True,  # needs float8: checked on its own below, under torchtitan
    "async_tp": True,  # needs compile: checked on its own below, under torchtitan
    "overlap_comm": False,  # data-parallel and pipeline traffic only
    "tp_comm_overlap": True,  # needs --framework megatron: checked on its own below
    "cross_entropy_fusion": True,  # the same; the LM head's loss only
    "grad_reduce_dtype": "bf16",  # data-parallel traffic and buffers only (bf16 configs)
}


@pytest.mark.parametrize("name,cluster_name,nodes,config,framework", CASES,
                         ids=[c[0] for c in CASES])
def test_the_layer_compute_key_holds_every_field_it_reads(name, cluster_name, nodes, config,
                                                          framework):
    """``timing._layer_compute`` is shared by every configuration with the same
    ``LAYER_COMPUTE_FIELDS``: computed cold, it is the same for a configuration that differs in
    any other field, for every mode and kind of layer."""
    assert set(OTHER_VALUES) | set(timing.LAYER_COMPUTE_FIELDS) >= set(
        ParallelConfig.__dataclass_fields__), "a field is neither in the key nor checked here"
    model, cluster, cal = load_model(name), load_cluster(cluster_name, nodes=nodes), \
        default_calibration()
    base = config.replace(layers_per_stage=None, recompute="none", vpp=1, pp=4, dp=2,
                          global_batch_size=64)

    selective = "op" if framework in ("torchtitan", "meshplan") else "selective"  # layer_modes

    def compute(cfg):
        timing._LAYER_COMPUTE.clear()
        return [timing._layer_compute(model, cluster, cfg, cal, framework, moe, mode)
                for moe in {False, model.is_moe} for mode in ("none", selective, "full")]

    want = compute(base)
    checked = 0
    for field, value in OTHER_VALUES.items():
        if field == "layers_per_stage" and model.num_layers != 32:
            continue
        try:
            other = base.replace(**{field: value})
        except ValueError:
            continue
        assert compute(other) == want, field
        checked += 1
    assert checked >= 9
    if framework == "torchtitan":  # the LM head's float8 leaves the blocks' compute alone
        float8 = base.replace(float8=True)
        assert compute(float8.replace(float8_head=True)) == compute(float8)
        # async TP changes the TP traffic, not the layers' compute
        compiled = base.replace(compile="model")
        assert compute(compiled.replace(async_tp=True)) == compute(compiled)
    if framework == "megatron":  # TE's TP overlap and the fused loss: TP traffic and head only
        assert compute(base.replace(tp_comm_overlap=True)) == want
        assert compute(base.replace(cross_entropy_fusion=True)) == want
    # and the key is what tells layers apart: a field inside it does change the compute
    assert compute(base.replace(micro_batch_size=2 * base.micro_batch_size)) != want
