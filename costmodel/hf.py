"""Profile a HuggingFace ``transformers`` causal LM built from a local config, without weights.

The only module that imports ``transformers`` (the optional ``hf`` extra: ``pip install
-e .[hf]``), and only inside its functions, so ``import costmodel.hf`` works without it.
Nothing here touches the network: configs are read from a dict or a local ``config.json``
through ``AutoConfig.for_model`` (never ``from_pretrained`` on a hub name), models are built
with ``AutoModelForCausalLM.from_config`` on the meta device, and ``HF_HUB_OFFLINE=1`` is set
(unless the caller set it) before this module imports ``transformers`` (it cannot take effect
if the caller imported ``transformers`` first; nothing here needs the hub anyway).

``trace_hf`` runs one training step's forward and backward through
``costmodel.tracing.trace_module``. Its layers are the model's own modules, found by the
automatic descent of ``costmodel.tracing.top_level_layers``: for Llama ``model.embed_tokens``,
``model.rotary_emb``, ``model.layers.0`` ... ``model.norm``, ``lm_head``; for GPT-2
``transformer.wte``, ``transformer.wpe``, ``transformer.drop``, ``transformer.h.0`` ...
``transformer.ln_f``, ``lm_head``.

Where the fake-mode trace differs from a real run (forward FLOPs are the same):

* HF cannot tell fake position ids from packed sequences, so it passes SDPA an explicit
  [b, 1, s, s] causal mask instead of ``is_causal=True``; the CPU flash kernel still runs and
  does not save the mask;
* the CPU flash kernel has no dropout: with attention dropout > 0 (GPT-2's default
  ``attn_pdrop`` 0.1) SDPA takes the math path, which saves s x s probabilities and masks,
  where a CUDA flash kernel saves only its log-sum-exp. ``saved_bytes`` then overstates GPU
  memory, and attention backward counts 2x its forward (two batched matmuls per forward one)
  instead of the flash formula's 2.5x.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from meshplan.costmodel.tracing import LayerGraph, trace_module

if TYPE_CHECKING:
    import transformers

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "sdpa"
"""HF attention backend used for tracing: the same ``scaled_dot_product_attention`` kernels
the runtime calls (flash on CPU when there is no dropout, the math path with dropout)."""


QUIET_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")
"""Loggers that warn while ``from_config`` first imports transformers' torchao quantizer: the
CPU wheel lacks torchao's CUDA extensions, and torchao registers enums torch's pytree now
takes natively. Neither matters to a model built on meta; the warnings are held back there."""


@contextlib.contextmanager
def _quiet_imports() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in QUIET_IMPORT_LOGGERS]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


def _transformers() -> Any:
    """The ``transformers`` module, imported with the hub switched offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError as err:
        raise ImportError("costmodel.hf needs the optional 'transformers' package: "
                          "pip install -e '.[hf]'") from err
    return transformers


def knows_model_type(model_type: str) -> bool:
    """Whether the installed ``transformers`` has a config class for ``model_type``."""
    return model_type in _transformers().CONFIG_MAPPING


def hf_config(data: Mapping[str, Any] | str | os.PathLike[str]) -> transformers.PretrainedConfig:
    """A ``transformers`` config from a ``config.json`` dict, file, or folder holding one.

    ``model_type`` picks the config class (``AutoConfig.for_model``); every other key is passed
    to it. A string must be an existing local path: hub names are refused, never downloaded.
    """
    if isinstance(data, Mapping):
        fields = dict(data)
    else:
        path = Path(data).expanduser()
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"HF config {os.fspath(data)!r} is not a local config.json or a "
                             f"folder holding one (hub names are not fetched)")
        fields = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(fields, dict):
            raise ValueError(f"{path}: expected a JSON object, got {type(fields).__name__}")
    model_type = fields.pop("model_type", None)
    if not model_type:
        raise ValueError(f"HF config needs a 'model_type' (e.g. 'llama', 'gpt2'); got keys "
                         f"{sorted(fields)}")
    return _transformers().AutoConfig.for_model(model_type, **fields)


def hf_factory(config: transformers.PretrainedConfig) -> Callable[[], nn.Module]:
    """A zero-argument factory of ``AutoModelForCausalLM.from_config(config)`` in train mode.

    Attention is ``ATTN_IMPLEMENTATION``. ``trace_module`` calls the factory under
    ``torch.device("meta")``, so no weight is allocated.
    """
    transformers = _transformers()

    def build() -> nn.Module:
        with _quiet_imports():
            try:
                model = transformers.AutoModelForCausalLM.from_config(
                    config, attn_implementation=ATTN_IMPLEMENTATION)
            except ValueError as err:  # a model without an SDPA path (Gemma 2's soft-capping)
                if "attention implementation" not in str(err):
                    raise
                logger.info("%s: %s; tracing its eager attention", type(config).__name__, err)
                model = transformers.AutoModelForCausalLM.from_config(
                    config, attn_implementation="eager")
        return model.train()

    return build


def training_inputs(batch_size: int, seq_len: int) -> dict[str, Any]:
    """Keyword inputs of one training micro-batch of a HF causal LM: integer token ids as both
    ``input_ids`` and ``labels``, so the model computes its own shifted cross-entropy (whose
    fp32 log-softmax is what a training step keeps for the loss's backward), and
    ``use_cache=False``, as training runs (no key/value cache is built: hybrid models such as
    Qwen3-Next and Jamba cannot build one in a training forward)."""
    ids = torch.zeros((batch_size, seq_len), dtype=torch.long)
    return {"input_ids": ids, "labels": ids, "use_cache": False}


def causal_lm_loss(output: Any) -> torch.Tensor:
    """The loss a HF causal LM computed from ``training_inputs``' labels."""
    return output.loss


def trace_hf(config: transformers.PretrainedConfig | Mapping[str, Any] | str
               | os.PathLike[str], *, micro_batch: int, seq_len: int,
               dtype: torch.dtype = torch.bfloat16) -> LayerGraph:
    """Layer graph of one training step of a HF causal LM on ``micro_batch`` x ``seq_len`` tokens.

    ``config``: a ``PretrainedConfig`` or anything ``hf_config`` reads. Inputs are integer token
    ids passed as both ``input_ids`` and ``labels`` (``use_cache=False``), so the model computes
    its own shifted cross-entropy as in training and that loss is backpropagated. The loss adds
    no FLOPs (no matmul); the fp32 log-softmax of the logits it saves for backward counts in
    ``total_saved_bytes`` outside any layer. ``dtype``: parameters and buffers are cast to it.
    Learned position tables (GPT-2) are not checked against ``seq_len``.
    """
    if micro_batch <= 0 or seq_len <= 0:
        raise ValueError(f"micro_batch and seq_len must be positive, got {micro_batch}, "
                         f"{seq_len}")
    transformers = _transformers()
    if not isinstance(config, transformers.PretrainedConfig):
        config = hf_config(config)

    logger.debug("tracing %s with %d x %d tokens in %s", type(config).__name__, micro_batch,
                 seq_len, dtype)
    return trace_module(hf_factory(config),
                        example_inputs=lambda: training_inputs(micro_batch, seq_len),
                        dtype=dtype, loss_fn=causal_lm_loss)
