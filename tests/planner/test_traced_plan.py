"""Planning a traced model (``meshplan.runtime.examples:hybrid``, layers not alike): the CP-SAT split over
stage boundaries against brute force, and the command line end to end.

Brute force: every candidate of the space (``planner.space.candidates``) x every split of the
10 layers into pp stages x every per-stage recompute tuple, each through ``costmodel.estimate``
on the same cluster; the fastest that ``fits`` is the optimum the search must reach (1e-6
relative). Device memory is cut down with ``dataclasses.replace`` on ``hbm_bytes`` so that it
binds: a few MiB above the communicator buffers every multi-rank plan reserves. Whether any
plan fits is decided by brute force alone, and ``NoPlanFits`` must follow it.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import dataclass, field

import pytest

from meshplan.testing import stage_modes
from meshplan.costmodel import default_calibration, estimate, load_cluster, load_model
from meshplan.costmodel.config import even_split
from meshplan import cli
from meshplan.planner.search import NoPlanFits, search
from meshplan.planner.space import SearchSpace, candidates

HYBRID = "meshplan.runtime.examples:hybrid"
NUM_LAYERS = 10
SEQ_LEN = 64
GLOBAL_BATCH = 8
REL = 1e-6
MIB = 2**20
SEARCH_TIME_LIMIT_S = 60.0
CALIBRATION = default_calibration()


@pytest.fixture(scope="module")
def hybrid():
    return load_model(HYBRID)


def compositions(total: int, parts: int):
    """Every split of ``total`` layers into ``parts`` stages of at least one layer."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        edges = (0, *cuts, total)
        yield tuple(edges[i + 1] - edges[i] for i in range(parts))


def cpu_cluster(gpus: int, extra_mib: float | None):
    """``gpus`` CPU ranks on one node; ``extra_mib`` MiB above the communicator buffers (None:
    the catalog's memory, where everything fits)."""
    cluster = load_cluster("cpu", nodes=1, gpus_per_node=gpus)
    if extra_mib is None:
        return cluster
    communicator = CALIBRATION.communicator_bytes if gpus > 1 else 0
    gpu = dataclasses.replace(cluster.gpu, hbm_bytes=int(communicator + extra_mib * MIB))
    return dataclasses.replace(cluster, gpu=gpu)


def brute_force(model, cluster, space, framework, *, splits=None):
    """The fastest fitting estimate over the whole space, or None."""
    best = None
    for config in candidates(model, cluster, space, framework=framework):
        for split in splits or compositions(model.num_layers, config.pp):
            for modes in stage_modes(space.recompute_modes, config.pp, framework):
                est = estimate(model, cluster,
                               config.replace(layers_per_stage=split, recompute=modes),
                               framework=framework, calibration=CALIBRATION)
                if est.fits and (best is None or est.time.step_s < best.time.step_s):
                    best = est
    return best


def brute_force_by_capacity(model, clusters, space, framework):
    """``brute_force`` on each of ``clusters``, which differ only in GPU memory (the first
    has the most), from one pass over the space: step time does not depend on GPU memory, so
    a capacity's optimum is the fastest estimate on the first cluster that fits and whose
    reserved peak is within that capacity; it is estimated again on its own cluster, which
    must agree (fits, same step). Splits the framework cannot build (DeepSpeed's partition
    methods, ``framework_layout_error``) are not plans."""
    from meshplan.costmodel.layout import framework_layout_error

    every = []
    for config in candidates(model, clusters[0], space, framework=framework):
        for split in compositions(model.num_layers, config.pp):
            for modes in stage_modes(space.recompute_modes, config.pp, framework):
                staged = config.replace(layers_per_stage=split, recompute=modes)
                if framework_layout_error(framework, staged, model) is not None:
                    continue
                est = estimate(model, clusters[0], staged, framework=framework,
                               calibration=CALIBRATION)
                if est.fits:
                    every.append(est)
    every.sort(key=lambda est: est.time.step_s)
    out = []
    for cluster in clusters:
        best = next((est for est in every
                     if est.memory.peak_reserved_bytes <= cluster.gpu.hbm_bytes), None)
        if best is not None:
            again = estimate(model, cluster, best.config, framework=framework,
                             calibration=CALIBRATION)
            assert again.fits and again.time.step_s == best.time.step_s
        out.append(best)
    return out


def planned(model, cluster, space, framework):
    """The search's best estimate, or None when it raises NoPlanFits."""
    try:
        result = search(model, cluster, space, framework=framework, calibration=CALIBRATION,
                        top_k=1, time_limit_s=SEARCH_TIME_LIMIT_S)
    except NoPlanFits:
        return None
    assert result.status == "OPTIMAL"
    return result.ranked[0].estimate


@dataclass(frozen=True)
class Scenario:
    gpus: int
    pp: int
    framework: str
    tight_mib: tuple[float, ...]
    """Capacities (MiB above the communicator) where memory binds: the best plan is slower
    than with the catalog's memory. Chosen between the least any configuration of the space
    needs and what the roomy best plan needs (DeepSpeed's ZeRO buffers, a fixed ~1 GB of
    reduce bucket, put its scenarios near 1,000 MiB)."""
    none_fit_mib: float | None = None
    """A capacity where nothing fits."""
    modes: tuple[str, ...] = ("none", "full")
    pins: dict = field(default_factory=dict)

    def space(self) -> SearchSpace:
        """The scenario's space: ZeRO 1-3 (0 on one GPU), cp 1, micro-batches up to 16, as the
        capacities above were chosen for (the whole space would let ZeRO-3 with parameter
        offload fit where these scenarios expect nothing to), and the scenario's pins."""
        pins = {"zero_stage": (0,) if self.gpus == 1 else (1, 2, 3), "cp": (1,),
                "micro_batch_size": tuple(range(1, 17)), **self.pins}
        return SearchSpace(global_batch_size=GLOBAL_BATCH, seq_len=SEQ_LEN, pp=(self.pp,),
                           recompute_modes=self.modes, **pins)


SCENARIOS = {
    # On the CPU device offloaded states stay in the memory a plan's peak is counted in
    # (memory.stage_memory), so offload saves nothing there; the roomy best plans still offload
    # the optimizer (host copies on the CPU run at the memcpy rate, and the offloading runtime
    # steps with the fused CPU AdamW) and need 9.4, 8.8 and 1009.2 MiB in the first three
    # scenarios: the tight capacities sit below that, above the least any plan needs.
    "1gpu-meshplan": Scenario(1, 1, "meshplan", tight_mib=(8.0,), none_fit_mib=6.5),
    "2gpu-pp2-meshplan": Scenario(2, 2, "meshplan", tight_mib=(4.0, 6.0), none_fit_mib=3.0),
    "2gpu-pp2-deepspeed": Scenario(2, 2, "deepspeed", tight_mib=(1005.3, 1006.1),
                                   none_fit_mib=1004.0),
    "4gpu-pp2-no-recompute": Scenario(4, 2, "meshplan", tight_mib=(4.0, 5.0),
                                      none_fit_mib=3.0, modes=("none",)),
    "2gpu-pp2-full-only": Scenario(2, 2, "deepspeed", tight_mib=(), none_fit_mib=1.0,
                                   modes=("full",)),
    "4gpu-pp2-meshplan": Scenario(4, 2, "meshplan", tight_mib=(3.0, 4.0)),
    "4gpu-pp4-meshplan": Scenario(4, 4, "meshplan", tight_mib=(2.7, 3.0),
                                  pins={"micro_batch_size": (1, 2, 4, 8)}),
    # DeepSpeed's pipeline engine runs ZeRO 0-1 only: its plans here are ZeRO-1 (the roomy
    # best needs 1,004.4 MiB, the least plan 1,003.1)
    "8gpu-pp2-deepspeed": Scenario(8, 2, "deepspeed", tight_mib=(1004.0,), none_fit_mib=1002.0),
    "8gpu-pp4-meshplan": Scenario(8, 4, "meshplan", tight_mib=(2.5,),
                                  pins={"zero_stage": (1,), "micro_batch_size": (1,)}),
}


_OPTIMA: dict = {}


def scenario_optima(model, name: str) -> list:
    """(capacity in MiB, kind, cluster, brute-force optimum) of each capacity of scenario
    ``name``; cached: two tests of this module read the four-stage scenario's."""
    if name not in _OPTIMA:
        scenario = SCENARIOS[name]
        capacities = [(None, "roomy")] + [(mib, "tight") for mib in scenario.tight_mib]
        if scenario.none_fit_mib is not None:
            capacities.append((scenario.none_fit_mib, "none fits"))
        clusters = [cpu_cluster(scenario.gpus, extra_mib) for extra_mib, _ in capacities]
        optima = brute_force_by_capacity(model, clusters, scenario.space(), scenario.framework)
        _OPTIMA[name] = [(mib, kind, cluster, best) for (mib, kind), cluster, best
                         in zip(capacities, clusters, optima)]
    return _OPTIMA[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_search_finds_the_brute_force_optimum(hybrid, name):
    scenario = SCENARIOS[name]
    space = scenario.space()
    roomy = None
    for extra_mib, kind, cluster, expected in scenario_optima(hybrid, name):
        found = planned(hybrid, cluster, space, scenario.framework)
        where = f"{name} at {extra_mib} MiB ({kind})"
        if kind == "none fits":
            assert expected is None, where
        if expected is None:
            assert kind == "none fits", f"{where}: the scenario expects a plan to fit"
            assert found is None, f"{where}: brute force finds nothing, the search does"
            continue
        assert found is not None, f"{where}: brute force finds {expected.config}"
        assert found.fits, where
        assert found.time.step_s == pytest.approx(expected.time.step_s, rel=REL), where
        if kind == "roomy":
            roomy = expected
        else:  # memory binds: the catalog's best plan does not fit here
            assert expected.time.step_s > roomy.time.step_s * (1 + REL), where


def test_the_optimal_split_is_uneven_and_beats_the_even_split(hybrid):
    """The wide block sits early, so the first of two stages takes fewer layers: the even split
    (5, 5) is not optimal, and the search's split is the brute-force one."""
    space = SCENARIOS["2gpu-pp2-meshplan"].space()
    cluster = cpu_cluster(2, None)
    best = brute_force(hybrid, cluster, space, "meshplan")
    even = brute_force(hybrid, cluster, space, "meshplan", splits=[even_split(NUM_LAYERS, 2)])
    found = planned(hybrid, cluster, space, "meshplan")
    assert even_split(NUM_LAYERS, 2) == (5, 5)
    layers = found.config.layers_per_stage
    assert layers != (5, 5) and layers[0] < layers[1]
    assert found.time.step_s == pytest.approx(best.time.step_s, rel=REL)
    assert even.time.step_s > best.time.step_s * (1 + REL)


@pytest.mark.slow
def test_memory_moves_the_four_stage_split_off_the_even_one(hybrid):
    """Four stages with memory binding: the optimum is neither the even split (2, 3, 3, 2)
    nor reachable with it."""
    space = SCENARIOS["4gpu-pp4-meshplan"].space()
    (cluster, best), = [(cluster, best) for mib, _, cluster, best
                        in scenario_optima(hybrid, "4gpu-pp4-meshplan") if mib == 3.0]
    split = even_split(NUM_LAYERS, 4)
    even = brute_force(hybrid, cluster, space, "meshplan", splits=[split])
    found = planned(hybrid, cluster, space, "meshplan")
    assert found.config.layers_per_stage != split
    assert len(set(found.config.layers_per_stage)) > 1
    assert found.time.step_s == pytest.approx(best.time.step_s, rel=REL)
    assert even is None or even.time.step_s > best.time.step_s * (1 + REL)


# ----- the command line --------------------------------------------------------------------------
def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("meshplan: error: ")
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("traced-plan") / "plan.json"
    code = cli.main(["plan", "--model", HYBRID, "--cluster", "cpu", "--global-batch", "8",
                     "-o", str(path)])
    assert code == 0
    return path


def test_plan_writes_a_traced_model(plan_path, capsys):
    data = json.loads(plan_path.read_text())
    traced = data["model"]["traced"]
    assert len(traced) == NUM_LAYERS
    assert data["model"]["num_layers"] == NUM_LAYERS
    assert data["model"]["factory"] == HYBRID
    assert data["tp"] == data["cp"] == data["vpp"] == 1
    assert sum(data["layers_per_stage"]) == NUM_LAYERS


def test_explain_a_traced_plan(plan_path, capsys):
    code, out, err = run(capsys, "explain", str(plan_path))
    assert code == 0, err
    assert out


def test_export_a_traced_plan_to_deepspeed(tmp_path, capsys):
    """A traced model planned for DeepSpeed exports to it. (The default framework's plan
    here offloads the optimizer without ZeRO, which DeepSpeed refuses: on the CPU the
    runtime's host AdamW is its fused kernel, faster than the device path's.)"""
    path = tmp_path / "ds.json"
    assert cli.main(["plan", "--model", HYBRID, "--cluster", "cpu", "--global-batch", "8",
                     "--framework", "deepspeed", "-o", str(path)]) == 0
    capsys.readouterr()
    code, out, err = run(capsys, "export", str(path), "--to", "deepspeed")
    assert code == 0, err
    config = json.loads(out)
    assert config["train_batch_size"] == 8


@pytest.mark.parametrize("target, name", [("megatron", "Megatron-LM"),
                                          ("torchtitan", "torchtitan")])
def test_export_a_traced_plan_elsewhere_is_refused(plan_path, capsys, target, name):
    code, out, err = run(capsys, "export", str(plan_path), "--to", target)
    assert code == 2
    assert out == ""
    line = one_error_line(err)
    assert "traced" in line and name in line and "deepspeed" in line


def test_estimate_a_traced_split(capsys):
    base = ["estimate", "--model", HYBRID, "--cluster", "cpu", "--global-batch", "8"]
    code, out, err = run(capsys, *base, "--pp", "2", "--layers-per-stage", "3,7", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["plan"]["layers_per_stage"] == [3, 7]
    assert len(data["memory"]["per_stage"]) == 2
    code, out, err = run(capsys, *base, "--pp", "2", "--layers-per-stage", "6,4", "--json")
    assert code == 0, err
    assert json.loads(out)["time"]["step_s"] != data["time"]["step_s"]
    code, out, err = run(capsys, *base, "--tp", "2")
    assert code == 2
    one_error_line(err)


def test_an_unknown_module_is_one_error_line(capsys):
    code, out, err = run(capsys, "estimate", "--model", "nosuch_pkg.mod:fn", "--cluster", "cpu",
                         "--global-batch", "8")
    assert code == 2
    assert out == ""
    line = one_error_line(err)
    assert "nosuch_pkg" in line


def test_models_lists_a_traced_module_layer_by_layer():
    from meshplan.testing import run_cli

    text = run_cli("models", "--model", HYBRID)
    assert text.code == 0, text.err
    lines = text.out.splitlines()
    assert "10 traced layers" in lines[0] and "a chain" in lines[0]
    assert sum(1 for line in lines if line.strip().startswith("layers.")) == 10
    data = run_cli("models", "--model", HYBRID, "--json").json()
    assert len(data["traced"]) == 10 and data["traced_chain"] is True
    assert data["num_params"] == sum(layer["params"] for layer in data["traced"])
    bad = run_cli("models", "--model", "nosuch_pkg.mod:fn")
    assert bad.code == 2 and len(bad.err.splitlines()) == 1
