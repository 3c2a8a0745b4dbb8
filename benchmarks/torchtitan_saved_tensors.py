"""What one torchtitan block keeps for backward, eager and under torch.compile, on this CPU.

Builds torchtitan 0.2.2's llama3 ``Transformer`` (one process, no parallelism), wraps its blocks
with ``apply_ac`` (``--policy``: ``op``, an integer N, ``full`` or ``none``) and, with
``--compile``, compiles each block as torchtitan's ``apply_compile`` does (after the
checkpoint wrapper). It runs the blocks' forward on a batch and reports, per block:

* eager: the bytes the block's forward leaves alive (live-tensor tracker), less its output;
* compiled: the tensors the compiled graph saves for backward (``saved_tensors_hooks`` sees
  what AOT autograd's partition hands to ``save_for_backward``), less the parameters it keeps
  references to.

Both leave out the block's input, which the caller holds either way. The cost model's
``activations.op_policy_layer_bytes`` counts the eager set; a compiled block keeps only what
its backward and recomputation read.

    python benchmarks/torchtitan_saved_tensors.py [--policy op] [--compile] [--dim 256]
        [--tokens 256] [--batch 4]
"""

from __future__ import annotations

import argparse

import torch

from torchtitan_cpu_memory import _ac_config, _stub_moe_kernels


def _model(dim: int, tokens: int, policy: str, compiled: bool):
    _stub_moe_kernels()
    from torchtitan.config.job_config import Compile
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list, apply_compile
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    torch.manual_seed(0)
    args = TransformerModelArgs(dim=dim, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512,
                                multiple_of=64, max_seq_len=tokens)
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    if policy != "none":
        apply_ac(model, _ac_config(policy), op_sac_save_list=_op_sac_save_list,
                 model_compile_enabled=compiled)
    if compiled:
        apply_compile(model, Compile(enable=True, components=["model"]))
    return model


def saved_bytes(*, dim: int, tokens: int, batch: int, policy: str, compiled: bool) -> list[int]:
    """Per block, the bytes its forward keeps for backward beyond its input (module doc)."""
    from meshplan.runtime.memory import LiveStorageTracker

    model = _model(dim, tokens, policy, compiled)
    ids = torch.randint(0, 512, (batch, tokens), generator=torch.Generator().manual_seed(0))
    h = model.tok_embeddings(ids).detach().requires_grad_()
    result = []
    for block in model.layers.values():
        # what existed before the block ran (views of the weights share their storages)
        held = (*model.parameters(), model.freqs_cis, h)
        if compiled:
            skip = {tensor.untyped_storage().data_ptr() for tensor in held}
            saved: dict[int, int] = {}

            def pack(tensor, saved=saved, skip=skip):
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in skip:
                    saved[storage.data_ptr()] = storage.nbytes()
                return tensor

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                out = block(h, model.freqs_cis, None)
            result.append(sum(saved.values()))
        else:
            tracker = LiveStorageTracker()
            for tensor in held:
                tracker.track(tensor)
            before = tracker.live_bytes
            with tracker:
                out = block(h, model.freqs_cis, None)
            result.append(tracker.live_bytes - before - out.untyped_storage().nbytes())
        h = out
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="op", help="op, an integer N, full or none")
    parser.add_argument("--compile", action="store_true", help="compile each block")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    per_block = saved_bytes(dim=args.dim, tokens=args.tokens, batch=args.batch,
                            policy=args.policy, compiled=args.compile)
    kind = "compiled" if args.compile else "eager"
    for index, nbytes in enumerate(per_block):
        print(f"policy {args.policy} {kind} block {index}: {nbytes} bytes kept beyond its input")


if __name__ == "__main__":
    main()
