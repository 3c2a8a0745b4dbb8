"""Training data: one deterministic global batch per step, whatever the parallel layout.

Every rank builds the *whole* global batch of a step (``global_batch``) from the seed and the
step number and then takes its own rows (``replica_rows``), so a dp=4 run sees exactly the
sequences a single process sees, in the same order. Two sources:

* synthetic (default): arithmetic token sequences ``t_i = (start + stride * i) mod V'`` over
  the lowest quarter of the vocabulary (V' = V / 4), with a random start and a stride below 8
  per sequence. The model learns within the first steps (the unused three quarters of the
  vocabulary at once, then the strides), so each update moves the loss by percents and a
  wrong gradient in some layout shows up in the loss curve;
* a token file (``--data FILE``): a flat array of token ids read with ``numpy.memmap``
  (uint16 when the vocabulary fits, else int32, or as named by ``token_dtype``); step k reads
  the B (s + 1)-token windows that follow step k-1's, wrapping at the end of the file, or,
  with ``shuffle`` (text corpora tokenized by ``corpus.py``), B windows in a seeded order.

Each row holds s + 1 tokens: inputs are ``row[:-1]``, targets ``row[1:]``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

_STEP_SEED_STRIDE = 1_000_003
"""Spaces the per-step generator seeds apart (a prime, so steps of different runs rarely meet)."""
SYNTHETIC_VOCAB_FRACTION = 4
"""Synthetic tokens use the lowest 1/4 of the vocabulary."""
SYNTHETIC_MAX_STRIDE = 8
"""Synthetic sequences step by 1..7 tokens."""


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """Where tokens come from and the shape of a global batch."""

    global_batch_size: int
    """Sequences per optimizer step (B)."""
    seq_len: int
    """Tokens per sequence fed to the model (s); each row holds s + 1 tokens."""
    vocab_size: int
    """Token ids are below this (V)."""
    seed: int = 0
    """Synthetic data seed."""
    token_file: str | None = None
    """Flat token-id file (numpy memmap), or None for synthetic data."""
    token_dtype: str | None = None
    """``uint16`` or ``int32``; None picks uint16 when V <= 65536."""
    shuffle: bool = False
    """Read the token file's (s + 1)-token windows in a seeded random order, a new one per
    pass over the file (text corpora, ``corpus.py``); False: in file order."""

    def __post_init__(self) -> None:
        if self.token_dtype not in (None, "uint16", "int32"):
            raise ValueError(f"token_dtype must be uint16 or int32, got {self.token_dtype!r}")


def global_batch(spec: DataSpec, step: int) -> torch.Tensor:
    """Token ids ``[B, s + 1]`` (int64) of step ``step``; identical on every rank."""
    if spec.token_file is not None:
        return _file_batch(spec, step)
    gen = torch.Generator().manual_seed(spec.seed * _STEP_SEED_STRIDE + step)
    rows = spec.global_batch_size
    used = max(2, spec.vocab_size // SYNTHETIC_VOCAB_FRACTION)
    start = torch.randint(0, used, (rows, 1), generator=gen)
    stride = torch.randint(1, SYNTHETIC_MAX_STRIDE, (rows, 1), generator=gen)
    positions = torch.arange(spec.seq_len + 1).unsqueeze(0)
    return (start + stride * positions) % used


def token_dtype(spec: DataSpec) -> str:
    """The token file's dtype: ``spec.token_dtype``, else uint16 when V <= 65536, else int32."""
    return spec.token_dtype or ("uint16" if spec.vocab_size <= 2 ** 16 else "int32")


@functools.lru_cache(maxsize=2)
def _pass_order(seed: int, epoch: int, windows: int) -> np.ndarray:
    """The window order of pass ``epoch`` (made once per pass, not once per step; a step
    spans at most two passes)."""
    return np.random.default_rng([seed, epoch]).permutation(windows)


def _shuffled_index(spec: DataSpec, step: int, size: int) -> np.ndarray:
    """Token positions of step ``step``'s rows when shuffling: sample i = step * B + r is
    window ``perm_e[i mod n]`` of the n whole windows, perm_e a permutation seeded by (seed,
    pass e = i div n). A function of seed and step only: resuming needs no other state."""
    row = spec.seq_len + 1
    windows = size // row
    samples = step * spec.global_batch_size + np.arange(spec.global_batch_size)
    chosen = np.empty(spec.global_batch_size, dtype=np.int64)
    for epoch in np.unique(samples // windows):
        order = _pass_order(spec.seed, int(epoch), windows)
        mask = samples // windows == epoch
        chosen[mask] = order[samples[mask] % windows]
    return (chosen[:, None] * row + np.arange(row)[None, :]).reshape(-1)


def _file_batch(spec: DataSpec, step: int) -> torch.Tensor:
    dtype = token_dtype(spec)
    path = Path(spec.token_file)
    tokens = np.memmap(path, dtype=dtype, mode="r")
    row = spec.seq_len + 1
    need = spec.global_batch_size * row
    if tokens.size < row:
        raise ValueError(f"--data {path}: {tokens.size} tokens, fewer than one sequence "
                         f"of {row}")
    if spec.shuffle:
        index = _shuffled_index(spec, step, tokens.size)
    else:
        start = (step * need) % tokens.size
        index = (start + np.arange(need)) % tokens.size
    batch = torch.from_numpy(tokens[index].astype(np.int64)).view(spec.global_batch_size, row)
    if int(batch.max()) >= spec.vocab_size:
        raise ValueError(f"--data {path}: token id {int(batch.max())} >= vocab size "
                         f"{spec.vocab_size}")
    return batch


def replica_rows(batch: torch.Tensor, *, dp_rank: int, dp: int) -> torch.Tensor:
    """Rows of data-parallel replica ``dp_rank``: the ``dp_rank``-th of ``dp`` equal slices."""
    rows = batch.shape[0] // dp
    return batch[dp_rank * rows:(dp_rank + 1) * rows]


def split_inputs_targets(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs ``rows[:, :-1]``, targets ``rows[:, 1:]``), both contiguous."""
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
