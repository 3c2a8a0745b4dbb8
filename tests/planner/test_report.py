"""``planner/report.py``'s text tables: the layout pandas' ``DataFrame.to_string(index=False)``
gave them before report.py stopped importing pandas (``meshplan models`` stays light)."""

from __future__ import annotations

import random

import pytest

from meshplan.planner import report


def test_table_layout_by_hand():
    rows = [{"name": "cpu", "gpus": 2, "NIC GB/s": 1.0, "mesh": "tp-cp-dp-pp"},
            {"name": "dgx-h100", "gpus": 16, "NIC GB/s": 50.0, "mesh": "tp"}]
    assert report._table(rows, {"NIC GB/s": "{:.1f}"}) == (
        "    name  gpus NIC GB/s        mesh\n"
        "     cpu     2      1.0 tp-cp-dp-pp\n"
        "dgx-h100    16     50.0          tp")


def test_integer_header_gets_a_leading_space_and_gaps_read_nan():
    # "tp" is an integer column: header " tp", so the column is 3 wide for 2-digit values
    assert report._table([{"tp": 16}, {"tp": 2}]) == " tp\n 16\n  2"
    # a row without "days" makes the column float (NaN); "rank" with None too
    rows = [{"rank": 1, "days": 1.25}, {"rank": None}]
    assert report._table(rows, {"days": "{:.1f}"}) == "rank days\n1.00  1.2\n NaN  NaN"
    assert report._table([{"what": "a"}, {"what": None}, {}]) == "what\n   a\n NaN\n NaN"
    assert report._table([]) == "Empty DataFrame\nColumns: []\nIndex: []"


def test_percent_and_thousands_formats():
    rows = [{"tokens/s": 37856.4, "MFU": 0.699}, {"tokens/s": 1234567.0, "MFU": 0.1}]
    assert report._table(rows, {"tokens/s": "{:,.0f}", "MFU": "{:.1%}"}) == (
        " tokens/s   MFU\n   37,856 69.9%\n1,234,567 10.0%")


def _pandas_table(rows, formats, default_format):
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame(rows)
    formatters = {col: formats.get(col, default_format).format
                  for col in frame.columns if frame[col].dtype.kind == "f"}
    return frame.to_string(index=False, formatters=formatters)


def test_same_text_as_pandas_on_random_tables():
    """pandas is the oracle the tables were written against (benchmarks still use it)."""
    rng = random.Random(7)
    values = [lambda: rng.randint(-5, 10 ** rng.randint(0, 9)),
              lambda: rng.uniform(-1e6, 1e6), lambda: rng.random(),
              lambda: rng.choice(["a", "off", "tp-cp-dp-pp", "x y", "tab\tq"]),
              lambda: None]
    kinds = [[0], [1], [2], [3], [0, 1], [0, 4], [1, 4], [3, 4], [3, 0]]
    for _ in range(400):
        names = [f"{rng.choice(['tp', 'a', 'step s', '% of step'])}{i}"
                 for i in range(rng.randint(1, 5))]
        column_kinds = [rng.choice(kinds) for _ in names]
        rows = [{n: values[rng.choice(k)]() for n, k in zip(names, column_kinds)
                 if rng.random() > 0.15} for _ in range(rng.randint(1, 5))]
        if not any(rows):
            continue
        formats = {names[0]: rng.choice(["{:.1%}", "{:,.0f}", "{:.4g}"])}
        default = rng.choice(["{:.2f}", "{:.1f}", "{:.4g}"])
        assert report._table(rows, formats, default) == _pandas_table(rows, formats, default), \
            rows


def test_the_plan_report_names_the_megatron_settings():
    from meshplan.costmodel import ParallelConfig
    config = ParallelConfig(tp=2, sp=True, tp_comm_overlap=True, cross_entropy_fusion=True)
    assert report.settings_text(config) == ", TP overlap, fused cross entropy"
    assert report.settings_text(config.replace(sp=False, tp_comm_overlap=False)) == \
        ", fused cross entropy"
