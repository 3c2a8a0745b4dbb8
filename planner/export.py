"""Write a ``Plan`` as the configuration of the framework that will run it.

Three pure functions, one per target, and ``render`` for the command line:

* ``to_deepspeed``: a DeepSpeed config dict (``deepspeed.initialize(config=...)``; 0.19);
* ``to_megatron``: Megatron-LM ``pretrain_gpt.py`` arguments (core_r0.16 names);
* ``to_torchtitan``: a torchtitan ``JobConfig`` TOML (``--job.config_file``; torchtitan 0.2),
  naming the torchtitan flavour with the plan's architecture (``TORCHTITAN_FLAVOURS``).
  torchtitan 0.3 reads no TOML: its configs are Python ``config_registry`` functions chosen
  with ``--module``/``--config`` and overridden by ``--section.key`` flags. The ``[training]``
  and ``[parallelism]`` keys written here are also 0.3's ``--training.*``/``--parallelism.*``
  names, except ``enable_async_tensor_parallel`` (0.3: ``--compile.*``); ``[model]`` and
  ``[activation_checkpoint]`` changed shape in 0.3.

How each target gets the plan's choices:

* A choice the target cannot make raises ``ValueError`` naming the choice and what the target
  accepts (the CLI prints it as one line and exits 2).
* A choice the target can only approximate is approximated in the direction that holds no more
  GPU memory than planned (a stronger recompute mode, more sharding or offload), and the
  export says so with an ``ExportWarning``; so does a choice that is set outside the target's
  config, and a plan costed for another framework's memory layout. The CLI prints each as
  ``meshplan: warning: ...``.

Per-stage recompute lists map to the strongest mode of the list for every target: none of them
takes a recompute mode per pipeline stage (Megatron's ``--recompute-num-layers`` is one count
for all stages).

The run settings ``compile`` (torch.compile) and ``float8`` (float8 training of the blocks'
linears) are modelled as torchtitan runs them: torchtitan gets its own switches; Megatron-LM
gets its float8 recipe and leaves compile out (a warning); DeepSpeed leaves compile to the
training script (a warning) and refuses float8.
"""

from __future__ import annotations

import json
import shlex
import warnings
from typing import Any, NamedTuple

from meshplan.costmodel import ModelSpec, ParallelConfig
from meshplan.costmodel.config import CPU_DEVICE_KEY, MESH_AXES, RECOMPUTE_MODES
from meshplan.costmodel.frameworks import cp_exchange
from meshplan.costmodel.layout import (FRAMEWORK_MESH_ORDERS, deepspeed_partition_method,
                                       framework_layout_error)
from meshplan.planner.plan import Plan

TARGETS = ("deepspeed", "megatron", "torchtitan")
MEGATRON_TP_PP_DP_ORDER = ("tp", "cp", "pp", "dp")
"""Megatron-LM's other layout, chosen with ``--use-tp-pp-dp-mapping``."""
NVME_PATH_PLACEHOLDER = "/local_nvme"
"""DeepSpeed's ``nvme_path``: a placeholder for the node-local NVMe mount to fill in."""
SAME_MEMORY_ACCOUNTING = {"deepspeed": ("deepspeed",), "megatron": ("megatron",),
                          "torchtitan": ("torchtitan", "meshplan")}
"""Plan frameworks whose cost-model memory layout is the target's (costmodel.frameworks)."""
TORCHTITAN_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
"""Plan dtype -> torchtitan ``mixed_precision_param`` (torchtitan has no fp16 training)."""


class ExportWarning(UserWarning):
    """The export differs from the plan where the target cannot follow it exactly."""


def _warn(message: str) -> None:
    warnings.warn(message, ExportWarning, stacklevel=3)


# ----- shared ------------------------------------------------------------------------------------

def recompute_mode(plan: Plan, *, target: str) -> str:
    """The plan's recompute mode; a per-stage list maps to its strongest mode, with a warning."""
    modes = plan.config.recompute
    if isinstance(modes, str):
        return modes
    strongest = max(modes, key=RECOMPUTE_MODES.index)
    if len(set(modes)) > 1:
        _warn(f"{target} takes one recompute mode for all pipeline stages; the plan's per-stage "
              f"{list(modes)} is exported as {strongest!r} (less memory, more compute)")
    return strongest


def stage_layers(plan: Plan) -> tuple[int, ...]:
    return plan.config.stage_layers(plan.model.num_layers)


def model_part_layers(layers_per_stage: tuple[int, ...], vpp: int) -> list[int]:
    """Layers of each model part (virtual stage) in model order, for the looped schedule.

    Part ``k`` is chunk ``k // pp`` of stage ``k % pp`` (Megatron-LM and torch.distributed
    pipelining place virtual stages round-robin). A stage's layers are split into ``vpp``
    chunks as evenly as possible, the first chunks taking the remainder. Example: stages
    (3, 4), vpp 2 -> chunks (2, 1) and (2, 2) -> parts [2, 2, 1, 2].
    """
    pp = len(layers_per_stage)
    chunks = [[n // vpp + (1 if c < n % vpp else 0) for c in range(vpp)]
              for n in layers_per_stage]
    return [chunks[k % pp][k // pp] for k in range(pp * vpp)]


def _check_framework(plan: Plan, target: str) -> None:
    if plan.framework not in SAME_MEMORY_ACCOUNTING[target]:
        _warn(f"the plan's memory was estimated for framework {plan.framework!r}, which "
              f"allocates differently from {target}; check that it fits with "
              f"`meshplan estimate --framework {target}` and the plan's degrees")


def _check_not_traced(plan: Plan, target: str) -> None:
    """Megatron-LM and torchtitan build their own transformer from its shape; a traced module
    has no such shape (export it to DeepSpeed, which wraps the user's own module)."""
    if plan.model.is_traced:
        raise ValueError(f"{plan.model.name} is a traced module ({plan.model.factory}); "
                         f"{target} builds its own transformer and cannot run it: export to "
                         f"deepspeed instead")


def _check_layout(plan: Plan, target: str) -> None:
    """ValueError for a layout ``target`` cannot run (``layout.framework_layout_error``: the
    rule the planner searches under, so a plan made for ``target`` always passes)."""
    refusal = framework_layout_error(target, plan.config, plan.model)
    if refusal is not None:
        raise ValueError(refusal)


def _check_mesh_order(plan: Plan, target: str, supported: tuple[tuple[str, ...], ...]) -> None:
    if plan.config.mesh_order not in supported:
        _warn(f"{target} cannot lay ranks out as {','.join(plan.config.mesh_order)} "
              f"(fastest-varying first); it uses {','.join(supported[0])}, so communication "
              f"times may differ from the prediction")


# ----- DeepSpeed ---------------------------------------------------------------------------------

def to_deepspeed(plan: Plan) -> dict[str, Any]:
    """A DeepSpeed config dict: batch sizes, precision, ZeRO and offload, checkpointing, pipeline.

    DeepSpeed's data-parallel world is ``dp`` (it divides the world by tensor, pipeline and
    sequence parallel degrees), so ``train_batch_size = micro x accumulation x dp``. Tensor
    parallel maps to DeepSpeed's AutoTP (``tensor_parallel.autotp_size``); context parallel to
    DeepSpeed-Ulysses (``sequence_parallel_size``); pipeline stages to the ``pipeline`` section,
    which DeepSpeed's ``PipelineModule`` / ``PipelineEngine`` read. Which layers the model code
    wraps in ``deepspeed.checkpointing.checkpoint`` (selective or full) stays the model's choice.
    Float8 training raises ValueError and torch.compile is left to the training script
    (``_check_deepspeed_settings``).
    """
    config = plan.config
    _check_deepspeed_settings(config)
    _check_framework(plan, "deepspeed")
    _check_mesh_order(plan, "deepspeed", FRAMEWORK_MESH_ORDERS["deepspeed"])
    _check_layout(plan, "deepspeed")
    data: dict[str, Any] = {
        "train_batch_size": config.global_batch_size,
        "train_micro_batch_size_per_gpu": config.micro_batch_size,
        "gradient_accumulation_steps": config.grad_accum_steps,
        "bf16": {"enabled": config.dtype == "bf16"},
        "fp16": {"enabled": config.dtype == "fp16"},
        "zero_optimization": _deepspeed_zero(config),
    }
    recompute = recompute_mode(plan, target="deepspeed")
    layers = stage_layers(plan)
    if recompute != "none":
        partition = config.tp > 1  # split saved checkpoints over the tensor-parallel ranks
        data["activation_checkpointing"] = {
            "partition_activations": partition,
            "contiguous_memory_optimization": partition,
            "number_checkpoints": max(layers),
            "cpu_checkpointing": False,
        }
    if config.pp > 1:
        data["pipeline"] = _deepspeed_pipeline(plan, layers, recompute)
    if config.tp > 1:
        data["tensor_parallel"] = {"autotp_size": config.tp}
    if config.cp > 1:
        data["sequence_parallel_size"] = config.cp
        exchange = cp_exchange(plan.framework, config.cp_comm_type)
        if exchange != "a2a":
            _warn(f"DeepSpeed splits the sequence with Ulysses all-to-all (sequence_parallel_"
                  f"size {config.cp}), not the {exchange} exchange the plan's cp {config.cp} "
                  f"was timed with under framework {plan.framework!r}")
    if config.ep > 1:
        _warn(f"DeepSpeed takes the expert-parallel degree in the model code, not the config: "
              f"build the MoE layers with deepspeed.moe.layer.MoE(..., ep_size={config.ep})")
    return data


def _check_deepspeed_settings(config: ParallelConfig) -> None:
    """ValueError for float8, a warning for compile: DeepSpeed 0.19's config has a switch for
    neither. Float8 training is Transformer Engine layers in the model code, not a config key;
    torch.compile is ``engine.compile()`` in the training script (the config's ``compile``
    section, ``deepspeed.compile.config.CompileConfig``, only tunes DeepCompile)."""
    if config.float8:
        raise ValueError("DeepSpeed's config has no float8 training switch (the plan sets "
                         "float8); export to torchtitan or megatron, or plan without --float8")
    if config.compile != "none":
        _warn(f"DeepSpeed's config has no torch.compile switch: call engine.compile() after "
              f"deepspeed.initialize in the training script (it compiles the whole module); "
              f"the plan's compile {config.compile!r} is left out of the export")
    _warn_attention_kernel(config, "DeepSpeed's config has no attention switch (the model "
                                   "code picks its kernel)")


def _deepspeed_zero(config: ParallelConfig) -> dict[str, Any]:
    """The ``zero_optimization`` section (the layout passed ``_check_layout``)."""
    zero: dict[str, Any] = {"stage": config.zero_stage}
    if config.offload == "none":
        return zero
    target = {"device": config.offload_device, "pin_memory": True}
    if config.offload_device == "nvme":
        target["nvme_path"] = NVME_PATH_PLACEHOLDER
    zero["offload_optimizer"] = dict(target)
    if config.offload == "optimizer+params":
        zero["offload_param"] = dict(target)
    return zero


def _deepspeed_pipeline(plan: Plan, layers: tuple[int, ...], recompute: str) -> dict[str, Any]:
    """``pipeline``: stages, the ``PipelineModule`` partition method that builds the plan's
    split (``layout.deepspeed_partition_method``; ``_check_layout`` refused any other) and the
    split itself, checkpoint interval (one schedule, no interleaving: ``_check_layout``).
    ``partition`` is advice: DeepSpeed's engine does not read it, the training script passes
    it to ``PipelineModule(partition_method=...)`` (``type`` as ``type:<block class>``), on a
    layer list of the embedding, the blocks, the final norm and the head (``uniform`` counts
    items: check the split it prints against ``layers_per_stage``)."""
    partition = deepspeed_partition_method(plan.model, layers)
    return {"stages": plan.config.pp, "partition": partition, "layers_per_stage": list(layers),
            "activation_checkpoint_interval": 1 if recompute == "full" else 0}


# ----- Megatron-LM -------------------------------------------------------------------------------

def to_megatron(plan: Plan) -> list[str]:
    """Megatron-LM arguments for ``pretrain_gpt.py``: model shape, degrees, batch, memory.

    ZeRO-1 is Megatron's distributed optimizer; ZeRO-2/3 are Megatron-FSDP with sharding
    strategy ``optim_grads`` / ``optim_grads_params`` and the flags Megatron-LM 0.16's
    Megatron-FSDP user guide lists with it: ``--no-gradient-accumulation-fusion`` and
    ``--ckpt-format fsdp_dtensor`` (``validate_args`` asserts that format under Megatron-FSDP;
    the guide also has ``CUDA_DEVICE_MAX_CONNECTIONS`` unset, which Megatron-LM's example
    launch scripts set to 1: an environment variable, left to the launch); optimizer offload
    is the hybrid CPU
    optimizer (``--optimizer-cpu-offload``, fraction 1). Megatron cannot offload parameters or
    offload to NVMe, use ALiBi or an embedding norm: those raise ValueError. Float8 training
    is ``MEGATRON_FLOAT8``; torch.compile has no Megatron-LM switch (a warning). Tokenizer,
    data and learning-rate arguments are left to the user.
    """
    model, config = plan.model, plan.config
    _check_not_traced(plan, "Megatron-LM")
    _check_framework(plan, "megatron")
    _check_mesh_order(plan, "megatron", (MESH_AXES, MEGATRON_TP_PP_DP_ORDER))
    _check_layout(plan, "megatron")
    args = _megatron_model(model, seq_len=config.seq_len)
    args += _megatron_parallel(plan)
    args += ["--micro-batch-size", str(config.micro_batch_size),
             "--global-batch-size", str(config.global_batch_size)]
    args += _megatron_recompute(recompute_mode(plan, target="megatron"))
    args += _megatron_zero(config)
    if config.dtype != "fp32":
        args.append(f"--{config.dtype}")
    args += _megatron_settings(config)
    if config.flash_attention:
        args.append("--use-flash-attn")
    return args


def _megatron_model(model: ModelSpec, *, seq_len: int) -> list[str]:
    """Architecture arguments (Megatron-LM ``_add_network_size_args`` and MoE arguments)."""
    if model.position_embedding == "alibi":
        raise ValueError(f"Megatron-LM has no ALiBi position embedding ({model.name}); it takes "
                         f"--position-embedding-type learned_absolute or rope")
    if model.embedding_norm:
        raise ValueError(f"Megatron-LM has no norm after the word embedding ({model.name} has "
                         f"embedding_norm true)")
    args = ["--num-layers", str(model.num_layers), "--hidden-size", str(model.hidden_size),
            "--ffn-hidden-size", str(model.ffn_hidden_size),
            "--num-attention-heads", str(model.num_heads)]
    if model.head_size != model.hidden_size // model.num_heads:
        args += ["--kv-channels", str(model.head_size)]
    if model.kv_heads != model.num_heads:
        args += ["--group-query-attention", "--num-query-groups", str(model.kv_heads)]
    args += ["--seq-length", str(seq_len),
             "--max-position-embeddings", str(max(seq_len, model.seq_len))]
    if model.activation == "swiglu":
        args.append("--swiglu")
    args += ["--normalization", "RMSNorm" if model.norm == "rmsnorm" else "LayerNorm",
             "--position-embedding-type",
             "rope" if model.position_embedding == "rope" else "learned_absolute"]
    if not model.tied_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    if not model.linear_bias:
        args.append("--disable-bias-linear")
        if model.qkv_bias:
            args.append("--add-qkv-bias")
    if model.qk_norm:
        args.append("--qk-layernorm")
    if not model.dropout:
        args += ["--attention-dropout", "0.0", "--hidden-dropout", "0.0"]
    if model.is_moe:
        args += ["--num-experts", str(model.num_experts),
                 "--moe-router-topk", str(model.moe_top_k)]
        if model.expert_ffn_size != model.ffn_hidden_size:
            args += ["--moe-ffn-hidden-size", str(model.expert_ffn_size)]
        if model.moe_layer_freq > 1:  # ModelSpec: the last layer of every group is MoE
            k, layers = model.moe_layer_freq, model.num_layers
            args += ["--moe-layer-freq",
                     f"([0]*{k - 1}+[1])*{layers // k}+[0]*{layers % k}"]
    return args


def _megatron_parallel(plan: Plan) -> list[str]:
    """Degrees, sequence parallelism, rank layout and the pipeline split."""
    config = plan.config
    args = ["--tensor-model-parallel-size", str(config.tp),
            "--pipeline-model-parallel-size", str(config.pp),
            "--context-parallel-size", str(config.cp)]
    if config.cp > 1:  # the exchange the plan was priced with (frameworks.cp_exchange)
        args += ["--cp-comm-type", cp_exchange("megatron", config.cp_comm_type)]
    if plan.model.is_moe:
        args += ["--expert-model-parallel-size", str(config.ep)]
    if config.sp and config.tp > 1:  # Megatron turns sequence parallelism off at tp 1
        args.append("--sequence-parallel")
        if config.tp_comm_overlap:  # Transformer Engine's TP overlap needs SP
            args.append("--tp-comm-overlap")
    if config.mesh_order == MEGATRON_TP_PP_DP_ORDER:
        args.append("--use-tp-pp-dp-mapping")
    return args + _megatron_pipeline_split(stage_layers(plan), config.vpp)


def _megatron_pipeline_split(layers: tuple[int, ...], vpp: int) -> list[str]:
    """The layer split: even, first/last stage different, or a full pipeline layout.

    Megatron splits evenly by default (``--num-layers-per-virtual-pipeline-stage`` with vpp);
    ``--decoder-first/last-pipeline-num-layers`` give the first and last stage their own count
    when the middle stages are equal (and, with vpp, every count divides by vpp). Any other
    split is a ``--pipeline-model-parallel-layout`` string, one ``|``-separated entry per
    virtual stage in model order, ``E`` the embedding, ``t`` a layer, ``L`` the loss:
    stages (19, 21, 21, 19) -> ``Et*19|t*21|t*21|t*19L``.
    """
    pp = len(layers)
    if pp == 1:
        return []
    parts = model_part_layers(layers, vpp)
    if len(set(parts)) == 1:
        return ["--num-layers-per-virtual-pipeline-stage", str(parts[0])] if vpp > 1 else []
    first, *middle, last = layers
    if len(set(middle)) <= 1 and all(n % vpp == 0 for n in layers):
        args = []
        if not middle or first != middle[0]:
            args += ["--decoder-first-pipeline-num-layers", str(first)]
        if not middle or last != middle[0]:
            args += ["--decoder-last-pipeline-num-layers", str(last)]
        if vpp > 1:
            args += ["--num-virtual-stages-per-pipeline-rank", str(vpp)]
        return args
    entries = [f"t*{n}" for n in parts]
    entries[0], entries[-1] = "E" + entries[0], entries[-1] + "L"
    return ["--pipeline-model-parallel-layout", "|".join(entries)]


def _megatron_recompute(mode: str) -> list[str]:
    if mode == "full":  # every layer recomputed, one at a time
        return ["--recompute-granularity", "full", "--recompute-method", "uniform",
                "--recompute-num-layers", "1"]
    if mode == "selective":
        return ["--recompute-granularity", "selective"]
    return []


MEGATRON_FLOAT8 = ("--fp8-format", "hybrid", "--fp8-recipe")
"""The plan's float8 training in Megatron-LM core_r0.16 (``_add_transformer_engine_args``:
``--fp8-format`` {e4m3, hybrid}, dest ``fp8``; ``--fp8-recipe`` {tensorwise, delayed, mxfp8,
blockwise}; megatron-core's ``TransformerConfig.fp8`` / ``fp8_recipe``), followed by the plan's
``float8_recipe``: hybrid is e4m3 for activations and weights, e5m2 for gradients, as
torchao's Float8Linear; tensorwise (the default) is per-tensor current scaling, as
torchtitan's default recipe, delayed Transformer Engine's delayed scaling. Transformer Engine
runs it, on the blocks' linears only (the output layer stays bf16, as the plan's LM head)."""


def _warn_attention_kernel(config: ParallelConfig, why: str) -> None:
    """A warning where the plan was priced with an attention kernel the target does not run
    (``ParallelConfig.attention_kernel``): its step time was the kernel's."""
    if config.attention_kernel != "auto":
        _warn(f"{why}; the plan's step was priced with the {config.attention_kernel} attention "
              f"kernel, which the export leaves out")


def _megatron_settings(config: ParallelConfig) -> list[str]:
    """Float8 training (``MEGATRON_FLOAT8``) and the fused cross entropy; torch.compile is
    left out with a warning: Megatron-LM has no switch for it and fuses its own kernels
    instead."""
    if config.compile != "none":
        _warn(f"Megatron-LM has no torch.compile switch (it runs its own fused kernels: bias "
              f"and activation, RoPE, cross entropy); the plan's compile {config.compile!r} is "
              f"left out of the export")
    _warn_attention_kernel(config, "Megatron-LM runs its own fused attention (--use-flash-attn "
                                   "or Transformer Engine's)")
    if config.float8_head:
        raise ValueError("Megatron-LM runs float8 on the transformer layers' linears only (its "
                         "output layer stays bf16); plan without --float8-head, or export to "
                         "torchtitan")
    fused_loss = ["--cross-entropy-loss-fusion"] if config.cross_entropy_fusion else []
    float8 = [*MEGATRON_FLOAT8, config.float8_recipe] if config.float8 else []
    return float8 + fused_loss


def _megatron_zero(config: ParallelConfig) -> list[str]:
    """ZeRO stage, data-parallel overlap and optimizer offload (the layout passed
    ``_check_layout``)."""
    args = []
    if config.zero_stage >= 1:
        args.append("--use-distributed-optimizer")
    if config.overlap_comm and config.zero_stage <= 1 and config.dp * config.cp > 1:
        # the data-parallel overlap the cost model prices (ParallelConfig.overlap_comm);
        # Megatron-LM asserts --overlap-param-gather only with the distributed optimizer and
        # --overlap-grad-reduce
        args.append("--overlap-grad-reduce")
        if config.zero_stage == 1:
            args.append("--overlap-param-gather")
    if config.zero_stage >= 2:
        strategy = "optim_grads" if config.zero_stage == 2 else "optim_grads_params"
        args += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy,
                 "--no-gradient-accumulation-fusion", "--ckpt-format", "fsdp_dtensor"]
    if config.offload == "optimizer":
        args += ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.0",
                 "--use-precision-aware-optimizer"]
    return args


# ----- torchtitan --------------------------------------------------------------------------------

TORCHTITAN_VERSION = "0.2.2"
"""The torchtitan release whose flavours ``TORCHTITAN_FLAVOURS`` copies."""
TORCHTITAN_FLAVOURS: dict[str, dict[str, dict[str, Any]]] = {
    # torchtitan 0.2.2 torchtitan/models/llama3/__init__.py, ``llama3_args`` (the sdpa flavours;
    # ``*_flex*``/``*_varlen`` are the same shapes with other attention kernels). Defaults:
    # llama3/model/args.py ``TransformerModelArgs`` (n_kv_heads None = n_heads, vocab_size
    # 128256, multiple_of 256, ffn_dim_multiplier None); untied embeddings, head dim
    # dim / n_heads (llama3/model/model.py).
    "llama3": {
        "debugmodel": {"dim": 256, "n_layers": 6, "n_heads": 16, "vocab_size": 2048},
        "8B": {"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8,
               "ffn_dim_multiplier": 1.3, "multiple_of": 1024},
        "70B": {"dim": 8192, "n_layers": 80, "n_heads": 64, "n_kv_heads": 8,
                "ffn_dim_multiplier": 1.3, "multiple_of": 4096},
        "405B": {"dim": 16384, "n_layers": 126, "n_heads": 128, "n_kv_heads": 8,
                 "ffn_dim_multiplier": 1.2, "multiple_of": 4096},
    },
    # torchtitan 0.2.2 torchtitan/models/qwen3/__init__.py, ``qwen3_args``: the shape arguments,
    # with ``moe_args``' num_experts and top_k flattened (enable_weight_tying defaults to False
    # in qwen3/model/args.py). MoE flavours have an MoE block in every layer (hidden_dim unused)
    # and no shared experts.
    "qwen3": {
        "debugmodel": {"vocab_size": 2048, "head_dim": 128, "dim": 256, "n_layers": 8,
                       "n_heads": 16, "n_kv_heads": 8, "qk_norm": True, "hidden_dim": 3072,
                       "enable_weight_tying": True},
        "0.6B": {"vocab_size": 151936, "head_dim": 128, "dim": 1024, "n_layers": 28,
                 "n_heads": 16, "n_kv_heads": 8, "qk_norm": True, "hidden_dim": 3072,
                 "enable_weight_tying": True},
        "1.7B": {"vocab_size": 151936, "head_dim": 128, "dim": 2048, "n_layers": 28,
                 "n_heads": 16, "n_kv_heads": 8, "qk_norm": True, "hidden_dim": 6144,
                 "enable_weight_tying": True},
        "4B": {"vocab_size": 151936, "head_dim": 128, "dim": 2560, "n_layers": 36,
               "n_heads": 32, "n_kv_heads": 8, "qk_norm": True, "hidden_dim": 9728,
               "enable_weight_tying": True},
        "8B": {"vocab_size": 151936, "head_dim": 128, "dim": 4096, "n_layers": 36,
               "n_heads": 32, "n_kv_heads": 8, "qk_norm": True, "hidden_dim": 12288},
        "14B": {"vocab_size": 151936, "head_dim": 128, "dim": 5120, "n_layers": 40,
                "n_heads": 40, "n_kv_heads": 8, "qk_norm": True, "hidden_dim": 17408},
        "32B": {"vocab_size": 151936, "head_dim": 128, "dim": 5120, "n_layers": 64,
                "n_heads": 64, "n_kv_heads": 8, "qk_norm": True, "hidden_dim": 25600},
        "debugmodel_moe": {"vocab_size": 2048, "head_dim": 128, "dim": 256, "n_layers": 8,
                           "n_heads": 16, "n_kv_heads": 8, "qk_norm": True,
                           "moe_inter_dim": 768, "num_experts": 64, "top_k": 8},
        "30B-A3B": {"vocab_size": 151936, "head_dim": 128, "dim": 2048, "n_layers": 48,
                    "n_heads": 32, "n_kv_heads": 4, "qk_norm": True, "moe_inter_dim": 768,
                    "num_experts": 128, "top_k": 8},
        "235B-A22B": {"vocab_size": 151936, "head_dim": 128, "dim": 4096, "n_layers": 94,
                      "n_heads": 64, "n_kv_heads": 4, "qk_norm": True, "moe_inter_dim": 1536,
                      "num_experts": 128, "top_k": 8},
    },
    # Not here: llama4 and deepseek_v3 (every MoE layer has shared experts, and deepseek_v3 has
    # latent attention), gpt_oss (attention sinks, alternating sliding windows), llama3_ft
    # (llama3's flavours), flux (not a decoder); a ModelSpec describes none of these.
}
"""torchtitan model name -> flavour -> its shape arguments, as torchtitan's source spells them."""


class TorchtitanArchitecture(NamedTuple):
    """The numbers that tell torchtitan flavours apart, and a ModelSpec's for comparison."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    ffn: int
    """Dense MLP inner width; 0 when every layer is MoE."""
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    tied: bool = False
    qk_norm: bool = False

    def describe(self, fields: tuple[str, ...] | None = None) -> str:
        """``hidden 4096, 32 layers, ...``: the given fields, or those that are set."""
        if fields is None:
            fields = tuple(f for f in self._fields if getattr(self, f))
        return ", ".join(_ARCHITECTURE_LABELS[f](getattr(self, f)) for f in fields)


_ARCHITECTURE_LABELS = {
    "hidden": "hidden {}".format, "layers": "{} layers".format, "heads": "{} heads".format,
    "kv_heads": "{} kv heads".format, "head_dim": "head dim {}".format,
    "vocab": "vocab {}".format, "ffn": "ffn {}".format, "experts": "{} experts".format,
    "top_k": "top-{}".format, "expert_ffn": "expert ffn {}".format,
    "tied": lambda tied: "tied embeddings" if tied else "untied embeddings",
    "qk_norm": lambda norm: "query/key norms" if norm else "no query/key norms",
}


def llama3_ffn_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """torchtitan llama3's MLP inner width (llama3/model/model.py ``FeedForward``, hidden_dim
    ``4 * dim``): 2/3 of it, times the multiplier, rounded up to ``multiple_of``."""
    hidden_dim = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden_dim = int(ffn_dim_multiplier * hidden_dim)
    return multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)


def torchtitan_flavour_architecture(name: str, args: dict[str, Any]) -> TorchtitanArchitecture:
    """The architecture torchtitan builds from a ``TORCHTITAN_FLAVOURS`` entry."""
    dim, heads = args["dim"], args["n_heads"]
    kv_heads = args.get("n_kv_heads") or heads
    if name == "llama3":
        return TorchtitanArchitecture(
            dim, args["n_layers"], heads, kv_heads, dim // heads, args.get("vocab_size", 128256),
            llama3_ffn_dim(dim, args.get("multiple_of", 256), args.get("ffn_dim_multiplier")))
    moe = "num_experts" in args
    return TorchtitanArchitecture(
        dim, args["n_layers"], heads, kv_heads, args["head_dim"], args["vocab_size"],
        0 if moe else args["hidden_dim"], args.get("num_experts", 0), args.get("top_k", 0),
        args.get("moe_inter_dim", 0) if moe else 0, args.get("enable_weight_tying", False),
        args.get("qk_norm", False))


def model_architecture(model: ModelSpec) -> TorchtitanArchitecture:
    """A ModelSpec's numbers in ``TorchtitanArchitecture`` form (vocabulary before padding)."""
    moe = model.is_moe
    return TorchtitanArchitecture(
        model.hidden_size, model.num_layers, model.num_heads, model.kv_heads, model.head_size,
        model.vocab_size, model.ffn_hidden_size if model.num_moe_layers < model.num_layers else 0,
        model.num_experts if moe else 0, model.moe_top_k if moe else 0,
        model.expert_ffn_size if moe else 0, model.tied_embeddings, model.qk_norm)


def torchtitan_flavour(model: ModelSpec) -> tuple[str, str]:
    """The torchtitan (model name, flavour) that builds ``model``; ValueError when none does.

    torchtitan's llama3 and qwen3 are SwiGLU, RMSNorm, RoPE decoders without biases; a flavour
    matches when every ``TorchtitanArchitecture`` number is equal, qwen3's query and key norms
    (``ModelSpec.qk_norm``) among them. RoPE and norm settings are the flavour's (no effect on
    the plan's costs).
    """
    unlike = [what for what, differs in (
        (f"{model.activation} MLP", model.activation != "swiglu"),
        (model.norm, model.norm != "rmsnorm"),
        (f"{model.position_embedding} positions", model.position_embedding != "rope"),
        ("linear biases", model.linear_bias), ("Q/K/V biases", model.qkv_bias),
        ("a norm after the embedding", model.embedding_norm),
        (f"sliding-window attention ({model.sliding_window})", model.sliding_window is not None),
    ) if differs]
    if unlike:
        raise ValueError(f"torchtitan {TORCHTITAN_VERSION}'s "
                         f"{' and '.join(TORCHTITAN_FLAVOURS)} decoders are SwiGLU, RMSNorm and "
                         f"RoPE without biases; {model.name} has {', '.join(unlike)}: export to "
                         f"megatron or deepspeed")
    want = model_architecture(model)
    candidates = [(name, flavour, torchtitan_flavour_architecture(name, args))
                  for name, flavours in TORCHTITAN_FLAVOURS.items()
                  for flavour, args in flavours.items()]
    for name, flavour, have in candidates:
        if have == want:
            return name, flavour
    same_kind = [(name, flavour, have) for name, flavour, have in candidates
                 if bool(have.experts) == bool(want.experts)]
    listing = "; ".join(
        f"{name} " + ", ".join(flavour for n, flavour, _ in same_kind if n == name)
        for name in dict.fromkeys(name for name, _, _ in same_kind))
    if want.experts:
        listing += " (llama4's and deepseek_v3's have shared experts)"
    raise ValueError(f"torchtitan {TORCHTITAN_VERSION} has no flavour with {model.name}'s "
                     f"architecture ({want.describe()}){_nearest(want, same_kind)}; its "
                     f"{'MoE' if want.experts else 'dense'} flavours: {listing}; register one "
                     f"with these numbers (torchtitan/models/*/__init__.py) to train it there, "
                     f"or export to megatron or deepspeed")


def _nearest(want: TorchtitanArchitecture,
             candidates: list[tuple[str, str, TorchtitanArchitecture]]) -> str:
    """``; nearest: <name> <flavour> (its differing numbers)`` when one differs in at most two."""
    best = None
    for name, flavour, have in candidates:
        differ = tuple(f for f, a, b in zip(have._fields, have, want) if a != b)
        if len(differ) <= 2 and (best is None or len(differ) < len(best[2])):
            best = (name, flavour, differ, have)
    if best is None:
        return ""
    name, flavour, differ, have = best
    return f"; nearest: {name} {flavour} ({have.describe(differ)})"


TORCHTITAN_COMPILE_COMPONENTS = {"model": ("model",), "model+loss": ("model", "loss")}
"""Plan compile mode -> torchtitan 0.2.2 ``[compile] components`` (``config.job_config.Compile``;
``model`` compiles each transformer block, ``loss`` the loss function)."""
TORCHTITAN_FLOAT8_CONVERTER = "quantize.linear.float8"
"""torchtitan 0.2.2's model converter for float8 linears (``components/quantization/float8.py``
``register_model_converter(Float8LinearConverter, "quantize.linear.float8")``)."""
TORCHTITAN_FLOAT8 = {"enable_fsdp_float8_all_gather": True,
                     "precompute_float8_dynamic_scale_for_fsdp": True,
                     "filter_fqns": ("output",)}
"""``[quantize.linear.float8]`` (``config.job_config.Float8Linear``): tensorwise dynamic scaling
(no ``recipe_name``, which torchtitan refuses next to the float8 all-gather), FSDP2 all-gathers
the weights in float8 with their scales computed once per step, and the LM head ``output``
stays in bf16 (``filter_fqns``) unless the plan sets ``float8_head``, whose table leaves the
filter empty (torchtitan's default). torchtitan turns the all-gather off itself without FSDP
(dp shard 1)."""


def to_torchtitan(plan: Plan) -> str:
    """A torchtitan JobConfig TOML (``--job.config_file``): job, model, training, parallelism.

    ``[model]`` is the torchtitan model and flavour that build the plan's model
    (``torchtitan_flavour``; ValueError when there is none). torch.compile is ``[compile]``
    (``TORCHTITAN_COMPILE_COMPONENTS``); float8 training is the ``[model] converters`` entry
    ``quantize.linear.float8`` with its ``[quantize.linear.float8]`` table (``TORCHTITAN_FLOAT8``).

    torchtitan's ``local_batch_size`` is what one data-parallel rank takes per optimizer
    micro-step and pipeline micro-batches are cut from it, so with pp > 1 it is the whole
    per-replica batch (``micro x accumulation``) cut into ``pipeline_parallel_microbatch_size``
    pieces (one schedule per step, as the plan times it); with pp = 1 it is the micro-batch and
    torchtitan accumulates ``global / (local x dp)`` steps.
    """
    _check_not_traced(plan, "torchtitan")
    sections = torchtitan_sections(plan)
    lines = [f"# meshplan export: {plan.model.name} on {plan.cluster.name}, "
             f"{plan.config.world_size} GPUs (torchtitan JobConfig, --job.config_file)"]
    for name, values in sections.items():
        lines += _toml_table(name, values)
    return "\n".join(lines) + "\n"


def torchtitan_sections(plan: Plan) -> dict[str, dict[str, Any]]:
    """The TOML's tables as dicts (what ``tomllib`` reads back from ``to_torchtitan``)."""
    model, config = plan.model, plan.config
    name, flavour = torchtitan_flavour(model)
    if model.dropout:
        _warn(f"torchtitan's {name} has no dropout; {model.name} was planned with dropout (the "
              f"export holds less activation memory than planned)")
    _check_framework(plan, "torchtitan")
    _check_mesh_order(plan, "torchtitan", FRAMEWORK_MESH_ORDERS["torchtitan"])
    _check_layout(plan, "torchtitan")
    if config.dtype not in TORCHTITAN_DTYPES:
        raise ValueError(f"torchtitan trains in bf16 or fp32, not {config.dtype}; "
                         f"use dtype bf16 or fp32")
    if config.cross_entropy_fusion and config.tp == 1:  # under TP it priced nothing
        raise ValueError("torchtitan 0.2.2 has no fused cross-entropy option; the plan was "
                         "priced with one: plan without --cross-entropy-fusion, or with "
                         "--compile model+loss (torchtitan's compiled loss)")
    if config.attention_kernel != "auto":
        raise ValueError(f"torchtitan 0.2.2 calls torch's SDPA (or flex attention); the plan "
                         f"was priced with the {config.attention_kernel} attention kernel: "
                         f"plan with --attention-kernel auto")
    if config.float8 and plan.cluster.gpu.key == CPU_DEVICE_KEY:
        raise ValueError("torchtitan 0.2.2 converts linears to float8 only on GPUs of compute "
                         "capability 8.9 or later (its Float8LinearConverter; on other devices "
                         "only emulated, without compile); the plan is for the CPU: plan "
                         "without --float8")
    exchange = cp_exchange(plan.framework, config.cp_comm_type)
    if config.cp > 1 and exchange != "p2p":
        raise ValueError(f"torchtitan's context parallelism is torch's ring (context_parallel, "
                         f"p2p); the plan was priced with the {exchange} exchange: plan with "
                         f"--cp-comm-type p2p, or export to megatron")
    if config.grad_reduce_dtype != "fp32":
        raise ValueError(f"torchtitan 0.2.2 reduces gradients in float32 only "
                         f"(training.mixed_precision_reduce); the plan reduces in "
                         f"{config.grad_reduce_dtype}: plan with --grad-reduce-dtype fp32")
    per_replica = config.micro_batch_size * config.grad_accum_steps
    training: dict[str, Any] = {
        "local_batch_size": per_replica if config.pp > 1 else config.micro_batch_size,
        "global_batch_size": config.global_batch_size,
        "seq_len": config.seq_len,
        "mixed_precision_param": TORCHTITAN_DTYPES[config.dtype],
    }
    if config.offload != "none":  # parameters and optimizer (``_check_layout``)
        training["enable_cpu_offload"] = True
    mode = recompute_mode(plan, target="torchtitan")
    checkpointing: dict[str, Any] = {"mode": mode}
    if mode == "selective":
        checkpointing["selective_ac_option"] = plan.config.selective_ac
    if mode == "full" and plan.config.recompute_early_stop:
        checkpointing["early_stop"] = True
    sections: dict[str, dict[str, Any]] = {
        "job": {"dump_folder": "./outputs",
                "description": f"meshplan plan: {model.name} on {plan.cluster.name}"},
        "model": {"name": name, "flavor": flavour},
        "training": training,
        "parallelism": _torchtitan_parallelism(plan),
        "activation_checkpoint": checkpointing,
    }
    if config.compile != "none":
        sections["compile"] = {"enable": True,
                               "components": list(TORCHTITAN_COMPILE_COMPONENTS[config.compile])}
    if config.float8:
        sections["model"]["converters"] = [TORCHTITAN_FLOAT8_CONVERTER]
        float8 = {key: list(value) if isinstance(value, tuple) else value
                  for key, value in TORCHTITAN_FLOAT8.items()}
        if config.float8_head:
            float8["filter_fqns"] = []
        sections["quantize"] = {"linear": {"float8": float8}}
    return sections


def _torchtitan_parallelism(plan: Plan) -> dict[str, Any]:
    """Degrees and the FSDP2 mode for the ZeRO stage, and the pipeline split.

    ZeRO-3 is FSDP2 resharding after forward (``always``); ZeRO-2 keeps the gathered parameters
    until backward (``never``); ZeRO-0 is DDP, which torchtitan runs only as the one
    parallelism (ZeRO-1, and ZeRO-0 beside tp, pp or cp, are refused by ``_check_layout``).
    """
    config = plan.config
    ddp = config.zero_stage < 2
    values: dict[str, Any] = {
        "data_parallel_replicate_degree": config.dp if ddp else 1,
        "data_parallel_shard_degree": 1 if ddp else config.dp,
        "fsdp_reshard_after_forward": "always" if config.zero_stage == 3 else "never",
        "tensor_parallel_degree": config.tp,
        "enable_async_tensor_parallel": config.async_tp and config.tp > 1,
        "pipeline_parallel_degree": config.pp,
        "context_parallel_degree": config.cp,
        "expert_parallel_degree": config.ep,
    }
    if config.tp > 1 and not config.sp:
        _warn("torchtitan always uses sequence parallelism with tensor parallelism; the plan "
              "has sp off (the export holds less activation memory than planned)")
    if config.pp > 1:
        parts = model_part_layers(stage_layers(plan), config.vpp)
        values.update({
            "pipeline_parallel_schedule": "Interleaved1F1B" if config.vpp > 1 else "1F1B",
            "pipeline_parallel_microbatch_size": config.micro_batch_size,
            "module_fqns_per_model_part": torchtitan_module_names(parts),
        })
    return values


def torchtitan_module_names(parts: list[int]) -> list[list[str]]:
    """Module names of each model part of a torchtitan decoder (``tok_embeddings``,
    ``layers.<i>``, ``norm``, ``output``), from the layers of each part in model order."""
    names, start = [], 0
    for count in parts:
        names.append([f"layers.{i}" for i in range(start, start + count)])
        start += count
    names[0].insert(0, "tok_embeddings")
    names[-1] += ["norm", "output"]
    return names


def _toml_table(name: str, values: dict[str, Any]) -> list[str]:
    """``[name]`` and its values, then each nested table as ``[name.key]`` (TOML's dotted
    header: ``{"quantize": {"linear": {"float8": {...}}}}`` -> ``[quantize.linear.float8]``);
    a table that holds only tables gets no header of its own."""
    plain = {key: value for key, value in values.items() if not isinstance(value, dict)}
    lines = []
    if plain or not values:
        lines += ["", f"[{name}]"]
        lines += [f"{key} = {_toml_value(value)}" for key, value in plain.items()]
    for key, value in values.items():
        if isinstance(value, dict):
            lines += _toml_table(f"{name}.{key}", value)
    return lines


def _toml_value(value: Any) -> str:
    """A TOML value: booleans, integers, strings (JSON escapes are TOML's), nested arrays."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        if value and isinstance(value[0], list):  # one inner array per line
            rows = "".join(f"    {_toml_value(row)},\n" for row in value)
            return f"[\n{rows}]"
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


# ----- the command line's entry ------------------------------------------------------------------

def render(plan: Plan, target: str) -> str:
    """The export as the text to write: JSON, one shell-quoted line of arguments, or TOML."""
    if target == "deepspeed":
        return json.dumps(to_deepspeed(plan), indent=2) + "\n"
    if target == "megatron":
        return shlex.join(to_megatron(plan)) + "\n"
    if target == "torchtitan":
        return to_torchtitan(plan)
    raise ValueError(f"unknown export target {target!r}; use one of {', '.join(TARGETS)}")
