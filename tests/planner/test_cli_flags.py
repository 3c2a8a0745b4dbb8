"""The plan flags come from ``ParallelConfig``: one flag per field, its help the field's
docstring (``meshplan.cli.args``); and the CLI's own modules stay what DESIGN.md says."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
from dataclasses import dataclass

import pytest

from meshplan import cli
from meshplan.cli import args as cli_args
from meshplan.costmodel import ParallelConfig
from meshplan.testing import run_cli, usage_error

FLAGS = {"tp": "--tp", "pp": "--pp", "dp": "--dp", "cp": "--cp", "ep": "--ep", "sp": "--sp",
         "zero_stage": "--zero", "offload": "--offload", "offload_device": "--offload-device",
         "recompute": "--recompute", "selective_ac": "--selective-ac",
         "recompute_early_stop": "--recompute-early-stop", "compile": "--compile",
         "float8": "--float8", "float8_recipe": "--float8-recipe",
         "grad_reduce_dtype": "--grad-reduce-dtype", "float8_head": "--float8-head",
         "async_tp": "--async-tp",
         "tp_comm_overlap": "--tp-comm-overlap", "cross_entropy_fusion": "--cross-entropy-fusion",
         "attention_kernel": "--attention-kernel", "cp_comm_type": "--cp-comm-type",
         "overlap_comm": "--no-overlap-comm",
         "micro_batch_size": "--micro-batch",
         "global_batch_size": "--global-batch", "vpp": "--vpp", "seq_len": "--seq-len",
         "layers_per_stage": "--layers-per-stage", "mesh_order": "--mesh-order",
         "flash_attention": "--no-flash-attention", "dtype": "--dtype"}
"""The flag of each field, as DESIGN.md's command line and the 0.1 CLI spell them."""


def _plan_group() -> dict[str, argparse.Action]:
    parser = argparse.ArgumentParser()
    cli_args.add_config_arguments(parser)
    group = next(g for g in parser._action_groups if g.title.startswith("plan"))
    return {a.dest: a for a in group._group_actions}


def _docstrings_by_hand() -> dict[str, str]:
    """The string under each field of ParallelConfig, read from inspect's copy of the class."""
    body = ast.parse(textwrap.dedent(inspect.getsource(ParallelConfig))).body[0].body
    return {a.target.id: " ".join(b.value.value.split()) for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr)}


def test_every_field_has_its_flag_and_dest():
    actions = _plan_group()
    assert set(actions) == {f.name for f in dataclasses.fields(ParallelConfig)}
    assert {dest: a.option_strings[0] for dest, a in actions.items()} == FLAGS


def test_help_is_the_field_docstring_then_the_cli_default():
    actions, docs = _plan_group(), _docstrings_by_hand()
    for dest, action in actions.items():
        assert action.help.startswith(docs[dest].replace("``", "")), dest
    assert actions["tp"].help == ("Tensor-parallel degree (Megatron column/row split inside "
                                  "each layer). Default: 1.")
    assert actions["dp"].help == ("Data-parallel replicas (the ZeRO sharding group). "
                                  "Default: GPUs / (tp*pp*cp).")
    assert actions["dtype"].help.endswith("Default: bf16; fp32 on the cpu cluster.")
    assert actions["seq_len"].help.endswith("Default: the model's.")
    assert actions["offload"].help == ("none, optimizer (optimizer states and step on the host) "
                                       "or optimizer+params. Default: none.")
    assert actions["mesh_order"].help.endswith("Default: tp,cp,dp,pp.")
    assert actions["sp"].help.endswith("Default: off.")
    assert "Default" not in actions["global_batch_size"].help  # required: no default


def test_flag_kinds_values_and_metavars():
    actions = _plan_group()
    assert actions["global_batch_size"].required
    assert sum(a.required for a in actions.values()) == 1
    assert (actions["zero_stage"].choices, actions["zero_stage"].metavar) == ((0, 1, 2, 3),
                                                                              "{0-3}")
    assert actions["flash_attention"].const is False and actions["sp"].const is True
    assert all(a.default is None for a in actions.values())  # unset flags stay None
    assert [actions[d].metavar for d in ("tp", "pp", "dp", "cp", "ep", "micro_batch_size",
                                         "global_batch_size", "vpp", "seq_len")] == \
        ["T", "P", "D", "C", "E", "B", "G", "V", "S"]
    args = cli.build_parser().parse_args(
        ["estimate", "--model", "tiny", "--cluster", "cpu", "--global-batch", "8",
         "--no-flash-attention", "--mesh-order", "dp,tp,cp,pp", "--layers-per-stage", "2,2",
         "--zero", "3"])
    assert cli_args.config_kwargs_from_args(args) == {
        "global_batch_size": 8, "flash_attention": False, "mesh_order": ("dp", "tp", "cp", "pp"),
        "layers_per_stage": (2, 2), "zero_stage": 3}


@pytest.mark.parametrize("command", ["estimate", "plan"])
def test_compile_and_float8_flags_are_in_the_help(command):
    """torchtitan's settings, on both commands that take plan flags: --compile takes one of
    the cost model's modes, --float8 is a switch."""
    result = run_cli(command, "--help")
    assert result.code == 0
    assert "[--compile {none,model,model+loss}] [--float8]" in " ".join(result.out.split())
    args = cli.build_parser().parse_args(
        [command, "--model", "tiny", "--cluster", "cpu", "--global-batch", "8",
         "--compile", "model", "--float8"])
    kwargs = cli_args.config_kwargs_from_args(args)
    assert (kwargs["compile"], kwargs["float8"]) == ("model", True)
    unset = cli.build_parser().parse_args(
        [command, "--model", "tiny", "--cluster", "cpu", "--global-batch", "8"])
    assert not {"compile", "float8"} & set(cli_args.config_kwargs_from_args(unset))


def test_compile_flag_refuses_an_unknown_mode():
    line = usage_error("estimate", "--model", "tiny", "--cluster", "cpu", "--global-batch", "8",
                       "--compile", "everything")
    assert "--compile" in line and "invalid choice: 'everything'" in line


@dataclass(frozen=True, kw_only=True)
class _Toy:
    """A dataclass whose docstrings ``field_docs`` reads."""

    width_px: int = 3
    """How wide,
    over two lines."""
    undocumented: int = 0
    name: str = "x"
    """Its name."""


def test_field_docs_reads_the_string_under_each_field():
    assert cli_args.field_docs(_Toy) == {"width_px": "How wide, over two lines.",
                                         "name": "Its name."}


def test_a_field_without_a_parser_is_refused():
    @dataclass
    class Odd:
        ratio: float = 0.5

    with pytest.raises(TypeError, match="needs a value parser"):
        cli_args._add_config_flag(argparse.ArgumentParser(), dataclasses.fields(Odd)[0])
