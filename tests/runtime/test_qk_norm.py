"""Qwen3's query and key norms under tensor parallelism: each rank normalises its own heads,
so the norm weights' gradients are partial per rank and must be summed over the TP group
(``parallelize._block_plan``). Two gloo processes, with and without sequence parallelism, with
device-only collectives (``runtime/strict.py``); every gradient of the model must equal a
single process's on the same batch. tests/runtime/test_hf.py checks the layouts end to end
against ``transformers``; this checks the gradients themselves, where a missing reduction
shows as a factor of about 2 instead of a 1e-4 drift of the gradient norm."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from meshplan.costmodel import load_model

SPEC = dataclasses.replace(load_model("tiny"), name="tiny-qk-norm", qk_norm=True,
                           head_dim=32, num_layers=2, hf_model_type="qwen3")
"""The tiny decoder with Qwen3's norms and heads of 32 (query width 128, hidden 64)."""
TOKENS = (2, 17)
"""16 input positions: sequence parallelism needs them divisible by the TP degree."""
TIMEOUT_S = 120.0
GRAD_TOL = 1e-5


def _model():
    from meshplan.runtime.model import build_decoder

    model = build_decoder(SPEC, seed=5)
    with torch.no_grad():  # norm weights away from 1, alike in every process
        gen = torch.Generator().manual_seed(7)
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
    return model


def _loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _tokens() -> torch.Tensor:
    return torch.randint(0, SPEC.vocab_size, TOKENS, generator=torch.Generator().manual_seed(3))


def _worker(rank: int, port: int, sp: bool, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshplan.runtime import strict
    from meshplan.runtime.parallelize import apply_tensor_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    strict.install()
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = _model()
        apply_tensor_parallel(model, init_device_mesh("cpu", (2,)), sp=sp)
        _loss(model, _tokens()).backward()
        grads = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                 for name, p in model.named_parameters()}
        if rank == 0:
            Path(out).write_text(json.dumps({k: v.tolist() for k, v in grads.items()}))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_qk_norm_gradients_under_tp_equal_one_process(tmp_path, sp):
    reference = _model()
    _loss(reference, _tokens()).backward()
    out = tmp_path / "grads.json"
    context = mp.start_processes(_worker, args=(_free_port(), sp, str(out)), nprocs=2,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not context.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"2-process TP run did not finish in {TIMEOUT_S} s")
    got = json.loads(out.read_text())
    norms = [n for n in got if n.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(norms) == 2 * SPEC.num_layers
    for name, param in reference.named_parameters():
        diff = (torch.tensor(got[name]) - param.grad).abs().max().item()
        assert diff <= GRAD_TOL * max(1.0, param.grad.abs().max().item()), (name, diff)


def test_qk_norms_under_autocast_run_without_torchs_mixed_dtype_warning():
    """Under bf16 autocast the query and key norms get bf16 projections beside fp32 weights;
    torch's rms_norm then warns (once a process) that it cannot use its fused kernel, which
    every worker of a run printed. The attention silences that one warning
    (``model.MIXED_NORM_WARNING``): a fresh process training the qk-norm model prints none,
    where the same norm called on its own prints it."""
    import subprocess
    import sys

    from meshplan.runtime.model import MIXED_NORM_WARNING

    step = ("import torch, tests.runtime.test_qk_norm as t\n"
            "with torch.autocast('cpu', dtype=torch.bfloat16):\n"
            "    t._loss(t._model(), t._tokens()).backward()\n")
    alone = ("import torch\n"
             "torch.nn.RMSNorm(32)(torch.randn(2, 32, dtype=torch.bfloat16))\n")
    root = Path(__file__).resolve().parents[2]
    runs = {name: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 timeout=120, cwd=root)
            for name, code in (("step", step), ("alone", alone))}
    assert all(done.returncode == 0 for done in runs.values()), runs
    assert MIXED_NORM_WARNING not in runs["step"].stderr
    assert MIXED_NORM_WARNING in runs["alone"].stderr
