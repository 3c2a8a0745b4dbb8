"""Element-wise traffic of torchtitan's eager Llama block, counted op by op on this CPU.

Runs one torchtitan 0.2.2 llama3 ``TransformerBlock`` forward and backward in bf16 under a
dispatch mode that adds up, for every ATen op other than the matmuls, fused attention and
views, the bytes of its tensor inputs and outputs: what each kernel would read from and
write to HBM on a GPU, where eager PyTorch launches the same ops. Prints bytes per token by op
for forward and backward beside what ``costmodel.eager.layer_elementwise_bytes`` counts for the
same shape (forward, and ``timing.BACKWARD_FACTOR`` times it for backward).

    python benchmarks/eager_traffic.py [--dim 1024] [--heads 8 2] [--ffn-multiplier 1.3]

Finding (2026-12-06, torch 2.13 CPU, the defaults: dim 1024, 8 / 2 heads, ffn 3584): 156 kB
per token counted forward against 106 kB modelled, 345 kB backward against 213 kB; nearly all
of the difference is RMSNorm. ``F.rms_norm`` upcasts to fp32 (an upcast, ``pow``,
``mean``, two products and a cast back: ~40 bytes per element forward, ~108 backward), where
the model counts 7 and 14 bf16 passes (14 and 28 bytes); RoPE, SwiGLU and the residual adds
match the model's counts; no head-merging copy follows the CPU flash kernel. Recorded in
benchmarks/README.md (step-time accuracy), not applied to the model.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torchtitan_cpu_memory import _stub_moe_kernels  # noqa: E402

ATEN = torch.ops.aten
MOVES_NO_DATA = {"view", "_unsafe_view", "transpose", "t", "permute", "expand", "unsqueeze",
                 "squeeze", "slice", "select", "as_strided", "alias", "detach", "split",
                 "unbind", "view_as_complex", "view_as_real", "reshape", "empty"}
"""Ops that make views or fresh buffers: no HBM traffic of their own."""
MATMULS = {"mm", "addmm", "bmm", "baddbmm"}


class TrafficCount(TorchDispatchMode):
    """Input plus output bytes of every element-wise or reduction op, by op name."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in MOVES_NO_DATA or name in MATMULS or name.startswith("_scaled_dot_product"):
            return out
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        self.by_op[name] += sum(t.numel() * t.element_size() for t in tensors)
        return out


def count(dim: int, heads: int, kv_heads: int, ffn_multiplier: float, batch: int,
          seq: int) -> tuple[collections.Counter, collections.Counter, int]:
    """(forward bytes by op, backward bytes by op, ffn width) of one block on batch x seq
    tokens."""
    _stub_moe_kernels()
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import TransformerBlock, precompute_freqs_cis
    args = TransformerModelArgs(dim=dim, n_layers=1, n_heads=heads, n_kv_heads=kv_heads,
                                vocab_size=256, max_seq_len=seq,
                                ffn_dim_multiplier=ffn_multiplier, multiple_of=256)
    block = TransformerBlock(0, args).to(torch.bfloat16)
    freqs = precompute_freqs_cis(dim // heads, seq, args.rope_theta)
    x = torch.randn(batch, seq, dim, dtype=torch.bfloat16, requires_grad=True)
    forward = TrafficCount()
    with forward:
        y = block(x, freqs, None)
    grad = torch.randn_like(y)
    backward = TrafficCount()
    with backward:
        y.backward(grad)
    return forward.by_op, backward.by_op, block.feed_forward.w1.weight.shape[0]


def model_bytes_per_token(dim: int, heads: int, kv_heads: int, ffn: int) -> float:
    """What the cost model counts for one token of the same block's forward."""
    from meshplan.costmodel import ParallelConfig
    from meshplan.costmodel.eager import layer_elementwise_bytes
    from meshplan.costmodel.model import ModelSpec
    spec = ModelSpec(name="probe", num_layers=1, hidden_size=dim, num_heads=heads,
                     num_kv_heads=kv_heads, ffn_hidden_size=ffn, vocab_size=256, seq_len=256,
                     activation="swiglu", norm="rmsnorm", position_embedding="rope")
    return layer_elementwise_bytes(spec, ParallelConfig(seq_len=256), tokens=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--heads", type=int, nargs=2, default=(8, 2), metavar=("Q", "KV"))
    parser.add_argument("--ffn-multiplier", type=float, default=1.3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    forward, backward, ffn = count(args.dim, args.heads[0], args.heads[1], args.ffn_multiplier,
                                   args.batch, args.seq)
    tokens = args.batch * args.seq
    fwd, bwd = sum(forward.values()) / tokens, sum(backward.values()) / tokens
    from meshplan.costmodel.timing import BACKWARD_FACTOR
    modelled = model_bytes_per_token(args.dim, *args.heads, ffn)
    print(f"block: dim {args.dim}, heads {args.heads[0]}/{args.heads[1]}, ffn {ffn}, "
          f"{tokens} tokens, bf16")
    print(f"forward : {fwd:10.0f} B/token counted, {modelled:10.0f} modelled")
    print(f"backward: {bwd:10.0f} B/token counted, {BACKWARD_FACTOR * modelled:10.0f} modelled")
    for label, ops in (("forward", forward), ("backward", backward)):
        print(f"{label} by op (B/token):",
              ", ".join(f"{op} {b / tokens:.0f}" for op, b in ops.most_common() if b))


if __name__ == "__main__":
    main()
