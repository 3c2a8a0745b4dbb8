"""The planner's per-stage memory tables against the cost model's ``estimate``, over the whole
layer range of a stage: a split the tables accept fits, and one they refuse does not.

Stage memory is not linear in the layer count everywhere (the largest of several phase peaks
is taken, and that maximum changes with the count), so a form read at ``lo`` and ``lo + 1``
under-estimates the far end of a long range. Expected values come from ``estimate`` of full
configurations built here.
"""

from __future__ import annotations

import dataclasses

import pytest

from meshplan.costmodel import ParallelConfig, default_calibration, estimate, load_cluster, load_model
from meshplan.planner import tables as tables_module
from meshplan.planner.tables import build_tables, fits, stage_config

CAL = default_calibration()
GIB = 2**30

CASES = [  # model, cluster, nodes, config, framework
    ("llama3-70b", "dgx-h100", 4,
     dict(tp=8, pp=4, dp=1, micro_batch_size=1, global_batch_size=32, seq_len=8192,
          zero_stage=1), "meshplan"),
    ("gpt3-175b", "dgx-a100-80gb", 8,
     dict(tp=8, pp=8, dp=1, micro_batch_size=1, global_batch_size=64, seq_len=2048,
          zero_stage=1, vpp=2), "meshplan"),
    ("llama3-8b", "dgx-h100", 1,
     dict(tp=1, pp=4, dp=2, micro_batch_size=2, global_batch_size=64, seq_len=8192,
          zero_stage=3, offload="optimizer+params"), "deepspeed"),
    ("mixtral-8x7b", "dgx-h100", 2,
     dict(tp=2, pp=4, dp=2, ep=2, micro_batch_size=1, global_batch_size=64, seq_len=4096,
          zero_stage=3), "torchtitan"),
]


def reserved(model, cluster, config, stage, layers, mode, framework) -> float:
    """``estimate``'s reserved bytes of ``stage`` holding ``layers`` layers under ``mode``."""
    est = estimate(model, cluster, stage_config(config, model, stage, layers, mode),
                   framework=framework, calibration=CAL)
    return est.memory.per_stage[stage].reserved_bytes


def with_hbm(cluster, hbm_bytes: float):
    return dataclasses.replace(cluster, gpu=dataclasses.replace(cluster.gpu,
                                                                hbm_bytes=int(hbm_bytes)))


@pytest.mark.parametrize("case", CASES, ids=[c[0] + "-" + c[4] for c in CASES])
@pytest.mark.parametrize("where", ["top", "middle"])
def test_tables_fit_exactly_where_the_estimate_fits(case, where, monkeypatch):
    """The capacity is set between the estimate's memory at two adjacent layer counts, near
    the top of a stage's range or in its middle; the tables must accept the smaller count and
    refuse the larger one, for every stage end and mode. Over the whole range of counts: the
    split DeepSpeed builds itself (which its tables pin) is lifted."""
    monkeypatch.setattr(tables_module, "framework_split", lambda *args: None)
    name, cluster_name, nodes, kwargs, framework = case
    model, cluster = load_model(name), load_cluster(cluster_name, nodes=nodes)
    config = ParallelConfig(**kwargs)
    p = config.pp
    lo = max(1, config.vpp)
    hi = model.num_layers - (p - 1) * lo
    n = hi - 1 if where == "top" else (lo + hi) // 2
    for stage in (0, p - 1):
        for mode in ("none", "full"):
            below = reserved(model, cluster, config, stage, n, mode, framework)
            above = reserved(model, cluster, config, stage, n + 1, mode, framework)
            assert above > below
            roomy = with_hbm(cluster, (below + above) / 2)
            tables = build_tables(model, roomy, config, modes=(mode,), framework=framework,
                                  calibration=CAL)
            assert fits(tables, stage, n, mode), (stage, mode, below / GIB, above / GIB)
            assert not fits(tables, stage, n + 1, mode), (stage, mode, below / GIB,
                                                          above / GIB)
            assert not fits(tables, stage, hi, mode) or n + 1 > hi
            assert fits(tables, stage, lo, mode)
