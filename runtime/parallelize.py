"""Tensor/sequence parallelism, activation checkpointing and ZeRO for one model chunk.

Applied in DESIGN.md's order by ``train.py``: ``apply_tensor_parallel`` -> (pipeline split,
``pipeline.py``) -> ``apply_checkpointing`` -> ``apply_data_parallel``; offload is part of the
data-parallel and optimizer choice (``optim.py``).

Tensor parallel plan (Megatron-LM, Shoeybi et al. 2019, arXiv:1909.08053, Sec. 3): attention
``wq``/``wk``/``wv`` and MLP ``w1``/``w3`` column-wise, ``wo`` and ``w2`` row-wise; embeddings
row-wise (vocabulary split), the LM head column-wise with replicated logits. With sequence
parallelism (Korthikanti et al. 2022, arXiv:2205.05198) the norms run on sequence shards
(``SequenceParallel``) and the row-wise outputs are reduce-scattered along the sequence.

ZeRO (Rajbhandari et al. 2020, arXiv:1910.02054) maps onto torch as

=====  ===========================================================================
stage  torch
=====  ===========================================================================
0      ``DistributedDataParallel`` (replicated states, gradient all-reduce)
1      DDP + ``ZeroRedundancyOptimizer`` (optimizer states sharded, ``optim.py``)
2      FSDP2 ``fully_shard(reshard_after_forward=False)`` (gradients and states sharded;
       parameters stay gathered from forward to backward)
3      FSDP2 ``fully_shard(reshard_after_forward=True)`` (parameters sharded too)
=====  ===========================================================================

With tensor parallelism or an interleaved pipeline, stages 0 and 1 use ``replicate`` (FSDP2's
DDP, which understands DTensor parameters) instead of DDP: DDP cannot hold DTensors, and its
bucket rebuild fails when several pipeline chunks of one rank run backward in turn (torch
2.13: "rebuilt parameter indices size is not same as original model parameters size").
Inside pipeline stages ZeRO-3 keeps ``reshard_after_forward=False``: FSDP2 resharding after
forward combined with some pipeline schedules (zero-bubble, DualPipeV) gives wrong gradients
without an error (shared/notes/torch-distributed-on-cpu.md), so ZeRO-3 under pp > 1 holds a
stage's parameters gathered from forward to backward, like ZeRO-2. (With the 1F1B and
interleaved schedules this runtime builds, ``True`` gave the same losses as one process in
our checks; switching would need that test kept.)

torch APIs: ``torch.distributed.tensor.parallel.parallelize_module`` with ``ColwiseParallel``,
``RowwiseParallel``, ``SequenceParallel``, ``PrepareModuleInput``;
``torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper``;
``torch.utils.checkpoint.create_selective_checkpoint_contexts``;
``torch.distributed.fsdp.fully_shard`` with ``MixedPrecisionPolicy`` and
``CPUOffloadPolicy`` (pinned on CUDA); ``torch.nn.parallel.DistributedDataParallel``;
``torch.distributed._composable.replicate_with_fsdp.replicate``.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                    fully_shard)
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel,
                                               parallelize_module)
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from meshplan.runtime.model import Decoder


# ----- tensor and sequence parallelism ------------------------------------------------------

def _edge_plan(model: Decoder, *, sp: bool) -> dict:
    """TP styles of the embeddings, the final norm and the LM head of this chunk."""
    plan = {}
    seq = Shard(1) if sp else Replicate()
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.pos_embeddings is not None:  # output [s, h]: the sequence is dim 0
        plan["pos_embeddings"] = RowwiseParallel(input_layouts=Replicate(),
                                                 output_layouts=Shard(0) if sp else Replicate())
    if sp and model.embedding_norm is not None:
        plan["embedding_norm"] = SequenceParallel(use_local_output=True)
    if model.output is not None:
        if sp:
            plan["norm"] = SequenceParallel()
        plan["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate(),
                                         use_local_output=True)
    return plan


def _block_plan(*, sp: bool, swiglu: bool, qk_norm: bool = False) -> dict:
    """TP styles inside one block (names relative to the block).

    The query and key norms (``qk_norm``) run on each rank's own heads, ``[b, s, heads, d]``
    sharded on dim 2: ``SequenceParallel(sequence_dim=2)`` replicates their weights as
    DTensors and takes the local projections as that shard, so the weight gradients, partial
    per rank, are summed over the TP group (as torchtitan 0.2.2 shards Qwen3's)."""
    out = Shard(1) if sp else Replicate()
    plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=out),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=out)}
    if swiglu:
        plan["feed_forward.w3"] = ColwiseParallel()
    if qk_norm:
        heads = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan.update({"attention.q_norm": heads, "attention.k_norm": heads})
    if sp:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update({"attention_norm": SequenceParallel(), "attention": gather,
                     "ffn_norm": SequenceParallel(), "feed_forward": gather})
    return plan


def apply_tensor_parallel(model: Decoder, tp_mesh: DeviceMesh, *, sp: bool) -> None:
    """Shard ``model`` over ``tp_mesh`` in place (Megatron column/row split, optional SP)."""
    tied = model.output is not None and model.tok_embeddings is not None and \
        model.output.weight is model.tok_embeddings.weight
    parallelize_module(model, tp_mesh, _edge_plan(model, sp=sp))
    for block in model.layers.values():
        parallelize_module(block, tp_mesh,
                           _block_plan(sp=sp, swiglu=block.feed_forward.swiglu,
                                       qk_norm=block.attention.q_norm is not None))
    if tied:  # both are Shard(0) over the vocabulary; re-share the one DTensor parameter
        model.output.weight = model.tok_embeddings.weight


# ----- activation checkpointing --------------------------------------------------------------

_SAVED_OPS = frozenset({
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
})
"""Outputs kept under selective recompute: the linear layers' matmuls and TP collectives."""


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Save matmul and collective outputs; recompute norms, RoPE, the attention core and the
    activation function (Korthikanti et al. 2022, Sec. 4.3: recompute the cheap, large parts)."""
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_checkpointing(model: Decoder, mode: str) -> None:
    """Wrap each block of ``model`` for ``mode``: none, selective or full recompute.

    ``full`` recomputes the whole block in backward (``checkpoint_wrapper``, non-reentrant);
    ``selective`` runs the block under ``create_selective_checkpoint_contexts`` with
    ``_selective_policy``.
    """
    if mode == "none":
        return
    if mode not in ("selective", "full"):
        raise ValueError(f"recompute must be none, selective or full, got {mode!r}")
    context_fn = (functools.partial(create_selective_checkpoint_contexts, _selective_policy)
                  if mode == "selective" else None)
    names = getattr(model, "layer_names", None)
    if names is not None:  # chain.Whole: its module's top-level layers, replaced in place
        for name in names:
            parent, _, leaf = name.rpartition(".")
            owner = model.module.get_submodule(parent) if parent else model.module
            block = owner.get_submodule(leaf)
            setattr(owner, leaf, checkpoint_wrapper(block, preserve_rng_state=False)
                    if context_fn is None else
                    checkpoint_wrapper(block, preserve_rng_state=False, context_fn=context_fn))
        return
    for key, block in list(model.layers.items()):
        wrapped = (checkpoint_wrapper(block, preserve_rng_state=False) if context_fn is None
                   else checkpoint_wrapper(block, preserve_rng_state=False,
                                           context_fn=context_fn))
        model.layers[key] = wrapped


# ----- ZeRO / data parallelism -------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class DataParallelChoice:
    """How one plan's data-parallel group holds model states."""

    zero_stage: int
    """0-3 (module docstring)."""
    offload: str
    """``none``, ``optimizer`` (optim.py) or ``optimizer+params`` (FSDP2 CPU offload)."""
    dp: int
    """Data-parallel degree."""
    tensor_parallel: bool
    """Parameters are DTensors over a TP mesh."""
    pipelined: bool
    """The module is a pipeline stage (pp > 1)."""
    interleaved: bool = False
    """The rank holds several pipeline chunks (vpp > 1)."""
    param_dtype: torch.dtype | None = None
    """Compute dtype of gathered parameters under FSDP2 (None: keep fp32)."""

    @property
    def uses_fsdp(self) -> bool:
        return self.zero_stage >= 2 or self.offload == "optimizer+params"


def _blocks(module: nn.Module) -> list[nn.Module]:
    """The units FSDP2 wraps one by one: a chunk's ``layers``, or a whole traced module's
    top-level layers (``chain.Whole``). Layers that share a parameter (a transformers model's
    tied input embedding and LM head) stay in the root group, as FSDP2 needs a parameter in
    one group."""
    names = getattr(module, "layer_names", None)
    if names is None:
        return list(module.layers.values())
    blocks = [module.module.get_submodule(name) for name in names]
    owners: dict[int, int] = {}
    for block in blocks:
        for param in block.parameters():
            owners[id(param)] = owners.get(id(param), 0) + 1
    return [block for block in blocks
            if all(owners[id(param)] == 1 for param in block.parameters())]


FSDP_VIEW_OUTPUT_WARNING = r"FSDP2-wrapped module .* returned a view tensor"
"""The start of the warning FSDP2's root gives when a module returns a view: under tensor
parallelism the LM head's ``use_local_output`` hands back the DTensor's local tensor, a view,
and every worker of a TP x ZeRO run printed it. It warns of an in-place op on that view, and
nothing in the runtime modifies the logits in place (the loss only reads them), so ``_fsdp``
silences it."""


def _fsdp(module: nn.Module, dp_mesh: DeviceMesh, choice: DataParallelChoice) -> nn.Module:
    warnings.filterwarnings("ignore", message=FSDP_VIEW_OUTPUT_WARNING, category=UserWarning)
    reshard = choice.zero_stage == 3 and not choice.pipelined
    # pinned host shards on a GPU (DMA copies); pageable on the CPU, where pinning needs CUDA
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) \
        if choice.offload == "optimizer+params" else OffloadPolicy()
    mp = MixedPrecisionPolicy(param_dtype=choice.param_dtype, reduce_dtype=torch.float32) \
        if choice.param_dtype is not None else MixedPrecisionPolicy()
    kwargs = dict(mesh=dp_mesh, mp_policy=mp, offload_policy=offload)
    for block in _blocks(module):
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    # The root group (embeddings, head) is gathered last in backward: never reshard it early.
    return fully_shard(module, reshard_after_forward=False, **kwargs)


def apply_data_parallel(module: nn.Module, dp_mesh: DeviceMesh,
                        choice: DataParallelChoice) -> nn.Module:
    """``module`` wrapped for ``choice``'s ZeRO stage; may return a new (DDP) module."""
    if choice.uses_fsdp:
        return _fsdp(module, dp_mesh, choice)
    if choice.dp == 1:
        return module
    if choice.tensor_parallel or choice.interleaved:
        return replicate(module, mesh=dp_mesh)
    device = next(module.parameters()).device
    return DistributedDataParallel(module, process_group=dp_mesh.get_group(),
                                   device_ids=[device.index] if device.type == "cuda" else None)
