"""Loading what the flags name (model, cluster, calibration) and the CLI's plan defaults."""

from __future__ import annotations

import dataclasses

import argparse
from collections.abc import Callable
from typing import Any

from meshplan.costmodel.calibration import Calibration, load_calibration
from meshplan.costmodel.config import ParallelConfig, default_dtype
from meshplan.costmodel.hardware import ClusterSpec, load_cluster
from meshplan.costmodel.model import ModelSpec
from meshplan.costmodel.models import is_traced_ref, load_model


def load_flagged(flag: str, ref: str | None, loader: Callable[[], Any]) -> Any:
    """``loader()``, with an unreadable file (OSError) and a value of the wrong JSON type in a
    calibration or GPU entry (TypeError, which the loaders do not translate yet) turned into a
    ValueError naming ``flag``; the loaders report bad content as ValueError already."""
    try:
        return loader()
    except OSError as err:
        raise ValueError(f"{flag} {ref!r}: cannot read {err.filename or ref!r}: "
                         f"{err.strerror or err}") from None
    except TypeError as err:  # wrong JSON value types the loader does not check
        raise ValueError(f"{flag} {ref!r}: {err}") from None


def load_calibration_flag(path: str | None) -> Calibration:
    """The calibration of ``--calibration`` (None: the built-in one)."""
    return load_flagged("--calibration", path, lambda: load_calibration(path))


def load_inputs(args: argparse.Namespace) -> tuple[ModelSpec, ClusterSpec, Calibration]:
    """Model, cluster and calibration named by the flags; ValueError for anything unreadable."""
    cluster = load_flagged("--cluster", args.cluster,
                           lambda: load_cluster(args.cluster, nodes=args.nodes,
                                                gpus_per_node=args.gpus_per_node))
    overrides = {}
    if getattr(args, "host_memory_gib", None) is not None:
        overrides["host_bytes"] = int(args.host_memory_gib * 2**30)
    if getattr(args, "nvme_gib", None) is not None:
        overrides["nvme_bytes"] = int(args.nvme_gib * 2**30)
    if overrides:
        cluster = dataclasses.replace(cluster, **overrides)
    # a traced module (a user's package.module:callable, or an HF config the analytic reader
    # lacks) is traced at the sequence length and in the dtype the plans will use
    seq_len = dtype = None
    if is_traced_ref(args.model):
        seq_len = getattr(args, "seq_len", None)
        dtype = getattr(args, "dtype", None) or default_dtype(cluster.gpu.key)
    model = load_flagged("--model", args.model,
                         lambda: load_model(args.model, seq_len=seq_len, dtype=dtype))
    return model, cluster, load_calibration_flag(args.calibration)


def default_dp(*, num_gpus: int, tp: int, pp: int, cp: int) -> int:
    """Data-parallel degree that uses every GPU: num_gpus / (tp * pp * cp)."""
    used = tp * pp * cp
    if num_gpus % used:
        raise ValueError(f"tp*pp*cp = {tp}*{pp}*{cp} = {used} does not divide the cluster's "
                         f"{num_gpus} GPUs, so --dp cannot fill it; pick degrees whose product "
                         f"divides {num_gpus}")
    return num_gpus // used


def fill_config_defaults(given: dict[str, Any], *, model: ModelSpec,
                         cluster: ClusterSpec) -> ParallelConfig:
    """A ParallelConfig from the flags in ``given`` plus the CLI's defaults.

    Defaults: degrees 1, ``dp`` the GPUs left over, ``seq_len`` the model's, dtype bf16 (fp32 on
    the CPU pseudo-device); the rest are ParallelConfig's own defaults. Raises ValueError.
    """
    values = dict(given)
    for axis in ("tp", "pp", "cp"):
        values.setdefault(axis, 1)
    if "dp" not in values:
        values["dp"] = default_dp(num_gpus=cluster.num_gpus, tp=values["tp"], pp=values["pp"],
                                  cp=values["cp"])
    values.setdefault("seq_len", model.seq_len)
    values.setdefault("dtype", default_dtype(cluster.gpu.key))
    return ParallelConfig(**values)
