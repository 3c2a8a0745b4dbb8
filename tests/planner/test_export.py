"""Exports of a plan to DeepSpeed, Megatron-LM and torchtitan (planner/export.py, meshplan export).

Two layers:

* schema tests (always run): the exact keys and values for the issue's two plans, a 3D plan
  (tp 2, pp 2, dp 2, ZeRO-1) and a ZeRO-3 + CPU offload plan (dp 8), both llama3-8b on one
  DGX H100; plus the mapping rules, the errors and the warnings;
* parser tests: each export loaded by its target's own code, when the ``export`` extra is
  installed (``pip install -e .[export]``), skipped otherwise:
  - DeepSpeed: ``deepspeed.runtime.config.DeepSpeedConfig`` (batch arithmetic, pydantic ZeRO
    and offload sections), with an mpu that reports the data-parallel size;
  - Megatron-LM: the arguments parsed as Megatron-LM's ``arguments.py`` names them, then
    megatron-core's ``TransformerConfig`` (a ``ModelParallelConfig``), ``DistributedDataParallel
    Config``, ``OptimizerConfig`` and micro-batch calculator built from them as Megatron-LM's
    ``core_transformer_config_from_args`` does, so their ``__post_init__`` validation runs;
  - torchtitan 0.2: its ``ConfigManager`` reading the TOML (``--job.config_file``), its
    ``ParallelDims`` validating the degrees, the value types checked against ``JobConfig``, and
    the ``[model]`` flavour built (on the meta device) by torchtitan's own model code, as its
    trainer does; the export's flavour table (``export.TORCHTITAN_FLAVOURS``) is checked against
    the installed torchtitan the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import shlex
import sys
import tomllib
import types
import typing
import warnings
from importlib import metadata

import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from meshplan.costmodel import ModelSpec, ParallelConfig, estimate, load_cluster, load_model
from meshplan import cli
from meshplan.planner import export
from meshplan.planner.export import ExportWarning
from meshplan.planner.plan import Plan, write_plan
from meshplan.testing import usage_error

# ----- plans -------------------------------------------------------------------------------------
PLAN_3D = {"tp": 2, "pp": 2, "dp": 2, "sp": True, "zero_stage": 1, "recompute": "selective",
           "micro_batch_size": 1, "global_batch_size": 64, "seq_len": 8192}
PLAN_3D_FSDP = {**PLAN_3D, "zero_stage": 2}
"""The 3D plan as torchtitan runs it: it has no ZeRO-1, so FSDP2 without resharding after
forward (ZeRO-2)."""
PLAN_2D_ZERO3 = {**PLAN_3D, "pp": 1, "dp": 4, "zero_stage": 3}
"""A plan every export takes: no pipeline beside ZeRO-3 (DeepSpeed's engine runs ZeRO 0-1
there), FSDP for torchtitan."""
PLAN_ZERO3_OFFLOAD = {"dp": 8, "zero_stage": 3, "offload": "optimizer+params",
                      "recompute": "full", "micro_batch_size": 1, "global_batch_size": 64,
                      "seq_len": 8192}
PLAN_ZERO3_OPTIMIZER_OFFLOAD = {**PLAN_ZERO3_OFFLOAD, "offload": "optimizer"}
"""Megatron-LM cannot offload parameters; this is the ZeRO-3 + CPU offload plan it can run."""


QWEN3_30B_A3B = ModelSpec(
    name="qwen3-30b-a3b", num_layers=48, hidden_size=2048, num_heads=32, num_kv_heads=4,
    head_dim=128, ffn_hidden_size=6144, vocab_size=151936, seq_len=4096, activation="swiglu",
    norm="rmsnorm", position_embedding="rope", linear_bias=False, tied_embeddings=False,
    num_experts=128, moe_top_k=8, moe_ffn_hidden_size=768, qk_norm=True)
"""torchtitan 0.2.2's qwen3 flavour ``30B-A3B`` (torchtitan/models/qwen3/__init__.py): an MoE
block in every layer, no shared experts (its ffn 6144 is the flavour's unused dense width)."""
QWEN3_0_6B = ModelSpec(
    name="qwen3-0.6b", num_layers=28, hidden_size=1024, num_heads=16, num_kv_heads=8,
    head_dim=128, ffn_hidden_size=3072, vocab_size=151936, seq_len=4096, activation="swiglu",
    norm="rmsnorm", position_embedding="rope", linear_bias=False, tied_embeddings=True,
    qk_norm=True)
"""torchtitan 0.2.2's qwen3 ``0.6B``: head dim 128, not 1024 / 16, and tied embeddings."""


def make_plan(*, model: str | ModelSpec = "llama3-8b", nodes: int = 1,
              framework: str = "meshplan", **config) -> Plan:
    spec = load_model(model) if isinstance(model, str) else model
    est = estimate(spec, load_cluster("dgx-h100", nodes=nodes), ParallelConfig(**config),
                   framework=framework)
    return Plan.from_estimate(est, provenance={"solver": "test"})


def for_target(plan: Plan, target: str) -> Plan:
    """The plan costed for ``target``'s memory layout (so no framework warning)."""
    return dataclasses.replace(plan, framework=target)


def quietly(function, plan: Plan):
    """Export with any ExportWarning turned into a test failure."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExportWarning)
        return function(plan)


def flag_values(args: list[str]) -> dict[str, str | None]:
    """``--flag value`` pairs and bare ``--flag`` switches of an argument list."""
    values: dict[str, str | None] = {}
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            nxt = args[i + 1] if i + 1 < len(args) else None
            values[arg] = None if nxt is None or nxt.startswith("--") else nxt
    return values


# ----- schema: DeepSpeed -------------------------------------------------------------------------
def test_deepspeed_3d_zero1():
    data = quietly(export.to_deepspeed, for_target(make_plan(**PLAN_3D), "deepspeed"))
    assert data == {
        "train_batch_size": 64,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 32,  # 64 / (dp 2 x micro 1)
        "bf16": {"enabled": True},
        "fp16": {"enabled": False},
        "zero_optimization": {"stage": 1},
        "activation_checkpointing": {"partition_activations": True,
                                     "contiguous_memory_optimization": True,
                                     "number_checkpoints": 16, "cpu_checkpointing": False},
        "pipeline": {"stages": 2, "partition": "parameters", "layers_per_stage": [16, 16],
                     "activation_checkpoint_interval": 0},
        "tensor_parallel": {"autotp_size": 2},
    }


def test_deepspeed_zero3_cpu_offload():
    data = quietly(export.to_deepspeed, for_target(make_plan(**PLAN_ZERO3_OFFLOAD), "deepspeed"))
    cpu = {"device": "cpu", "pin_memory": True}
    assert data == {
        "train_batch_size": 64,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 8,
        "bf16": {"enabled": True},
        "fp16": {"enabled": False},
        "zero_optimization": {"stage": 3, "offload_optimizer": cpu, "offload_param": cpu},
        "activation_checkpointing": {"partition_activations": False,
                                     "contiguous_memory_optimization": False,
                                     "number_checkpoints": 32, "cpu_checkpointing": False},
    }


def test_deepspeed_nvme_offload_has_path_placeholder():
    plan = make_plan(**{**PLAN_ZERO3_OFFLOAD, "offload_device": "nvme"})
    zero = quietly(export.to_deepspeed, for_target(plan, "deepspeed"))["zero_optimization"]
    nvme = {"device": "nvme", "pin_memory": True, "nvme_path": "/local_nvme"}
    assert zero == {"stage": 3, "offload_optimizer": nvme, "offload_param": nvme}


def test_deepspeed_optimizer_offload_only():
    plan = make_plan(dp=8, zero_stage=2, offload="optimizer", global_batch_size=64)
    zero = export.to_deepspeed(for_target(plan, "deepspeed"))["zero_optimization"]
    assert zero == {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}


@pytest.mark.parametrize("config, message", [
    ({"pp": 2, "dp": 4, "zero_stage": 2}, "pipeline engine runs only ZeRO stage 0 or 1"),
    ({"dp": 8, "zero_stage": 2, "offload": "optimizer", "offload_device": "nvme"},
     "NVMe only under ZeRO-3"),
    ({"dp": 8, "zero_stage": 0, "offload": "optimizer"}, "offloads only under ZeRO"),
    ({"pp": 2, "dp": 4, "vpp": 2}, "no interleaved schedule"),
])
def test_deepspeed_rejects_what_it_cannot_run(config, message):
    plan = make_plan(global_batch_size=64, **config)
    with pytest.raises(ValueError, match=message):
        export.to_deepspeed(for_target(plan, "deepspeed"))


def test_deepspeed_uneven_split_and_full_recompute_in_pipeline_section():
    # Llama-3-8B in PipelineModule's items: embedding E = 128256 x 4096 = 525.3M, 32 blocks
    # of B = 218.1M, the norm, the head (E again). By parameters over 3 stages: E + 10B,
    # 12B, 10B + E (2706M, 2617M, 2706M) is the most even; 11 middle blocks leave 2399M
    plan = make_plan(nodes=3, pp=3, dp=8, global_batch_size=64, layers_per_stage=(10, 12, 10),
                     recompute="full")
    data = quietly(export.to_deepspeed, for_target(plan, "deepspeed"))
    assert data["pipeline"] == {"stages": 3, "partition": "parameters",
                                "layers_per_stage": [10, 12, 10],
                                "activation_checkpoint_interval": 1}
    assert data["activation_checkpointing"]["number_checkpoints"] == 12
    # blocks balanced to within one, the extra ones first: DeepSpeed's type: method
    plan = make_plan(nodes=3, pp=3, dp=8, global_batch_size=64, layers_per_stage=(11, 11, 10))
    data = quietly(export.to_deepspeed, for_target(plan, "deepspeed"))
    assert data["pipeline"]["partition"] == "type"


def test_deepspeed_refuses_a_split_no_partition_method_builds():
    plan = make_plan(pp=2, dp=4, global_batch_size=64, layers_per_stage=(15, 17))
    with pytest.raises(ValueError, match=r"PipelineModule.*\[15, 17\].*\[16, 16\]"):
        export.to_deepspeed(for_target(plan, "deepspeed"))


# ----- schema: Megatron-LM -----------------------------------------------------------------------
LLAMA3_8B_ARGS = [
    "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
    "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
    "--seq-length", "8192", "--max-position-embeddings", "8192", "--swiglu",
    "--normalization", "RMSNorm", "--position-embedding-type", "rope",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
]


def test_megatron_3d_zero1():
    args = quietly(export.to_megatron, for_target(make_plan(**PLAN_3D), "megatron"))
    assert args == LLAMA3_8B_ARGS + [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--context-parallel-size", "1", "--sequence-parallel",
        "--micro-batch-size", "1", "--global-batch-size", "64",
        "--recompute-granularity", "selective",
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        "--bf16", "--use-flash-attn",
    ]


def test_megatron_data_parallel_overlap_follows_the_plan():
    """--overlap-grad-reduce (and, with the distributed optimizer, --overlap-param-gather) are
    written exactly when the plan prices them: data parallelism over more than one rank and
    ParallelConfig.overlap_comm."""
    def flags(**kwargs):
        plan = for_target(make_plan(**{**PLAN_3D, **kwargs}), "megatron")
        args = quietly(export.to_megatron, plan)
        return [a for a in args if a.startswith("--overlap-")]
    assert flags() == ["--overlap-grad-reduce", "--overlap-param-gather"]
    assert flags(zero_stage=0) == ["--overlap-grad-reduce"]
    assert flags(overlap_comm=False) == []
    assert flags(tp=4, dp=1, global_batch_size=4) == []


@pytest.mark.filterwarnings("ignore::UserWarning")  # megatron-core's "TE not installed"
def test_megatron_tp_comm_overlap_is_written_with_sequence_parallelism(megatron):
    """--tp-comm-overlap (ParallelConfig.tp_comm_overlap) goes with --sequence-parallel, which
    megatron-core's TransformerConfig requires of it; without SP the flag is left out (the
    cost model prices no overlap there either)."""
    plan = for_target(make_plan(**PLAN_3D, tp_comm_overlap=True, framework="megatron"),
                      "megatron")
    args = quietly(export.to_megatron, plan)
    assert args[args.index("--sequence-parallel") + 1] == "--tp-comm-overlap"
    assert megatron(args, world_size=8)["transformer"].tp_comm_overlap
    no_sp = for_target(make_plan(**{**PLAN_3D, "sp": False}, tp_comm_overlap=True,
                                 framework="megatron"), "megatron")
    assert "--tp-comm-overlap" not in quietly(export.to_megatron, no_sp)


def test_megatron_float8_recipe_follows_the_plan():
    def recipe(**kwargs):
        plan = for_target(make_plan(**PLAN_3D, float8=True, framework="megatron", **kwargs),
                          "megatron")
        return flag_values(quietly(export.to_megatron, plan))["--fp8-recipe"]
    assert recipe() == "tensorwise"
    assert recipe(float8_recipe="delayed") == "delayed"


@pytest.mark.filterwarnings("ignore::UserWarning")  # megatron-core's "TE not installed"
def test_megatron_fused_cross_entropy_is_written_when_the_plan_prices_it(megatron):
    plan = for_target(make_plan(**PLAN_3D, cross_entropy_fusion=True, framework="megatron"),
                      "megatron")
    args = quietly(export.to_megatron, plan)
    assert "--cross-entropy-loss-fusion" in args
    assert megatron(args, world_size=8)["transformer"].cross_entropy_loss_fusion
    plain = for_target(make_plan(**PLAN_3D, framework="megatron"), "megatron")
    assert "--cross-entropy-loss-fusion" not in quietly(export.to_megatron, plain)


@pytest.mark.filterwarnings("ignore::UserWarning")  # megatron-core's "TE not installed"
@pytest.mark.parametrize("exchange,written", [("auto", "p2p"), ("all_gather", "all_gather"),
                                              ("a2a", "a2a")])
def test_megatron_context_parallel_exchange_follows_the_plan(megatron, exchange, written):
    plan = for_target(make_plan(**{**PLAN_3D, "dp": 1, "cp": 2}, cp_comm_type=exchange,
                                framework="megatron"), "megatron")
    args = quietly(export.to_megatron, plan)
    assert flag_values(args)["--cp-comm-type"] == written
    assert megatron(args, world_size=8)["transformer"].cp_comm_type == written
    # without context parallelism the flag is left to Megatron-LM's default
    plain = for_target(make_plan(**PLAN_3D, framework="megatron"), "megatron")
    assert "--cp-comm-type" not in quietly(export.to_megatron, plain)


def test_megatron_zero3_cpu_optimizer_offload():
    plan = for_target(make_plan(**PLAN_ZERO3_OPTIMIZER_OFFLOAD), "megatron")
    args = quietly(export.to_megatron, plan)
    assert args == LLAMA3_8B_ARGS + [
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
        "--context-parallel-size", "1",
        "--micro-batch-size", "1", "--global-batch-size", "64",
        "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1",
        "--use-distributed-optimizer", "--use-megatron-fsdp",
        "--data-parallel-sharding-strategy", "optim_grads_params",
        # Megatron-LM 0.16's validate_args asserts this checkpoint format under Megatron-FSDP
        # (megatron/training/arguments.py); its Megatron-FSDP user guide lists both flags
        "--no-gradient-accumulation-fusion", "--ckpt-format", "fsdp_dtensor",
        "--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.0",
        "--use-precision-aware-optimizer", "--bf16", "--use-flash-attn",
    ]


def test_megatron_zero2_is_megatron_fsdp_optim_grads():
    args = export.to_megatron(for_target(make_plan(dp=8, zero_stage=2, global_batch_size=64),
                                         "megatron"))
    assert flag_values(args)["--data-parallel-sharding-strategy"] == "optim_grads"


@pytest.mark.parametrize("config, message", [
    (PLAN_ZERO3_OFFLOAD, "cannot offload parameters"),
    ({**PLAN_ZERO3_OPTIMIZER_OFFLOAD, "offload_device": "nvme"}, "cannot offload to NVMe"),
    ({"dp": 8, "zero_stage": 0, "offload": "optimizer", "global_batch_size": 64},
     "distributed optimizer"),
])
def test_megatron_rejects_offload_it_cannot_do(config, message):
    with pytest.raises(ValueError, match=message):
        export.to_megatron(for_target(make_plan(**config), "megatron"))


# Plans on llama3-8b (32 layers) with their pipeline split and the arguments that express it.
PIPELINE_SPLITS = {
    "even": ({"pp": 2, "dp": 4, "layers_per_stage": (16, 16)}, []),
    "even-vpp": ({"pp": 4, "dp": 2, "vpp": 2},
                 ["--num-layers-per-virtual-pipeline-stage", "4"]),
    "first-last": ({"pp": 2, "dp": 4, "layers_per_stage": (15, 17)},
                   ["--decoder-first-pipeline-num-layers", "15",
                    "--decoder-last-pipeline-num-layers", "17"]),
    "first-last-equal": ({"pp": 4, "dp": 2, "layers_per_stage": (7, 9, 9, 7)},
                         ["--decoder-first-pipeline-num-layers", "7",
                          "--decoder-last-pipeline-num-layers", "7"]),
    "first-only": ({"pp": 4, "dp": 2, "layers_per_stage": (5, 9, 9, 9)},
                   ["--decoder-first-pipeline-num-layers", "5"]),
    "first-last-vpp": ({"pp": 4, "dp": 2, "vpp": 2, "layers_per_stage": (6, 10, 10, 6)},
                       ["--decoder-first-pipeline-num-layers", "6",
                        "--decoder-last-pipeline-num-layers", "6",
                        "--num-virtual-stages-per-pipeline-rank", "2"]),
    "layout": ({"pp": 4, "dp": 2, "layers_per_stage": (9, 7, 8, 8)},
               ["--pipeline-model-parallel-layout", "Et*9|t*7|t*8|t*8L"]),
    "layout-vpp": ({"pp": 4, "dp": 2, "vpp": 2, "layers_per_stage": (7, 9, 8, 8)},
                   ["--pipeline-model-parallel-layout",
                    "Et*4|t*5|t*4|t*4|t*3|t*4|t*4|t*4L"]),
}


@pytest.mark.parametrize("name", PIPELINE_SPLITS)
def test_megatron_pipeline_split(name):
    config, expected = PIPELINE_SPLITS[name]
    plan = for_target(make_plan(global_batch_size=64, **config), "megatron")
    args = quietly(export.to_megatron, plan)
    start = args.index("--context-parallel-size") + 2
    end = args.index("--micro-batch-size")
    assert args[start:end] == expected


def test_model_part_layers_round_robin():
    # Stage 0 (3 layers) -> chunks (2, 1); stage 1 (4) -> (2, 2); parts in model order.
    assert export.model_part_layers((3, 4), 2) == [2, 2, 1, 2]
    assert export.model_part_layers((16, 16), 1) == [16, 16]


def test_megatron_gpt3_architecture_flags():
    plan = for_target(make_plan(model="gpt3-1.3b", dp=8, global_batch_size=64, seq_len=2048),
                      "megatron")
    flags = flag_values(quietly(export.to_megatron, plan))
    assert flags["--normalization"] == "LayerNorm"
    assert flags["--position-embedding-type"] == "learned_absolute"
    for absent in ("--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
                   "--group-query-attention", "--attention-dropout", "--num-experts"):
        assert absent not in flags  # GeLU, tied, biased, MHA, Megatron's default dropout, dense


def test_megatron_moe_flags():
    plan = for_target(make_plan(model="mixtral-8x7b", tp=2, dp=4, ep=2, sp=True,
                                global_batch_size=64, seq_len=4096), "megatron")
    flags = flag_values(quietly(export.to_megatron, plan))
    assert (flags["--num-experts"], flags["--moe-router-topk"],
            flags["--expert-model-parallel-size"]) == ("8", "2", "2")


def test_megatron_rejects_alibi():
    plan = for_target(make_plan(model="bloom-176b", nodes=4, tp=8, pp=2, dp=2,
                                global_batch_size=64), "megatron")
    with pytest.raises(ValueError, match="ALiBi"):
        export.to_megatron(plan)


def test_megatron_rank_layouts():
    plan = for_target(make_plan(**PLAN_3D, mesh_order=("tp", "cp", "pp", "dp")), "megatron")
    assert "--use-tp-pp-dp-mapping" in quietly(export.to_megatron, plan)
    plan = for_target(make_plan(**PLAN_3D, mesh_order=("dp", "tp", "cp", "pp")), "megatron")
    with pytest.warns(ExportWarning, match="cannot lay ranks out as dp,tp,cp,pp"):
        assert "--use-tp-pp-dp-mapping" not in export.to_megatron(plan)


@pytest.mark.parametrize("dtype, flag", [("fp16", "--fp16"), ("fp32", None)])
def test_megatron_precision(dtype, flag):
    args = export.to_megatron(for_target(make_plan(**PLAN_3D, dtype=dtype), "megatron"))
    assert "--bf16" not in args
    assert (flag in args) if flag else ("--fp16" not in args)


# ----- schema: torchtitan ------------------------------------------------------------------------
def test_torchtitan_refuses_zero1_and_ddp_beside_other_parallelism():
    with pytest.raises(ValueError, match="it has no ZeRO-1"):
        export.to_torchtitan(for_target(make_plan(**PLAN_3D), "torchtitan"))
    with pytest.raises(ValueError, match=r"replicates it \(DDP, ZeRO-0\) only without tp"):
        export.to_torchtitan(for_target(make_plan(**{**PLAN_3D, "zero_stage": 0}),
                                        "torchtitan"))


def test_torchtitan_3d_zero2():
    text = quietly(export.to_torchtitan, for_target(make_plan(**PLAN_3D_FSDP), "torchtitan"))
    layers = [f"layers.{i}" for i in range(32)]
    assert tomllib.loads(text) == {
        "job": {"dump_folder": "./outputs", "description": "meshplan plan: llama3-8b on dgx-h100"},
        "model": {"name": "llama3", "flavor": "8B"},  # torchtitan's llama3_args["8B"]
        "training": {"local_batch_size": 32, "global_batch_size": 64, "seq_len": 8192,
                     "mixed_precision_param": "bfloat16"},
        "parallelism": {
            "data_parallel_replicate_degree": 1, "data_parallel_shard_degree": 2,
            "fsdp_reshard_after_forward": "never", "tensor_parallel_degree": 2,
            "enable_async_tensor_parallel": False, "pipeline_parallel_degree": 2,
            "context_parallel_degree": 1, "expert_parallel_degree": 1,
            "pipeline_parallel_schedule": "1F1B", "pipeline_parallel_microbatch_size": 1,
            "module_fqns_per_model_part": [["tok_embeddings", *layers[:16]],
                                           [*layers[16:], "norm", "output"]],
        },
        "activation_checkpoint": {"mode": "selective", "selective_ac_option": "op"},
    }


def test_torchtitan_zero3_cpu_offload():
    plan = for_target(make_plan(**PLAN_ZERO3_OFFLOAD), "torchtitan")
    data = tomllib.loads(quietly(export.to_torchtitan, plan))
    assert data["training"] == {"local_batch_size": 1, "global_batch_size": 64, "seq_len": 8192,
                                "mixed_precision_param": "bfloat16", "enable_cpu_offload": True}
    assert data["parallelism"] == {
        "data_parallel_replicate_degree": 1, "data_parallel_shard_degree": 8,
        "fsdp_reshard_after_forward": "always", "tensor_parallel_degree": 1,
        "enable_async_tensor_parallel": False, "pipeline_parallel_degree": 1,
        "context_parallel_degree": 1, "expert_parallel_degree": 1}
    assert data["activation_checkpoint"] == {"mode": "full"}


def test_torchtitan_plain_ddp_stays_replicated():
    plan = for_target(make_plan(dp=8, global_batch_size=64), "torchtitan")
    parallelism = tomllib.loads(quietly(export.to_torchtitan, plan))["parallelism"]
    assert (parallelism["data_parallel_replicate_degree"],
            parallelism["data_parallel_shard_degree"]) == (8, 1)


PLAN_INTERLEAVED_MOE = {"tp": 2, "pp": 2, "dp": 2, "ep": 2, "vpp": 2, "sp": True,
                        "zero_stage": 2, "global_batch_size": 64, "seq_len": 4096}


def test_torchtitan_interleaved_and_moe():
    plan = for_target(make_plan(model=QWEN3_30B_A3B, **PLAN_INTERLEAVED_MOE), "torchtitan")
    data = tomllib.loads(quietly(export.to_torchtitan, plan))
    assert data["model"] == {"name": "qwen3", "flavor": "30B-A3B"}
    parallelism = data["parallelism"]
    assert parallelism["pipeline_parallel_schedule"] == "Interleaved1F1B"
    assert parallelism["expert_parallel_degree"] == 2
    # 48 layers in 4 parts of 12; the first adds tok_embeddings, the last norm and output
    assert [len(p) for p in parallelism["module_fqns_per_model_part"]] == [13, 12, 12, 14]


def test_torchtitan_rejects_fp16_and_nvme():
    with pytest.raises(ValueError, match="bf16 or fp32"):
        export.to_torchtitan(for_target(make_plan(**PLAN_3D_FSDP, dtype="fp16"), "torchtitan"))
    plan = make_plan(**{**PLAN_ZERO3_OFFLOAD, "offload_device": "nvme"})
    with pytest.raises(ValueError, match="cannot offload to NVMe"):
        export.to_torchtitan(for_target(plan, "torchtitan"))


def test_exports_refuse_or_warn_about_an_exchange_they_do_not_run():
    """torchtitan's context parallelism is torch's ring: a plan priced with another exchange
    is refused; DeepSpeed's is Ulysses: a plan priced with another one exports with a
    warning (its sequence_parallel_size), one priced with the all-to-alls without."""
    cp = {**PLAN_2D_ZERO3, "tp": 1, "sp": False, "dp": 2, "cp": 4}
    gathered = make_plan(**cp, cp_comm_type="all_gather", framework="megatron")
    with pytest.raises(ValueError, match="priced with the all_gather exchange"):
        export.to_torchtitan(for_target(gathered, "torchtitan"))
    quietly(export.to_torchtitan, for_target(make_plan(**cp, framework="torchtitan"),
                                             "torchtitan"))
    with pytest.warns(ExportWarning, match="not the all_gather exchange"):
        export.to_deepspeed(for_target(gathered, "deepspeed"))
    a2a = make_plan(**cp, cp_comm_type="a2a", framework="megatron")
    assert quietly(export.to_deepspeed, for_target(a2a, "deepspeed"))[
        "sequence_parallel_size"] == 4


def test_torchtitan_toml_strings_are_escaped():
    plan = for_target(make_plan(dp=8, global_batch_size=64), "torchtitan")
    name = 'my "llama" \\ v2 \u00e9'
    plan = dataclasses.replace(plan, model=dataclasses.replace(plan.model, name=name))
    job = tomllib.loads(export.to_torchtitan(plan))["job"]
    assert job["description"] == f"meshplan plan: {name} on dgx-h100"


# The catalog's Llama 3 models and torchtitan 0.2.2's llama3 flavours (llama3/__init__.py:
# dim, n_layers, n_heads, n_kv_heads 8, vocab 128256 by default) with the MLP width torchtitan's
# FeedForward computes: m * ceil(int(multiplier * int(2 * 4 * dim / 3)) / m).
LLAMA3_FLAVOURS = {
    "llama3-8b": ("8B", (4096, 32, 32), 1024 * -(-int(1.3 * int(2 * 4 * 4096 / 3)) // 1024)),
    "llama3-70b": ("70B", (8192, 80, 64), 4096 * -(-int(1.3 * int(2 * 4 * 8192 / 3)) // 4096)),
    "llama3-405b": ("405B", (16384, 126, 128),
                    4096 * -(-int(1.2 * int(2 * 4 * 16384 / 3)) // 4096)),
}


@pytest.mark.parametrize("model", LLAMA3_FLAVOURS)
def test_torchtitan_flavour_of_catalog_llama3(model):
    flavour, (dim, layers, heads), ffn = LLAMA3_FLAVOURS[model]
    spec = load_model(model)
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.kv_heads, spec.head_size,
            spec.vocab_size, spec.ffn_hidden_size, spec.tied_embeddings) == \
        (dim, layers, heads, 8, dim // heads, 128256, ffn, False)  # the numbers do match
    plan = for_target(make_plan(model=model, nodes=8, tp=8, pp=4, dp=2, zero_stage=3,
                                global_batch_size=64), "torchtitan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExportWarning)
        data = tomllib.loads(export.to_torchtitan(plan))
    assert data["model"] == {"name": "llama3", "flavor": flavour}


def test_llama3_ffn_dim_is_torchtitans():
    # debugmodel: int(2 * 1024 / 3) = 682, no multiplier, up to a multiple of 256
    assert export.llama3_ffn_dim(256, 256, None) == 768
    # 8B, 70B, 405B: Llama 3's published MLP widths
    assert [export.llama3_ffn_dim(4096, 1024, 1.3), export.llama3_ffn_dim(8192, 4096, 1.3),
            export.llama3_ffn_dim(16384, 4096, 1.2)] == [14336, 28672, 53248]


def test_torchtitan_flavour_of_qwen3_shapes():
    assert export.torchtitan_flavour(QWEN3_30B_A3B) == ("qwen3", "30B-A3B")
    assert export.torchtitan_flavour(QWEN3_0_6B) == ("qwen3", "0.6B")
    # untied, 0.6B's numbers are no flavour (qwen3's 0.6B ties them; llama3 never does)
    with pytest.raises(ValueError, match="no flavour with qwen3-0.6b's"):
        export.torchtitan_flavour(dataclasses.replace(QWEN3_0_6B, tied_embeddings=False))
    # qwen3 builds its query and key norms; llama3 has none
    with pytest.raises(ValueError, match=r"nearest: qwen3 0.6B \(query/key norms\)"):
        export.torchtitan_flavour(dataclasses.replace(QWEN3_0_6B, qk_norm=False))
    with pytest.raises(ValueError, match=r"nearest: llama3 8B \(no query/key norms\)"):
        export.torchtitan_flavour(dataclasses.replace(load_model("llama3-8b"), qk_norm=True))


@pytest.mark.parametrize("model, parts", [
    # dense, one number off llama3 70B: torchtitan's vocabulary is 128256
    ("llama2-70b", ["no flavour with llama2-70b's architecture (hidden 8192, 80 layers",
                    "vocab 32000", "nearest: llama3 70B (vocab 128256)",
                    "dense flavours: llama3 debugmodel, 8B, 70B, 405B; qwen3 debugmodel, 0.6B, "
                    "1.7B, 4B, 8B, 14B, 32B;", "export to megatron or deepspeed"]),
    # tied embeddings, head dim 64: llama3 ties none, qwen3's head dim is 128
    ("llama3.2-1b", ["no flavour with llama3.2-1b's", "head dim 64", "tied embeddings"]),
    # MoE: qwen3's MoE flavours only (llama4's and deepseek_v3's have shared experts)
    ("mixtral-8x7b", ["no flavour with mixtral-8x7b's", "8 experts, top-2, expert ffn 14336",
                      "MoE flavours: qwen3 debugmodel_moe, 30B-A3B, 235B-A22B (llama4"]),
    ("gpt3-1.3b", ["are SwiGLU, RMSNorm and RoPE without biases; gpt3-1.3b has gelu MLP, "
                   "layernorm, learned positions, linear biases: export to megatron"]),
])
def test_torchtitan_refuses_a_model_with_no_flavour(model, parts):
    with pytest.raises(ValueError) as error:
        export.torchtitan_flavour(load_model(model))
    message = str(error.value)
    assert "\n" not in message
    for part in parts:
        assert part in message


def test_torchtitan_refuses_before_warning():
    """A plan with warnings (ZeRO-1) and no flavour: the refusal, and nothing else."""
    plan = make_plan(model="mixtral-8x7b", **PLAN_3D)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExportWarning)
        with pytest.raises(ValueError, match="no flavour with mixtral-8x7b's"):
            export.to_torchtitan(plan)


def test_torchtitan_warns_that_it_has_no_dropout():
    plan = for_target(make_plan(dp=8, global_batch_size=64), "torchtitan")
    plan = dataclasses.replace(plan, model=dataclasses.replace(plan.model, dropout=True))
    with pytest.warns(ExportWarning, match="torchtitan's llama3 has no dropout"):
        export.to_torchtitan(plan)


# ----- shared rules ------------------------------------------------------------------------------
def test_per_stage_recompute_maps_to_strongest_mode_everywhere():
    plan = make_plan(pp=2, dp=4, global_batch_size=64, recompute=("selective", "full"))
    with pytest.warns(ExportWarning, match="per-stage"):
        ds = export.to_deepspeed(for_target(plan, "deepspeed"))
    assert ds["pipeline"]["activation_checkpoint_interval"] == 1
    with pytest.warns(ExportWarning, match="per-stage"):
        assert flag_values(export.to_megatron(for_target(plan, "megatron")))[
            "--recompute-granularity"] == "full"
    fsdp = make_plan(pp=2, dp=4, global_batch_size=64, zero_stage=2,
                     recompute=("selective", "full"))  # torchtitan: FSDP2 beside a pipeline
    with pytest.warns(ExportWarning, match="per-stage"):
        text = export.to_torchtitan(for_target(fsdp, "torchtitan"))
    assert tomllib.loads(text)["activation_checkpoint"]["mode"] == "full"


def test_same_recompute_on_every_stage_does_not_warn():
    plan = for_target(make_plan(pp=2, dp=4, global_batch_size=64, recompute=("full", "full")),
                      "megatron")
    assert "full" in quietly(export.to_megatron, plan)


def test_framework_mismatch_warns():
    plan = make_plan(**PLAN_ZERO3_OFFLOAD, framework="megatron")
    with pytest.warns(ExportWarning, match="estimated for framework 'megatron'"):
        export.to_deepspeed(plan)
    # meshplan and torchtitan share the FSDP2 accounting (costmodel.frameworks).
    quietly(export.to_torchtitan, for_target(plan, "meshplan"))


def test_render_matches_the_functions():
    plan = for_target(make_plan(**PLAN_2D_ZERO3), "megatron")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExportWarning)
        assert json.loads(export.render(plan, "deepspeed")) == export.to_deepspeed(plan)
        line = export.render(plan, "megatron")
        assert line.count("\n") == 1 and shlex.split(line) == export.to_megatron(plan)
        assert export.render(plan, "torchtitan") == export.to_torchtitan(plan)
    with pytest.raises(ValueError, match="unknown export target 'nemo'"):
        export.render(plan, "nemo")


# ----- the command line --------------------------------------------------------------------------
@pytest.fixture
def plan_file(tmp_path):
    path = tmp_path / "plan.json"
    write_plan(make_plan(**PLAN_3D, framework="megatron"), path)
    return path


def test_cli_export_to_stdout(capsys, plan_file):
    assert cli.main(["export", str(plan_file), "--to", "megatron"]) == 0
    out, err = capsys.readouterr()
    assert shlex.split(out) == export.to_megatron(make_plan(**PLAN_3D, framework="megatron"))
    assert err == ""


def test_cli_export_prints_warnings_on_stderr(capsys, tmp_path):
    plan_file = tmp_path / "plan.json"
    write_plan(make_plan(**PLAN_3D_FSDP, framework="megatron"), plan_file)
    assert cli.main(["export", str(plan_file), "--to", "torchtitan"]) == 0
    out, err = capsys.readouterr()
    assert tomllib.loads(out)["parallelism"]["tensor_parallel_degree"] == 2
    lines = err.splitlines()
    assert lines and all(line.startswith("meshplan: warning: ") for line in lines)
    assert any("framework 'megatron'" in line for line in lines)


def test_cli_export_output_file_refuses_to_overwrite(capsys, plan_file, tmp_path):
    target = tmp_path / "ds.json"
    assert cli.main(["export", str(plan_file), "--to", "deepspeed", "-o", str(target)]) == 0
    assert capsys.readouterr().out == ""
    assert json.loads(target.read_text())["zero_optimization"] == {"stage": 1}
    target.write_text("keep me")
    assert cli.main(["export", str(plan_file), "--to", "deepspeed", "-o", str(target)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--force" in err and len(err.splitlines()) == 1
    assert target.read_text() == "keep me"
    assert cli.main(["export", str(plan_file), "--to", "deepspeed", "-o", str(target),
                     "--force"]) == 0
    assert json.loads(target.read_text())["train_batch_size"] == 64


def test_cli_export_json(capsys, plan_file):
    assert cli.main(["export", str(plan_file), "--to", "deepspeed", "--json"]) == 0
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert set(data) == {"target", "config", "text", "warnings"}
    assert data["config"] == json.loads(data["text"])
    assert any("framework 'megatron'" in note for note in data["warnings"])
    assert err == ""


def test_cli_export_error_is_one_line_without_warnings(capsys, tmp_path):
    path = tmp_path / "plan.json"
    write_plan(make_plan(**PLAN_ZERO3_OFFLOAD, framework="deepspeed"), path)
    target = tmp_path / "out.txt"
    assert cli.main(["export", str(path), "--to", "megatron", "-o", str(target)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("meshplan: error: Megatron-LM cannot offload parameters")
    assert not target.exists()


def test_cli_export_refuses_a_model_torchtitan_has_no_flavour_for(tmp_path):
    path, target = tmp_path / "plan.json", tmp_path / "job.toml"
    write_plan(make_plan(model="llama2-70b", nodes=4, tp=8, pp=4, global_batch_size=64,
                         framework="megatron"), path)  # a warning too, not printed
    line = usage_error("export", path, "--to", "torchtitan", "-o", target)
    assert line.startswith("meshplan: error: torchtitan 0.2.2 has no flavour with llama2-70b's "
                           "architecture (")
    assert "nearest: llama3 70B (vocab 128256)" in line  # torchtitan's llama3 vocab_size
    assert not target.exists()


@pytest.mark.parametrize("argv, message", [
    (["export", "missing.json", "--to", "deepspeed"], "does not exist"),
    (["export", "plan.json"], "--to"),
    (["export", "plan.json", "--to", "nemo"], "invalid choice"),
])
def test_cli_export_usage_errors(capsys, argv, message):
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("meshplan: error: ") and message in err


# ----- parser: DeepSpeed -------------------------------------------------------------------------
class DataParallelMpu:
    """The part of an mpu DeepSpeedConfig asks: the data-parallel world size."""

    def __init__(self, size: int) -> None:
        self.size = size

    def get_data_parallel_world_size(self) -> int:
        return self.size


@pytest.fixture
def deepspeed_config(monkeypatch):
    """DeepSpeedConfig as a rank of a ``dp``-way data-parallel job sees it (no process group)."""
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *args, **kwargs: 0)
    return lambda source, dp: ds_config.DeepSpeedConfig(source, mpu=DataParallelMpu(dp))


@pytest.mark.parametrize("config", [PLAN_3D, PLAN_ZERO3_OFFLOAD], ids=["3d-zero1", "zero3-cpu"])
def test_deepspeed_parser_loads_export(deepspeed_config, tmp_path, config):
    plan = for_target(make_plan(**config), "deepspeed")
    path = tmp_path / "ds_config.json"
    path.write_text(export.render(plan, "deepspeed"))
    parsed = deepspeed_config(str(path), plan.config.dp)
    assert parsed.world_size == plan.config.dp
    assert (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu,
            parsed.gradient_accumulation_steps) == (64, 1, plan.config.grad_accum_steps)
    assert parsed.zero_optimization_stage == plan.config.zero_stage
    assert parsed.bfloat16_config.enabled
    offloaded = plan.config.offload != "none"
    assert (parsed.zero_config.offload_optimizer is not None) == offloaded
    if offloaded:
        assert parsed.zero_config.offload_param.device == "cpu"
    assert parsed.pipeline["stages"] == (plan.config.pp if plan.config.pp > 1 else "auto")
    assert parsed.tensor_parallel_config.autotp_size == (2 if plan.config.tp > 1 else 0)


def test_deepspeed_parser_catches_a_wrong_batch(deepspeed_config):
    """The fixture really validates: a batch that does not add up fails."""
    data = export.to_deepspeed(for_target(make_plan(**PLAN_3D), "deepspeed"))
    with pytest.raises(AssertionError, match="train_batch_size is not equal"):
        deepspeed_config({**data, "gradient_accumulation_steps": 16}, 2)


def test_deepspeed_parser_loads_nvme_offload(deepspeed_config):
    plan = for_target(make_plan(**{**PLAN_ZERO3_OFFLOAD, "offload_device": "nvme"}), "deepspeed")
    parsed = deepspeed_config(export.to_deepspeed(plan), 8)
    assert str(parsed.zero_config.offload_param.nvme_path) == "/local_nvme"


# ----- parser: megatron-core ---------------------------------------------------------------------
MEGATRON_INT_FLAGS = (
    "num-layers", "hidden-size", "ffn-hidden-size", "num-attention-heads", "kv-channels",
    "num-query-groups", "seq-length", "max-position-embeddings", "num-experts",
    "moe-router-topk", "moe-ffn-hidden-size", "tensor-model-parallel-size",
    "pipeline-model-parallel-size", "context-parallel-size", "expert-model-parallel-size",
    "decoder-first-pipeline-num-layers", "decoder-last-pipeline-num-layers",
    "num-layers-per-virtual-pipeline-stage", "num-virtual-stages-per-pipeline-rank",
    "micro-batch-size", "global-batch-size", "recompute-num-layers")
MEGATRON_SWITCHES = (
    "group-query-attention", "swiglu", "untie-embeddings-and-output-weights",
    "disable-bias-linear", "add-qkv-bias", "sequence-parallel", "use-tp-pp-dp-mapping",
    "use-distributed-optimizer", "use-megatron-fsdp", "optimizer-cpu-offload",
    "use-precision-aware-optimizer", "bf16", "fp16", "use-flash-attn", "overlap-grad-reduce",
    "overlap-param-gather", "tp-comm-overlap", "cross-entropy-loss-fusion",
    "no-gradient-accumulation-fusion",
    # core_r0.16: arguments.py builds TransformerConfig's fields as flags (ArgumentGroupFactory)
    "qk-layernorm")
MEGATRON_CHOICES = {
    "normalization": ("LayerNorm", "RMSNorm"),
    "position-embedding-type": ("learned_absolute", "rope", "mrope", "relative", "none"),
    "recompute-granularity": ("full", "selective"),
    "recompute-method": ("uniform", "block"),
    "data-parallel-sharding-strategy": ("no_shard", "optim", "optim_grads",
                                        "optim_grads_params"),
    "ckpt-format": ("torch", "torch_dist", "torch_dcp", "fsdp_dtensor"),  # training_config.py
}


def parse_megatron_args(args: list[str]) -> argparse.Namespace:
    """The arguments as Megatron-LM's ``arguments.py`` declares them (names, types, choices)."""
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False)
    for name in MEGATRON_INT_FLAGS:
        parser.add_argument(f"--{name}", type=int)
    for name in MEGATRON_SWITCHES:
        parser.add_argument(f"--{name}", action="store_true")
    for name, choices in MEGATRON_CHOICES.items():
        parser.add_argument(f"--{name}", choices=choices)
    for name in ("attention-dropout", "hidden-dropout", "optimizer-offload-fraction"):
        parser.add_argument(f"--{name}", type=float)
    # _add_transformer_engine_args (core_r0.16): --fp8-format's dest is fp8
    parser.add_argument("--fp8-format", dest="fp8", choices=("e4m3", "hybrid"))
    parser.add_argument("--fp8-recipe", default="delayed",
                        choices=("tensorwise", "delayed", "mxfp8", "blockwise"))
    parser.add_argument("--moe-layer-freq", type=lambda text: eval(text, {"__builtins__": {}}))
    parser.add_argument("--pipeline-model-parallel-layout", type=str)
    # _add_distributed_args: one exchange for every layer, or one per layer
    parser.add_argument("--cp-comm-type", nargs="+", type=str, default=["p2p"])
    namespace, unknown = parser.parse_known_args(args)
    assert unknown == [], f"arguments Megatron-LM does not declare: {unknown}"
    return namespace


def build_megatron_configs(args: list[str], *, world_size: int) -> dict[str, object]:
    """megatron-core's configs from the arguments, as Megatron-LM builds them (validation runs)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    a = parse_megatron_args(args)
    dtype = torch.bfloat16 if a.bf16 else torch.float16 if a.fp16 else torch.float32
    pp = a.pipeline_model_parallel_size
    vpp = a.num_virtual_stages_per_pipeline_rank
    if a.num_layers_per_virtual_pipeline_stage:
        vpp = a.num_layers // pp // a.num_layers_per_virtual_pipeline_stage
    transformer = TransformerConfig(
        num_layers=a.num_layers, hidden_size=a.hidden_size, ffn_hidden_size=a.ffn_hidden_size,
        num_attention_heads=a.num_attention_heads, kv_channels=a.kv_channels,
        num_query_groups=a.num_query_groups if a.group_query_attention else None,
        tensor_model_parallel_size=a.tensor_model_parallel_size,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=a.context_parallel_size,
        cp_comm_type=a.cp_comm_type[0] if len(a.cp_comm_type) == 1 else a.cp_comm_type,
        expert_model_parallel_size=a.expert_model_parallel_size or 1,
        sequence_parallel=a.sequence_parallel, tp_comm_overlap=a.tp_comm_overlap,
        cross_entropy_loss_fusion=a.cross_entropy_loss_fusion,
        num_layers_in_first_pipeline_stage=a.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=a.decoder_last_pipeline_num_layers,
        pipeline_model_parallel_layout=a.pipeline_model_parallel_layout,
        gated_linear_unit=a.swiglu, activation_func=F.silu if a.swiglu else F.gelu,
        normalization=a.normalization, add_bias_linear=not a.disable_bias_linear,
        add_qkv_bias=a.add_qkv_bias, qk_layernorm=a.qk_layernorm,
        attention_dropout=0.1 if a.attention_dropout is None else a.attention_dropout,
        hidden_dropout=0.1 if a.hidden_dropout is None else a.hidden_dropout,
        num_moe_experts=a.num_experts, moe_router_topk=a.moe_router_topk or 2,
        moe_ffn_hidden_size=a.moe_ffn_hidden_size, moe_layer_freq=a.moe_layer_freq or 1,
        recompute_granularity=a.recompute_granularity, recompute_method=a.recompute_method,
        recompute_num_layers=a.recompute_num_layers,
        bf16=a.bf16, fp16=a.fp16, params_dtype=dtype, fp8=a.fp8, fp8_recipe=a.fp8_recipe,
        pipeline_dtype=dtype if pp > 1 else None,
        attention_backend=AttnBackend.flash if a.use_flash_attn else AttnBackend.auto,
    )
    ddp = DistributedDataParallelConfig(
        use_distributed_optimizer=a.use_distributed_optimizer,
        use_megatron_fsdp=a.use_megatron_fsdp,
        overlap_grad_reduce=a.overlap_grad_reduce, overlap_param_gather=a.overlap_param_gather,
        data_parallel_sharding_strategy=a.data_parallel_sharding_strategy or "no_shard")
    optimizer = OptimizerConfig(
        optimizer="adam", bf16=a.bf16, fp16=a.fp16, params_dtype=dtype,
        use_distributed_optimizer=a.use_distributed_optimizer,
        optimizer_cpu_offload=a.optimizer_cpu_offload,
        optimizer_offload_fraction=a.optimizer_offload_fraction or 0.0,
        use_precision_aware_optimizer=a.use_precision_aware_optimizer)
    dp = world_size // (a.tensor_model_parallel_size * pp * a.context_parallel_size)
    batches = ConstantNumMicroBatchesCalculator(a.global_batch_size, a.micro_batch_size, dp,
                                                decrease_batch_size_if_needed=False, rank=0)
    return {"args": a, "transformer": transformer, "ddp": ddp, "optimizer": optimizer,
            "batches": batches}


@pytest.fixture
def megatron(monkeypatch):
    pytest.importorskip("megatron.core")
    from megatron.core.optimizer import optimizer_config
    # The precision-aware optimizer checks the installed Transformer Engine version (>= 2.1);
    # TE is a GPU package, absent here: report a recent one, as a GPU machine would have.
    monkeypatch.setattr(optimizer_config, "is_te_min_version", lambda version: True)
    return build_megatron_configs


@pytest.mark.filterwarnings("ignore::UserWarning")  # megatron-core's "TE not installed"
@pytest.mark.parametrize("config", [PLAN_3D, PLAN_ZERO3_OPTIMIZER_OFFLOAD],
                         ids=["3d-zero1", "zero3-cpu-optimizer"])
def test_megatron_core_builds_configs_from_export(megatron, config):
    plan = for_target(make_plan(**config), "megatron")
    built = megatron(export.to_megatron(plan), world_size=plan.config.world_size)
    transformer, ddp, optimizer = built["transformer"], built["ddp"], built["optimizer"]
    assert (transformer.tensor_model_parallel_size, transformer.pipeline_model_parallel_size,
            transformer.sequence_parallel) == (plan.config.tp, plan.config.pp, plan.config.sp)
    assert transformer.num_query_groups == 8 and transformer.gated_linear_unit
    assert built["batches"].get() == plan.config.grad_accum_steps
    assert ddp.use_distributed_optimizer
    if plan.config.zero_stage == 3:
        assert ddp.data_parallel_sharding_strategy == "optim_grads_params"
        assert optimizer.optimizer_cpu_offload and optimizer.optimizer_offload_fraction == 1.0


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", PIPELINE_SPLITS)
def test_megatron_core_accepts_pipeline_split(megatron, name):
    config, _ = PIPELINE_SPLITS[name]
    plan = for_target(make_plan(global_batch_size=64, **config), "megatron")
    transformer = megatron(export.to_megatron(plan), world_size=8)["transformer"]
    vpp = transformer.virtual_pipeline_model_parallel_size
    assert (vpp or 1) == plan.config.vpp


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_megatron_core_accepts_moe_and_gpt3(megatron):
    moe = for_target(make_plan(model="mixtral-8x7b", tp=2, dp=4, ep=2, sp=True,
                               global_batch_size=64, seq_len=4096), "megatron")
    transformer = megatron(export.to_megatron(moe), world_size=8)["transformer"]
    assert (transformer.num_moe_experts, transformer.expert_model_parallel_size) == (8, 2)
    every_fourth = dataclasses.replace(moe.model, moe_layer_freq=4)  # layers 3, 7, ... are MoE
    args = export.to_megatron(dataclasses.replace(moe, model=every_fourth))
    assert flag_values(args)["--moe-layer-freq"] == "([0]*3+[1])*8+[0]*0"
    transformer = megatron(args, world_size=8)["transformer"]
    assert transformer.moe_layer_freq == [0, 0, 0, 1] * 8
    gpt = for_target(make_plan(model="gpt3-1.3b", tp=2, pp=2, dp=2, vpp=2, zero_stage=2,
                               recompute="full", global_batch_size=64, seq_len=2048), "megatron")
    transformer = megatron(export.to_megatron(gpt), world_size=8)["transformer"]
    assert transformer.add_bias_linear and transformer.normalization == "LayerNorm"
    assert not transformer.qk_layernorm


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_megatron_core_builds_qwen3_query_and_key_norms(megatron):
    plan = for_target(make_plan(model=QWEN3_0_6B, tp=2, dp=4, sp=True, global_batch_size=64,
                                seq_len=4096), "megatron")
    args = export.to_megatron(plan)
    assert "--qk-layernorm" in args and "--add-qkv-bias" not in args
    transformer = megatron(args, world_size=8)["transformer"]
    assert transformer.qk_layernorm and transformer.normalization == "RMSNorm"
    assert transformer.kv_channels == 128


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_megatron_core_rejects_a_broken_split(megatron):
    """The builder really validates: a split whose middle stages differ fails in megatron-core."""
    args = export.to_megatron(for_target(make_plan(**PLAN_3D), "megatron"))
    args = [*args, "--pipeline-model-parallel-size", "4",
            "--decoder-first-pipeline-num-layers", "7"]  # 25 layers on 3 middle stages
    with pytest.raises(ValueError, match="divisible"):
        megatron(args, world_size=16)


# ----- parser: torchtitan ------------------------------------------------------------------------
def _no_triton_kernels(*args, **kwargs):
    raise RuntimeError("torchtitan's MoE token permutation is a Triton kernel, stubbed here")


@pytest.fixture(scope="module")
def torchtitan():
    """torchtitan 0.2's config manager, ParallelDims and train-spec registry, imported without
    the package __init__ and without Triton.

    ``torchtitan/__init__.py`` imports its quantization and MoE kernels, which need Triton (a
    CUDA compiler that a CPU torch does not bring; so ``import torchtitan`` fails here). The
    config code needs neither, so a bare package module stands in for the __init__, and the
    models' MoE layers import a stand-in ``torchtitan.models.moe.kernels`` (building a model on
    the meta device runs no kernel); both restored afterwards.
    """
    spec = importlib.util.find_spec("torchtitan")
    if spec is None:
        pytest.skip("torchtitan is not installed (pip install -e .[export])")
    version = metadata.version("torchtitan")
    if not version.startswith("0.2."):
        pytest.skip(f"torchtitan {version} reads no TOML job config; the export targets 0.2")
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] == "torchtitan"}
    package = types.ModuleType("torchtitan")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["torchtitan"] = package
    kernels = types.ModuleType("torchtitan.models.moe.kernels")
    kernels.generate_permute_indices = _no_triton_kernels
    sys.modules[kernels.__name__] = kernels
    try:
        with warnings.catch_warnings():  # torch's own import-time deprecations (inductor)
            warnings.simplefilter("ignore", DeprecationWarning)
            from torchtitan.config import ConfigManager, JobConfig
            from torchtitan.distributed.parallel_dims import ParallelDims
            from torchtitan.models import _supported_models
            from torchtitan.protocols.train_spec import get_train_spec
            for name in (*export.TORCHTITAN_FLAVOURS, "llama4", "deepseek_v3"):
                importlib.import_module(f"torchtitan.models.{name}")
        yield types.SimpleNamespace(ConfigManager=ConfigManager, JobConfig=JobConfig,
                                    ParallelDims=ParallelDims, get_train_spec=get_train_spec,
                                    models=_supported_models, version=version)
    finally:
        for name in [k for k in sys.modules if k.split(".")[0] == "torchtitan"]:
            del sys.modules[name]
        sys.modules.update(saved)


def matches_annotation(annotation, value) -> bool:
    """``value`` (as TOML gives it) fits the JobConfig field type ``annotation``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return value in args
    if origin in (typing.Union, types.UnionType):
        return any(matches_annotation(arg, value) for arg in args)
    if origin is list:
        return isinstance(value, list) and all(matches_annotation(args[0], v) for v in value)
    if annotation is type(None):
        return value is None
    if annotation in (int, float) and isinstance(value, bool):
        return False
    if annotation is float:
        return isinstance(value, (int, float))
    return isinstance(value, annotation)


def load_torchtitan(tt, plan: Plan, tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(export.to_torchtitan(plan))
    job = tt.ConfigManager().parse_args(["--job.config_file", str(path)])
    # The manager checks key names only; check each value against its field's type as well.
    check_table_types(job, tomllib.loads(path.read_text()))
    return job


def check_table_types(config, table: dict, where: str = "") -> None:
    """Every value of the TOML ``table`` fits its field of the JobConfig part ``config``;
    nested tables (``[quantize.linear.float8]``) against the nested dataclasses."""
    hints = typing.get_type_hints(type(config))
    for key, value in table.items():
        if isinstance(value, dict) and dataclasses.is_dataclass(hints[key]):
            check_table_types(getattr(config, key), value, f"{where}{key}.")
        else:
            assert matches_annotation(hints[key], value), (f"{where}{key}", value, hints[key])


def built_architecture(tt, name: str, flavour: str) -> dict[str, object]:
    """The numbers of the model torchtitan's trainer builds for ``[model] name, flavor``: its
    train spec's ``model_cls(model_args[flavor])`` on the meta device (torchtitan/train.py)."""
    import torch

    spec = tt.get_train_spec(name)
    with torch.device("meta"):
        module = spec.model_cls(spec.model_args[flavour])
    blocks = list(module.layers.values())
    attention = blocks[0].attention
    assert all((b.attention.n_heads, b.attention.n_kv_heads, b.attention.head_dim) ==
               (attention.n_heads, attention.n_kv_heads, attention.head_dim) for b in blocks)
    dense = {b.feed_forward.w1.out_features for b in blocks if getattr(b, "moe", None) is None}
    moe = {(b.moe.experts.num_experts, b.moe.router.top_k, b.moe.experts.w1.shape[1],
            b.moe.shared_experts is not None) for b in blocks if getattr(b, "moe", None)}
    assert len(dense) <= 1 and len(moe) <= 1  # one dense width, one kind of MoE block
    ffn = dense.pop() if dense else 0
    experts, top_k, expert_ffn, shared = moe.pop() if moe else (0, 0, 0, False)
    assert not (ffn and experts)  # every layer dense or every layer MoE
    return {"hidden": module.tok_embeddings.embedding_dim, "layers": len(blocks),
            "heads": attention.n_heads, "kv_heads": attention.n_kv_heads,
            "head_dim": attention.head_dim, "vocab": module.tok_embeddings.num_embeddings,
            "ffn": ffn, "experts": experts, "top_k": top_k, "expert_ffn": expert_ffn,
            "tied": module.output.weight is module.tok_embeddings.weight,
            "qk_norm": getattr(attention, "q_norm", None) is not None,
            "shared_experts": shared}


def spec_architecture(model: ModelSpec) -> dict[str, object]:
    """A dense or all-MoE ModelSpec's numbers as ``built_architecture`` names them."""
    assert model.moe_layer_freq == 1
    return {"hidden": model.hidden_size, "layers": model.num_layers, "heads": model.num_heads,
            "kv_heads": model.kv_heads, "head_dim": model.head_size, "vocab": model.vocab_size,
            "ffn": 0 if model.is_moe else model.ffn_hidden_size,
            "experts": model.num_experts, "top_k": model.moe_top_k,
            "expert_ffn": model.expert_ffn_size if model.is_moe else 0,
            "tied": model.tied_embeddings, "qk_norm": model.qk_norm, "shared_experts": False}


def check_torchtitan_job(tt, job, plan: Plan) -> None:
    """What torchtitan's trainer and pipeline set-up check before training starts, and that
    the model it builds from ``[model]`` is the plan's."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    assert built_architecture(tt, job.model.name, job.model.flavor) == \
        spec_architecture(plan.model)

    par, training = job.parallelism, job.training
    dims = tt.ParallelDims(dp_replicate=par.data_parallel_replicate_degree,
                           dp_shard=par.data_parallel_shard_degree,
                           cp=par.context_parallel_degree, tp=par.tensor_parallel_degree,
                           pp=par.pipeline_parallel_degree, ep=par.expert_parallel_degree,
                           etp=par.expert_tensor_parallel_degree,
                           world_size=plan.config.world_size)
    batch_degree = dims.dp_replicate * dims.dp_shard
    assert training.global_batch_size % (training.local_batch_size * batch_degree) == 0
    if training.enable_cpu_offload:
        assert dims.fsdp_enabled  # torchtitan offloads only through FSDP2
    if dims.pp > 1:
        schedule = get_schedule_class(par.pipeline_parallel_schedule)
        parts = par.module_fqns_per_model_part
        per_rank = len(parts) // dims.pp
        assert len(parts) % dims.pp == 0
        assert per_rank == 1 if issubclass(schedule, PipelineScheduleSingle) else per_rank >= 2
        microbatches = training.local_batch_size // par.pipeline_parallel_microbatch_size
        assert microbatches == plan.config.grad_accum_steps
        layers = [f"layers.{i}" for i in range(plan.model.num_layers)]
        assert sum(parts, []) == ["tok_embeddings", *layers, "norm", "output"]


@pytest.mark.parametrize("config", [PLAN_3D_FSDP, PLAN_ZERO3_OFFLOAD],
                         ids=["3d-zero2", "zero3-cpu"])
def test_torchtitan_config_manager_loads_export(torchtitan, tmp_path, config):
    plan = for_target(make_plan(**config), "torchtitan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExportWarning)
        job = load_torchtitan(torchtitan, plan, tmp_path)
    check_torchtitan_job(torchtitan, job, plan)
    assert job.training.seq_len == 8192
    assert job.parallelism.tensor_parallel_degree == plan.config.tp
    assert job.activation_checkpoint.mode == plan.config.recompute


def test_torchtitan_config_manager_loads_interleaved_moe(torchtitan, tmp_path):
    plan = for_target(make_plan(model=QWEN3_30B_A3B, **PLAN_INTERLEAVED_MOE), "torchtitan")
    job = load_torchtitan(torchtitan, plan, tmp_path)
    check_torchtitan_job(torchtitan, job, plan)
    assert job.parallelism.pipeline_parallel_schedule == "Interleaved1F1B"


def test_torchtitan_config_manager_rejects_unknown_keys(torchtitan, tmp_path):
    """The manager really validates: a misspelt key fails."""
    plan = for_target(make_plan(dp=8, global_batch_size=64), "torchtitan")
    path = tmp_path / "job.toml"
    path.write_text(export.to_torchtitan(plan).replace("seq_len", "seq_length"))
    with pytest.raises(ValueError, match="seq_length"):
        torchtitan.ConfigManager().parse_args(["--job.config_file", str(path)])


@pytest.mark.parametrize("model", LLAMA3_FLAVOURS)
def test_torchtitan_builds_the_catalog_llama3_it_is_given(torchtitan, tmp_path, model):
    plan = for_target(make_plan(model=model, nodes=8, tp=8, pp=4, dp=2, zero_stage=3,
                                global_batch_size=64), "torchtitan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExportWarning)
        job = load_torchtitan(torchtitan, plan, tmp_path)
    check_torchtitan_job(torchtitan, job, plan)


TORCHTITAN_FAMILIES_LEFT_OUT = {
    "llama4": "shared experts in every MoE layer",
    "deepseek_v3": "shared experts and latent attention (MLA)",
    "gpt_oss": "attention sinks, alternating sliding windows, biased experts",
    "llama3_ft": "llama3's flavours, for fault-tolerant training",
    "flux": "a diffusion model",
}
"""torchtitan models ``export.TORCHTITAN_FLAVOURS`` leaves out: a ModelSpec describes none."""


def test_torchtitan_flavour_table_is_the_installed_torchtitans(torchtitan):
    """Every table entry builds, in the installed torchtitan, the architecture the export
    matches against; every sdpa flavour of a covered model is in the table; every model the
    table leaves out is known."""
    table = export.TORCHTITAN_FLAVOURS
    assert set(table) | set(TORCHTITAN_FAMILIES_LEFT_OUT) == set(torchtitan.models), \
        f"torchtitan {torchtitan.version} models changed"
    for name, flavours in table.items():
        installed = torchtitan.get_train_spec(name).model_args
        assert set(flavours) == {f for f, args in installed.items() if args.attn_type == "sdpa"}
        for flavour, args in flavours.items():
            expected = {**export.torchtitan_flavour_architecture(name, args)._asdict(),
                        "shared_experts": False}
            assert built_architecture(torchtitan, name, flavour) == expected, \
                (torchtitan.version, name, flavour)
    for name in ("llama4", "deepseek_v3"):
        moe_args = [args.moe_args for args in torchtitan.get_train_spec(name).model_args.values()]
        assert moe_args and all(moe.num_shared_experts > 0 for moe in moe_args)


def test_torchtitan_exports_its_checkpointing_settings(torchtitan, tmp_path):
    """The plan's every-Nth-block selective policy and early-stopping recomputation reach
    torchtitan's own config manager as its activation_checkpoint options."""
    layer = for_target(make_plan(**{**PLAN_ZERO3_OFFLOAD, "offload": "none",
                                    "recompute": "selective", "selective_ac": "2"}),
                       "torchtitan")
    job = load_torchtitan(torchtitan, layer, tmp_path)
    assert (job.activation_checkpoint.mode, job.activation_checkpoint.selective_ac_option) == \
        ("selective", "2")
    full = for_target(make_plan(**{**PLAN_ZERO3_OFFLOAD, "offload": "none",
                                   "recompute_early_stop": True}), "torchtitan")
    job = load_torchtitan(torchtitan, full, tmp_path)
    assert job.activation_checkpoint.mode == "full" and job.activation_checkpoint.early_stop
    plain = for_target(make_plan(**{**PLAN_ZERO3_OFFLOAD, "offload": "none"}), "torchtitan")
    assert not load_torchtitan(torchtitan, plain, tmp_path).activation_checkpoint.early_stop


# ----- torch.compile and float8 (ParallelConfig.compile, ParallelConfig.float8) -----------------
PLAN_COMPILED = {**PLAN_ZERO3_OFFLOAD, "offload": "none", "compile": "model+loss", "float8": True}
"""The ZeRO-3 plan with torchtitan's torch.compile of the blocks and the loss and float8
training of the blocks' linears (the cost model prices compile under torchtitan only)."""
TORCHTITAN_FLOAT8_TABLE = {"enable_fsdp_float8_all_gather": True,
                           "precompute_float8_dynamic_scale_for_fsdp": True,
                           "filter_fqns": ["output"]}
"""``[quantize.linear.float8]`` as the issue spells it (torchtitan 0.2.2's ``Float8Linear``)."""


def compiled_plan(target: str, **changes) -> Plan:
    """``PLAN_COMPILED`` (with ``changes``), costed for torchtitan, labelled for ``target``."""
    return for_target(make_plan(framework="torchtitan", **{**PLAN_COMPILED, **changes}), target)


def test_torchtitan_compile_and_float8_tables():
    text = quietly(export.to_torchtitan, compiled_plan("torchtitan"))
    data = tomllib.loads(text)
    assert data["model"] == {"name": "llama3", "flavor": "8B",
                             "converters": ["quantize.linear.float8"]}
    assert data["compile"] == {"enable": True, "components": ["model", "loss"]}
    assert data["quantize"] == {"linear": {"float8": TORCHTITAN_FLOAT8_TABLE}}
    assert "[quantize.linear.float8]" in text.splitlines()
    assert "[quantize]" not in text
    assert "recipe_name" not in text  # None: tensorwise, the only recipe with float8 all-gather
    assert data == quietly(export.torchtitan_sections, compiled_plan("torchtitan"))


def test_torchtitan_compile_of_the_blocks_only():
    data = tomllib.loads(quietly(export.to_torchtitan,
                                 compiled_plan("torchtitan", compile="model", float8=False)))
    assert data["compile"] == {"enable": True, "components": ["model"]}
    assert "quantize" not in data and "converters" not in data["model"]


def test_torchtitan_float8_head_empties_the_filter():
    """torchtitan 0.2.2 converts every linear its filter does not name: a float8 head is the
    table with an empty ``filter_fqns``."""
    data = tomllib.loads(quietly(export.to_torchtitan,
                                 compiled_plan("torchtitan", float8_head=True)))
    assert data["quantize"] == {"linear": {"float8": {**TORCHTITAN_FLOAT8_TABLE,
                                                      "filter_fqns": []}}}


def test_torchtitan_async_tp_where_the_plan_runs_tp():
    """``parallelism.enable_async_tensor_parallel`` follows the plan's async_tp where it has
    tensor parallelism (torchtitan ignores it without)."""
    tp = {"tp": 2, "dp": 4, "sp": True}
    plain = tomllib.loads(quietly(export.to_torchtitan, compiled_plan("torchtitan", **tp)))
    fused = tomllib.loads(quietly(export.to_torchtitan,
                                  compiled_plan("torchtitan", async_tp=True, **tp)))
    assert plain["parallelism"]["enable_async_tensor_parallel"] is False
    assert fused["parallelism"]["enable_async_tensor_parallel"] is True
    assert fused["parallelism"]["tensor_parallel_degree"] == 2


def test_megatron_refuses_a_float8_head():
    with pytest.raises(ValueError, match="output layer stays bf16"):
        quietly(export.to_megatron, compiled_plan("megatron", compile="none", float8_head=True))


def test_megatron_float8_is_hybrid_tensorwise():
    args = quietly(export.to_megatron, compiled_plan("megatron", compile="none"))
    flags = flag_values(args)
    assert (flags["--fp8-format"], flags["--fp8-recipe"]) == ("hybrid", "tensorwise")
    plain = quietly(export.to_megatron, for_target(make_plan(**PLAN_ZERO3_OPTIMIZER_OFFLOAD),
                                                  "megatron"))
    assert not any(arg.startswith("--fp8") for arg in plain)


def test_megatron_leaves_compile_out_with_a_warning():
    plan = compiled_plan("megatron", float8=False)
    with pytest.warns(ExportWarning, match="Megatron-LM has no torch.compile switch .* "
                                           "compile 'model\\+loss' is left out"):
        args = export.to_megatron(plan)
    assert args == quietly(export.to_megatron,
                           dataclasses.replace(plan, config=plan.config.replace(compile="none")))


def test_deepspeed_refuses_float8_before_any_warning():
    plan = make_plan(framework="torchtitan", **PLAN_COMPILED)  # also a framework mismatch
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExportWarning)
        with pytest.raises(ValueError, match="DeepSpeed's config has no float8 training switch"):
            export.to_deepspeed(plan)


def test_deepspeed_leaves_compile_to_the_training_script():
    plan = compiled_plan("deepspeed", float8=False)
    with pytest.warns(ExportWarning, match=r"call engine\.compile\(\) after deepspeed\.initialize"):
        data = export.to_deepspeed(plan)
    assert "compile" not in data
    assert data == quietly(export.to_deepspeed,
                           dataclasses.replace(plan, config=plan.config.replace(compile="none")))


def test_cli_export_of_a_float8_plan(capsys, tmp_path):
    path = tmp_path / "plan.json"
    write_plan(make_plan(framework="torchtitan", **PLAN_COMPILED), path)
    line = usage_error("export", path, "--to", "deepspeed")
    assert line.startswith("meshplan: error: DeepSpeed's config has no float8 training switch")
    assert cli.main(["export", str(path), "--to", "megatron"]) == 0
    out, err = capsys.readouterr()
    assert flag_values(shlex.split(out))["--fp8-recipe"] == "tensorwise"
    assert any(line.startswith("meshplan: warning: Megatron-LM has no torch.compile switch")
               for line in err.splitlines())
    assert cli.main(["export", str(path), "--to", "torchtitan"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["compile"]["enable"] is True


def test_torchtitan_config_manager_loads_compile_and_float8(torchtitan, tmp_path):
    plan = compiled_plan("torchtitan")
    job = load_torchtitan(torchtitan, plan, tmp_path)
    check_torchtitan_job(torchtitan, job, plan)
    assert (job.compile.enable, job.compile.components) == (True, ["model", "loss"])
    assert job.model.converters == ["quantize.linear.float8"]
    float8 = job.quantize.linear.float8
    assert (float8.enable_fsdp_float8_all_gather, float8.precompute_float8_dynamic_scale_for_fsdp,
            float8.filter_fqns, float8.recipe_name) == (True, True, ["output"], None)


def test_torchtitan_config_manager_rejects_a_misspelt_float8_key(torchtitan, tmp_path):
    """The manager checks nested tables too: a misspelt float8 key fails."""
    path = tmp_path / "job.toml"
    path.write_text(export.to_torchtitan(compiled_plan("torchtitan")).replace(
        "filter_fqns", "filter_fqn"))
    with pytest.raises(ValueError, match="filter_fqn"):
        torchtitan.ConfigManager().parse_args(["--job.config_file", str(path)])


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_megatron_core_builds_float8_configs_from_export(megatron):
    plan = compiled_plan("megatron", compile="none")
    transformer = megatron(export.to_megatron(plan), world_size=8)["transformer"]
    assert (transformer.fp8, transformer.fp8_recipe) == ("hybrid", "tensorwise")


def test_deepspeed_parser_loads_the_export_of_a_compiled_plan(deepspeed_config):
    """What the export leaves out turns nothing on: DeepSpeed's compile section stays at its
    defaults (no DeepCompile) until the training script calls engine.compile()."""
    with pytest.warns(ExportWarning, match="engine.compile"):
        data = export.to_deepspeed(compiled_plan("deepspeed", float8=False))
    parsed = deepspeed_config(data, 8)
    assert parsed.zero_optimization_stage == 3 and not parsed.compile_config.deepcompile


def test_torchtitan_refuses_a_float8_plan_for_the_cpu():
    """The cost model prices float8 on the CPU (torch runs float8 GEMMs there), but
    torchtitan 0.2.2's float8 converter raises without a GPU of compute capability 8.9+
    (or emulation without compile): the export says so in one line."""
    config = ParallelConfig(dp=2, zero_stage=3, dtype="bf16", float8=True, micro_batch_size=1,
                            global_batch_size=2, seq_len=64)
    est = estimate(load_model("llama3-8b"), load_cluster("cpu", nodes=1, gpus_per_node=2),
                   config, framework="torchtitan")
    plan = Plan.from_estimate(est, provenance={"solver": "test"})
    with pytest.raises(ValueError, match="float8 only on GPUs of compute capability 8.9"):
        export.to_torchtitan(plan)
    gpu = make_plan(framework="torchtitan", dp=8, zero_stage=3, dtype="bf16", float8=True,
                    micro_batch_size=1, global_batch_size=8, seq_len=64)
    assert "quantize" in tomllib.loads(quietly(export.to_torchtitan, gpu))


# ----- random plans: every export parses, or the export refuses it in one line ------------------
@st.composite
def _random_plans(draw, target: str):
    """A random plan on one to four DGX H100 nodes, costed for ``target`` (what ``meshplan plan
    --framework target -o`` writes): degrees, ZeRO, offload, recompute, interleaving, SP and
    sequence length drawn; models whose architecture the targets take and some they refuse."""
    model = load_model(draw(st.sampled_from(("llama3-8b", "llama3-70b", "llama2-7b",
                                             "gpt3-1.3b", "mixtral-8x7b", "bloom-176b"))))
    nodes = draw(st.sampled_from([1, 2, 4]))
    world = 8 * nodes
    tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if world % t == 0]))
    pp = draw(st.sampled_from([p for p in (1, 2, 4) if (world // tp) % p == 0]))
    cp = draw(st.sampled_from([c for c in (1, 2) if (world // (tp * pp)) % c == 0]))
    dp = world // (tp * pp * cp)
    ep = (draw(st.sampled_from([e for e in (1, 2, 4) if (dp * cp) % e == 0]))
          if model.is_moe else 1)
    zero = draw(st.integers(0, 3))
    mb, m = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 4, 8]))
    try:
        config = ParallelConfig(
            tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, sp=tp > 1 and draw(st.booleans()),
            zero_stage=zero, offload=draw(st.sampled_from(
                ["none", "optimizer"] + (["optimizer+params"] if zero == 3 else []))),
            recompute=draw(st.sampled_from(("none", "selective", "full"))),
            micro_batch_size=mb, global_batch_size=dp * mb * m,
            vpp=2 if pp > 1 and draw(st.booleans()) else 1,
            seq_len=draw(st.sampled_from([2048, 8192])))
        est = estimate(model, load_cluster("dgx-h100", nodes=nodes), config, framework=target)
    except ValueError:
        reject()
    return for_target(Plan.from_estimate(est, provenance={"solver": "test"}), target)


def _exported_or_refused(render, plan: Plan):
    """``render(plan)``, or None where the export refuses the plan with one line that names
    what the target cannot run."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExportWarning)
            return render(plan)
    except ValueError as err:
        assert str(err) and "\n" not in str(err), str(err)
        return None


RANDOM_EXPORTS = settings(max_examples=40, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.function_scoped_fixture])
"""The same 40 draws every run (of the plans that cost, 21 DeepSpeed, 34 Megatron-LM and 6
torchtitan exports load in their parsers, the rest are refused in one line): the three
targets' parsers over degrees, ZeRO, offload, interleaving, SP and CP at once, beside the
fixed plans above. A randomised run of 400 plans (2026-12-07) found no export a parser
rejected."""


@RANDOM_EXPORTS
@given(plan=_random_plans("deepspeed"))
def test_random_plans_export_to_configs_deepspeed_loads(deepspeed_config, plan):
    data = _exported_or_refused(export.to_deepspeed, plan)
    if data is not None:
        parsed = deepspeed_config(data, plan.config.dp)
        assert parsed.train_batch_size == plan.config.global_batch_size


@pytest.mark.filterwarnings("ignore::UserWarning")
@RANDOM_EXPORTS
@given(plan=_random_plans("megatron"))
def test_random_plans_export_to_arguments_megatron_core_builds(megatron, plan):
    args = _exported_or_refused(export.to_megatron, plan)
    if args is not None:
        built = megatron(args, world_size=plan.config.world_size)
        assert built["batches"].get() == plan.config.grad_accum_steps


@RANDOM_EXPORTS
@given(plan=_random_plans("torchtitan"))
def test_random_plans_export_to_jobs_torchtitan_loads(torchtitan, tmp_path_factory, plan):
    if _exported_or_refused(export.to_torchtitan, plan) is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExportWarning)
            job = load_torchtitan(torchtitan, plan, tmp_path_factory.mktemp("job"))
        check_torchtitan_job(torchtitan, job, plan)
