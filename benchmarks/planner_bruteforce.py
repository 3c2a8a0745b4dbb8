"""Brute force against the planner: no plan the cost model can be asked about beats its best.

For each scenario (a catalog model on a catalog cluster at a realistic global batch and
sequence length, under one of the four frameworks) this script

1. enumerates every global configuration of the scenario's space with ``space.candidates``
   (degrees, sp, ZeRO, offload, micro-batch, vpp, rank layout; the whole space, not the core
   one), as ``search`` limits it for the scenario's framework (``framework_space`` and the
   layout rule, ``layout.framework_layout_error``, which also drops splits and per-stage
   mixes the framework does not run), and calls ``costmodel.estimate`` on each under every
   uniform recompute mode of ``space.recompute_modes`` with the cost model's default layer
   split;
2. for pipelined candidates (pp > 1) where the scenario's budget of estimate calls allows, also
   tries a few other splits (one layer moved from the first and/or last stage to the middle
   stages or the other way, two layers off the last stage; +-1 and +-2 layers between the two
   stages of pp = 2) and per-stage recompute mixes (the more memory-saving mode on the first
   1, p/2 or p - 1 stages, the less saving one on the rest), under every uniform mode and mix.
   The candidates get these in order of their fastest step at the default split ignoring
   memory, skipping those whose leanest default-split peak exceeds 1.5x the capacity or whose
   fastest step is above 2x the best fitting plan found in step 1 (heuristics that spend the
   budget where a faster plan is likely; they only limit what is tried, never what counts);
   the ``alt_cands`` column says how many candidates were covered;
3. keeps the fastest plan that fits: ``est.fits`` (GPU, host memory and NVMe capacity) and
   reserved memory at most the GPU memory x (1 - ``space.memory_margin``), the test suite's
   ``fits_capacity`` rule;
4. runs the planner (``search(..., top_k=1, deterministic=True)`` by default, or a wall-clock
   ``--time-limit``) on exactly the same model, cluster, space and framework, records its
   status, proven gap and CPU seconds, and re-evaluates its plan with ``estimate``.

The check: the brute force's best step must not be faster than the planner's,
``brute / planner >= 1 - 1e-9``. Brute force is a subset of what the planner searches (the
same candidates, the default split and a few others, uniform modes and a few mixes), so a
faster brute-force plan is a planner bug (or, when the planner's status is FEASIBLE, a gap
it reported). Also flagged: the planner's plan does not fit, its step differs from a fresh
``estimate`` of its configuration, its configuration is not a candidate of the space or uses
a recompute mode outside it, or the planner finds no plan where brute force found one. Any of
these exits 1 and prints VIOLATION.

Why it is independent: the brute force uses only ``costmodel.estimate`` (the authoritative
numbers) and ``space.candidates`` (what the space is: of each space ``search.exchange_spaces``
names, one per context-parallel exchange the framework runs); none of the planner's search, bounds,
pruning, integer tables, CP-SAT model or greedy splits. What it cannot see: a configuration
that ``candidates`` itself leaves out, and splits/mixes it does not try (where the planner may
be faster; ratios above 1 are expected for pipelined plans, since the planner optimises the
split).

Large scenarios pin some choices (``SearchSpace`` pins, listed in the ``pins`` column) so the
enumeration stays tractable; the planner gets exactly the same pinned space. GPU memory keeps
the CLI's default 5 % margin. ``--quick`` runs the scenarios marked quick (all four
frameworks, two to three minutes on one core); the whole set should take roughly 20 minutes
on one idle core (0.6-1.7 ms per estimate, 30k-85k estimates and a 3-15 s planner run per
scenario), well under 40.
Prints a table and writes ``planner-bruteforce-<date>.{md,json}`` under
``benchmarks/results/`` (``planner-bruteforce-quick-<date>`` with ``--quick``).

``--random N [--seed S]`` runs N small random scenarios instead (``random_scenarios``: many
shapes of cluster and memory pressure, a few seconds each), written as
``planner-bruteforce-randomN-seedS-<date>``.

    python benchmarks/planner_bruteforce.py [--quick] [--only 0 3 ...] [--list]
        [--time-limit S | --max-nodes N] [--alt-budget N] [--random N [--seed S]]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from meshplan.costmodel import (ClusterSpec, ModelSpec, ParallelConfig, default_calibration,
                                estimate, load_cluster, load_model)
from meshplan.costmodel.frameworks import per_stage_recompute
from meshplan.costmodel.layout import framework_layout_error
from meshplan.planner.search import (NoPlanFits, SearchTimeout, exchange_spaces, framework_space,
                                     search)
from meshplan.planner.space import SearchSpace, candidates, pins_of
from common import print_table

RESULTS = Path(__file__).resolve().parent / "results"
MEMORY_MARGIN = 0.05
"""The CLI's default ``--memory-margin``."""
REL_TOL = 1e-9
SAVING_ORDER = ("full", "selective", "none")
"""Recompute modes, most memory saved first."""
ALT_MEMORY_SLACK = 1.5
"""Alternatives only for candidates whose leanest default-split peak is within this factor of
the capacity (moving one or two layers cannot save more)."""
ALT_STEP_SLACK = 2.0
"""... and whose fastest default-split step (ignoring memory) is within this factor of the best
fitting step of the uniform pass."""
DEFAULT_ALT_BUDGET = 20000
"""Estimate calls per scenario for alternative splits and mixes, unless the scenario says."""


@dataclass
class Scenario:
    model: str
    cluster: str
    nodes: int
    batch: int
    """Global batch (sequences)."""
    seq: int
    framework: str
    gpus_per_node: int | None = None
    host_gib: float | None = None
    pins: dict = field(default_factory=dict)
    """SearchSpace pins (tuples), the same for brute force and planner."""
    alt_budget: int = DEFAULT_ALT_BUDGET
    quick: bool = False

    def build(self) -> tuple[ModelSpec, ClusterSpec, SearchSpace]:
        model = load_model(self.model)
        cluster = load_cluster(self.cluster, nodes=self.nodes, gpus_per_node=self.gpus_per_node)
        if self.host_gib is not None:  # as `meshplan plan --host-memory-gib` does
            cluster = dataclasses.replace(cluster, host_bytes=int(self.host_gib * 2**30))
        if "layers_per_stage" in self.pins or "recompute_pinned" in self.pins:
            raise ValueError("the brute force does not support split or per-stage recompute "
                             "pins")
        space = SearchSpace(global_batch_size=self.batch, seq_len=self.seq,
                            memory_margin=MEMORY_MARGIN, **self.pins)
        return model, cluster, space


SCENARIOS = (
    # one node of H100s, the whole space
    Scenario("llama3-8b", "dgx-h100", 1, 128, 8192, "meshplan"),
    Scenario("llama3-8b", "dgx-h100", 1, 64, 8192, "deepspeed"),
    # two nodes: tp across nodes, pp over the node boundary
    Scenario("llama3-8b", "dgx-h100", 2, 256, 8192, "torchtitan"),
    # ZeRO-Offload's case: 13B on one A100-80GB with 512 GiB of host memory (offload binds)
    Scenario("llama2-13b", "dgx-a100-80gb", 1, 8, 4096, "deepspeed", gpus_per_node=1,
             host_gib=512, quick=True),
    Scenario("llama2-13b", "dgx-a100-80gb", 1, 8, 4096, "meshplan", gpus_per_node=1,
             host_gib=512, quick=True),
    # 7B on one A100 node
    Scenario("llama2-7b", "dgx-a100-80gb", 1, 256, 4096, "megatron"),
    # 70B: memory binds on 16 and 32 H100s; without offload the split and recompute decide
    Scenario("llama3-70b", "dgx-h100", 2, 128, 8192, "megatron", pins={"vpp": (1, 2, 4, 5)},
             alt_budget=40000, quick=True),
    Scenario("llama3-70b", "dgx-h100", 2, 128, 8192, "meshplan",
             pins={"offload": ("none",), "vpp": (1, 2, 4, 5)}, alt_budget=40000),
    Scenario("llama3-70b", "dgx-h100", 4, 256, 8192, "torchtitan",
             pins={"vpp": (1, 2, 4, 5), "micro_batch_size": (1, 2, 4)}),
    Scenario("llama3-70b", "dgx-h100", 4, 256, 8192, "megatron",
             pins={"offload": ("none",), "vpp": (1, 2, 4, 5, 10)}, alt_budget=40000),
    # MoE
    Scenario("mixtral-8x7b", "dgx-h100", 2, 256, 4096, "megatron",
             pins={"vpp": (1, 2, 4, 8)}),
    Scenario("mixtral-8x7b", "dgx-h100", 2, 128, 4096, "deepspeed", pins={"vpp": (1, 2, 4)}),
    # GPT-3 175B on 64 and 128 A100s
    Scenario("gpt3-175b", "dgx-a100-80gb", 8, 1536, 2048, "megatron",
             pins={"tp": (4, 8), "vpp": (1, 2, 3, 4), "micro_batch_size": (1, 2, 4)},
             alt_budget=30000),
    Scenario("gpt3-175b", "dgx-a100-80gb", 16, 1536, 2048, "deepspeed",
             pins={"tp": (4, 8), "vpp": (1, 2, 4), "micro_batch_size": (1, 2, 4)},
             alt_budget=30000),
    Scenario("gpt3-175b", "dgx-a100-80gb", 16, 1536, 2048, "megatron",
             pins={"tp": (4, 8), "offload": ("none",), "vpp": (1, 2, 3, 4, 6),
                   "micro_batch_size": (1, 2, 4, 8)}, alt_budget=30000),
    # 13B on two A100 nodes under torchtitan
    Scenario("gpt3-13b", "dgx-a100-80gb", 2, 512, 2048, "torchtitan",
             pins={"vpp": (1, 2, 4, 5)}, quick=True),
)


RANDOM_MODELS = ("gpt3-125m", "llama3.2-1b", "llama2-7b", "llama3-8b", "gpt3-1.3b",
                 "megatron-1.7b", "mixtral-8x7b", "llama2-13b")
RANDOM_CLUSTERS = ("dgx-a100-40gb", "dgx-a100-80gb", "dgx-h100", "dgx-h200", "grand-teton-h100",
                   "h100-800gbps", "dgx-b200")
RANDOM_ALT_BUDGET = 3000


def random_scenarios(count: int, seed: int) -> list[Scenario]:
    """``count`` small scenarios drawn with ``seed`` (``--random``): a catalog model up to 47B
    on 1-4 nodes of a catalog cluster, or 1-4 nodes of 1, 2 or 4 GPUs, with or without a
    host-memory limit (64 or 256 GiB), any framework, global batch 1-16 sequences per GPU,
    1,024-8,192 tokens; vpp pinned to 1 or 2 (and the micro-batch to 1-4 from 8 GPUs on) so
    each enumerates in seconds. Where the fixed set covers a few large cases in depth, these
    cover many shapes of cluster and memory pressure thinly."""
    rng = random.Random(seed)
    drawn = []
    for _ in range(count):
        per_node = rng.choice([None, None, 1, 2, 4])
        nodes = rng.choice([1, 1, 2, 4] if per_node is None else [1, 2, 4])
        gpus = (per_node or 8) * nodes
        pins = {"vpp": (1, 2)}
        if gpus >= 8:
            pins["micro_batch_size"] = (1, 2, 4)
        drawn.append(Scenario(rng.choice(RANDOM_MODELS), rng.choice(RANDOM_CLUSTERS), nodes,
                              gpus * rng.choice([1, 2, 4, 8, 16]),
                              rng.choice([1024, 2048, 4096, 8192]),
                              rng.choice(["meshplan", "megatron", "deepspeed", "torchtitan"]),
                              gpus_per_node=per_node, host_gib=rng.choice([None, None, 64, 256]),
                              pins=pins, alt_budget=RANDOM_ALT_BUDGET))
    return drawn


# ----- brute force -------------------------------------------------------------------------------
def _spread(counts: list[int], delta: int, lo: int) -> list[int] | None:
    """Add ``delta`` layers (remove, if negative) to the middle stages of ``counts``, one at a
    time to the smallest (largest) middle stage, nearest the centre first."""
    p = len(counts)
    centre = (p - 1) / 2
    middle = list(range(1, p - 1))
    out = list(counts)
    for _ in range(abs(delta)):
        if delta > 0:
            i = min(middle, key=lambda j: (out[j], abs(j - centre)))
            out[i] += 1
        else:
            i = min(middle, key=lambda j: (-out[j], abs(j - centre)))
            if out[i] - 1 < lo:
                return None
            out[i] -= 1
    return out


def alternative_splits(model: ModelSpec, config: ParallelConfig) -> list[tuple[int, ...]]:
    """A few splits near the cost model's default one (which is not listed)."""
    p, lo = config.pp, max(1, config.vpp)
    base = list(config.stage_layers(model.num_layers))
    out = []
    if p == 2:
        for d in (-1, 1, -2, 2):
            out.append([base[0] + d, base[1] - d])
    else:
        for first, last in ((-1, 0), (0, -1), (-1, -1), (1, 0), (0, 1), (0, -2)):
            counts = list(base)
            counts[0] += first
            counts[-1] += last
            spread = _spread(counts, -(first + last), lo)
            if spread is not None:
                out.append(spread)
    seen, splits = {tuple(base)}, []
    for counts in out:
        split = tuple(counts)
        if min(split) >= lo and sum(split) == model.num_layers and split not in seen:
            seen.add(split)
            splits.append(split)
    return splits


def mode_mixes(p: int, modes: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The more saving mode on the first k stages, the less saving one on the rest, for
    k in {1, p/2, p - 1}."""
    ordered = [m for m in SAVING_ORDER if m in modes]
    ks = sorted({1, p // 2, p - 1} - {0, p})
    return [(heavy,) * k + (light,) * (p - k)
            for i, heavy in enumerate(ordered) for light in ordered[i + 1:] for k in ks]


def alternatives(model: ModelSpec, config: ParallelConfig, modes: tuple[str, ...],
                 framework: str) -> list[ParallelConfig]:
    """Other splits and per-stage mixes of ``config``: mixes only where the framework takes a
    mode per stage (``frameworks.per_stage_recompute``); splits the framework does not build
    are left to ``brute_force``'s layout check."""
    mixes = mode_mixes(config.pp, modes) if per_stage_recompute(framework) else []
    out = [config.replace(recompute=mix) for mix in mixes]
    for split in alternative_splits(model, config):
        for recompute in (*modes, *mixes):
            out.append(config.replace(layers_per_stage=split, recompute=recompute))
    return out


@dataclass
class BruteForce:
    candidates: int = 0
    estimates: int = 0
    rejected: int = 0
    """Configurations ``estimate`` refused (ValueError)."""
    alt_candidates: int = 0
    alt_eligible: int = 0
    pipelined: int = 0
    best_step_s: float | None = None
    best_config: ParallelConfig | None = None
    best_in_alternatives: bool = False
    cpu_s: float = 0.0
    configs: set = field(default_factory=set)


def brute_force(model: ModelSpec, cluster: ClusterSpec, space: SearchSpace, *, framework: str,
                calibration, alt_budget: int) -> BruteForce:
    start = time.process_time()
    capacity = cluster.gpu.hbm_bytes * (1 - space.memory_margin)
    out = BruteForce()
    phase = {"alt": False}

    def evaluate(config: ParallelConfig) -> tuple[float, float] | None:
        if framework_layout_error(framework, config, model) is not None:
            out.rejected += 1  # a layout (or split) the framework does not run
            return None
        try:
            est = estimate(model, cluster, config, framework=framework,
                           calibration=calibration)
        except ValueError:
            out.rejected += 1
            return None
        out.estimates += 1
        step, peak = est.time.step_s, est.memory.peak_reserved_bytes
        if est.fits and peak <= capacity and (out.best_step_s is None
                                              or step < out.best_step_s):
            out.best_step_s, out.best_config = step, est.config
            out.best_in_alternatives = phase["alt"]
        return step, peak

    space = framework_space(space, framework)  # what search itself searches
    configs = [c for sub in exchange_spaces(space, framework)  # each context-parallel exchange
               for c in candidates(model, cluster, sub, framework=framework)]
    out.candidates = len(configs)
    out.configs = set(configs)
    rows = []
    for config in configs:
        results = [r for r in (evaluate(config.replace(recompute=mode))
                               for mode in space.recompute_modes) if r is not None]
        if config.pp > 1 and results:
            rows.append((min(s for s, _ in results), min(p for _, p in results), config))
    out.pipelined = len(rows)
    ref = out.best_step_s if out.best_step_s is not None else math.inf
    eligible = sorted((r for r in rows if r[1] <= ALT_MEMORY_SLACK * capacity
                       and r[0] <= ALT_STEP_SLACK * ref), key=lambda r: r[0])
    out.alt_eligible = len(eligible)
    phase["alt"] = True
    spent = 0
    for _, _, config in eligible:
        variants = alternatives(model, config, space.recompute_modes, framework)
        if spent + len(variants) > alt_budget:
            break
        for variant in variants:
            evaluate(variant)
        spent += len(variants)
        out.alt_candidates += 1
    out.cpu_s = time.process_time() - start
    return out


# ----- planner ------------------------------------------------------------------------------------
@dataclass
class Planned:
    status: str
    gap: float | None = None
    cpu_s: float = 0.0
    wall_s: float = 0.0
    step_s: float | None = None
    config: ParallelConfig | None = None
    problems: list[str] = field(default_factory=list)


def run_planner(model: ModelSpec, cluster: ClusterSpec, space: SearchSpace, *, framework: str,
                calibration, time_limit_s: float | None, max_nodes: int | None,
                configs: set) -> Planned:
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        result = search(model, cluster, space, framework=framework, calibration=calibration,
                        top_k=1, deterministic=time_limit_s is None,
                        time_limit_s=time_limit_s or 3600.0, max_nodes=max_nodes)
    except NoPlanFits:
        return Planned(status="NO_PLAN", cpu_s=time.process_time() - cpu,
                       wall_s=time.perf_counter() - wall)
    except SearchTimeout:
        return Planned(status="TIMEOUT", cpu_s=time.process_time() - cpu,
                       wall_s=time.perf_counter() - wall)
    except Exception as exc:  # noqa: BLE001 - a crash is reported, the other scenarios run
        return Planned(status="ERROR", cpu_s=time.process_time() - cpu,
                       wall_s=time.perf_counter() - wall,
                       problems=[f"planner raised {type(exc).__name__}: {exc}"])
    out = Planned(status=result.status, gap=result.stats.get("gap"),
                  cpu_s=time.process_time() - cpu, wall_s=time.perf_counter() - wall)
    best = result.ranked[0]
    out.step_s, out.config = best.step_s, best.estimate.config
    # the plan, checked with the cost model alone
    c = out.config
    try:
        est = estimate(model, cluster, c, framework=framework, calibration=calibration)
    except ValueError as exc:
        out.problems.append(f"estimate refuses the plan's configuration: {exc}")
        return out
    if abs(est.time.step_s - out.step_s) > REL_TOL * out.step_s:
        out.problems.append(f"reported step {out.step_s:.9g} s but estimate gives "
                            f"{est.time.step_s:.9g} s")
    if not (est.fits and est.memory.peak_reserved_bytes
            <= cluster.gpu.hbm_bytes * (1 - space.memory_margin)):
        out.problems.append(f"plan does not fit: {est.why_not or 'over the margin'} "
                            f"({est.memory.peak_reserved_bytes / 2**30:.2f} GiB reserved)")
    if c.replace(layers_per_stage=None, recompute="none") not in configs:
        out.problems.append("plan's global configuration is not a candidate of the space")
    bad = sorted({c.stage_recompute(i) for i in range(c.pp)} - set(space.recompute_modes))
    if bad:
        out.problems.append(f"plan uses recompute modes outside the space: {bad}")
    return out


# ----- report -------------------------------------------------------------------------------------
def describe(c: ParallelConfig | None, model: ModelSpec) -> str:
    if c is None:
        return "-"
    parts = [f"tp{c.tp}", f"pp{c.pp}", f"dp{c.dp}", f"cp{c.cp}"]
    if c.ep > 1:
        parts.append(f"ep{c.ep}")
    parts += ["sp" if c.sp else "nosp", f"z{c.zero_stage}", f"mb{c.micro_batch_size}",
              f"v{c.vpp}"]
    if c.offload != "none":
        parts.append(f"off:{c.offload}@{c.offload_device}")
    if c.pp > 1 and c.dp > 1:
        parts.append("dp-out" if c.mesh_order[-1] == "dp" else "pp-out")
    modes = [c.stage_recompute(i) for i in range(c.pp)]
    parts.append("rc:" + (modes[0] if len(set(modes)) == 1
                          else "/".join(m[0] for m in modes)))
    if c.pp > 1:
        parts.append("L" + "/".join(map(str, c.stage_layers(model.num_layers))))
    return " ".join(parts)


def pins_text(space: SearchSpace) -> str:
    pins = {k: v for k, v in pins_of(space).items() if k != "memory_margin"}
    return " ".join(f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}"
                    for k, v in pins.items()) or "-"


def run_scenario(index: int, sc: Scenario, args, calibration) -> dict:
    model, cluster, space = sc.build()
    budget = sc.alt_budget if args.alt_budget is None else args.alt_budget
    bf = brute_force(model, cluster, space, framework=sc.framework, calibration=calibration,
                     alt_budget=budget)
    pl = run_planner(model, cluster, space, framework=sc.framework, calibration=calibration,
                     time_limit_s=args.time_limit, max_nodes=args.max_nodes,
                     configs=bf.configs)
    problems = list(pl.problems)
    if bf.best_step_s is not None and pl.step_s is None:
        problems.append(f"planner found no plan ({pl.status}) but brute force found one")
    ratio = None
    if bf.best_step_s is not None and pl.step_s is not None:
        ratio = bf.best_step_s / pl.step_s
        if ratio < 1 - REL_TOL:
            within = (pl.status == "FEASIBLE" and pl.gap is not None
                      and bf.best_step_s >= pl.step_s * (1 - pl.gap) * (1 - REL_TOL))
            problems.append(f"brute force is {1 - ratio:.3%} faster"
                            + (f" (planner FEASIBLE, within its proven gap {pl.gap:.2%})"
                               if within else ""))
    host = f", host {sc.host_gib:g} GiB" if sc.host_gib is not None else ""
    row = {"i": index, "model": sc.model, "gpus": cluster.num_gpus,
           "cluster": f"{sc.cluster} x{sc.nodes}"
                      + (f" ({cluster.gpus_per_node}/node{host})"
                         if sc.gpus_per_node is not None or host else ""),
           "framework": sc.framework, "batch": sc.batch, "seq": sc.seq,
           "pins": pins_text(space), "candidates": bf.candidates,
           "estimates": bf.estimates, "rejected": bf.rejected,
           "alt_cands": f"{bf.alt_candidates}/{bf.alt_eligible}/{bf.pipelined}",
           "brute_step_s": bf.best_step_s, "brute_plan": describe(bf.best_config, model),
           "brute_from_alt": bf.best_in_alternatives,
           "planner_step_s": pl.step_s, "planner_plan": describe(pl.config, model),
           "ratio": ratio, "status": pl.status, "gap": pl.gap,
           "planner_cpu_s": pl.cpu_s, "brute_cpu_s": bf.cpu_s,
           "ok": not problems, "problems": "; ".join(problems)}
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", type=int, nargs="*", help="scenario indices to run")
    parser.add_argument("--quick", action="store_true",
                        help="only the scenarios marked quick (every framework)")
    parser.add_argument("--list", action="store_true",
                        help="list the scenarios with their candidate counts and exit")
    parser.add_argument("--time-limit", type=float, default=None, metavar="S",
                        help="planner wall-clock limit (default: deterministic budget)")
    parser.add_argument("--max-nodes", type=int, default=None,
                        help="nodes of a deterministic search (default: the planner's)")
    parser.add_argument("--alt-budget", type=int, default=None,
                        help="estimate calls for alternative splits/mixes per scenario "
                             "(default: the scenario's)")
    parser.add_argument("--random", type=int, default=None, metavar="N",
                        help="instead of the fixed set, N small random scenarios "
                             "(random_scenarios)")
    parser.add_argument("--seed", type=int, default=0, help="seed of --random (default 0)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    scenarios = (SCENARIOS if args.random is None
                 else tuple(random_scenarios(args.random, args.seed)))
    chosen = [(i, sc) for i, sc in enumerate(scenarios)
              if (args.only is None or i in args.only) and (not args.quick or sc.quick)]
    if args.list:
        for i, sc in chosen:
            model, cluster, space = sc.build()
            space = framework_space(space, sc.framework)
            configs = [c for sub in exchange_spaces(space, sc.framework)
                       for c in candidates(model, cluster, sub, framework=sc.framework)]
            uniform = len(configs) * len(space.recompute_modes)
            print(f"{i:2d} {sc.model:13s} {cluster.num_gpus:4d} GPUs {sc.framework:10s} "
                  f"B{sc.batch} s{sc.seq}  candidates {len(configs):7d}  uniform estimates "
                  f"{uniform:7d}  alt budget {sc.alt_budget}  pins {pins_text(space)}"
                  + ("  [quick]" if sc.quick else ""))
        return 0
    calibration = default_calibration()
    wall = time.perf_counter()
    rows = []
    for i, sc in chosen:
        row = run_scenario(i, sc, args, calibration)
        rows.append(row)
        flag = "ok" if row["ok"] else "VIOLATION: " + row["problems"]
        print(f"[{i}] {sc.model} {row['gpus']} GPUs {sc.framework}: {row['estimates']} "
              f"estimates, brute {row['brute_step_s']}, planner {row['planner_step_s']} "
              f"({row['status']}), {flag}", file=sys.stderr, flush=True)
    total_s = time.perf_counter() - wall
    table = pd.DataFrame(rows)
    shown = table.drop(columns=["problems", "batch", "seq", "rejected"])
    print_table(shown, {"brute_step_s": "{:.4f}", "planner_step_s": "{:.4f}",
                        "ratio": "{:.6f}", "gap": "{:.2%}", "planner_cpu_s": "{:.1f}",
                        "brute_cpu_s": "{:.1f}"}, width=400)
    bad = table[~table.ok]
    print(f"\n{len(rows)} scenarios in {total_s:.0f} s wall")
    for _, row in bad.iterrows():
        print(f"VIOLATION in scenario {row.i} ({row.model}, {row.gpus} GPUs, {row.framework}): "
              f"{row.problems}\n  brute:   {row.brute_step_s} s  {row.brute_plan}\n"
              f"  planner: {row.planner_step_s} s  {row.planner_plan}")
    if bad.empty:
        print("no violation: brute force never beat the planner")
    args.out.mkdir(parents=True, exist_ok=True)
    kind = ("-quick" if args.quick else "") + (f"-random{args.random}-seed{args.seed}"
                                                 if args.random is not None else "")
    stem = f"planner-bruteforce{kind}-{dt.date.today().isoformat()}"
    planner_budget = (f"wall-clock limit {args.time_limit:g} s" if args.time_limit
                      else "deterministic budget"
                      + (f", {args.max_nodes} nodes" if args.max_nodes else ""))
    header = (f"# Planner vs brute force over the cost model\n\n"
              f"{len(rows)} scenarios ({'--quick' if args.quick else 'all'}"
              f"{f', --random {args.random} --seed {args.seed}' if args.random is not None else ''}"
              f"{', --only ' + ' '.join(map(str, args.only)) if args.only else ''}), "
              f"planner: top_k 1, 1 CP-SAT worker, {planner_budget}; memory margin "
              f"{MEMORY_MARGIN:g}; {total_s:.0f} s wall. ratio = brute-force best step / "
              f"planner best step (must be >= 1 - 1e-9). alt_cands: pipelined candidates that "
              f"got alternative splits and mixes / eligible / all pipelined. "
              f"{'No violation.' if bad.empty else f'{len(bad)} VIOLATION(S).'}\n\n")
    (args.out / f"{stem}.md").write_text(
        header + table.to_markdown(index=False, floatfmt=".6g") + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps(
        {"planner_budget": planner_budget, "memory_margin": MEMORY_MARGIN,
         "wall_s": total_s, "rows": rows}, indent=2, default=str))
    return 0 if bad.empty else 1


if __name__ == "__main__":
    sys.exit(main())
