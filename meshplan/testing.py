"""Run ``meshplan`` in this process and capture what it prints (tests, notebooks, scripts)."""

from __future__ import annotations

import contextlib
import itertools
import io
import json
from dataclasses import dataclass
from typing import Any

from meshplan import cli


@dataclass(frozen=True)
class CliResult:
    """Exit code and captured stdout and stderr of one ``meshplan`` call."""

    code: int
    out: str
    err: str

    def json(self) -> Any:
        """stdout as JSON; the call must have succeeded with nothing on stderr."""
        assert self.code == 0, self.err
        assert self.err == "", self.err
        return json.loads(self.out)


def usage_error(*argv: Any) -> str:
    """``meshplan ARGV`` must fail as a user error: exit 2, nothing on stdout, one line on
    stderr and no traceback; returns that line."""
    result = run_cli(*argv)
    assert result.code == 2, (result.code, result.err)
    assert result.out == ""
    assert "Traceback" not in result.err
    lines = result.err.splitlines()
    assert len(lines) == 1, result.err
    assert lines[0].startswith("meshplan: error: ")
    return lines[0]


def run_cli(*argv: Any) -> CliResult:
    """``meshplan ARGV`` through ``meshplan.cli.main``; stdout and stderr captured apart."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in argv])
    return CliResult(code, out.getvalue(), err.getvalue())


def stage_modes(modes: tuple[str, ...], stages: int, framework: str):
    """Every recompute-mode assignment a brute force tries for ``stages`` stages: any mode per
    stage where the framework runs a mode per stage (meshplan's runtime; the ``ideal``
    accounting), otherwise one mode for all (Megatron-LM, torchtitan and DeepSpeed take one
    for the whole model). Written out here, apart from the planner's own rule."""
    if framework in ("meshplan", "ideal") or stages == 1:
        return itertools.product(modes, repeat=stages)
    return [(mode,) * stages for mode in modes]
