"""How context parallelism exchanges keys and values (``ParallelConfig.cp_comm_type``, as
Megatron-LM's ``--cp-comm-type`` names it): the ring (``p2p``), an all-gather of K and V, or
all-to-alls to a head split (``a2a``), each priced as it runs, and refused where the framework
does not run it."""

from __future__ import annotations

import pytest

from meshplan.costmodel import (ParallelConfig, default_calibration, estimate, load_cluster,
                                load_model)
from meshplan.costmodel import collectives as coll
from meshplan.costmodel import timing
from meshplan.costmodel.frameworks import cp_exchange
from meshplan.costmodel.reference import reference_runs
from meshplan.testing import usage_error

CAL = default_calibration()
MODEL = load_model("llama3-8b")  # 32 query heads, 8 k / v heads
CLUSTER = load_cluster("dgx-h100", nodes=2)


def _config(**kw) -> ParallelConfig:
    base = dict(tp=2, sp=True, dp=2, cp=4, micro_batch_size=1, global_batch_size=16,
                seq_len=32768, recompute="none", zero_stage=1)
    return ParallelConfig(**{**base, **kw})


def _step(config: ParallelConfig, framework: str = "megatron") -> float:
    return estimate(MODEL, CLUSTER, config, framework=framework, calibration=CAL).time.step_s


@pytest.mark.parametrize("framework,own", [("megatron", "p2p"), ("torchtitan", "p2p"),
                                           ("deepspeed", "a2a"), ("meshplan", "p2p")])
def test_auto_is_the_frameworks_own_exchange(framework, own):
    assert cp_exchange(framework, "auto") == own
    if framework in ("megatron", "torchtitan"):
        config = _config(zero_stage=1 if framework == "megatron" else 2)
        assert _step(config, framework) == _step(config.replace(cp_comm_type=own), framework)


def test_only_the_ring_merges_and_cuts_the_kernel_calls_to_a_chunk():
    ring, gathered, a2a = (_config(cp_comm_type=t) for t in ("p2p", "all_gather", "a2a"))
    merges = [timing.ring_attention_merge_s(MODEL, CLUSTER, c, CAL, recompute="none",
                                            framework="megatron") for c in (ring, gathered, a2a)]
    assert merges[0] > 0 and merges[1] == merges[2] == 0
    keys = [timing.attention_keys_per_call(c, "megatron") for c in (ring, gathered, a2a)]
    assert keys == [8192, 32768, 32768]


def test_the_all_gather_is_exposed_and_gathers_once_more_under_full_recomputation():
    """Forward: one all-gather of every rank's K and V; backward: another, and a
    reduce-scatter of their gradients; full recomputation gathers a third time."""
    link = timing.stage_links(CLUSTER, _config(), 0).cp
    chunk = 2 * 1 * 8192 * MODEL.kv_size / 2 * 2  # bf16 K and V of 8192 tokens, tp 2
    effs = dict(intra_eff=CAL.nvlink_efficiency, inter_eff=CAL.network_efficiency)
    gather = coll.all_gather_s(link, 4 * chunk, **effs)
    scatter = coll.reduce_scatter_s(link, 4 * chunk, **effs)

    def traffic(recompute: str) -> float:
        return timing._cp_comm_per_layer_s(MODEL, _config(cp_comm_type="all_gather"), link, CAL,
                                           attention_fwd_s=1.0, framework="megatron",
                                           recompute=recompute)
    # a whole second of attention to hide behind, and none of it hidden
    assert traffic("none") == pytest.approx(2 * gather + scatter)
    assert traffic("full") - traffic("none") == pytest.approx(gather)


def test_megatrons_all_to_alls_move_grouped_k_and_v_at_their_width():
    """DeepSpeed-Ulysses repeats k and v to the query heads before its all-to-alls;
    Transformer Engine's a2a exchange (Megatron-LM) moves them as they are: for Llama 3 8B
    (k and v a quarter of q) less traffic, between 5/8 of DeepSpeed's (the bytes) and all of
    it (the latency)."""
    config = _config(cp_comm_type="a2a")
    link = timing.stage_links(CLUSTER, config, 0).cp
    megatron = timing.ulysses_per_layer_s(MODEL, config, link, CAL, repeated_kv=False)
    deepspeed = timing.ulysses_per_layer_s(MODEL, config, link, CAL, repeated_kv=True)
    assert 5 / 8 * deepspeed <= megatron < deepspeed


@pytest.mark.parametrize("framework,exchange", [("torchtitan", "all_gather"),
                                                ("torchtitan", "a2a"), ("deepspeed", "p2p"),
                                                ("deepspeed", "all_gather")])
def test_an_exchange_the_framework_does_not_run_is_refused(framework, exchange):
    config = _config(cp_comm_type=exchange, zero_stage=2, tp=1, sp=False, dp=4)
    with pytest.raises(ValueError, match=f"--cp-comm-type {exchange} is not an exchange "
                                         f"--framework {framework} runs"):
        _step(config, framework)


def test_an_unknown_exchange_is_one_line_and_exit_2():
    with pytest.raises(ValueError, match="cp_comm_type must be one of auto, p2p, all_gather, "
                                         "a2a"):
        _config(cp_comm_type="ring")
    message = usage_error("estimate", "--model", "llama3-8b", "--cluster", "dgx-h100",
                          "--nodes", "1", "--global-batch", "8", "--cp", "2",
                          "--cp-comm-type", "ring")
    assert "--cp-comm-type" in message and "ring" in message and "\n" not in message.strip()


def test_llama_3s_long_context_row_runs_its_all_gather():
    """Llama 3 405B at 131K tokens over cp 16 (Dubey et al. 2024, Sec. 3.3.2: K and V
    all-gathered, one attention per local query chunk); every other reference row with
    context parallelism runs its framework's own exchange."""
    rows = {run.id: run.config.cp_comm_type for run in reference_runs() if run.config.cp > 1}
    assert rows.pop("llama3-405b-16k-gpus-cp16") == "all_gather"
    assert rows and set(rows.values()) == {"auto"}


def test_megatrons_all_to_alls_need_heads_the_ring_divides():
    """Transformer Engine's a2a splits the query and the key / value heads of a TP rank over
    the cp ranks: Llama 3 8B at tp 2 has 16 and 4 of them, so cp 8 cannot run a2a (the ring
    can); the planner keeps only what the framework runs, and the export refuses it."""
    from meshplan.costmodel.layout import framework_layout_error
    config = _config(cp=8, dp=1, global_batch_size=8)
    assert framework_layout_error("megatron", config.replace(cp_comm_type="p2p"), MODEL) is None
    refusal = framework_layout_error("megatron", config.replace(cp_comm_type="a2a"), MODEL)
    assert "must divide the 16 query and 4 key/value heads" in refusal
    assert framework_layout_error("megatron", _config(cp=4, cp_comm_type="a2a"), MODEL) is None
