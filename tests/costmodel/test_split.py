"""``even_split``: the one rule for near-equal layer counts, in its two documented orders."""

from __future__ import annotations

import pytest

from meshplan.costmodel.config import ParallelConfig, even_split


def test_remainder_goes_to_the_middle_stages_first():
    # 10 = 4 x 2 + 2: stages 1 and 2 take the extra layers; the ends carry embedding and head
    assert even_split(10, 4) == (2, 3, 3, 2)
    assert even_split(11, 4) == (3, 3, 3, 2)  # the third extra layer: first stage, then last
    assert even_split(5, 2) == (3, 2)  # two stages are both ends: the first takes it
    assert ParallelConfig(pp=4).stage_layers(10) == (2, 3, 3, 2)


def test_remainder_first_gives_the_first_parts_one_more():
    assert even_split(10, 4, remainder="first") == (3, 3, 2, 2)
    assert even_split(4, 3, remainder="first") == (2, 1, 1)
    assert even_split(6, 3, remainder="first") == even_split(6, 3) == (2, 2, 2)


@pytest.mark.parametrize("total, parts", [(0, 3), (7, 1), (23, 5), (64, 7)])
def test_both_orders_split_the_same_counts(total, parts):
    for remainder in ("middle", "first"):
        counts = even_split(total, parts, remainder=remainder)
        assert sum(counts) == total and max(counts) - min(counts) <= (1 if total % parts else 0)
    assert sorted(even_split(total, parts)) == sorted(even_split(total, parts, remainder="first"))


def test_bad_parts_or_order_are_refused():
    with pytest.raises(ValueError, match="parts >= 1"):
        even_split(4, 0)
    with pytest.raises(ValueError, match="remainder"):
        even_split(4, 2, remainder="last")
