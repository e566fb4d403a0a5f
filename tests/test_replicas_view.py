"""show_replicas: per-rank checksums of one report, drift curves and summary of many."""

from __future__ import annotations

import pytest

from labkit.views.replicas_view import drift_summary, replica_rows, show_replicas

SAME = {"checksums": [7, 7, 7], "max_abs_diff": 0.0, "per_param": {"0.weight": 0.0},
        "identical": True}  # fmt: skip
APART = {"checksums": [7, 9, 7], "max_abs_diff": 0.25,
         "per_param": {"0.weight": 0.25, "0.bias": 0.0}, "identical": False}  # fmt: skip


def test_rows_flag_the_rank_that_differs():
    rows = replica_rows(APART)
    assert [r["same_as_rank_0"] for r in rows] == [True, False, True]
    assert rows[1]["checksum"] == "00000009"


def test_report_view_has_a_bar_per_parameter_coloured_by_drift():
    view = show_replicas(APART)
    assert view.mode == "report"
    bar = view.figures[0].data[0]
    assert list(bar.x) == ["0.weight", "0.bias"] and list(bar.y) == [0.25, 0.0]
    assert list(bar.marker.color) == ["#cf222e", "#1a7f37"]
    assert "replicas differ" in view.to_html() and "NO" in view.to_html()
    assert "bit-identical" in show_replicas(SAME).to_html()


def test_drift_view_summarises_each_run_and_puts_zero_on_the_floor():
    histories = {"ok": [SAME, SAME], "broken": [SAME, dict(APART, step=5)]}
    rows = drift_summary(histories)
    assert rows[0] == {"run": "ok", "identical": True, "max_abs_diff": 0.0,
                       "distinct_checksums": 1, "first_drift_step": None}  # fmt: skip
    assert rows[1]["first_drift_step"] == 5 and rows[1]["distinct_checksums"] == 2
    view = show_replicas(histories)
    ok, broken = view.figures[0].data
    assert list(ok.y) == [1e-12, 1e-12] and list(broken.x) == [1, 5]
    assert view.figures[0].layout.yaxis.type == "log"


def test_bad_input_says_what_is_needed():
    with pytest.raises(ValueError, match="replica_report"):
        show_replicas({})
    with pytest.raises(ValueError, match="missing"):
        show_replicas({"run": [{"checksums": [1]}]})
