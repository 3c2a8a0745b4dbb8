"""Checkpoints with torch.distributed.checkpoint (DCP): atomic saves, the latest one, resume.

Layout of ``--checkpoint-dir DIR``::

    DIR/
      latest                "step-4": the last committed checkpoint (replaced with os.replace)
      step-2/               committed after optimizer step 2 (steps count from 1)
      step-4/
        .metadata           DCP: every key's global shape, and which file holds each shard
        __<r>_0.distcp      DCP data, one file per rank r that wrote shards
        train_state.json    step, data stream, model, recipe; loss, step time, gradient
                            norm and learning rate of steps 1..4
        checksums.json      size and SHA-256 of every other file (integrity.py)
      step-6.tmp/           a save in progress, or an interrupted one: never read

Keys, the same under every layout (DCP joins nested keys with dots)::

    model.<fqn>                                    a parameter of the whole model
    optimizer.<fqn>.step / .exp_avg / .exp_avg_sq  its AdamW state

``<fqn>`` is the parameter's name in the whole, unsplit model (``layers.3.attention.wq.weight``):
pipeline chunks key their blocks by global layer index (model.py), ``get_model_state_dict``
drops wrapper prefixes (DDP's ``module.``; ``checkpoint_wrapper``'s) and ``_fqn`` does the same
for the optimizer's parameters. Tensor parallelism, FSDP2 and ``replicate`` hold DTensors, whose
shards DCP places by global offset; replicas are written once. So a checkpoint saved under one
plan loads under any other plan of the same model (tp, pp, vpp, dp, ZeRO stage, offload): every
rank asks for the pieces it now holds and DCP reads them wherever they were written. Under ZeRO-1
a rank saves and loads the AdamW states of the parameters it owns only (``optim.adamw_states``).

Save (``save``, collective): rank 0 clears a stale ``step-K.tmp`` or uncommitted ``step-K`` and
creates ``step-K.tmp``; barrier; every rank writes its shards with ``dcp.save`` (it returns after
rank 0 has written ``.metadata``, which it does once every rank's data is written), rank 0 adds
``train_state.json``; barrier; the ranks hash the folder's files in parallel and rank 0
writes ``checksums.json``; rank 0 renames ``step-K.tmp`` to ``step-K`` and then points
``latest`` at it (``latest.tmp`` written, fsynced, ``os.replace``d); barrier. ``latest`` is the
commit record: a save interrupted anywhere before that ``os.replace`` leaves ``latest`` on the
previous checkpoint. All nodes must see DIR (a shared file system).

With ``keep_last`` K (``--keep-last``) rank 0 then deletes all but the K newest committed
folders (``prune``); ``latest``'s is never deleted.

Integrity: ``meshplan run --resume`` checks the sizes of the latest checkpoint's files against
its manifest before any worker starts (a truncated shard is refused with exit code 2), and
``load`` re-hashes every file first (the ranks share the work) and refuses, on every rank with
one line, a checkpoint whose bytes changed (random bytes, zeroed blocks): it is never loaded.

Resume (``load``, collective) restores the parameters, the AdamW moments and step counts, the
step counter, and the loss log and step times of steps 1..K (``TrainState``), so a run's report
lists one loss per step even across restarts, the steps after K being run again. The data of
step k is a pure function of the data stream (seed, token file, batch shape) and k (data.py),
so K is the data position; training draws nothing from global random generators (no dropout;
weights and data use their own seeded generators), so there is no RNG state to keep. A resume
with another data stream, model or training recipe is refused (``check_compatible``); the
recipe (``recipe.Recipe``: learning-rate schedule, AdamW hyperparameters, clipping) is saved
in ``train_state.json`` with the gradient norms and learning rates of steps 1..K, and the
learning rate of a step is a function of the recipe and the step alone, so the schedule
continues exactly.

torch APIs: ``torch.distributed.checkpoint.save`` / ``load``;
``torch.distributed.checkpoint.state_dict.get_model_state_dict`` / ``set_model_state_dict``.
The optimizer half comes from ``optim.adamw_states`` rather than ``get_optimizer_state_dict``,
which cannot see these optimizers' states: ``ZeroRedundancyOptimizer.state_dict`` gathers
everything on one rank, the offloaded and TP ZeRO-1 optimizers keep states in inner optimizers
(keyed by host copies, or on owner ranks only), and one optimizer spans all pipeline chunks of
a rank while ``get_optimizer_state_dict`` takes one module.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshplan.costmodel.model import ModelSpec
from meshplan.runtime import integrity
from meshplan.runtime.materialize import clean_name
from meshplan.runtime.data import DataSpec

# DCP (torch.distributed.checkpoint) and optim.py (torch.distributed.optim) are imported by the
# functions that save and load: ``meshplan run``'s launching process imports this module for
# its checks only (``worker.import_training``).

LATEST = "latest"
"""Pointer file naming the last committed checkpoint folder."""
TRAIN_STATE = "train_state.json"
DCP_METADATA = ".metadata"
TMP_SUFFIX = ".tmp"
_STEP_NAME = re.compile(r"step-(\d+)")
_MODEL_FIELDS_IGNORED = ("name", "source", "reported_params", "hf_model_type")
"""ModelSpec fields that do not change the weights (a renamed model still resumes)."""


@dataclass(frozen=True, kw_only=True)
class TrainState:
    """What a checkpoint keeps besides tensors (``train_state.json``)."""

    step: int
    """Optimizer steps done (K)."""
    losses: tuple[float, ...]
    """Global mean loss of steps 1..K."""
    step_s: tuple[float, ...]
    """Step times of steps 1..K, seconds (the slowest rank's)."""
    data: dict[str, Any]
    """The data stream (``data_stream``)."""
    model: dict[str, Any]
    """The architecture (``architecture``)."""
    plan: dict[str, Any]
    """The plan that saved it (for people; a resume may use another)."""
    recipe: dict[str, Any] | None = None
    """The training recipe (``recipe.Recipe`` as a dict); a resume must use the same."""
    grad_norms: tuple[float, ...] = ()
    """Gradient norms of steps 1..K (before clipping)."""
    lrs: tuple[float, ...] = ()
    """Learning rates of steps 1..K."""
    run_id: str | None = None
    """The rendezvous id of the job that saved it (an elastic job's later attempts and nodes
    continue their own run's checkpoints without ``--resume``)."""

    def __post_init__(self) -> None:
        series = (self.losses, self.step_s, self.grad_norms, self.lrs)
        if self.step < 1 or any(len(values) != self.step for values in series):
            raise ValueError(f"a train state after step {self.step} needs {self.step} losses, "
                             f"step times, gradient norms and learning rates, got "
                             f"{[len(values) for values in series]}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "TrainState":
        data = json.loads(text)
        series = ("losses", "step_s", "grad_norms", "lrs")
        return cls(**{**data, **{key: tuple(data.get(key, ())) for key in series}})


def data_stream(spec: DataSpec) -> dict[str, Any]:
    """What decides the batches of each step (data.py), as JSON."""
    token_file = os.path.abspath(spec.token_file) if spec.token_file else None
    return {**dataclasses.asdict(spec), "token_file": token_file}


def architecture(model: ModelSpec) -> dict[str, Any]:
    """The fields of ``model`` that shape or initialise the weights, as JSON."""
    fields = dataclasses.asdict(model)
    return json.loads(json.dumps({k: v for k, v in fields.items()
                                  if k not in _MODEL_FIELDS_IGNORED}))


def _model_defaults() -> dict[str, Any]:
    """``architecture``'s keys that have a default, at it, as JSON: a checkpoint saved before
    a field existed holds a model with that field at its default (``qk_norm``, say)."""
    defaults = {}
    for f in dataclasses.fields(ModelSpec):
        if f.name in _MODEL_FIELDS_IGNORED:
            continue
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = f.default_factory()
    return json.loads(json.dumps(defaults))


def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step}")


def latest_step(directory: str) -> int | None:
    """The step of the last committed checkpoint in ``directory`` (``latest``), or None.

    ``step-K.tmp`` folders are never considered. ValueError when ``latest`` names something
    that is not a complete checkpoint.
    """
    pointer = os.path.join(directory, LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as handle:
        name = handle.read().strip()
    match = _STEP_NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"{pointer}: expected 'step-<N>', found {name!r}")
    folder = os.path.join(directory, name)
    for required in (DCP_METADATA, TRAIN_STATE, integrity.CHECKSUMS):
        if not os.path.isfile(os.path.join(folder, required)):
            raise ValueError(f"{pointer} names {folder}, which has no {required}: not a "
                             "complete checkpoint")
    return int(match.group(1))


def read_train_state(directory: str, step: int) -> TrainState:
    with open(os.path.join(step_dir(directory, step), TRAIN_STATE)) as handle:
        return TrainState.from_json(handle.read())


def check_compatible(state: TrainState, *, data: dict[str, Any], model: dict[str, Any],
                     recipe: dict[str, Any], steps: int, where: str) -> None:
    """Raise ValueError unless a run of ``steps`` steps on ``data`` and ``model`` under
    ``recipe`` can continue from ``state`` (saved at ``where``): same data stream, same
    architecture (model fields the checkpoint predates taken at their defaults), same recipe
    (so the learning-rate schedule continues exactly; a checkpoint without one is taken as
    saved under this one), K <= steps."""
    checks = [("data stream", state.data, data),
              ("model", {**_model_defaults(), **state.model}, model)]
    if state.recipe is not None:
        checks.append(("training recipe", state.recipe, recipe))
    for what, saved, now in checks:
        changed = sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k))
        if changed:
            detail = ", ".join(f"{k} {saved.get(k)!r} -> {now.get(k)!r}" for k in changed)
            raise ValueError(f"{where} was saved with another {what} ({detail}); a resume "
                             "continues the same one")
    if state.step > steps:
        raise ValueError(f"{where} is past --steps {steps} (it holds {state.step} steps)")


def check_start(directory: str | None, *, resume: bool, saving: bool, restarted: bool,
                data: dict[str, Any], model: dict[str, Any], recipe: dict[str, Any],
                steps: int, run_id: str | None = None) -> None:
    """Raise ValueError when a run cannot start as asked (before any work): ``resume`` without
    a committed checkpoint, a checkpoint it would continue (``resume``, or ``restarted`` by
    torchrun) that is incompatible, or saving into a folder that holds checkpoints without
    ``resume`` (it would mix two runs). A checkpoint saved by the same job (``run_id``: an
    elastic job's node joining late, or started again) counts as ``restarted``."""
    if directory is None:
        return
    step = latest_step(directory) if os.path.isdir(directory) else None
    if run_id is not None and step is not None:
        restarted = restarted or read_train_state(directory, step).run_id == run_id
    if resume or (restarted and step is not None):
        if step is None:
            raise ValueError(f"--resume: no complete checkpoint in {directory} (no "
                             f"{os.path.join(directory, LATEST)})")
        integrity.check_sizes(step_dir(directory, step))
        check_compatible(read_train_state(directory, step), data=data, model=model,
                         recipe=recipe, steps=steps, where=step_dir(directory, step))
    elif saving and step is not None:
        raise ValueError(f"--checkpoint-dir {directory} already holds checkpoints (latest: "
                         f"step-{step}); pass --resume to continue from it, or use another "
                         "folder")


def torchrun_restarts() -> int:
    """How many times torchrun restarted this job's workers (TORCHELASTIC_RESTART_COUNT)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def resume_step(directory: str | None, *, resume: bool, restarted: bool) -> int | None:
    """The step to resume from, agreed by all ranks (rank 0 reads ``latest``), or None.

    A run resumes when asked (``resume``: the checkpoint must exist) or when torchrun restarted
    it (``restarted``) and a checkpoint exists; otherwise it starts at step 0.
    """
    if directory is None or not (resume or restarted):
        return None
    found = [latest_step(directory) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(found, src=0)
    if found[0] is None and resume:
        raise ValueError(f"--resume: no complete checkpoint in {directory}")
    return found[0]


# ----- state dicts -------------------------------------------------------------------------------

def _fqn(name: str) -> str:
    """A parameter's whole-model name from its name in a wrapped chunk."""
    return clean_name(name)


def _is_tied_copy(module: nn.Module) -> bool:
    return any(getattr(sub, "tied_copy", False) for sub in module.modules())


def _tied_key(key: str, copy: bool) -> str:
    """A last stage's copy of a tied embedding is saved and loaded as the embedding itself
    (``tok_embeddings.weight``, equal on both stages; DCP writes it once), so checkpoints
    of tied models move between plans with and without pipeline stages."""
    return "tok_embeddings.weight" if copy and key == "output.weight" else key


def _state_dict(modules: Sequence[nn.Module], optimizer: torch.optim.Optimizer
                ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(``{"model": {fqn: tensor}, "optimizer": {fqn: AdamW state}}``, each chunk's model
    state dict).

    The tensors are the model's and the optimizer's own (or views of them): DCP loads in place.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from meshplan.runtime import optim as optim_mod

    parts = [get_model_state_dict(module) for module in modules]
    model: dict[str, Any] = {}
    names: dict[torch.Tensor, str] = {}
    for module, part in zip(modules, parts):
        if model.keys() & part.keys():
            raise RuntimeError(f"pipeline chunks share keys {sorted(model.keys() & part.keys())}")
        copy = _is_tied_copy(module)
        model.update({_tied_key(key, copy): value for key, value in part.items()})
        names.update((param, _tied_key(_fqn(name), copy))
                     for name, param in module.named_parameters())
    states = {}
    for param, state in optim_mod.adamw_states(optimizer):
        fqn = names[param]
        if fqn not in model:
            raise RuntimeError(f"optimizer parameter {fqn} is not a model state key")
        states[fqn] = state
    return {"model": model, "optimizer": states}, parts


def _sync_write(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _commit(directory: str, step: int) -> None:
    """Rank 0: rename ``step-K.tmp`` to ``step-K``, then point ``latest`` at it atomically."""
    final = step_dir(directory, step)
    os.rename(final + TMP_SUFFIX, final)
    _fsync_dir(directory)
    _sync_write(os.path.join(directory, LATEST + TMP_SUFFIX), f"step-{step}\n")
    os.replace(os.path.join(directory, LATEST + TMP_SUFFIX), os.path.join(directory, LATEST))
    _fsync_dir(directory)


def save(modules: Sequence[nn.Module], optimizer: torch.optim.Optimizer, directory: str,
         state: TrainState, *, keep_last: int = 0) -> None:
    """Write checkpoint ``step-<state.step>`` of this rank's chunks and optimizer (collective;
    module docstring: the commit protocol); then keep only the ``keep_last`` newest (0: all)."""
    import torch.distributed.checkpoint as dcp

    final = step_dir(directory, state.step)
    rank0 = dist.get_rank() == 0
    if rank0:
        if latest_step(directory) == state.step:
            raise RuntimeError(f"{final} is the committed latest checkpoint; not overwriting it")
        for stale in (final + TMP_SUFFIX, final):  # left by an interrupted run
            shutil.rmtree(stale, ignore_errors=True)
        os.makedirs(final + TMP_SUFFIX)
    dist.barrier()
    tensors, _ = _state_dict(modules, optimizer)
    dcp.save(tensors, checkpoint_id=final + TMP_SUFFIX)
    if rank0:
        _sync_write(os.path.join(final + TMP_SUFFIX, TRAIN_STATE), state.to_json())
    dist.barrier()
    _write_checksums(final + TMP_SUFFIX)
    if rank0:
        _commit(directory, state.step)
        if keep_last:
            prune(directory, keep_last)
    dist.barrier()


def _write_checksums(folder: str) -> None:
    """Every rank hashes every world-th file of ``folder``; rank 0 writes the manifest
    (collective)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    names = integrity.checkpoint_files(folder)
    mine = integrity.entries(folder, names[rank::world])
    gathered: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        integrity.write_manifest(folder, {k: v for part in gathered for k, v in part.items()})


def committed_steps(directory: str) -> list[int]:
    """Steps of the committed checkpoint folders in ``directory`` (``step-K``), ascending."""
    steps = []
    for name in os.listdir(directory):
        match = _STEP_NAME.fullmatch(name)
        if match and os.path.isdir(os.path.join(directory, name)):
            steps.append(int(match.group(1)))
    return sorted(steps)


def prune(directory: str, keep_last: int) -> None:
    """Delete all but the ``keep_last`` newest committed checkpoints (never ``latest``'s)."""
    latest = latest_step(directory)
    for step in committed_steps(directory)[:-keep_last]:
        if step != latest:
            shutil.rmtree(step_dir(directory, step), ignore_errors=True)


def verify(directory: str, step: int) -> None:
    """``integrity.CorruptCheckpoint`` (on every rank) unless checkpoint ``step``'s files match
    their manifest; the ranks hash the files in parallel (collective)."""
    problem = integrity.verify_files(step_dir(directory, step), rank=dist.get_rank(),
                                     world_size=dist.get_world_size())
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    found = [p for p in problems if p]
    if found:
        raise integrity.CorruptCheckpoint(found[0])


def load(modules: Sequence[nn.Module], optimizer: torch.optim.Optimizer, directory: str,
         step: int) -> None:
    """Load checkpoint ``step-<step>`` into this rank's chunks and optimizer, resharding to
    their layout (collective). Its ``TrainState`` is ``read_train_state``'s."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    from meshplan.runtime import optim as optim_mod

    verify(directory, step)
    tensors, parts = _state_dict(modules, optimizer)
    dcp.load(tensors, checkpoint_id=step_dir(directory, step))
    for module, part in zip(modules, parts):
        set_model_state_dict(module, part)
    optim_mod.reload_master_weights(optimizer)
