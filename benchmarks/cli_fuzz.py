"""Random inputs through the command line: every one must end in a result or in one clear line.

Three kinds of input, each drawn from a seeded generator:

* ``flags``: ``estimate`` and ``plan`` command lines with random subsets of their flags, each
  flag's value drawn from valid ones, out-of-range numbers, ``inf``/``nan``, text and empty
  strings (a few bad model or cluster names too);
* ``plan-files``: a plan file written by ``meshplan plan``, mutated at one to three random
  places (a value replaced by null, a number of another size, text, a list or an object; a key
  deleted; a few truncated), read by ``export`` and ``explain``;
* ``documents``: the plan's cluster and model objects and the built-in calibration, mutated the
  same way, given to ``estimate`` and ``plan`` as ``--cluster``, ``--model`` and
  ``--calibration`` files.

An outcome is acceptable when the command exits 0 with output on stdout (strict JSON under
``--json``: no NaN or Infinity), 2 with exactly one ``meshplan: error: `` line on stderr and
nothing on stdout, or 3 ("no plan fits"). Anything else, an exception escaping ``main``
included, is a violation, printed with its input.
Writes ``cli-fuzz-<date>.{md,json}`` under ``benchmarks/results/``.

    python benchmarks/cli_fuzz.py [--flags 1500] [--plan-files 600] [--documents 300] [--seed 1]
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import random
import tempfile
import traceback
from collections import Counter
from pathlib import Path

from meshplan.costmodel.jsonio import read_package_json
from meshplan.testing import run_cli

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ("llama2-7b", "llama3-8b", "mixtral-8x7b", "gpt3-125m", "megatron-1.7b", "llama3-70b")
CLUSTERS = ("dgx-a100-80gb", "dgx-h100", "dgx-h200")
INTS = ("0", "1", "2", "3", "4", "7", "8", "16", "64", "-1", "1.5", "1e9", "x", "")
FLOATS = ("0", "0.5", "1", "2", "-1", "nan", "inf", "1e30", "x")
FLAGS = {
    "--nodes": INTS, "--gpus-per-node": INTS, "--host-memory-gib": FLOATS, "--nvme-gib": FLOATS,
    "--framework": ("meshplan", "megatron", "deepspeed", "torchtitan", "ideal", "other"),
    "--tp": INTS, "--pp": INTS, "--dp": INTS, "--cp": INTS, "--ep": INTS, "--vpp": INTS,
    "--micro-batch": INTS, "--seq-len": INTS, "--sp": None, "--zero": ("0", "1", "2", "3", "4"),
    "--offload": ("none", "optimizer", "optimizer+params", "x"),
    "--offload-device": ("cpu", "nvme", "x"),
    "--recompute": ("none", "selective", "full", "full,none", "none,none,none,none", "x", ""),
    "--selective-ac": ("op", "1", "2", "0", "-1", "x"), "--recompute-early-stop": None,
    "--compile": ("none", "model", "model+loss", "x"), "--float8": None,
    "--float8-recipe": ("tensorwise", "delayed", "x"), "--float8-head": None,
    "--grad-reduce-dtype": ("fp32", "bf16", "fp16", "x"), "--async-tp": None,
    "--tp-comm-overlap": None, "--attention-kernel": ("auto", "triton", "x"),
    "--cross-entropy-fusion": None, "--no-overlap-comm": None,
    "--cp-comm-type": ("auto", "p2p", "all_gather", "a2a", "x"),
    "--layers-per-stage": ("16,16", "32", "1,31", "0,32", "a,b", "", "8,8,8,8"),
    "--mesh-order": ("tp,cp,dp,pp", "pp,dp,cp,tp", "tp,dp", "tp,tp,dp,pp"),
    "--no-flash-attention": None, "--dtype": ("bf16", "fp16", "fp32", "x"),
    "--calibration": ("/nonexistent.json", "/etc/hostname", "/tmp")}
PLAN_FLAGS = {
    "--objective": ("time", "cost", "x"), "--top": INTS, "--time-limit": FLOATS,
    "--global-batch-tolerance": FLOATS, "--allow-fewer-gpus": None,
    "--elastic": ("1:2", "2:1", "0:4", "8:16", "x"), "--seed": INTS, "--memory-margin": FLOATS,
    "--train-tokens": FLOATS, "--gpu-hour-price": FLOATS, "--deadline-days": FLOATS}
WEIRD = (None, -1, 0, 1, 2, 1.5, 1e300, 1e-300, "x", "", [], {}, True, False, 10 ** 30,
         [1, 2], {"a": 1}, 4096, 0.5)
TIME_LIMIT = ("--time-limit", "5")


def outcome(argv: list[str]) -> str:
    """``ok``, ``user-error``, ``no-plan`` or ``violation: ...`` for ``meshplan argv``."""
    try:
        result = run_cli(*argv)
    except BaseException:  # noqa: BLE001 - anything escaping main is what this looks for
        return "violation: " + traceback.format_exc(limit=-2).strip().splitlines()[-1]
    lines = result.err.strip().splitlines()
    if result.code == 0:
        if not result.out:
            return "violation: exit 0 without output"
        if "--json" in argv:
            try:
                json.loads(result.out, parse_constant=_refuse)
            except ValueError as err:
                return f"violation: --json output is not strict JSON ({err})"
        return "ok"
    if result.code == 2:
        if result.out or len(lines) != 1 or not lines[0].startswith("meshplan: error: "):
            return "violation: exit 2 without exactly one error line: " + result.err[-300:]
        return "user-error"
    if result.code == 3:
        return "no-plan"
    return f"violation: exit {result.code}: {result.err[-300:]}"


def _refuse(constant: str):
    raise ValueError(constant)


def flag_lines(rng: random.Random, count: int):
    for _ in range(count):
        command = "plan" if rng.random() < 0.2 else "estimate"
        flags = {**FLAGS, **(PLAN_FLAGS if command == "plan" else {})}
        argv = [command, "--model", rng.choice(MODELS) if rng.random() < 0.97 else "nope",
                "--cluster", rng.choice(CLUSTERS) if rng.random() < 0.97 else "nope"]
        if rng.random() < 0.97:
            argv += ["--global-batch", rng.choice(("8", "16", "32", "64", "128"))]
        for flag in rng.sample(sorted(flags), rng.randint(0, 7)):
            argv.append(flag)
            if flags[flag] is not None:
                argv.append(rng.choice(flags[flag]))
        if command == "plan" and "--time-limit" not in argv:
            argv += TIME_LIMIT
        if rng.random() < 0.3:
            argv.append("--json")
        yield argv, None


def mutated(rng: random.Random, document):
    """``document`` with one to three random places changed (or a key deleted)."""
    data = copy.deepcopy(document)
    for _ in range(rng.randint(1, 3)):
        path = rng.choice([p for p in _paths(data) if p])
        parent = data
        for key in path[:-1]:
            parent = parent[key]
        if rng.random() < 0.2 and isinstance(path[-1], str):
            del parent[path[-1]]
        else:
            parent[path[-1]] = rng.choice(WEIRD)
    return data


def _paths(value, prefix=()):
    yield prefix
    items = value.items() if isinstance(value, dict) else \
        enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield from _paths(child, prefix + (key,))


def plan_file_lines(rng: random.Random, count: int, plan: dict, folder: Path):
    for i in range(count):
        text = json.dumps(mutated(rng, plan))
        if rng.random() < 0.05:
            text = text[:rng.randint(0, len(text))]
        path = folder / f"plan-{i}.json"
        path.write_text(text)
        yield rng.choice([["export", "--to", rng.choice(("deepspeed", "megatron", "torchtitan")),
                           str(path)], ["export", "--json", "--to", "torchtitan", str(path)],
                          ["explain", "--time-limit", "2", str(path)]]), path


def document_lines(rng: random.Random, count: int, plan: dict, folder: Path):
    bases = {"--cluster": plan["cluster"], "--model": plan["model"],
             "--calibration": read_package_json("calibration.json")}
    for i in range(count):
        flag = rng.choice(sorted(bases))
        path = folder / f"document-{i}.json"
        path.write_text(json.dumps(mutated(rng, bases[flag])))
        given = {"--model": "llama2-7b", "--cluster": "dgx-a100-80gb", flag: str(path)}
        command = "plan" if rng.random() < 0.3 else "estimate"
        argv = [command, *[x for pair in given.items() for x in pair], "--global-batch", "64",
                *rng.choice(([], ["--pp", "2"], ["--zero", "3", "--offload", "optimizer"],
                             ["--tp", "2", "--sp"]))]
        yield argv + (list(TIME_LIMIT) if command == "plan" else []), path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flags", type=int, default=1500)
    parser.add_argument("--plan-files", type=int, default=600)
    parser.add_argument("--documents", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rows, violations = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        base = folder / "base.json"
        assert outcome(["plan", "--model", "llama2-7b", "--cluster", "dgx-a100-80gb", "--nodes",
                        "2", "--global-batch", "64", "--seq-len", "4096", "--pp", "2",
                        "--time-limit", "10", "-o", str(base)]) == "ok"
        plan = json.loads(base.read_text())
        kinds = {"flags": flag_lines(rng, args.flags),
                 "plan-files": plan_file_lines(rng, args.plan_files, plan, folder),
                 "documents": document_lines(rng, args.documents, plan, folder)}
        for kind, lines in kinds.items():
            counts = Counter()
            for argv, path in lines:
                got = outcome(argv)
                counts[got.split(":")[0]] += 1
                if got.startswith("violation"):
                    shown = path.read_text()[:2000] if path else ""
                    violations.append({"kind": kind, "argv": argv, "outcome": got,
                                       "input": shown})
                    print(f"{kind}: {' '.join(argv)}\n  {got}")
            rows[kind] = dict(counts)
            print(f"{kind}: {dict(counts)}")
    date = dt.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"cli-fuzz-{date}"
    stem.with_suffix(".json").write_text(json.dumps(
        {"seed": args.seed, "counts": rows, "violations": violations}, indent=1) + "\n")
    lines = [f"# Random command-line inputs (seed {args.seed})", "",
             "| input | ok | user-error | no-plan | violation |", "|---|---|---|---|---|"]
    for kind, counts in rows.items():
        lines.append(f"| {kind} | " + " | ".join(str(counts.get(k, 0)) for k in (
            "ok", "user-error", "no-plan", "violation")) + " |")
    lines += ["", f"{len(violations)} violation(s)."]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"{len(violations)} violation(s); wrote {stem}.{{md,json}}")


if __name__ == "__main__":
    main()
