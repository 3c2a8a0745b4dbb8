"""CP-SAT model of one candidate: layer-to-stage split and per-stage recomputation.

Only builds and solves: integer tables in (``tables.CandidateTables``), an immutable
``Solution`` or a typed exception out. Always a time limit, a seed and a worker count.

Data: p stages, R allowed recompute modes, L layers; per stage i and mode r the linear forms
(``base + slope * (n - lo_i)``) of every time term and of reserved memory; m micro-batches,
v virtual chunks.

Variables:
  y[i][r]  stage i uses mode r (Boolean; exactly one per stage)
  n[i][r]  layers on stage i if it uses mode r, else 0; a stage holds a *count* of layers:
           identical layers are interchangeable, so there are no per-layer variables and no
           symmetric copies of one split
  t[i]     stage i's seconds per micro-batch; e[i], g[i] its exposed ZeRO-2/3 and parameter
           offload traffic; d[i] its exposed once-per-step data-parallel traffic
  T, D, O, F   maxima over stages of t, d, optimizer step and offload step

Constraints (one family each):
  sum_r y[i][r] = 1; lo_i y[i][r] <= n[i][r] <= hi_i y[i][r]      one mode, layer bounds
  sum_i sum_r n[i][r] = L                                        every layer on one stage
  memory_i(n, y) <= capacity                                     memory cap per stage
  e[i] >= 0, e[i] >= comm_i - hidden_i (same for g[i], d[i])     exposed = max(0, raw - hidden)
  u[i] >= e[i], u[i] >= g[i]                                     the slower transfer chain
  t[i] = linear_i + u[i]
  T >= t[i], D >= d[i], O >= optimizer_i, F >= offload_i
  y[i][r] = w[r], sum_r w[r] = 1                                 one mode for every stage, where
                                                                 the framework takes one
                                                                 (``tables.uniform_modes``)

Objective (v x step time in ns, ``costmodel.composition.scaled_step``, as the cost model
composes a step; t[i] is ``composition.micro_total`` of the stage's terms):
  minimise (m v - 1) T + sum_i t[i] + v (D + O + F)
Every term has a positive weight, so at the optimum each maximum and each max(0, .) is tight.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

from ortools.sat.python import cp_model

from meshplan.costmodel import composition
from meshplan.costmodel.config import even_split

from meshplan.planner.tables import (CandidateTables, StageTerms, StageTime, TracedTables, fits,
                                     map_terms, objective_ns, scaled_step_ns, stage_time_ns,
                                     traced_objective_ns)


class Infeasible(Exception):
    """No split and recompute choice fits in memory (proved by the solver)."""


class BeyondRange(Infeasible):
    """The candidate's step times overflow the solver's 64-bit nanoseconds (a step of
    centuries, from rates off by orders of magnitude): it can never be the best plan, and
    ``search`` skips it as it skips one that does not fit."""


INT_RANGE = 2 ** 62
"""What the model's largest linear expression may reach (CP-SAT's integers are 64-bit)."""


def _check_range(bound: int, tables) -> None:
    """BeyondRange unless a stage's time bound ``bound`` (ns), scaled as the objective scales
    it (``_step_objective``; ``_build_counts``'s maxima allow 10 x bound + 1e12), fits."""
    weight = tables.micro_batches * tables.vpp + len(tables.allowed) + 3 * tables.vpp
    if (10 * bound + 10 ** 12) * weight >= INT_RANGE:
        raise BeyondRange(f"a stage's time bound of {bound / 1e9:.3g} s overflows the solver")


class NoSolutionInTime(Exception):
    """The time limit passed before any feasible split was found."""


@dataclass(frozen=True)
class Solution:
    layers: tuple[int, ...]
    modes: tuple[str, ...]
    objective: int
    """v x step time in ns (see the module docstring)."""
    vpp: int
    status: str
    """``OPTIMAL`` or ``FEASIBLE`` (time limit reached with a solution)."""
    wall_s: float

    @property
    def step_s(self) -> float:
        return self.objective / self.vpp / 1e9


def greedy_hint(tables: CandidateTables) -> tuple[list[int], list[str]] | None:
    """The cost model's even split (``costmodel.config.even_split``: extra layers to the
    middle stages), or the tables' pinned one, with, per stage, the fastest fitting mode;
    None if some stage fits under no mode."""
    p = len(tables.lo)
    layers = (list(tables.lo) if tables.lo == tables.hi
              else list(even_split(tables.num_layers, p)))
    modes = []
    for i, n in enumerate(layers):
        if not tables.lo[i] <= n <= tables.hi[i]:
            return None
        fitting = [r for r in tables.allowed[i] if fits(tables, i, n, r)]
        if not fitting:
            return None
        modes.append(fitting[0])
    terms = {(i, r): stage_time_ns(tables, i, n, r)
             for i, n in enumerate(layers) for r in tables.allowed[i] if fits(tables, i, n, r)}

    def objective(chosen: list[str]) -> int:
        return scaled_step_ns([terms[i, r] for i, r in enumerate(chosen)],
                              micro_batches=tables.micro_batches, vpp=tables.vpp)

    if tables.uniform_modes:  # one mode for every stage: the fastest that fits them all
        every = [[r] * p for r in tables.allowed[0] if all((i, r) in terms for i in range(p))]
        return (layers, min(every, key=objective)) if every else None
    best = objective(modes)
    for i in range(p):  # one pass of per-stage improvement
        for r in tables.allowed[i]:
            if (i, r) in terms:
                trial = modes[:i] + [r] + modes[i + 1:]
                value = objective(trial)
                if value < best:
                    best, modes = value, trial
    return layers, modes


def _tie_modes(model: cp_model.CpModel, chosen: list[dict],
               more: frozenset = frozenset()) -> dict:
    """One mode for every stage (``CandidateTables.uniform_modes``): per stage, ``chosen[i]``
    maps each mode to an expression that is 1 when the stage takes it, 0 otherwise; a mode
    Boolean w[r], exactly one true, equals each of them (a mode some stage cannot take is 0).
    ``more``: modes other variables may take (counted stages). Returns w."""
    modes = sorted(set().union(more, *chosen))
    w = {r: model.NewBoolVar(f"w_{r}") for r in modes}
    model.AddExactlyOne(w.values())
    for stage in chosen:
        for r in modes:
            model.Add(stage.get(r, 0) == w[r])
    return w


def _affine(form, y, n, lo):
    """base * y + slope * (n - lo * y): the linear form at the chosen count, 0 if not chosen."""
    return (form.base - form.slope * lo) * y + form.slope * n


def solve(tables: CandidateTables, *, time_limit_s: float, seed: int = 0, workers: int = 1,
          cutoff_s: float | None = None, deterministic_s: float | None = None) -> Solution:
    """Optimal split and modes for ``tables``; raises Infeasible or NoSolutionInTime.

    ``cutoff_s``: only solutions with a step time below it are wanted (branch and bound);
    Infeasible then also means "nothing beats the cutoff".

    Middle stages that run alike (same time terms, links included, and the same allowed modes)
    are modelled by how many of them take each (layer count, mode) combination
    (``_build_counts``, one group per kind); with fewer than three stages or a pinned split every
    stage gets its own variables (``_build_per_stage``).
    """
    start = time.perf_counter()
    groups = middle_groups(tables) if len(tables.lo) > 2 else None
    model = cp_model.CpModel()
    decode = (_build_counts(model, tables, groups) if groups
              else _build_per_stage(model, tables))
    if cutoff_s is not None:
        model.Add(decode.objective < int(cutoff_s * 1e9 * tables.vpp))
    hint = greedy_hint(tables)
    if hint is not None:
        decode.hint(model, *hint)
    solver, status = _run(model, time_limit_s=time_limit_s, seed=seed, workers=workers,
                          deterministic_s=deterministic_s)
    wall = time.perf_counter() - start
    layers, modes = decode.read(solver)
    # The split's own objective: equal to the solver's at the optimum; below it when a time
    # limit stopped the solver before its maxima were tight.
    return Solution(layers=tuple(layers), modes=tuple(modes),
                    objective=objective_ns(tables, layers, modes), vpp=tables.vpp,
                    status="OPTIMAL" if status == cp_model.OPTIMAL else "FEASIBLE",
                    wall_s=wall)


def _run(model: cp_model.CpModel, *, time_limit_s: float, seed: int, workers: int,
         deterministic_s: float | None = None) -> tuple[cp_model.CpSolver, int]:
    """Solve with a time limit, a seed and a worker count; Infeasible or NoSolutionInTime
    when there is no split to read. With ``deterministic_s`` the limit is CP-SAT's
    deterministic time instead of wall-clock time (and one worker), so the answer does not
    depend on the machine's load."""
    solver = cp_model.CpSolver()
    if deterministic_s is not None:
        solver.parameters.max_deterministic_time = deterministic_s
        workers = 1
    else:
        solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.random_seed = seed
    solver.parameters.num_workers = workers
    status = solver.Solve(model)
    if status == cp_model.INFEASIBLE:
        raise Infeasible("no layer split and recompute choice fits in memory")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        limit = (f"{deterministic_s} s of CP-SAT deterministic time" if deterministic_s
                 is not None else f"{time_limit_s} s")
        raise NoSolutionInTime(f"no feasible split found within {limit}")
    return solver, status


class _Decoder:
    """Reads a split back from a solved model and sets hints; built by the two formulations."""

    def __init__(self, read, hint, objective):
        self.read = read
        self.hint = hint
        self.objective = objective


def _build_per_stage(model: cp_model.CpModel, tables: CandidateTables) -> _Decoder:
    """Variables per stage (see the module docstring)."""
    p = len(tables.lo)
    big = 0
    stages, y_all, n_all = [], [], []
    for i in range(p):
        lo, hi = tables.lo[i], tables.hi[i]
        modes = tables.allowed[i]
        y = {r: model.NewBoolVar(f"y{i}_{r}") for r in modes}
        n = {r: model.NewIntVar(0, hi, f"n{i}_{r}") for r in modes}
        model.AddExactlyOne(y.values())
        for r in modes:
            model.Add(n[r] >= lo * y[r])
            model.Add(n[r] <= hi * y[r])
            if not fits(tables, i, lo, r):  # memory grows with layers: nothing fits
                model.Add(y[r] == 0)
        model.Add(sum(_affine(tables.fit_form(i, r), y[r], n[r], lo) for r in modes)
                  <= tables.capacity_bytes)

        terms = map_terms(lambda *forms: sum(_affine(f, y[r], n[r], lo)
                                             for f, r in zip(forms, modes)),
                          *(tables.time_ns[i][r] for r in modes))
        bound = max(abs(f.base) + abs(f.slope) * (hi - lo)
                    for forms in tables.time_ns[i].values() for f in forms.values())
        if tables.dp_buckets and tables.dp_buckets[i]:
            # bucketed calls: k >= amount / bucket, at its least (the ceiling) wherever the
            # stage's data-parallel traffic counts towards the objective
            held = sum(n.values())
            extra = 0
            for j, term in enumerate(tables.dp_buckets[i]):
                most = max(1, math.ceil(term.amount(hi - lo) / term.bucket))
                k = model.NewIntVar(1, most, f"k{i}_{j}")
                model.Add(int(round(term.bucket)) * k
                          >= int(round(term.base - term.slope * lo))
                          + int(round(term.slope)) * held)
                extra += term.cost * k
                bound += term.cost * most
            terms = dataclasses.replace(terms, dp_comm=terms.dp_comm + extra)
        _check_range(bound, tables)
        big = max(big, bound)
        stages.append(_stage_time(model, terms, bound, i))
        y_all.append(y)
        n_all.append(n)
    if tables.uniform_modes:
        _tie_modes(model, y_all)
    model.Add(sum(sum(n.values()) for n in n_all) == tables.num_layers)
    objective = _step_objective(model, stages, big=big,
                                micro_batches=tables.micro_batches, vpp=tables.vpp)
    model.Minimize(objective)

    def hint(model: cp_model.CpModel, layers: list[int], modes: list[str]) -> None:
        for i, (count, mode) in enumerate(zip(layers, modes)):
            for r in tables.allowed[i]:
                model.AddHint(y_all[i][r], r == mode)
                model.AddHint(n_all[i][r], count if r == mode else 0)

    def read(solver: cp_model.CpSolver) -> tuple[list[int], list[str]]:
        modes = [next(r for r in tables.allowed[i] if solver.BooleanValue(y_all[i][r]))
                 for i in range(p)]
        return [int(solver.Value(n_all[i][modes[i]])) for i in range(p)], modes

    return _Decoder(read, hint, objective)


def _stage_time(model: cp_model.CpModel, terms: StageTerms, bound: int, i: int):
    """Stage ``i``'s per-micro-batch time t, its exposed data-parallel traffic d, and its
    optimizer and offload-step terms, composed by ``costmodel.composition`` with
    ``max(0, raw - hidden)`` as a variable e >= raw - hidden, e >= 0 and the larger of two
    as a variable bounded below by both (tight at the optimum); ``terms`` holds the stage's
    expression for every time term."""
    made: list[cp_model.IntVar] = []

    def exposed(raw, hidden):
        name = ("zero_comm", "offload_raw", "dp_comm")[len(made)]
        var = model.NewIntVar(0, bound, f"{name}_exposed{i}")
        model.Add(var >= raw - hidden)
        made.append(var)
        return var

    def largest(a, b):
        var = model.NewIntVar(0, bound, f"transfer_exposed{i}")
        model.Add(var >= a)
        model.Add(var >= b)
        return var

    micro = composition.micro_total(
        linear=terms.linear, zero_comm=terms.zero_comm, zero_hidden=terms.zero_hidden,
        offload_raw=terms.offload_raw, offload_hidden=terms.offload_hidden, exposed=exposed,
        largest=largest)
    d = exposed(terms.dp_comm, terms.dp_hidden)
    t = model.NewIntVar(0, 3 * bound, f"t{i}")
    model.Add(t == micro)
    return t, d, terms.optimizer, terms.offload_step


def _step_objective(model: cp_model.CpModel, stages, *, big: int, micro_batches: int,
                    vpp: int):
    """v x step time, ``composition.scaled_step`` of T, sum_i t_i and D + O + F, with T, D, O,
    F variables bounding the maxima over stages from above (tight at the optimum: every term
    has a positive weight). ``stages``: each stage's (t, d, o, f) of ``_stage_time``."""
    top_t = model.NewIntVar(0, 3 * big, "T")
    top_d, top_o, top_f = (model.NewIntVar(0, big, name) for name in ("D", "O", "F"))
    for t, d, o, f in stages:
        model.Add(top_t >= t)
        model.Add(top_d >= d)
        model.Add(top_o >= o)
        model.Add(top_f >= f)
    once = composition.once_per_step(dp_exposed=top_d, optimizer=top_o, offload_step=top_f)
    return composition.scaled_step(micro_batches=micro_batches, vpp=vpp, top_micro=top_t,
                                   sum_micro=sum(t for t, _, _, _ in stages), once=once)


def middle_groups(tables: CandidateTables) -> list[list[int]] | None:
    """Middle stages grouped by equal time terms, allowed modes and layer bounds (in stage
    order), or None when some group cannot be counted (a pinned single layer count)."""
    groups: dict[tuple, list[int]] = {}
    for i in range(1, len(tables.lo) - 1):
        key = (repr(tables.time_ns[i]), tables.allowed[i], tables.lo[i], tables.hi[i])
        groups.setdefault(key, []).append(i)
    out = list(groups.values())
    if any(tables.lo[g[0]] == tables.hi[g[0]] for g in out):
        return None
    return out


def _build_counts(model: cp_model.CpModel, tables: CandidateTables,
                  groups: list[list[int]]) -> _Decoder:
    """First and last stage pick one (count, mode) combination each; middle stages that run
    alike (a group: same time terms, i.e. same links) are counted.

    Variables: z_first[x], z_last[x] (Boolean, one each); per group G, c[G, x] = stages of G
    taking combination x = (n, r) and u[G, x] = (c[G, x] > 0). Stage j of G fits x iff j is at
    or after g(G, x), the first stage of G where x fits (memory falls with the micro-batches in
    flight, which fall with the stage index), so the sets of stages x may use are nested and an
    assignment exists iff, for every stage j of G, the combinations that need a stage at or
    after j number at most the stages of G at or after j (Hall's condition). Every time term of
    a combination is a constant, so maxima and sums are linear.
    """
    p = len(tables.lo)
    c: dict[tuple, cp_model.IntVar] = {}
    u: dict[tuple, cp_model.IntVar] = {}
    terms: dict[tuple, StageTime] = {}
    first_g: dict[tuple, int] = {}
    for gi, group in enumerate(groups):
        head = group[0]
        for n in range(tables.lo[head], tables.hi[head] + 1):
            for r in tables.allowed[head]:
                fitting = [k for k, j in enumerate(group) if fits(tables, j, n, r)]
                if not fitting:
                    continue
                key = (gi, n, r)
                first_g[key] = fitting[0]
                terms[key] = stage_time_ns(tables, head, n, r)
                c[key] = model.NewIntVar(0, len(group), f"c{key}")
                u[key] = model.NewBoolVar(f"u{key}")
                model.Add(c[key] <= len(group) * u[key])
                model.Add(c[key] >= u[key])
        keys = [k for k in c if k[0] == gi]
        model.Add(sum(c[k] for k in keys) == len(group))
        for position in range(len(group)):  # Hall's condition on nested feasible sets
            needing = [c[k] for k in keys if first_g[k] >= position]
            if needing:
                model.Add(sum(needing) <= len(group) - position)
    ends = {}
    for stage in (0, p - 1):
        options = [(n, r) for n in range(tables.lo[stage], tables.hi[stage] + 1)
                   for r in tables.allowed[stage] if fits(tables, stage, n, r)]
        z = {x: model.NewBoolVar(f"z{stage}{x}") for x in options}
        model.AddExactlyOne(z.values())
        ends[stage] = (z, {x: stage_time_ns(tables, stage, *x) for x in options})
    if tables.uniform_modes:  # a group's stages all take the mode: c sums to its size
        chosen = [{r: sum(var for x, var in ends[stage][0].items() if x[1] == r)
                   for r in {x[1] for x in ends[stage][0]}} for stage in ends]
        w = _tie_modes(model, chosen, frozenset(k[2] for k in c))
        for gi, group in enumerate(groups):
            for r in w:
                model.Add(sum(c[k] for k in c if k[0] == gi and k[2] == r)
                          == len(group) * w[r])
    layers_used = sum(k[1] * c[k] for k in c) + sum(
        x[0] * var for stage in ends for x, var in ends[stage][0].items())
    model.Add(layers_used == tables.num_layers)
    bound = max([t.micro_total for t in terms.values()] + [
        t.micro_total for stage in ends for t in ends[stage][1].values()] + [0])
    _check_range(bound, tables)
    tops = {name: model.NewIntVar(0, 10 * bound + 10**12, name)
            for name in ("micro_total", "dp_exposed", "optimizer", "offload_step")}
    middle_count = sum(len(g) for g in groups)
    for name, top in tops.items():
        for k in c:
            model.Add(top >= getattr(terms[k], name) * u[k])
        # the largest is at least the mean over middle stages (tightens the LP relaxation)
        model.Add(middle_count * top >= sum(getattr(terms[k], name) * c[k] for k in c))
        for stage in ends:
            z, values = ends[stage]
            model.Add(top >= sum(getattr(values[x], name) * var for x, var in z.items()))
    total = sum(terms[k].micro_total * c[k] for k in c) + sum(
        values[x].micro_total * var for z, values in ends.values() for x, var in z.items())
    once = composition.once_per_step(dp_exposed=tops["dp_exposed"],
                                     optimizer=tops["optimizer"],
                                     offload_step=tops["offload_step"])
    objective = composition.scaled_step(micro_batches=tables.micro_batches, vpp=tables.vpp,
                                        top_micro=tops["micro_total"], sum_micro=total,
                                        once=once)
    model.Minimize(objective)

    def hint(model: cp_model.CpModel, layers: list[int], modes: list[str]) -> None:
        chosen = list(zip(layers, modes))
        for stage in ends:
            for x, var in ends[stage][0].items():
                model.AddHint(var, x == chosen[stage])
        for gi, group in enumerate(groups):
            picked = [chosen[j] for j in group]
            for key in (k for k in c if k[0] == gi):
                count = picked.count(key[1:])
                model.AddHint(c[key], count)
                model.AddHint(u[key], count > 0)

    def read(solver: cp_model.CpSolver) -> tuple[list[int], list[str]]:
        split: list[tuple[int, str]] = [None] * p  # type: ignore[list-item]
        for stage in ends:
            split[stage] = next(x for x, var in ends[stage][0].items()
                                if solver.BooleanValue(var))
        for gi, group in enumerate(groups):
            # combinations to stages: most demanding (latest first fit) to the latest stages
            pool = sorted((k for k in c if k[0] == gi for _ in range(solver.Value(c[k]))),
                          key=lambda k: first_g[k])
            for stage, key in zip(group, pool):
                split[stage] = key[1:]
        return [x[0] for x in split], [x[1] for x in split]

    return _Decoder(read, hint, objective)


# ----- traced models: stage boundaries over layers of several kinds ---------------------------------

def solve_traced(tables: TracedTables, *, time_limit_s: float, seed: int = 0, workers: int = 1,
                 cutoff_s: float | None = None,
                 deterministic_s: float | None = None) -> Solution:
    """Optimal split and modes of a traced model, or of one that mixes dense and MoE layers
    (layers of several kinds, in a fixed order).

    Variables: boundaries 0 = b_0 < b_1 < ... < b_p = L (at least v layers a stage); per kind k
    the prefix count P_k[b_i] through an element constraint, so stage i holds
    c[i][k] = P_k[b_{i+1}] - P_k[b_i] layers of kind k; y[i][o] its option and
    x[i][o][k] = c[i][k] if y[i][o] else 0. An option is a mode, or for a mixed model a mode
    and whether the stage holds an MoE layer (h[i], tied to c[i][heavy] >= 1), each with its
    own forms (``TracedTables.forms``). Every term of stage i is
    ``sum_o (base_o y[i][o] + sum_k slope_ok x[i][o][k])``; memory, exposure, maxima and the
    objective are as in ``_build_per_stage``.
    """
    start = time.perf_counter()
    p, total = len(tables.allowed), tables.num_layers
    kinds = len(tables.prefix)
    lo = max(1, tables.vpp)
    model = cp_model.CpModel()
    b = [model.NewConstant(0)] + [model.NewIntVar(lo * (i + 1), total - lo * (p - i - 1),
                                                  f"b{i + 1}")
                                  for i in range(p - 1)] + [model.NewConstant(total)]
    for i in range(p):
        model.Add(b[i + 1] >= b[i] + lo)
    if tables.pinned_layers is not None:
        edge = 0
        for i, n in enumerate(tables.pinned_layers[:-1]):
            edge += n
            model.Add(b[i + 1] == edge)
    at = [[model.NewIntVar(0, total, f"P{k}_{i}") for k in range(kinds)] for i in range(p + 1)]
    for i in range(p + 1):
        for k in range(kinds):
            model.AddElement(b[i], list(tables.prefix[k]), at[i][k])
    y_all, x_all, stages = [], [], []
    big = 1
    for i in range(p):
        counts = [at[i + 1][k] - at[i][k] for k in range(kinds)]
        modes = tables.allowed[i]
        # options: (mode, holds an MoE layer) for a mixed model, (mode, None) otherwise
        options = [(r, cls) for r in modes for cls in tables.classes(i)]
        y = {o: model.NewBoolVar(f"y{i}_{o[0]}_{o[1]}") for o in options}
        model.AddExactlyOne(y.values())
        heavy = None
        if tables.heavy_kind is not None:
            heavy = model.NewBoolVar(f"heavy{i}")
            model.Add(counts[tables.heavy_kind] >= 1).OnlyEnforceIf(heavy)
            model.Add(counts[tables.heavy_kind] == 0).OnlyEnforceIf(heavy.Not())
            for (r, cls), var in y.items():
                model.AddImplication(var, heavy if cls else heavy.Not())
        x = {}
        for o in options:
            x[o] = [model.NewIntVar(0, total, f"x{i}_{o[0]}_{o[1]}_{k}") for k in range(kinds)]
            for k in range(kinds):
                model.Add(x[o][k] == counts[k]).OnlyEnforceIf(y[o])
                model.Add(x[o][k] == 0).OnlyEnforceIf(y[o].Not())

        def form(f, o):
            return f.base * y[o] + sum(s * x[o][k] for k, s in enumerate(f.slopes) if s)

        def forms_of(o):
            light = o[1] is False
            times = tables.light_time_ns[i] if light else tables.time_ns[i]
            memory = tables.light_memory_bytes[i] if light else tables.memory_bytes[i]
            return times[o[0]], memory[o[0]]

        workspace = 0
        if "full" in modes and any(tables.workspace_bytes):
            # the largest rebuild over the kinds the stage holds, if it recomputes fully
            full = sum(var for (r, _), var in y.items() if r == "full")
            workspace = model.NewIntVar(0, max(tables.workspace_bytes), f"w{i}")
            for k, bytes_k in enumerate(tables.workspace_bytes):
                if bytes_k:
                    held = model.NewBoolVar(f"h{i}_{k}")
                    model.Add(counts[k] <= total * held)
                    model.Add(workspace >= bytes_k * (held + full - 1))
        model.Add(sum(form(forms_of(o)[1], o) for o in options) + workspace
                  <= tables.capacity_bytes)

        terms = map_terms(lambda *forms: sum(form(f, o) for f, o in zip(forms, options)),
                          *(forms_of(o)[0] for o in options))
        bound = max(abs(f.base) + sum(abs(s) for s in f.slopes) * total
                    for o in options for f in forms_of(o)[0].values())
        extra = []
        for cls in tables.classes(i):  # bucketed calls, counted for the class the stage takes
            literal = None if cls is None else (heavy if cls else heavy.Not())
            for j, term in enumerate(tables.buckets(i, cls is False)):
                most = max(1, math.ceil((abs(term.amount.base) + sum(
                    abs(s) for s in term.amount.slopes) * total) / term.bucket))
                k = model.NewIntVar(0, most, f"k{i}_{cls}_{j}")
                need = model.Add(int(round(term.bucket)) * k >= term.amount.base + sum(
                    s * counts[kind] for kind, s in enumerate(term.amount.slopes) if s))
                if literal is not None:
                    need.OnlyEnforceIf(literal)
                    model.Add(k == 0).OnlyEnforceIf(literal.Not())
                extra.append(term.cost * k)
                bound += term.cost * most
        if extra:
            terms = dataclasses.replace(terms, dp_comm=terms.dp_comm + sum(extra))
        _check_range(bound, tables)
        big = max(big, bound)
        stages.append(_stage_time(model, terms, bound, i))
        y_all.append(y)
        x_all.append(x)
    if tables.uniform_modes:
        _tie_modes(model, [{r: sum(var for (mode, _), var in y.items() if mode == r)
                            for r in {mode for mode, _ in y}} for y in y_all])
    objective = _step_objective(model, stages, big=big,
                                micro_batches=tables.micro_batches, vpp=tables.vpp)
    if cutoff_s is not None:
        model.Add(objective < int(cutoff_s * 1e9 * tables.vpp))
    model.Minimize(objective)
    solver, status = _run(model, time_limit_s=time_limit_s, seed=seed, workers=workers,
                          deterministic_s=deterministic_s)
    wall = time.perf_counter() - start
    edges = [int(solver.Value(v)) for v in b]
    layers = [edges[i + 1] - edges[i] for i in range(p)]
    modes = [next(r for (r, _), var in y_all[i].items() if solver.BooleanValue(var))
             for i in range(p)]
    return Solution(layers=tuple(layers), modes=tuple(modes),
                    objective=traced_objective_ns(tables, layers, modes), vpp=tables.vpp,
                    status="OPTIMAL" if status == cp_model.OPTIMAL else "FEASIBLE", wall_s=wall)
