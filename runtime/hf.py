"""HuggingFace checkpoints in and out of the runtime's decoder (Llama, Mistral, Qwen2, Qwen3).

The decoder of ``model.py`` computes what ``transformers``' ``LlamaForCausalLM`` (and
``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``) compute: pre-norm RMSNorm
blocks, rotate-half RoPE with the config's ``rope_theta``, grouped-query attention, a SwiGLU
MLP, Q/K/V biases for Qwen2, per-head query and key RMSNorms for Qwen3, Mistral's sliding
window, the config's norm epsilon. So an HF checkpoint maps onto it name by name
(``hf_name``):

    model.embed_tokens                       tok_embeddings
    model.layers.<i>.input_layernorm          layers.<i>.attention_norm
    model.layers.<i>.self_attn.{q,k,v,o}_proj layers.<i>.attention.{wq,wk,wv,wo}
    model.layers.<i>.self_attn.{q,k}_norm     layers.<i>.attention.{q,k}_norm  (Qwen3)
    model.layers.<i>.post_attention_layernorm layers.<i>.ffn_norm
    model.layers.<i>.mlp.{gate,up,down}_proj  layers.<i>.feed_forward.{w1,w3,w2}
    model.norm                                norm
    lm_head                                   output (absent when the embeddings are tied)

Loading (``SliceReader``) fills a stage built on ``meta`` and already sharded by tensor
parallelism and FSDP (``materialize.py``): a rank reads from the safetensors files (one file,
or several with ``model.safetensors.index.json``) only its own region of its own stage's
tensors, by name (``safetensors.safe_open(...).get_slice``).

Saving (``save``) gathers each pipeline stage's full tensors (``get_model_state_dict`` with
``full_state_dict``: a collective of the stage's ranks), and the first tensor- and
data-parallel rank of each stage writes ``model-<k>-of-<n>.safetensors``; global rank 0 writes
the index, ``config.json`` (the ``--init-from`` directory's, else one made from the spec) and
copies the tokenizer files. ``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads
the result.

torch / library APIs: ``safetensors.safe_open``, ``safetensors.torch.save_file``,
``torch.distributed.checkpoint.state_dict.get_model_state_dict``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshplan.costmodel.model import ModelSpec
from meshplan.runtime.materialize import clean_name

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")
HF_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
"""HF architectures whose weights map onto the runtime's decoder."""
_BLOCK = {"attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
          "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
          "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
          "feed_forward.w2": "mlp.down_proj",
          "attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm"}
_QK_NORMS = ("attention.q_norm", "attention.k_norm")
"""``_BLOCK`` entries only a model with ``qk_norm`` (Qwen3) has."""
_TOP = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)")


def check_mappable(spec: ModelSpec, *, what: str) -> str:
    """The HF ``model_type`` ``spec`` maps to; ValueError (one line) when it maps to none."""
    model_type = spec.hf_model_type or ("qwen3" if spec.qk_norm else
                                        "qwen2" if spec.qkv_bias else "llama")
    problems = []
    if model_type not in HF_MODEL_TYPES:
        problems.append(f"HF model_type {model_type!r} (supported: {', '.join(HF_MODEL_TYPES)})")
    if spec.activation != "swiglu" or spec.norm != "rmsnorm" or spec.position_embedding != "rope":
        problems.append("not a SwiGLU / RMSNorm / RoPE decoder")
    if spec.linear_bias or spec.embedding_norm or spec.is_moe or spec.is_traced:
        problems.append("biases on every linear, an embedding norm, experts or a traced module")
    if spec.qk_norm != (model_type == "qwen3"):
        problems.append("query and key norms (qk_norm) outside Qwen3" if spec.qk_norm
                        else "Qwen3 without its query and key norms (qk_norm)")
    if spec.qk_norm and spec.qkv_bias:
        problems.append("query and key norms with Q/K/V biases (Qwen3 has no biases)")
    if spec.sliding_window is not None and model_type != "mistral":
        problems.append(f"a sliding window of {spec.sliding_window} tokens (only Mistral has one)")
    if problems:
        raise ValueError(f"{what}: {spec.name} has no HuggingFace Llama/Mistral/Qwen2/Qwen3 "
                         f"equivalent: {'; '.join(problems)}")
    return model_type


def hf_name(name: str) -> str:
    """The HF tensor name of the decoder's parameter ``name`` (global layer indices)."""
    match = _LAYER.fullmatch(name)
    if match:
        layer, part, kind = match.groups()
        if part not in _BLOCK:
            raise KeyError(name)
        return f"model.layers.{layer}.{_BLOCK[part]}.{kind}"
    module, _, kind = name.rpartition(".")
    if module not in _TOP:
        raise KeyError(name)
    return f"{_TOP[module]}.{kind}"


def _files(directory: str) -> dict[str, str]:
    """HF tensor name -> safetensors file holding it; ValueError (one line) for an index
    without a weight map, or a file that is missing or has no readable safetensors header
    (only headers are read)."""
    index = os.path.join(directory, INDEX)
    if os.path.isfile(index):
        from meshplan.costmodel.jsonio import parse_json_document

        with open(index, encoding="utf-8") as handle:
            document = parse_json_document(handle.read(), origin=index)
        weight_map = document.get("weight_map") if isinstance(document, dict) else None
        if not isinstance(weight_map, dict) or not all(
                isinstance(file, str) for file in weight_map.values()):
            raise ValueError(f"{index}: no 'weight_map' of tensor names to file names")
        files = {name: os.path.join(directory, file) for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            _tensor_names(file)
        return files
    single = os.path.join(directory, SINGLE)
    if not os.path.isfile(single):
        raise ValueError(f"--init-from {directory}: no {SINGLE} and no {INDEX} (safetensors "
                         "weights are needed; save with save_pretrained(safe_serialization=True))")
    return {name: single for name in _tensor_names(single)}


def _tensor_names(file: str) -> list[str]:
    """The tensor names in a safetensors file's header."""
    from safetensors import safe_open

    if not os.path.isfile(file):
        raise ValueError(f"{file}: no such file (named by {INDEX})")
    try:
        with safe_open(file, framework="pt") as handle:
            return list(handle.keys())
    except Exception as error:  # safetensors raises its own SafetensorError
        raise ValueError(f"{file}: not a safetensors file ({error})") from None


def check_directory(directory: str, spec: ModelSpec) -> None:
    """ValueError (one line) unless ``directory`` holds an HF checkpoint of ``spec``: its
    config describes the same architecture and every tensor the decoder needs is there. For a
    model traced from an HF config (``hf-config:PATH``): ``check_traced_directory``."""
    from meshplan.costmodel.jsonio import parse_json_document
    from meshplan.costmodel.models import from_hf_config

    if traced_from_hf_config(spec):
        check_traced_directory(directory, spec)
        return
    check_mappable(spec, what="--init-from")
    path = os.path.join(directory, CONFIG)
    if not os.path.isfile(path):
        raise ValueError(f"--init-from {directory}: no {CONFIG}")
    with open(path, encoding="utf-8") as handle:
        theirs = from_hf_config(parse_json_document(handle.read(), origin=path),
                                name=spec.name, origin=path)
    fields = ("num_layers", "hidden_size", "num_heads", "kv_heads", "head_size",
              "ffn_hidden_size", "vocab_rows", "qkv_bias", "tied_embeddings", "rope_theta",
              "norm_eps", "sliding_window")
    differ = [f"{f} {getattr(theirs, f)} (plan: {getattr(spec, f)})" for f in fields
              if getattr(theirs, f) != getattr(spec, f)]
    if differ:
        raise ValueError(f"--init-from {directory}: its config is another model than the "
                         f"plan's: {', '.join(differ)}")
    names = _files(directory)
    wanted = ["model.embed_tokens.weight", "model.norm.weight"] + (
        [] if spec.tied_embeddings else ["lm_head.weight"])
    parts = [hf for ours, hf in _BLOCK.items() if spec.qk_norm or ours not in _QK_NORMS]
    wanted += [f"model.layers.{i}.{part}.weight" for i in range(spec.num_layers)
               for part in parts]
    missing = [name for name in wanted if name not in names]
    if missing:
        raise ValueError(f"--init-from {directory}: {len(missing)} tensors are missing, e.g. "
                         f"{missing[0]}")


def traced_from_hf_config(spec: ModelSpec) -> bool:
    """``spec`` is a transformers model traced from an HF config (``refs.HF_CONFIG_REF``)."""
    from meshplan.costmodel.refs import HF_CONFIG_REF

    return spec.is_traced and spec.factory.startswith(HF_CONFIG_REF)


def _module_tensor_shapes(spec: ModelSpec) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """The state-dict names and shapes of ``spec``'s transformers module, built on meta, and
    the names that alias another tensor of it (tied weights, which checkpoints store once)."""
    from meshplan.costmodel.factory import build_meta, load_factory

    module = build_meta(load_factory(spec.factory), ref=spec.factory)
    state = module.state_dict(keep_vars=True)
    seen: set[int] = set()
    aliases = set()
    for name, tensor in state.items():
        if id(tensor) in seen:
            aliases.add(name)
        seen.add(id(tensor))
    return {name: tuple(t.shape) for name, t in state.items()}, aliases


def _by_file(files: dict[str, str], names: Iterable[str]) -> dict[str, list[str]]:
    """``names`` (those ``files`` holds) grouped by the safetensors file holding them."""
    groups: dict[str, list[str]] = {}
    for name in names:
        if name in files:
            groups.setdefault(files[name], []).append(name)
    return groups


def check_traced_directory(directory: str, spec: ModelSpec) -> None:
    """ValueError (one line) unless ``directory``'s safetensors hold every tensor of ``spec``'s
    traced transformers module with its shape (a tied alias may be stored once); only the
    headers are read. The run loads them by name into the whole module
    (``load_traced_weights``)."""
    if spec.traced_chain:
        raise ValueError(f"--init-from: {spec.name} is traced as a chain of layers; the runtime "
                         f"loads HF weights into traced modules it runs whole only")
    files = _files(directory)
    shapes, aliases = _module_tensor_shapes(spec)
    missing = [name for name in shapes if name not in files and name not in aliases]
    if missing:
        raise ValueError(f"--init-from {directory}: {len(missing)} of the tensors of "
                         f"{spec.name}'s module are missing, e.g. {missing[0]}")
    from safetensors import safe_open

    for file, names in _by_file(files, shapes).items():
        with safe_open(file, framework="pt") as handle:
            for name in names:
                stored = tuple(handle.get_slice(name).get_shape())
                if stored != shapes[name]:
                    raise ValueError(f"--init-from {directory}: {name} has shape {stored}, "
                                     f"the plan's model needs {shapes[name]}")


def load_traced_weights(module: nn.Module, directory: str) -> int:
    """Copy the tensors of the HF checkpoint in ``directory`` into the transformers ``module``
    (whole, before it is sharded) by state-dict name; tied aliases follow their tensor. Returns
    the bytes read."""
    from safetensors import safe_open

    files = _files(directory)
    state = module.state_dict(keep_vars=True)
    done: set[int] = set()
    read = 0
    with torch.no_grad():
        for file, names in _by_file(files, state).items():
            with safe_open(file, framework="pt") as handle:
                for name in names:
                    if id(state[name]) in done:
                        continue
                    value = handle.get_tensor(name)
                    state[name].copy_(value)
                    done.add(id(state[name]))
                    read += value.numel() * value.element_size()
    return read


class SliceReader:
    """A ``materialize.Fill`` that reads each parameter's region from the HF checkpoint in
    ``directory``: only this rank's rows / columns of this stage's tensors
    (``safe_open(...).get_slice``). Each tensor's file is opened for that tensor only, so the
    mapped pages of one file do not pile up in the rank's memory."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.files = _files(directory)
        self.bytes_read = 0

    def __call__(self, name: str, shape: tuple[int, ...],
                 region: Sequence[slice]) -> torch.Tensor:
        from safetensors import safe_open

        key = hf_name(name)
        if key not in self.files and key == "lm_head.weight":  # tied in the checkpoint
            key = "model.embed_tokens.weight"
        if key not in self.files:
            raise ValueError(f"--init-from {self.directory}: no tensor {key}")
        with safe_open(self.files[key], framework="pt") as handle:
            part = handle.get_slice(key)
            if tuple(part.get_shape()) != tuple(shape):
                raise ValueError(f"--init-from {self.directory}: {key} has shape "
                                 f"{tuple(part.get_shape())}, the plan's model needs {shape}")
            tensor = part[tuple(region)]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


def check_savable(spec: ModelSpec) -> None:
    """ValueError (one line) unless ``--save-hf`` can write ``spec``: the built-in decoder's
    HF architectures (``check_mappable``), or a transformers model traced from its HF config
    and run whole."""
    if traced_from_hf_config(spec):
        if spec.traced_chain:
            raise ValueError(f"--save-hf: {spec.name} is traced as a chain of layers; the "
                             f"runtime writes traced modules it runs whole only")
        return
    check_mappable(spec, what="--save-hf")


def save(modules: Sequence[nn.Module], directory: str, *, spec: ModelSpec, stage_indices:
         Sequence[int], num_stages: int, writer: bool, source: str | None) -> None:
    """Write the HF checkpoint of the model held by ``modules`` into ``directory`` (every rank
    calls it; ``writer``: this rank writes its stages' files)."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if traced_from_hf_config(spec):
        _save_traced(modules, directory, spec=spec, source=source)
        return

    options = StateDictOptions(full_state_dict=True)
    written: dict[str, str] = {}
    for module, index in zip(modules, stage_indices):
        state = get_model_state_dict(module, options=options)  # collective of the stage
        if not writer:
            continue
        tensors = {}
        for name, value in state.items():
            local = value.full_tensor() if hasattr(value, "full_tensor") else value
            tensors[hf_name(clean_name(name))] = local.detach().to("cpu").contiguous()
        if spec.tied_embeddings:
            tensors.pop("lm_head.weight", None)
        file = f"model-{index + 1:05d}-of-{num_stages:05d}.safetensors"
        os.makedirs(directory, exist_ok=True)
        save_file(tensors, os.path.join(directory, file), metadata={"format": "pt"})
        written.update({name: file for name in tensors})
    gathered: list[dict[str, str]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, written)
    if dist.get_rank() == 0:
        weight_map = {name: file for part in gathered for name, file in part.items()}
        _write_json(os.path.join(directory, INDEX), {"metadata": {}, "weight_map": dict(
            sorted(weight_map.items()))})
        _write_config(directory, spec, source)
    dist.barrier()


def _save_traced(modules: Sequence[nn.Module], directory: str, *, spec: ModelSpec,
                 source: str | None) -> None:
    """``save`` of a transformers model traced from its HF config and run whole (one module
    on every rank, data parallel only): its full state under its own names, a tied alias
    once, into one ``model.safetensors`` beside the traced ``config.json`` (and the source's
    tokenizer files); global rank 0 writes."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from meshplan.costmodel.refs import HF_CONFIG_REF

    (module,) = modules
    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    if dist.get_rank() == 0:
        _, aliases = _module_tensor_shapes(spec)
        tensors = {}
        for name, value in state.items():
            key = clean_name(name)
            if key in aliases:
                continue
            local = value.full_tensor() if hasattr(value, "full_tensor") else value
            tensors[key] = local.detach().to("cpu").contiguous()
        os.makedirs(directory, exist_ok=True)
        save_file(tensors, os.path.join(directory, SINGLE), metadata={"format": "pt"})
        config = spec.factory[len(HF_CONFIG_REF):]
        if os.path.isdir(config):
            config = os.path.join(config, CONFIG)
        shutil.copyfile(config, os.path.join(directory, CONFIG))
        if source is not None:
            for name in _present(source, TOKENIZER_FILES):
                shutil.copyfile(os.path.join(source, name), os.path.join(directory, name))
    dist.barrier()


def _write_json(path: str, data: Any) -> None:
    with open(path, "w") as handle:
        json.dump(data, handle, indent=2)
        handle.write("\n")


def _write_config(directory: str, spec: ModelSpec, source: str | None) -> None:
    """``config.json`` (the source checkpoint's, else made from ``spec``) and the tokenizer."""
    if source is not None:
        shutil.copyfile(os.path.join(source, CONFIG), os.path.join(directory, CONFIG))
        for name in _present(source, TOKENIZER_FILES):
            shutil.copyfile(os.path.join(source, name), os.path.join(directory, name))
        return
    _write_json(os.path.join(directory, CONFIG), hf_config_of(spec))


def _present(directory: str, names: Iterable[str]) -> list[str]:
    return [n for n in names if os.path.isfile(os.path.join(directory, n))]


def hf_config_of(spec: ModelSpec) -> dict[str, Any]:
    """An HF ``config.json`` for ``spec`` (Llama, Qwen2 with Q/K/V biases, Qwen3 with query
    and key norms)."""
    model_type = check_mappable(spec, what="--save-hf")
    return {"architectures": [HF_MODEL_TYPES[model_type]], "model_type": model_type,
            "hidden_size": spec.hidden_size, "intermediate_size": spec.ffn_hidden_size,
            "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
            "num_key_value_heads": spec.kv_heads, "head_dim": spec.head_size,
            "vocab_size": spec.vocab_rows, "max_position_embeddings": spec.seq_len,
            "rms_norm_eps": spec.norm_eps, "rope_theta": spec.rope_theta,
            "tie_word_embeddings": spec.tied_embeddings, "hidden_act": "silu",
            "attention_bias": False, "torch_dtype": "float32",
            **({"sliding_window": spec.sliding_window} if model_type == "mistral" else {})}
