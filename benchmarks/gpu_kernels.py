"""One GPU: the kernel rates the cost model assumes, measured, next to what it predicts.

The step-time model prices a layer from a few per-device constants (``DeviceCalibration``):
a GEMM efficiency scaled by the row count, a fixed cost per GEMM call, a fused-attention
efficiency (eager SDPA for eager trainers, the library kernels of Megatron-LM otherwise), an
element-wise bandwidth fraction, and host-side rates for offload (pinned and pageable copies,
the host AdamW step). This script times each on the GPU it runs on, in bf16:

- ``gemm``: the projection and MLP products of Llama-3.2-1B, Llama-3-8B and Llama-3-70B
  layers (``[tokens, h] x [h, n]``) at 512 to 16,384 tokens, and an 8192-cube;
- ``narrow_gemm``: the products of MPT-125M to MPT-1B layers (hidden 768 to 2,048, fused QKV,
  a GeLU MLP four times as wide) and of their tied LM head (vocabulary 50,368) at 8,192 and
  49,152 tokens: reduction widths below the Llama cases', where pricing llm-foundry's fused
  cross entropy leaves the small MPT models 7-17 % short (benchmarks/README.md);
- ``attention``: causal SDPA forward and forward+backward with the flash backend and, where
  torch has it, cuDNN's, at sequence 2k-8k and head size 64/128 (FLOPs counted as the cost
  model counts them: causal forward ``2 * 2 * s * q / 2`` per token, backward twice forward),
  and at 16k and 32k tokens (one sequence a call);
- ``tp_gemm``: the projections one GPU runs at tensor-parallel degree 8 (Llama-3-8B, -70B,
  Llama-3.1-405B; k and v 128 wide, the 8B's output projection K = 512) on 32,768 rows, each
  as its forward product and the two backward products (input gradient, weight gradient),
  beside the cost model's seconds for that product (GEMM efficiency, call cost and the
  roofline excess of ``timing.gemm_memory_excess_s``): the narrow products where the
  torchtitan TP rows are predicted short;
- ``ring``: one rank's share of load-balanced ring attention at context-parallel degree 2, 4
  and 8 on one GPU (the collectives left out): every step's fused attention call on the
  chunk pair the round-robin layout gives it (step 0 causal over both local chunks; from a
  lower rank the first half of the keys, from a higher one the second half of the queries),
  the output and log-sum-exp merged in fp32 after each step (``out - sigmoid(lse_b - lse)
  (out - out_b)``, ``lse - logsigmoid(lse - lse_b)``, a half merged back by concatenation),
  the key / value buffer flattened for the next rank each step, and the backward's fp32
  gradient accumulators, for the first and the last rank; beside ``cp`` causal calls of the
  local length (the same FLOPs): what the ring costs beyond its FLOPs;
- ``launch``: back-to-back tiny kernels (the GPU-side cost of one launch) and a 256-cube GEMM;
- ``float8``: the Llama-3-8B layer products in float8 (``torch._scaled_mm``, tensorwise scales,
  bf16 out) at 4,096 and 16,384 tokens against the float8 peak, beside the cost model's
  assumption for ``--float8`` (the bf16 GEMM efficiency at the float8 peak), and one
  tensorwise cast of a bf16 activation to float8 (max-abs, scale, cast: 5 bytes per element
  read and written) against HBM bandwidth;
- ``loss``: the cross entropy an FSDP trainer runs on bf16 logits of Llama 3's vocabulary
  (16,384 tokens x 128,256, torchtitan's 2 x 8K) and MPT's (8,192 x 50,368), forward and
  backward, eager (``F.cross_entropy(logits.float(), labels)``, torchtitan's loss) and compiled
  (the same function under ``torch.compile``: torchtitan's ``compile`` of the loss, and the
  passes a fused cross-entropy kernel makes). Each as bytes per logit at the device's
  element-wise bandwidth (seconds x HBM bandwidth x ``memory_efficiency`` / logits) beside the
  cost model's (``eager.LOSS_BYTES_PER_LOGIT``, ``eager.FUSED_LOSS_BYTES_PER_LOGIT``), and the
  peak it allocates above the logits it is given, in fp32-sized logit copies, beside the
  model's count in the same frame (``frameworks.TORCHTITAN_LOGIT_COPIES`` for the eager loss,
  which in a training step runs with the logits already dropped;
  ``frameworks.COMPILED_LOSS_LOGIT_COPIES`` less the logits themselves for the compiled one):
  what the H200 rows' memory and the small MPT models' step time leave open;
- ``elementwise``: a 1 GiB bf16 add (bytes read and written over time);
- ``host``: 256 MiB host-device copies from pinned and from pageable memory, each way, and one
  fp32 AdamW step on the CPU over 64 M parameters with torch's fused kernel on all cores.

Each figure is the median of several timed repeats (CUDA events, after warm-up calls), printed
beside the cost model's value for the catalog GPU (``--gpu``, default ``h200``) under the
built-in calibration. Writes ``gpu-kernels-<gpu>-<date>.{md,json}`` under ``--out``.
About three minutes on one H200.

    python benchmarks/gpu_kernels.py [--gpu h200] [--out DIR]
    python benchmarks/gpu_kernels.py --dry-run   # CPU: tiny sizes, fp32; tests the plumbing

Without CUDA (and without ``--dry-run``) it stops with one line (exit 2).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from meshplan.costmodel import default_calibration
from meshplan.costmodel.hardware import gpu_catalog

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 2 ** 20
LAYERS = {  # name: (hidden, q size, kv size, ffn hidden), from the models' configs
    "llama3.2-1b": (2048, 2048, 512, 8192),
    "llama3-8b": (4096, 4096, 1024, 14336),
    "llama3-70b": (8192, 8192, 1024, 28672),
}
TOKENS = (512, 2048, 4096, 8192, 16384)
NARROW_LAYERS = {  # name: (hidden, ffn hidden); MPT's GeLU MLP, its vocabulary 50,368
    "mpt-125m": (768, 3072),
    "mpt-350m": (1024, 4096),
    "mpt-760m": (1536, 6144),
    "mpt-1b": (2048, 8192),
}
NARROW_VOCAB, NARROW_TOKENS = 50368, (8192, 49152)
ATTENTION = ((2048, 128), (4096, 128), (8192, 128), (4096, 64), (16384, 128), (32768, 128))
"""(sequence, head size) of the attention cases; 16,384 tokens a call (batch = 16384 / s; one
sequence of s beyond) and 16 query heads of 128 (32 of 64), 8 key-value heads of 128 (16 of
64)."""
LOSS_SHAPES = ((16384, 128256), (8192, 50368))
"""(tokens, vocabulary) of the loss cases: Llama 3 at torchtitan's 2 x 8,192 tokens, MPT."""
TP_LAYERS = {  # name: (hidden, q size, kv size, ffn hidden), sharded 8 ways
    "llama3-8b": (4096, 4096, 1024, 14336),
    "llama3-70b": (8192, 8192, 1024, 28672),
    "llama3.1-405b": (16384, 16384, 1024, 53248),
}
TP, TP_ROWS = 8, 32768
RING_CP = (2, 4, 8)
RING_LOCAL, RING_HEADS, RING_HEAD = 8192, 32, 128
"""Ring attention: 8,192 local tokens per rank, 32 heads of 128 (Llama-3-8B's 32 query heads,
its key / value heads repeated to 32 as torchtitan does before the attention call)."""


class Timer:
    """Median seconds of ``fn`` over ``repeats`` timed batches of ``calls`` calls each."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def __call__(self, fn: Callable[[], object], *, calls: int = 10, repeats: int = 5,
                 warmup: int = 3) -> float:
        for _ in range(warmup):
            fn()
        self.sync()
        samples = []
        for _ in range(repeats):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                for _ in range(calls):
                    fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3 / calls)
            else:
                begin = time.perf_counter()
                for _ in range(calls):
                    fn()
                samples.append((time.perf_counter() - begin) / calls)
        return statistics.median(samples)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def gemm_rows(timer: Timer, device: torch.device, dtype: torch.dtype, *, dry_run: bool,
              peak: float, cal) -> list[dict]:
    rows = []
    layers = {"tiny": (64, 64, 32, 128)} if dry_run else LAYERS
    tokens = (16, 64) if dry_run else TOKENS
    for model, (h, q, kv, ffn) in layers.items():
        for m in tokens:
            x = torch.randn(m, h, device=device, dtype=dtype)
            shapes = {"qkv": (h, q + 2 * kv), "mlp_up": (h, 2 * ffn), "mlp_down": (ffn, h)}
            for name, (k, n) in shapes.items():
                a = x if k == h else torch.randn(m, k, device=device, dtype=dtype)
                w = torch.randn(k, n, device=device, dtype=dtype)
                rows.append(_gemm_row(timer, a, w, group="gemm",
                                      case=f"{model} {name} m={m} k={k} n={n}", peak=peak,
                                      cal=cal, megatron=True))
                del a, w
    side = 128 if dry_run else 8192
    a = torch.randn(side, side, device=device, dtype=dtype)
    rows.append(_gemm_row(timer, a, a, group="gemm", case=f"square {side}", peak=peak, cal=cal,
                          megatron=True))
    return rows


def _gemm_row(timer: Timer, a: torch.Tensor, w: torch.Tensor, *, group: str, case: str,
              peak: float, cal, megatron: bool = False) -> dict:
    """One timed ``a @ w``: seconds, rate, efficiency against ``peak`` and the cost model's
    (``_predicted_gemm``; the Megatron-LM value too where ``megatron``)."""
    seconds = timer(lambda: torch.matmul(a, w))
    m, k = a.shape
    flop = 2.0 * m * k * w.shape[1]
    row = dict(group=group, case=case, rows=m, seconds=seconds, rate=flop / seconds,
               efficiency=flop / seconds / peak,
               predicted_efficiency=_predicted_gemm(cal, flop, m, peak))
    if megatron:
        row["predicted_efficiency_megatron"] = _predicted_gemm(cal, flop, m, peak, eager=False)
    return row


def narrow_gemm_rows(timer: Timer, device: torch.device, dtype: torch.dtype, *, dry_run: bool,
                     peak: float, cal) -> list[dict]:
    """``narrow_gemm``: each MPT layer product and the tied LM head's forward product
    (``[tokens, h] x [h, vocab]``) at ``NARROW_TOKENS`` rows (see the module docstring)."""
    rows = []
    layers = {"tiny": (32, 128)} if dry_run else NARROW_LAYERS
    vocab = 256 if dry_run else NARROW_VOCAB
    for model, (h, ffn) in layers.items():
        for m in ((16, 64) if dry_run else NARROW_TOKENS):
            shapes = {"qkv": (h, 3 * h), "out": (h, h), "mlp_up": (h, ffn),
                      "mlp_down": (ffn, h), "head": (h, vocab)}
            for name, (k, n) in shapes.items():
                a = torch.randn(m, k, device=device, dtype=dtype)
                w = torch.randn(k, n, device=device, dtype=dtype)
                rows.append(_gemm_row(timer, a, w, group="narrow_gemm",
                                      case=f"{model} {name} m={m} k={k} n={n}", peak=peak,
                                      cal=cal))
                del a, w
    return rows


def _predicted_gemm(cal, flop: float, rows: int, peak: float, *, eager: bool = True) -> float:
    """Achieved fraction of peak the cost model gives one GEMM call of ``flop`` FLOPs:
    ``flop / (peak * gemm_efficiency * row_efficiency) + matmul_overhead_s``."""
    seconds = (flop / (peak * cal.gemm_efficiency(eager) * cal.row_efficiency(rows))
               + cal.matmul_overhead_s)
    return flop / seconds / peak


def attention_rows(timer: Timer, device: torch.device, dtype: torch.dtype, *, dry_run: bool,
                   peak: float, cal) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"math": SDPBackend.MATH} if dry_run else {
        "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    cases = ((64, 16),) if dry_run else ATTENTION
    tokens = 256 if dry_run else 16384
    rows = []
    for seq, head in cases:
        heads, kv_heads = (16, 8) if head == 128 else (32, 16)
        if dry_run:
            heads, kv_heads = 2, 2
        batch = max(1, tokens // seq)
        q = torch.randn(batch, heads, seq, head, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(batch, heads, seq, head, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(batch, heads, seq, head, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn(batch, heads, seq, head, device=device, dtype=dtype)
        # forward FLOPs as the cost model counts them: 2 * 2 * s * q per token, causal halves
        fwd_flop = batch * seq * 2 * 2 * seq * heads * head / 2
        for name, backend in backends.items():
            def forward(backend=backend):
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, is_causal=True)

            def both(forward=forward):
                out = forward()
                torch.autograd.grad(out, (q, k, v), grad)

            try:
                fwd_s = timer(forward, calls=5)
                both_s = timer(both, calls=5)
            except RuntimeError as error:  # backend not available for this shape / build
                rows.append(dict(group="attention", case=f"{name} s={seq} d={head}",
                                 error=str(error).splitlines()[0][:160]))
                continue
            rows.append(dict(group="attention", case=f"{name} s={seq} d={head} b={batch}",
                             seconds=both_s, forward_s=fwd_s,
                             forward_efficiency=fwd_flop / fwd_s / peak,
                             efficiency=3 * fwd_flop / both_s / peak,
                             predicted_efficiency=cal.fused_attention_efficiency(True),
                             predicted_efficiency_megatron=cal.fused_attention_efficiency(
                                 False)))
        del q, k, v, grad
    return rows


def tp_gemm_rows(timer: Timer, device: torch.device, dtype: torch.dtype, *, dry_run: bool,
                 peak: float, hbm: float, cal) -> list[dict]:
    """``tp_gemm``: each projection of a TP-sharded layer as its three products (see the
    module docstring), measured and as the cost model prices one product."""
    from meshplan.costmodel.timing import gemm_memory_excess_s

    layers = {"tiny": (128, 128, 32, 256)} if dry_run else TP_LAYERS
    tp, m = (4, 64) if dry_run else (TP, TP_ROWS)
    rate = peak * cal.gemm_efficiency(True) * cal.row_efficiency(m)
    bandwidth = hbm * cal.memory_efficiency
    size = torch.finfo(dtype).bits // 8
    rows = []
    for model, (h, q, kv, ffn) in layers.items():
        shapes = {"wq": (h, q // tp), "wk": (h, kv // tp), "wv": (h, kv // tp),
                  "wo": (q // tp, h), "w1": (h, ffn // tp), "w2": (ffn // tp, h)}
        for name, (k, n) in shapes.items():
            x = torch.randn(m, k, device=device, dtype=dtype)
            w = torch.randn(k, n, device=device, dtype=dtype)
            dy = torch.randn(m, n, device=device, dtype=dtype)
            products = {"forward": (lambda: torch.matmul(x, w), (m, k, n)),
                        "input grad": (lambda: torch.matmul(dy, w.t()), (m, n, k)),
                        "weight grad": (lambda: torch.matmul(x.t(), dy), (k, m, n))}
            for kind, (fn, (rows_, inner, cols)) in products.items():
                seconds = timer(fn)
                flop = 2.0 * m * k * n
                predicted = (flop / rate + cal.matmul_overhead_s + gemm_memory_excess_s(
                    rows_, inner, cols, in_bytes=size, out_bytes=size, bandwidth=bandwidth,
                    rate=rate))
                intensity = flop / (size * (rows_ * inner + inner * cols + rows_ * cols))
                rows.append(dict(group="tp_gemm", case=f"{model} tp{tp} {name} {kind} "
                                 f"[{rows_}x{inner}]x[{inner}x{cols}]",
                                 seconds=seconds, efficiency=flop / seconds / peak,
                                 flop_per_byte=intensity, ridge=rate / bandwidth,
                                 predicted_s=predicted, measured_over_predicted=seconds
                                 / predicted))
            del x, w, dy
    return rows


def _flash_ops(device: torch.device):
    """(forward, backward) of the fused attention op torch's ring attention calls per step,
    as ``forward(q, k, v, causal) -> (out, lse, context)`` and ``backward(dout, q, k, v, out,
    lse, causal, context) -> (dq, dk, dv)``: the CUDA flash kernel, or its CPU counterpart."""
    aten = torch.ops.aten
    if device.type == "cuda":
        def forward(q, k, v, causal):
            out, lse, cq, ck, mq, mk, seed, offset, _ = aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, causal)
            return out, lse, (cq, ck, mq, mk, seed, offset)

        def backward(dout, q, k, v, out, lse, causal, context):
            cq, ck, mq, mk, seed, offset = context
            return aten._scaled_dot_product_flash_attention_backward(
                dout, q, k, v, out, lse, cq, ck, mq, mk, 0.0, causal, seed, offset)
    else:
        def forward(q, k, v, causal):
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
            return out, lse, None

        def backward(dout, q, k, v, out, lse, causal, context):
            return aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse, 0.0, causal)
    return forward, backward


def _ring_chunks(rank: int, step: int):
    """Which halves of the local query and of the arriving key/value chunk pair a rank's
    step attends with under the round-robin layout: (query half or None for all, key/value
    half or None for all, causal)."""
    if step == 0:
        return None, None, True
    source = rank - step  # negative: the chunk came from a higher rank
    return (None, 0, False) if source >= 0 else (1, None, False)


def _half(t: torch.Tensor, which: int | None) -> torch.Tensor:
    return t if which is None else t.chunk(2, dim=2)[which]


def _merge_back(whole: torch.Tensor, half: torch.Tensor) -> torch.Tensor:
    """``whole`` with its second half along the sequence replaced by ``half`` (a new tensor,
    by concatenation, as the ring's partial update does)."""
    return torch.cat([whole.chunk(2, dim=2)[0], half], dim=2)


def ring_forward(q, kv_steps, *, rank: int, forward):
    """One rank's ring attention forward on one device (see the module docstring):
    ``kv_steps[i]`` is the (key, value) chunk pair the rank holds at step ``i`` (its own at
    step 0, then rank - i's, wrapping). Returns (out, lse, per-step saved context for
    ``ring_backward``)."""
    cp = len(kv_steps)
    out = lse = None
    saved = []
    for step, (k, v) in enumerate(kv_steps):
        if step < cp - 1:
            torch.cat([k.flatten(), v.flatten()])  # the buffer sent to the next rank
        qh, kvh, causal = _ring_chunks(rank, step)
        block_out, block_lse, context = forward(_half(q, qh), _half(k, kvh), _half(v, kvh),
                                                causal)
        saved.append((qh, kvh, causal, context))
        lse_dtype = block_lse.dtype
        block_out, block_lse = block_out.float(), block_lse.float().unsqueeze(-1)
        if out is None:
            out, lse = block_out, block_lse
            continue
        o, s = _half(out, qh), _half(lse, qh)
        o = o - torch.sigmoid(block_lse - s) * (o - block_out)
        s = s - torch.nn.functional.logsigmoid(s - block_lse)
        out, lse = (o, s) if qh is None else (_merge_back(out, o), _merge_back(lse, s))
    return out.to(q.dtype), lse.squeeze(-1).to(lse_dtype), saved


def ring_backward(dout, q, kv_steps, out, lse, saved, *, backward):
    """One rank's ring attention backward: each step's fused backward on its chunks, the
    fp32 query gradient accumulated, the key/value gradients added into the fp32 buffer that
    travels with the chunk pair and flattened for the next rank (here the rank's own buffer
    stands in for the arriving one: the same bytes). Returns the query gradient."""
    cp = len(kv_steps)
    k0, v0 = kv_steps[0]
    dq = torch.zeros_like(q, dtype=torch.float32)
    dk = torch.zeros_like(k0, dtype=torch.float32)
    dv = torch.zeros_like(v0, dtype=torch.float32)
    for step, ((k, v), (qh, kvh, causal, context)) in enumerate(zip(kv_steps, saved)):
        if step < cp - 1:
            torch.cat([k.flatten(), v.flatten()])
        gq, gk, gv = backward(_half(dout, qh), _half(q, qh), _half(k, kvh), _half(v, kvh),
                              _half(out, qh), _half(lse, qh).contiguous(), causal, context)
        if kvh is None:
            dk, dv = dk + gk, dv + gv
        else:  # first half of the chunk pair's gradients, the whole rebuilt by concatenation
            dk = torch.cat([dk.chunk(2, dim=2)[0] + gk, dk.chunk(2, dim=2)[1]], dim=2)
            dv = torch.cat([dv.chunk(2, dim=2)[0] + gv, dv.chunk(2, dim=2)[1]], dim=2)
        buffer = torch.cat([dk.flatten(), dv.flatten()])  # sent on to the next rank
        dk, dv = buffer[:dk.numel()].view_as(dk), buffer[dk.numel():].view_as(dv)
        if qh is None:
            dq += gq
        else:
            dq = _merge_back(dq, dq.chunk(2, dim=2)[1] + gq)
    return dq.to(q.dtype)


def ring_rows(timer: Timer, device: torch.device, dtype: torch.dtype, *, dry_run: bool,
              peak: float, cal) -> list[dict]:
    """``ring``: one rank's ring attention against ``cp`` plain causal calls of the local
    length (the same FLOPs), forward and forward + backward."""
    forward, backward = _flash_ops(device)
    local, heads, head = (32, 2, 16) if dry_run else (RING_LOCAL, RING_HEADS, RING_HEAD)
    shape = (1, heads, local, head)
    q, k, v, dout = (torch.randn(shape, device=device, dtype=dtype) for _ in range(4))
    fwd_flop = local * 2 * 2 * local * heads * head / 2  # causal, as the cost model counts

    def plain_both():
        out, lse, context = forward(q, k, v, True)
        backward(dout, q, k, v, out, lse, True, context)

    plain_fwd = timer(lambda: forward(q, k, v, True), calls=3, repeats=3)
    plain = timer(plain_both, calls=3, repeats=3)
    rows = [dict(group="ring", case=f"plain causal s={local} h={heads} d={head}",
                 forward_s=plain_fwd, seconds=plain,
                 efficiency=3 * fwd_flop / plain / peak)]
    for cp in ((2, 4) if dry_run else RING_CP):
        for rank in (0, cp - 1):
            def fwd(cp=cp, rank=rank):
                return ring_forward(q, [(k, v)] * cp, rank=rank, forward=forward)

            def both(fwd=fwd, cp=cp):
                out, lse, saved = fwd()
                ring_backward(dout, q, [(k, v)] * cp, out, lse, saved, backward=backward)

            fwd_s = timer(fwd, calls=2, repeats=3)
            both_s = timer(both, calls=2, repeats=3)
            rows.append(dict(group="ring", case=f"cp={cp} rank={rank} s_local={local}",
                             forward_s=fwd_s, seconds=both_s,
                             forward_over_plain=fwd_s / (cp * plain_fwd),
                             over_plain=both_s / (cp * plain),
                             efficiency=3 * cp * fwd_flop / both_s / peak,
                             predicted_efficiency=cal.fused_attention_efficiency(
                                 True, cp * local)))
    return rows


def launch_rows(timer: Timer, device: torch.device, dtype: torch.dtype, cal) -> list[dict]:
    calls = 2000 if device.type == "cuda" else 20
    tiny = torch.zeros(1, device=device, dtype=dtype)
    per_launch = timer(lambda: tiny.add_(1), calls=calls, repeats=5)
    a = torch.randn(256, 256, device=device, dtype=dtype)
    small = timer(lambda: torch.matmul(a, a), calls=calls, repeats=5)
    return [dict(group="launch", case="tiny add (one kernel)", seconds=per_launch,
                 predicted_s=cal.op_overhead_s),
            dict(group="launch", case="gemm 256-cube", seconds=small,
                 predicted_s=cal.matmul_overhead_s)]


def float8_rows(timer: Timer, device: torch.device, *, dry_run: bool, peak: float,
                hbm: float, cal) -> list[dict]:
    """``float8``: what ``--float8`` assumes, measured (see the module docstring)."""
    rows = []
    h, q, kv, ffn = (64, 64, 32, 128) if dry_run else LAYERS["llama3-8b"]
    fp8 = torch.float8_e4m3fn
    one = torch.tensor(1.0, device=device)
    for m in ((16, 64) if dry_run else (4096, 16384)):
        shapes = {"qkv": (h, q + 2 * kv), "mlp_up": (h, 2 * ffn), "mlp_down": (ffn, h)}
        for name, (k, n) in shapes.items():
            a = torch.randn(m, k, device=device).to(fp8)
            b = torch.randn(n, k, device=device).to(fp8).t()  # column-major, as cuBLASLt wants
            seconds = timer(lambda a=a, b=b: torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                                               out_dtype=torch.bfloat16))
            flop = 2.0 * m * k * n
            rows.append(dict(group="float8", case=f"scaled_mm {name} m={m} k={k} n={n}",
                             rows=m, seconds=seconds, rate=flop / seconds,
                             efficiency=flop / seconds / peak,
                             predicted_efficiency=_predicted_gemm(cal, flop, m, peak)))
            del a, b
    m = 64 if dry_run else 16384
    x = torch.randn(m, h, device=device, dtype=torch.bfloat16)

    def cast() -> torch.Tensor:
        scale = torch.finfo(fp8).max / x.abs().max().float().clamp(min=1e-12)
        return (x.float() * scale).to(fp8)

    seconds = timer(cast)
    moved = 5.0 * x.numel()  # max-abs reads 2 bytes, the cast reads 2 and writes 1
    rows.append(dict(group="float8", case=f"tensorwise cast {m}x{h} bf16", seconds=seconds,
                     rate=moved / seconds, efficiency=moved / seconds / hbm,
                     predicted_efficiency=cal.memory_efficiency))
    return rows


def _torch_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torchtitan's cross entropy: the logits upcast to fp32, mean over the tokens."""
    return torch.nn.functional.cross_entropy(logits.float(), labels)


def loss_rows(timer: Timer, device: torch.device, dtype: torch.dtype, *, dry_run: bool,
              hbm: float, cal) -> list[dict]:
    """``loss``: the eager and the compiled cross entropy (see the module docstring)."""
    from meshplan.costmodel import eager, frameworks
    rows = []
    compiled = torch.compile(_torch_loss)
    fp32_fraction = torch.finfo(dtype).bits / 32  # the given logits, in fp32-sized copies
    for tokens, vocab in ((64, 512),) if dry_run else LOSS_SHAPES:
        logits = torch.randn(tokens, vocab, device=device, dtype=dtype, requires_grad=True)
        labels = torch.randint(vocab, (tokens,), device=device)
        logit_count = tokens * vocab
        fp32 = dtype == torch.float32
        cases = (("eager", _torch_loss,
                  eager.LOSS_BYTES_PER_LOGIT_FP32 if fp32 else eager.LOSS_BYTES_PER_LOGIT,
                  frameworks.logit_copies("torchtitan", fp32)),
                 ("compiled", compiled, eager.FUSED_LOSS_BYTES_PER_LOGIT,
                  frameworks.logit_copies("torchtitan", fp32, compiled_loss=True)))
        for kind, fn, predicted_bytes, copies in cases:
            def step(fn=fn) -> None:
                logits.grad = None
                fn(logits, labels).backward()

            seconds = timer(step, calls=3, repeats=3)
            extra = None
            if device.type == "cuda":
                logits.grad = None
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                step()
                torch.cuda.synchronize()
                extra = (torch.cuda.max_memory_allocated() - base) / (4.0 * logit_count)
            held = 0.0 if kind == "eager" else fp32_fraction  # the given logits are counted
            rows.append(dict(group="loss", case=f"{kind} cross entropy {tokens}x{vocab}",
                             seconds=seconds,
                             bytes_per_logit=seconds * hbm * cal.memory_efficiency
                             / logit_count,
                             predicted_bytes_per_logit=float(predicted_bytes),
                             peak_fp32_copies=extra if extra is not None else "",
                             predicted_fp32_copies=copies - held))
        del logits, labels
    return rows


def elementwise_rows(timer: Timer, device: torch.device, dtype: torch.dtype, *,
                     dry_run: bool, hbm: float, cal) -> list[dict]:
    n = (4 * MIB if dry_run else 512 * MIB)  # elements: 1 GiB of bf16
    a = torch.ones(n, device=device, dtype=dtype)
    b = torch.ones(n, device=device, dtype=dtype)
    out = torch.empty_like(a)
    seconds = timer(lambda: torch.add(a, b, out=out))
    moved = 3.0 * n * a.element_size()
    return [dict(group="elementwise", case=f"add {moved / 3 / MIB:.0f} MiB", seconds=seconds,
                 rate=moved / seconds, efficiency=moved / seconds / hbm,
                 predicted_efficiency=cal.memory_efficiency)]


def host_rows(timer: Timer, device: torch.device, *, dry_run: bool, pcie: float,
              calibration, host_bw: float) -> list[dict]:
    rows = []
    nbytes = (16 if dry_run else 256) * MIB
    if device.type == "cuda":
        gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
        for kind, pinned in (("pinned", True), ("pageable", False)):
            host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pinned)
            predicted = calibration.host_copy_rate(pcie, pinned=pinned)
            for way, fn in (("h2d", lambda host=host: gpu.copy_(host, non_blocking=True)),
                            ("d2h", lambda host=host: host.copy_(gpu, non_blocking=True))):
                seconds = timer(fn, calls=4, repeats=5)
                rows.append(dict(group="host", case=f"{way} {kind} {nbytes // MIB} MiB",
                                 seconds=seconds, rate=nbytes / seconds,
                                 predicted_rate=predicted))
    params = (1 if dry_run else 64) * MIB
    size = params // 16
    weights = [torch.zeros(size) for _ in range(16)]
    for weight in weights:
        weight.grad = torch.full_like(weight, 1e-3)
    adam = torch.optim.AdamW(weights, lr=1e-3, fused=True)
    seconds = Timer(cuda=False)(adam.step, calls=1, repeats=5, warmup=2)
    rows.append(dict(group="host", case=f"fused AdamW {params // MIB} M params, "
                     f"{torch.get_num_threads()} threads", seconds=seconds,
                     rate=params / seconds,
                     predicted_rate=host_bw / calibration.host_adam_bytes_per_param,
                     note="predicted: one DGX node's host memory bandwidth / 28 B per param"))
    return rows


def markdown(rows: list[dict], title: str) -> str:
    lines = [f"# {title}", ""]
    for group in ("gemm", "narrow_gemm", "tp_gemm", "attention", "ring", "launch", "float8",
                  "loss", "elementwise", "host"):
        part = [row for row in rows if row["group"] == group]
        if not part:
            continue
        keys = [k for k in part[0] if k != "group"]
        for row in part[1:]:
            keys += [k for k in row if k not in keys and k != "group"]
        lines += [f"## {group}", "", "| " + " | ".join(keys) + " |",
                  "|" + "---|" * len(keys)]
        for row in part:
            lines.append("| " + " | ".join(_cell(row.get(k, "")) for k in keys) + " |")
        lines.append("")
    return "\n".join(lines)


def _cell(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", default="h200", help="catalog GPU this is (default h200)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny sizes on this machine's CPU, fp32 (tests the plumbing)")
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_kernels.py: no CUDA device here; run it on a GPU machine (or pass "
              "--dry-run)", file=sys.stderr)
        return 2
    catalog = gpu_catalog()
    if args.gpu not in catalog:
        print(f"gpu_kernels.py: unknown GPU {args.gpu!r}; choose from {', '.join(catalog)}",
              file=sys.stderr)
        return 2
    gpu = catalog[args.gpu]
    calibration = default_calibration()
    cal = calibration.device("cpu" if args.dry_run else gpu.key)
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    peak = gpu.peak("fp32" if args.dry_run else "bf16")
    timer = Timer(cuda=device.type == "cuda")
    from meshplan.costmodel.hardware import cluster_names, load_cluster
    cluster = next((load_cluster(n) for n in cluster_names() if load_cluster(n).gpu.key ==
                    gpu.key), None)
    pcie = cluster.pcie_bytes_per_s if cluster else 25e9
    host_bw = calibration.host_memory_bytes_per_s.get(
        gpu.key, calibration.host_memory_bytes_per_s.get("default", 0.0))
    start = time.perf_counter()
    rows = []
    steps = (("gemm", lambda: gemm_rows(timer, device, dtype, dry_run=args.dry_run, peak=peak,
                                        cal=cal)),
             ("narrow_gemm", lambda: narrow_gemm_rows(timer, device, dtype,
                                                      dry_run=args.dry_run, peak=peak,
                                                      cal=cal)),
             ("attention", lambda: attention_rows(timer, device, dtype, dry_run=args.dry_run,
                                                  peak=peak, cal=cal)),
             ("tp_gemm", lambda: tp_gemm_rows(timer, device, dtype, dry_run=args.dry_run,
                                              peak=peak, hbm=gpu.hbm_bytes_per_s, cal=cal)),
             ("ring", lambda: ring_rows(timer, device, dtype, dry_run=args.dry_run, peak=peak,
                                        cal=cal)),
             ("launch", lambda: launch_rows(timer, device, dtype, cal)),
             ("float8", lambda: float8_rows(timer, device, dry_run=args.dry_run,
                                            peak=peak if args.dry_run else gpu.peak("fp8"),
                                            hbm=gpu.hbm_bytes_per_s, cal=cal)),
             ("loss", lambda: loss_rows(timer, device, dtype, dry_run=args.dry_run,
                                        hbm=gpu.hbm_bytes_per_s, cal=cal)),
             ("elementwise", lambda: elementwise_rows(timer, device, dtype,
                                                      dry_run=args.dry_run,
                                                      hbm=gpu.hbm_bytes_per_s, cal=cal)),
             ("host", lambda: host_rows(timer, device, dry_run=args.dry_run, pcie=pcie,
                                        calibration=calibration, host_bw=host_bw)))
    for name, step in steps:
        try:
            rows += step()
        except Exception as error:  # keep the other groups' figures
            rows.append(dict(group=name, case="failed", error=f"{type(error).__name__}: "
                             f"{str(error).splitlines()[0][:200] if str(error) else ''}"))
        print(f"{name}: done after {time.perf_counter() - start:.0f} s", file=sys.stderr,
              flush=True)
    name = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(0)
    title = (f"Kernel rates on {name} (catalog {gpu.key}, torch {torch.__version__}, "
             f"{os.cpu_count()} CPUs) vs the built-in calibration")
    text = markdown(rows, title)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"gpu-kernels-{'dryrun-cpu' if args.dry_run else gpu.key}-{dt.date.today()}"
    (args.out / f"{stem}.md").write_text(text + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps(
        {"device": name, "gpu": gpu.key, "torch": torch.__version__,
         "wall_s": time.perf_counter() - start, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
