"""Brute force against the planner on random models that mix dense and MoE layers.

The test suite's random scenarios (``tests/planner/test_search.py``: small models and clusters,
spaces sized for a brute force of a few thousand estimates, GPU memory often binding) with each
model made a mixture: 2 to 8 experts, top-1 or top-2, every second or third layer MoE. For each
scenario the brute force (every candidate of the space, every split and recompute mix, by
``costmodel.estimate``) is compared with ``search(..., deterministic=True)``; a planner plan
off the brute force's best by more than 1e-6 (relative), or a plan where brute force finds none or
the reverse, is a mismatch and the script exits 1.

    python benchmarks/planner_mixed_layers.py [--seed 11] [--scenarios 40]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import random
import sys
import time
from pathlib import Path

from meshplan.planner.search import NoPlanFits, framework_space, search
from meshplan.planner.space import candidates

ROOT = Path(__file__).resolve().parents[1]


def _scenario_helpers():
    """The random-scenario helpers of ``tests/planner/test_search.py``."""
    spec = importlib.util.spec_from_file_location(
        "search_scenarios", ROOT / "tests" / "planner" / "test_search.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def mixed_model(helpers, rng: random.Random):
    dense = helpers.random_model(rng)
    experts = rng.choice([2, 4, 8])
    return dataclasses.replace(dense, name=dense.name + "-moe", num_experts=experts,
                               moe_top_k=rng.choice([1, 2]), moe_layer_freq=rng.choice([2, 3]),
                               moe_ffn_hidden_size=dense.ffn_hidden_size // rng.choice([1, 2]))


def scenario(helpers, rng: random.Random, index: int):
    while True:
        model = mixed_model(helpers, rng)
        if model.num_layers < model.moe_layer_freq:  # no MoE layer: not a mixture
            continue
        per_node = rng.choice([1, 2, 4, 8])
        cluster = helpers.small_cluster(rng.choice(["dgx-a100-80gb", "dgx-h100"]),
                                        nodes=rng.randint(1, min(8, 64 // per_node)),
                                        gpus_per_node=per_node)
        space = dataclasses.replace(helpers.random_space(rng, model, cluster), ep=None)
        if not candidates(model, cluster, space):
            continue
        space = helpers.shrink_space(model, cluster, space)
        if space is None:
            continue
        framework = rng.choice(helpers.FRAMEWORKS)
        space = framework_space(space, framework)
        if not candidates(model, cluster, space):
            continue
        cluster = helpers.pick_memory(rng, model, cluster, space, framework)
        optima = tuple(helpers.brute_force(model, cluster, c, space, framework)
                       for c in candidates(model, cluster, space))
        return helpers.Scenario(index=index, model=model, cluster=cluster, space=space,
                                framework=framework, optima=optima)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--scenarios", type=int, default=40)
    args = parser.parse_args()
    helpers = _scenario_helpers()
    rng = random.Random(args.seed)
    counts = {"exact": 0, "no plan": 0, "mismatch": 0}
    start = time.perf_counter()
    for index in range(args.scenarios):
        sc = scenario(helpers, rng, index)
        want = sc.best_s
        try:
            got = search(sc.model, sc.cluster, sc.space, framework=sc.framework,
                         calibration=helpers.CAL, top_k=1, deterministic=True).ranked[0].step_s
        except NoPlanFits:
            got = None
        if (got is None) != (want is None) or (got is not None and abs(got / want - 1) > 1e-6):
            counts["mismatch"] += 1
            print(f"MISMATCH planner {got} brute force {want}: {sc.describe()}")
        else:
            counts["exact" if got is not None else "no plan"] += 1
    print(f"seed {args.seed}, {args.scenarios} scenarios in {time.perf_counter() - start:.0f} s: "
          f"{counts}")
    return 1 if counts["mismatch"] else 0


if __name__ == "__main__":
    sys.exit(main())
