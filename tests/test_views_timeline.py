"""show_timeline: bars per rank, colours by op, hover data, idle gaps, summary numbers."""

from __future__ import annotations

import pytest
from test_views_fakes import FakeLab

from labkit.views import ViewWarning, show_timeline, timeline_summary
from labkit.views._common import IDLE_COLOUR, op_colour
from labkit.wire.records import CommRecord, SpanRecord, to_dict

pytestmark = pytest.mark.filterwarnings("error::labkit.views.ViewWarning")
T0 = 100.0  # records are on the kernel clock; the chart starts at the first one


def _records() -> list:
    g = (0, 1)
    return [
        SpanRecord(rank=0, name="fwd", start=T0, end=T0 + 0.4, cell=1),
        CommRecord(rank=0, op="all_reduce", seq=1, group=g, bytes=1000, start=T0 + 0.4,
                   end=T0 + 0.6, cell=1),
        CommRecord(rank=0, op="recv", seq=2, group=g, peer=1, bytes=4000, start=T0 + 0.7,
                   end=T0 + 1.0, cell=2),
        SpanRecord(rank=1, name="fwd", start=T0, end=T0 + 0.2, cell=1),
        CommRecord(rank=1, op="all_reduce", seq=1, group=g, bytes=1000, start=T0 + 0.3,
                   end=T0 + 0.6, cell=1),
        CommRecord(rank=1, op="send", seq=2, group=g, peer=0, bytes=4000, start=T0 + 0.6,
                   end=T0 + 1.0, cell=2),
    ]  # fmt: skip


def _trace(view, name):
    return next(t for t in view.figures[0].data if t.name == name)


def test_summary_compute_comm_idle_from_hand_made_records() -> None:
    s = timeline_summary(_records())
    assert s[0]["comm"] == pytest.approx(0.5) and s[0]["compute"] == pytest.approx(0.4)
    assert s[0]["idle"] == pytest.approx(0.1) and s[0]["total"] == pytest.approx(1.0)
    assert s[1]["comm"] == pytest.approx(0.7) and s[1]["compute"] == pytest.approx(0.2)
    assert s[1]["idle"] == pytest.approx(0.1)
    assert s[1]["comm_pct"] == pytest.approx(70.0)


def test_comm_inside_a_span_is_not_counted_twice() -> None:
    recs = [
        SpanRecord(rank=0, name="step", start=0.0, end=1.0),
        CommRecord(rank=0, op="all_reduce", seq=1, group=(0,), start=0.2, end=0.5),
    ]
    s = timeline_summary(recs)[0]
    assert (s["compute"], s["comm"], s["idle"]) == pytest.approx((0.7, 0.3, 0.0))


def test_bars_per_rank_coloured_by_op_with_hover_data() -> None:
    view = show_timeline(_records())
    names = [t.name for t in view.figures[0].data]
    assert names == ["compute", "all_reduce", "recv", "send", "idle"]
    ar = _trace(view, "all_reduce")
    assert list(ar.y) == [0, 1]
    assert list(ar.base) == pytest.approx([400.0, 300.0])  # ms since the first record
    assert list(ar.x) == pytest.approx([200.0, 300.0])
    assert ar.marker.color == op_colour("all_reduce") != _trace(view, "send").marker.color
    seq, nbytes, ms, algbw, busbw = ar.customdata[0]
    assert (seq, nbytes) == (1, 1000) and ms == pytest.approx(200.0)
    assert algbw == pytest.approx(1000 / 0.2 / 1e9) and busbw == pytest.approx(algbw)  # 2(n-1)/n=1
    assert "bytes" in ar.hovertemplate and "GB/s" in ar.hovertemplate
    assert list(_trace(view, "compute").text) == ["fwd", "fwd"]


def test_idle_gaps_are_explicit_bars() -> None:
    idle = _trace(show_timeline(_records()), "idle")
    assert idle.marker.color == IDLE_COLOUR
    gaps = sorted(zip(idle.y, idle.base, idle.x, strict=True))
    assert [g[0] for g in gaps] == [0, 1]
    assert [g[1] for g in gaps] == pytest.approx([600.0, 200.0])
    assert [g[2] for g in gaps] == pytest.approx([100.0, 100.0])


def test_cell_filter_dicts_and_lab() -> None:
    view = show_timeline([to_dict(r) for r in _records()], cell=2)
    assert {t.name for t in view.figures[0].data} == {"recv", "send", "idle"}
    lab = FakeLab(2, records=_records(), num_cpus=4)
    view = show_timeline(lab, cell=1)
    assert ("trace", 1) in lab.calls and view.warning is None
    assert set(view.summary) == {0, 1}


def test_warns_when_ranks_outnumber_cores() -> None:
    lab = FakeLab(4, records=_records(), num_cpus=2)
    view = show_timeline(lab)
    assert "4 ranks on 2 CPU cores" in view.warning
    assert "outnumber" in view.children[0].value
    assert show_timeline(_records(), num_cpus=1).warning is not None
    assert show_timeline(_records(), num_cpus=2).warning is None


def test_backwards_record_warns_and_is_clamped() -> None:
    recs = [CommRecord(rank=0, op="barrier", seq=1, group=(0,), start=2.0, end=1.0)]
    with pytest.warns(ViewWarning, match="end before they start"):
        view = show_timeline(recs)
    assert view.summary[0]["comm"] == 0.0 and recs[0].end == 1.0  # the caller's record is kept


def test_static_html_and_empty_trace() -> None:
    page = show_timeline(_records()).to_html()
    assert "communication" in page and "all_reduce" in page and "<script" not in page
    empty = show_timeline([])
    assert empty.figures == [] and "no trace records" in empty.children[0].value


def _gpu_records() -> list:
    """The same trace as on CUDA: every call also carries its device time (CUDA events)."""
    recs = _records()
    for r, device in zip(recs, (None, 0.15, 0.25, None, 0.1, 0.35), strict=True):
        if isinstance(r, CommRecord):
            r.device_time = device
    return recs


def test_device_time_gets_its_own_track_per_rank() -> None:
    view = show_timeline(_gpu_records())
    dev = _trace(view, "device time")
    assert list(dev.y) == pytest.approx([0.42, 0.42, 1.42, 1.42])  # under rank 0, rank 1
    assert list(dev.x) == pytest.approx([150.0, 250.0, 100.0, 350.0])  # device ms, not host
    assert list(dev.base) == pytest.approx([400.0, 700.0, 300.0, 600.0])  # the host call's start
    assert dev.customdata[0][3:] == pytest.approx((150.0, 200.0))  # device vs host ms in hover
    axis = view.figures[0].layout.yaxis
    assert list(axis.ticktext) == ["rank 0", "rank 0 device", "rank 1", "rank 1 device"]
    assert list(axis.tickvals) == pytest.approx([0, 0.42, 1, 1.42])
    # the host bars are unchanged: device time sits beside host time, it does not replace it
    assert list(_trace(view, "all_reduce").x) == pytest.approx([200.0, 300.0])


def test_device_time_column_in_the_table() -> None:
    view = show_timeline(_gpu_records())
    assert view.device == pytest.approx({0: 0.4, 1: 0.45})
    page = view.to_html()
    assert "communication on the device" in page
    assert "400.000 ms" in page and "450.000 ms" in page


def test_cpu_records_have_no_device_track() -> None:
    view = show_timeline(_records())  # device_time None, as on CPU ranks
    assert "device time" not in [t.name for t in view.figures[0].data]
    assert view.device == {} and "on the device" not in view.to_html()
    assert list(view.figures[0].layout.yaxis.ticktext) == ["rank 0", "rank 1"]


def test_the_widget_lists_every_call_in_a_folded_table() -> None:
    view = show_timeline(_records())
    assert view.calls.get_title(0) == "calls (4)" and view.calls.selected_index is None
    table = view.calls.children[0].value
    assert table.count("<tr>") == 4 + 1  # a row per call, and the header
    for cell in ("all_reduce", "recv", "send", "4000", "300.000 ms"):
        assert cell in table
    assert "calls" in view.to_html()  # the text copy's table, as before
