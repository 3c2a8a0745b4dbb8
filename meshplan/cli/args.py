"""Flag value types and the flag groups several subcommands share.

The plan flags (``--tp`` ... ``--dtype``) are generated from ``ParallelConfig``: one flag per
field, its help the field's docstring. ``CONFIG_FLAGS`` lists only what differs from the
generic flag ``--field-name`` (a positive integer, a switch for a bool, any text for a str).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshplan.costmodel.config import (ATTENTION_KERNELS, COMPILE_MODES, CP_COMM_TYPES, DTYPES,
                                       FLOAT8_RECIPES, FRAMEWORKS,
                                       GRAD_REDUCE_DTYPES, MESH_AXES, OFFLOAD_DEVICES,
                                       OFFLOAD_MODES, RECOMPUTE_MODES, ParallelConfig)

# ----- flag value types (argparse turns ArgumentTypeError into "argument --x: <message>") -------


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def _number(text: str, *, accept: Callable[[float], bool], rule: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not accept(value):
        raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (``inf`` is refused: no flag means "unlimited" by it, and sizes,
    rates and timeouts are converted to integers or timedeltas, which it overflows)."""
    return _number(text, accept=lambda v: 0 < v < math.inf, rule="a finite number > 0")


def nonnegative_float(text: str) -> float:
    """A finite number >= 0 (see ``positive_float``)."""
    return _number(text, accept=lambda v: 0 <= v < math.inf, rule="a finite number >= 0")


def rdzv_conf(text: str) -> str:
    """torchrun's ``--rdzv-conf``: KEY=VALUE pairs joined by commas."""
    if not all(key.strip() and sep for key, sep, _ in
               (item.partition("=") for item in text.split(","))):
        raise argparse.ArgumentTypeError(f"must be KEY=VALUE[,KEY=VALUE...], got {text!r}")
    return text


def _split_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",")]


def recompute_modes(text: str) -> str | tuple[str, ...]:
    """One recompute mode, or a comma-separated list with one mode per pipeline stage."""
    modes = _split_list(text)
    bad = [m for m in modes if m not in RECOMPUTE_MODES]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown mode {bad[0]!r} in {text!r}; use one of {', '.join(RECOMPUTE_MODES)} "
            f"or a comma-separated list with one per stage (e.g. full,full,selective,none)")
    return modes[0] if len(modes) == 1 else tuple(modes)


def layers_per_stage(text: str) -> tuple[int, ...]:
    try:
        return tuple(positive_int(part) for part in _split_list(text))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be a comma-separated list of positive layer counts, got {text!r}") from None


def mesh_order(text: str) -> tuple[str, ...]:
    axes = tuple(_split_list(text))
    if sorted(axes) != sorted(MESH_AXES):
        raise argparse.ArgumentTypeError(
            f"must list each of {','.join(MESH_AXES)} once, fastest-varying first; got {text!r}")
    return axes


# ----- shared flags ------------------------------------------------------------------------------

def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """What to train on what: model, cluster, framework, calibration."""
    group = parser.add_argument_group("model and cluster")
    group.add_argument("--model", required=True, metavar="M",
                       help="catalog name (see 'meshplan models'), ModelSpec JSON or HF "
                            "config.json")
    group.add_argument("--cluster", required=True, metavar="C",
                       help="catalog name (see 'meshplan clusters') or cluster JSON")
    group.add_argument("--nodes", type=positive_int, metavar="N",
                       help="nodes of a catalog cluster (default 1, or the JSON's)")
    group.add_argument("--gpus-per-node", type=positive_int, metavar="K",
                       help="override the cluster's GPUs per node")
    group.add_argument("--host-memory-gib", type=positive_float, metavar="GIB",
                       help="override the host memory per node (GiB), for offload")
    group.add_argument("--nvme-gib", type=nonnegative_float, metavar="GIB",
                       help="override the local NVMe capacity per node (GiB), for offload")
    group.add_argument("--framework", choices=FRAMEWORKS, default="meshplan",
                       help="runtime whose memory layout to assume (default meshplan)")
    group.add_argument("--calibration", metavar="FILE",
                       help="calibration JSON (default: the built-in one)")


# ----- the plan flags, from ParallelConfig -------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class FlagSpec:
    """How one ParallelConfig field's flag differs from the generic one."""

    flag: str | None = None
    """The flag; None: ``--`` and the field name with dashes. A bool field's flag is a switch
    that sets True, or False when the flag starts with ``--no-``."""
    parse: Callable[[str], Any] | None = None
    """Value parser; None: by the field's type (int: a positive integer, str: the text)."""
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    required: bool = False
    default: str | None = None
    """What the CLI does when the flag is not given, where that is not the field's default."""


CONFIG_FLAGS: dict[str, FlagSpec] = {
    "tp": FlagSpec(metavar="T"),
    "pp": FlagSpec(metavar="P"),
    "dp": FlagSpec(metavar="D", default="GPUs / (tp*pp*cp)"),
    "cp": FlagSpec(metavar="C"),
    "ep": FlagSpec(metavar="E"),
    "zero_stage": FlagSpec(flag="--zero", parse=int, choices=(0, 1, 2, 3), metavar="{0-3}"),
    "offload": FlagSpec(choices=OFFLOAD_MODES),
    "offload_device": FlagSpec(choices=OFFLOAD_DEVICES),
    "recompute": FlagSpec(parse=recompute_modes, metavar="{none,selective,full}[,...]"),
    "compile": FlagSpec(choices=COMPILE_MODES),
    "float8_recipe": FlagSpec(choices=FLOAT8_RECIPES),
    "grad_reduce_dtype": FlagSpec(choices=GRAD_REDUCE_DTYPES),
    "attention_kernel": FlagSpec(choices=ATTENTION_KERNELS),
    "cp_comm_type": FlagSpec(choices=CP_COMM_TYPES),
    "micro_batch_size": FlagSpec(flag="--micro-batch", metavar="B"),
    "global_batch_size": FlagSpec(flag="--global-batch", metavar="G", required=True),
    "vpp": FlagSpec(metavar="V"),
    "seq_len": FlagSpec(metavar="S", default="the model's"),
    "layers_per_stage": FlagSpec(parse=layers_per_stage, metavar="L0,L1,...",
                                 default="even split"),
    "mesh_order": FlagSpec(parse=mesh_order, metavar="tp,cp,dp,pp"),
    "overlap_comm": FlagSpec(flag="--no-overlap-comm", default="on; this flag turns it off"),
    "flash_attention": FlagSpec(flag="--no-flash-attention", default="on; this flag turns it off"),
    "dtype": FlagSpec(choices=DTYPES, default="bf16; fp32 on the cpu cluster"),
}
"""Per ParallelConfig field, what its flag does not take from the generic rule."""

_PARSERS_BY_TYPE: dict[str, Callable[[str], Any]] = {"int": positive_int, "str": str}
"""Value parser of a field by its annotation (``from __future__ import annotations``: text)."""

CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(ParallelConfig))


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of the dataclass ``cls``: per field, the string literal right
    under it, whitespace collapsed. Read with ``ast`` from the source file of ``cls``'s module
    (nothing else is imported); a field without one is left out, and so is every field when
    the source is not there (a build without .py files)."""
    try:
        source = Path(sys.modules[cls.__module__].__file__ or "").read_text()
    except OSError:
        return {}
    body = next((node.body for node in ast.parse(source).body
                 if isinstance(node, ast.ClassDef) and node.name == cls.__name__), [])
    docs = {}
    for stmt, after in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


def _default_text(value: Any) -> str | None:
    if value is None or value is dataclasses.MISSING:
        return None
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def config_flag_help(field: dataclasses.Field) -> str:
    """The help of ``field``'s flag: its docstring (reST quotes dropped), then the default."""
    spec = CONFIG_FLAGS.get(field.name, FlagSpec())
    doc = field_docs(ParallelConfig).get(field.name, "").replace("``", "")
    if doc and not doc.endswith("."):
        doc += "."
    default = None if spec.required else spec.default or _default_text(field.default)
    text = f"{doc} Default: {default}." if default else doc
    return text.strip().replace("%", "%%")  # argparse formats help with %


def _add_config_flag(group: argparse._ArgumentGroup, field: dataclasses.Field) -> None:
    spec = CONFIG_FLAGS.get(field.name, FlagSpec())
    flag = spec.flag or "--" + field.name.replace("_", "-")
    common = dict(dest=field.name, default=None, help=config_flag_help(field))
    if field.type == "bool":
        if flag.startswith("--no-"):
            group.add_argument(flag, action="store_const", const=False, **common)
        else:
            group.add_argument(flag, action="store_true", **common)
        return
    parse = spec.parse or _PARSERS_BY_TYPE.get(str(field.type))
    if parse is None:
        raise TypeError(f"ParallelConfig.{field.name} ({field.type}) needs a value parser in "
                        f"meshplan.cli.args.CONFIG_FLAGS")
    group.add_argument(flag, type=parse, choices=spec.choices, metavar=spec.metavar,
                       required=spec.required, **common)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The plan flags, one per ParallelConfig field (``dest`` is the field). Unset flags stay
    None; ``inputs.fill_config_defaults`` applies the CLI's defaults."""
    group = parser.add_argument_group("plan (unset flags take defaults)")
    for field in dataclasses.fields(ParallelConfig):
        _add_config_flag(group, field)


def config_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The ParallelConfig fields the user set on the command line (unset flags are left out)."""
    return {name: getattr(args, name) for name in CONFIG_FIELDS
            if getattr(args, name, None) is not None}


def node_range(text: str) -> tuple[int, int | None]:
    """``N`` -> (N, None); ``MIN:MAX`` -> (MIN, MAX); argparse type of ``--nnodes``."""
    parts = text.split(":")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(parts) not in (1, 2) or len(values) != len(parts) or min(values) < 1 or (
            len(values) == 2 and values[0] > values[1]):
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX with 1 <= MIN <= MAX, got "
                                         f"{text!r}")
    return values[0], (values[1] if len(values) == 2 else None)
