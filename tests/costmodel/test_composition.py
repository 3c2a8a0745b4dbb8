"""``costmodel.composition``: the one composition of a step, on floats and on integers.

Hand-computed from Narayanan et al. 2021 Sec. 2.2: with stage times t_i per micro-batch, m
micro-batches and v chunks, ``step = m max t + (sum t - max t) / v + once``.
"""

from __future__ import annotations

import pytest

from meshplan.costmodel import composition


def test_exposed_is_what_compute_cannot_hide_in_the_input_type():
    assert composition.exposed(5.0, 2.0) == 3.0
    assert composition.exposed(2.0, 5.0) == 0.0 and isinstance(composition.exposed(2.0, 5.0),
                                                               float)
    assert composition.exposed(2, 5) == 0 and isinstance(composition.exposed(2, 5), int)


def test_micro_total_adds_linear_work_and_the_exposed_traffic():
    # 10 linear + (4 - 1) ZeRO exposed + 0 offload exposed (2 raw, 3 hidden)
    assert composition.micro_total(linear=10, zero_comm=4, zero_hidden=1, offload_raw=2,
                                   offload_hidden=3) == 13


def test_micro_total_waits_for_the_slower_transfer_chain():
    # ZeRO traffic and parameter offload run beside each other: 10 + max(4 - 1, 6 - 1), not
    # 10 + 3 + 5
    assert composition.micro_total(linear=10, zero_comm=4, zero_hidden=1, offload_raw=6,
                                   offload_hidden=1) == 15


def test_micro_total_never_falls_as_the_compute_grows():
    """More compute (recomputation) hides more of both transfers, but the stage never gets
    faster: compute c, FSDP-style prefetch hiding c, offload hiding c / 2, both exposed."""
    totals = [composition.micro_total(linear=c + 1.0, zero_comm=4.0, zero_hidden=c,
                                      offload_raw=6.0, offload_hidden=c / 2)
              for c in (0.0, 0.5, 1.0, 2.0, 3.0, 4.0, 8.0)]
    assert totals == sorted(totals), totals


def test_four_stage_interleaved_step_by_hand():
    stage_s = [1.0, 2.0, 3.0, 2.0]
    m, v = 4, 2
    once = composition.once_per_step(dp_exposed=0.5, optimizer=0.25, offload_step=0.0)
    # 4 x 3 + (8 - 3) / 2 + 0.75 = 15.25
    scaled = composition.scaled_step(micro_batches=m, vpp=v, top_micro=max(stage_s),
                                     sum_micro=sum(stage_s), once=once)
    assert scaled / v == pytest.approx(15.25, rel=1e-15)
    assert composition.pipeline_bubble(vpp=v, top_micro=3.0, sum_micro=8.0) == 2.5


def test_equal_stages_give_the_bubble_fraction_p_minus_one_over_v_m():
    p, m, v, t = 8, 16, 3, 0.125
    scaled = composition.scaled_step(micro_batches=m, vpp=v, top_micro=t, sum_micro=p * t,
                                     once=0.0)
    bubble = composition.pipeline_bubble(vpp=v, top_micro=t, sum_micro=p * t)
    assert scaled / v == pytest.approx(m * t + bubble, rel=1e-15)
    assert bubble / (m * t) == pytest.approx((p - 1) / (v * m), rel=1e-15)


def test_integer_nanoseconds_stay_integers():
    scaled = composition.scaled_step(micro_batches=4, vpp=2, top_micro=3_000, sum_micro=8_000,
                                     once=750)
    assert scaled == 7 * 3_000 + 8_000 + 2 * 750 and isinstance(scaled, int)
