"""The time breakdown against hand-worked answers, and its view's state and text (no ranks).

Every expected number below is worked out by hand from the records (in the comments), not
from labkit's interval code: overlap exactly known, a straggler 50 ms late, an async op that
spans compute, nested spans, ranks with no records, device time.
"""

from __future__ import annotations

import random

import pytest
from test_views_fakes import FakeLab

from labkit.views import breakdown, compare, show_breakdown, timeline_summary
from labkit.views.breakdown_data import METRICS
from labkit.wire.records import CommRecord, SpanRecord, to_dict

pytestmark = pytest.mark.filterwarnings("error::labkit.views.ViewWarning")
G4 = (0, 1, 2, 3)


def _ar(rank, seq, start, end, group=G4, **kw) -> CommRecord:
    return CommRecord(rank=rank, op="all_reduce", seq=seq, group=group, start=start, end=end,
                      **kw)  # fmt: skip


def _row(b, rank) -> tuple:
    r = b.row(rank)
    return (r.compute, r.comm, r.overlapped, r.exposed, r.waiting, r.idle)


def test_overlap_of_async_ops_under_compute_is_exactly_known() -> None:
    recs = [
        SpanRecord(rank=0, name="backward", start=0.0, end=1.0),
        _ar(0, 1, 0.2, 0.5, group=(0,), async_op=True),  # all 0.3 s under the span
        _ar(0, 2, 0.8, 1.4, group=(0,), async_op=True),  # 0.2 s under it, 0.4 s after
        SpanRecord(rank=0, name="step", start=1.4, end=1.6),
    ]
    b = breakdown(recs)
    # compute 1.0 + 0.2; comm 0.3 + 0.6; overlapped 0.3 + 0.2; exposed 0.4; no one to wait for
    assert _row(b, 0) == pytest.approx((1.2, 0.9, 0.5, 0.4, 0.0, 0.0))
    assert b.row(0).overlap_pct == pytest.approx(100 * 0.5 / 0.9)
    assert b.straggler is None and b.window == (0.0, 1.6)


def test_a_blocking_call_inside_a_span_hides_nothing() -> None:
    recs = [SpanRecord(rank=0, name="step", start=0.0, end=1.0), _ar(0, 1, 0.2, 0.5, (0,))]
    # the thread was inside all_reduce for 0.3 s: not computing, so nothing overlapped
    assert _row(breakdown(recs), 0) == pytest.approx((0.7, 0.3, 0.0, 0.3, 0.0, 0.0))


def test_ddp_buckets_without_a_measured_end_are_counted_and_said() -> None:
    """DDP's bucket all-reduces read from the Flight Recorder on gloo end where they start:
    they add nothing to comm, and the text says how many were left out; a bucket with a CUDA
    event's device time is timed and not counted as untimed."""
    recs = [
        SpanRecord(rank=0, name="backward", start=0.0, end=1.0),
        _ar(0, 1, 0.4, 0.4, (0,), recorded_by="flight_recorder"),
        _ar(0, 2, 0.9, 0.9, (0,), recorded_by="flight_recorder"),
    ]
    b = breakdown(recs)
    assert b.untimed == 2 and b.row(0).comm == 0.0
    assert "2 collective(s) issued by torch itself" in b.text
    timed = breakdown(recs[:2] + [_ar(0, 2, 0.9, 0.9, (0,), recorded_by="flight_recorder",
                                      device_time=0.05)])  # fmt: skip
    assert timed.untimed == 1 and timed.row(0).comm == pytest.approx(0.05)
    assert "issued by torch itself" not in breakdown(recs[:1]).text


def test_nested_spans_count_once() -> None:
    recs = [
        SpanRecord(rank=0, name="step", start=0.0, end=1.0),
        SpanRecord(rank=0, name="forward", start=0.1, end=0.4),
        SpanRecord(rank=0, name="matmul", start=0.2, end=0.3),
        SpanRecord(rank=0, name="tail", start=1.5, end=2.0),
    ]
    assert _row(breakdown(recs), 0) == pytest.approx((1.5, 0.0, 0.0, 0.0, 0.0, 0.5))


def _late_rank_3() -> list:
    """4 ranks compute, then all_reduce twice; rank 3 enters the first 50 ms after the others
    and the second 30 ms after; rank 1 is last into a third, 20 ms late."""
    recs = []
    for r in range(4):
        late = 0.05 if r == 3 else 0.0
        recs += [SpanRecord(rank=r, name="fwd", start=0.0, end=1.0 + late),
                 _ar(r, 1, 1.0 + late, 1.06)]  # fmt: skip
        late = 0.03 if r == 3 else 0.0
        recs.append(_ar(r, 2, 1.1 + late, 1.15))
        late = 0.02 if r == 1 else 0.0
        recs.append(_ar(r, 3, 1.2 + late, 1.25))
    return recs


def test_a_straggler_50_ms_late_is_named_with_the_others_wait() -> None:
    b = breakdown(_late_rank_3())
    s = b.straggler
    # ranks 0-2 waited 50 + 30 ms for rank 3; ranks 0, 2 and 3 waited 20 ms for rank 1
    assert s.rank == 3 and s.waited == pytest.approx(3 * 0.08)
    assert s.by_rank == pytest.approx({0: 0.08, 1: 0.08, 2: 0.08})
    assert (s.last, s.matched) == (2, 3)
    assert b.row(0).waiting == pytest.approx(0.1) and b.row(1).waiting == pytest.approx(0.08)
    assert b.row(3).waiting == pytest.approx(0.02)
    # rank 0: compute 1.0, comm 0.06 + 0.05 + 0.05, idle 0.04 + 0.05 between calls
    assert _row(b, 0) == pytest.approx((1.0, 0.16, 0.0, 0.16, 0.1, 0.09))
    assert "straggler: rank 3; the others waited for it 240.0 ms in all" in b.text


def test_an_async_op_spanning_compute_waits_only_outside_compute() -> None:
    g = (0, 1)
    recs = [
        _ar(0, 1, 0.0, 0.12, g, async_op=True),  # issued at once, wait() returns at 0.12
        SpanRecord(rank=0, name="compute", start=0.0, end=0.08),  # computes meanwhile
        SpanRecord(rank=1, name="compute", start=0.0, end=0.1),
        _ar(1, 1, 0.1, 0.12, g),  # rank 1 enters at 0.1
    ]
    b = breakdown(recs)
    # rank 0: in flight 0.12, under compute 0.08; waited from 0.08 (compute ended) to 0.1
    assert _row(b, 0) == pytest.approx((0.08, 0.12, 0.08, 0.04, 0.02, 0.0))
    assert b.straggler.rank == 1 and b.straggler.waited == pytest.approx(0.02)
    assert b.row(0).overlap_pct == pytest.approx(100 * 0.08 / 0.12)


def test_waiting_in_async_ops_in_flight_together_counts_once() -> None:
    g = (0, 1)
    recs = [
        _ar(0, 1, 0.0, 0.2, g, async_op=True),  # rank 0 issues two at once and waits for both
        _ar(0, 2, 0.0, 0.2, g, async_op=True),
        _ar(1, 1, 0.1, 0.15, g),  # rank 1 enters both 100 ms later
        _ar(1, 2, 0.15, 0.2, g),
    ]
    b = breakdown(recs)
    # rank 0 waited [0, 0.1] for #1 and [0, 0.15] for #2: 150 ms of its time, not 250
    assert b.row(0).waiting == pytest.approx(0.15)
    assert b.straggler.rank == 1 and b.straggler.waited == pytest.approx(0.15)


def test_subgroups_with_the_same_sequence_numbers_are_matched_apart() -> None:
    # a 2 x 2 mesh: tp groups (0, 1), (2, 3) then dp groups (0, 2), (1, 3), each its call #1
    recs = [
        _ar(0, 1, 0.00, 0.05, (0, 1)),
        _ar(1, 1, 0.03, 0.05, (0, 1)),  # rank 1 is 30 ms late into tp (0, 1)
        _ar(2, 1, 0.00, 0.02, (2, 3)),
        _ar(3, 1, 0.00, 0.02, (2, 3)),
        _ar(0, 1, 0.10, 0.20, (0, 2)),
        _ar(2, 1, 0.15, 0.20, (0, 2)),  # rank 2 is 50 ms late into dp (0, 2)
        _ar(1, 1, 0.10, 0.12, (1, 3)),
        _ar(3, 1, 0.10, 0.12, (1, 3)),
    ]
    b = breakdown(recs)
    # rank 0 waited 30 ms for rank 1 and 50 ms for rank 2; no one else waited. Matching by
    # sequence number alone would put all eight calls in one collective, rank 2 last at 0.15
    assert [b.row(r).waiting for r in range(4)] == pytest.approx([0.08, 0.0, 0.0, 0.0])
    s = b.straggler
    assert s.rank == 2 and s.waited == pytest.approx(0.05)
    assert s.by_rank == pytest.approx({0: 0.05, 3: 0.0})  # the ranks it shares a group with
    assert (s.last, s.matched) == (2, 4)  # dp (0, 2), and tp (2, 3) on a tie (lower rank)
    assert b.incomplete == []


def test_ranks_without_records_are_all_idle_and_named_missing() -> None:
    g = (0, 1, 2)
    recs = [_ar(0, 1, 0.0, 0.5, g), _ar(1, 1, 0.2, 0.5, g)]  # rank 2 never came
    b = breakdown(recs, ranks=range(4))
    assert [r.rank for r in b.rows] == [0, 1, 2, 3]
    for rank in (2, 3):
        assert _row(b, rank) == pytest.approx((0.0, 0.0, 0.0, 0.0, 0.0, 0.5))
    assert b.straggler.rank == 1 and b.straggler.waited == pytest.approx(0.2)
    assert b.incomplete == [("all_reduce", 1, (2,))]
    assert "all_reduce #1: rank(s) 2 of its group never entered it" in b.text
    assert breakdown([]).rows == [] and "no trace records" in breakdown([], cell=4).text


def test_device_time_is_the_communication_on_cuda() -> None:
    recs = [
        SpanRecord(rank=0, name="fwd", start=0.0, end=1.0),
        # the host call returns at once (NCCL enqueues it); the device ran it for 0.3 s
        _ar(0, 1, 0.5, 0.501, (0,), device_time=0.3),
        _ar(0, 2, 1.0, 1.2, (0,)),  # no events (a CPU tensor): host time
        # an async op's events: its issue to its wait() on the current stream, 0.2 s
        _ar(0, 3, 1.3, 1.301, (0,), async_op=True, device_time=0.2),
        SpanRecord(rank=0, name="bwd", start=1.3, end=1.4),
    ]
    b = breakdown(recs)
    # blocking, device 0.5-0.8: the stream orders it between the span's kernels, so it hides
    # nothing (compute 1.0 - 0.3 + 0.1); host 1.0-1.2 exposed; the async op 1.3-1.5 hides 0.1
    # of its 0.2; idle 1.2-1.3; window 0-1.5
    assert _row(b, 0) == pytest.approx((0.8, 0.7, 0.1, 0.6, 0.0, 0.1))
    assert b.row(0).source == "host+device" and "CUDA events where" in b.text


def test_the_parts_add_up_and_agree_with_the_timeline_on_random_traces() -> None:
    rng = random.Random(7)
    for _ in range(50):
        recs = []
        for r in range(3):
            for i in range(8):
                start = rng.uniform(0, 10)
                end = start + rng.uniform(0, 2)
                if rng.random() < 0.5:
                    recs.append(SpanRecord(rank=r, name="s", start=start, end=end))
                else:
                    recs.append(_ar(r, i, start, end, (0, 1, 2), async_op=rng.random() < 0.5))
        b, t = breakdown(recs), timeline_summary(recs)
        for r in b.rows:
            parts = r.compute - r.overlapped + r.overlapped + r.exposed + r.idle
            assert parts == pytest.approx(r.total)
            assert r.compute - r.overlapped == pytest.approx(t[r.rank]["compute"])
            assert r.comm == pytest.approx(t[r.rank]["comm"])
            assert r.idle == pytest.approx(t[r.rank]["idle"])
            assert 0 <= r.waiting <= r.exposed + 1e-12


def test_compare_two_cells() -> None:
    a = breakdown(_late_rank_3(), label="late")
    b = breakdown([r for r in _late_rank_3() if r.rank != 3], label="without rank 3")
    c = compare(a, b)
    rows = {k: (x, y) for k, x, y in c.rows}
    assert list(rows) == ["window", *METRICS]
    assert rows["window"] == pytest.approx((1.25, 1.25))
    # without rank 3 its row is all idle; ranks 0 and 2 still wait 20 ms for rank 1
    assert rows["waiting"] == pytest.approx(((0.1 + 0.08 + 0.1 + 0.02) / 4, 0.04 / 4))
    text = c.text
    assert text.startswith("late vs without rank 3") and "rank 3 (240.0 ms)" in text


def test_view_stacks_four_parts_per_rank_that_fill_the_window() -> None:
    view = show_breakdown(_late_rank_3(), num_cpus=4)
    fig = view.figures[0]
    assert [t.name for t in fig.data] == ["compute", "comm overlapped", "comm exposed", "idle"]
    assert fig.layout.barmode == "stack" and fig.layout.width is None  # follows its box
    assert list(fig.data[0].y) == ["rank 0", "rank 1", "rank 2", "rank 3"]
    for i in range(4):
        assert sum(t.x[i] for t in fig.data) == pytest.approx(1250.0)  # ms, the whole window
    assert "straggler rank 3" in fig.layout.title.text and "240.0 ms" in fig.layout.title.text
    assert view.to_text() == view.breakdown.text and "<script" not in view.to_html()
    assert "straggler: rank 3" in view.to_html() and view.warning is None


def test_view_compares_two_cells_of_a_lab() -> None:
    recs = [r for r in _late_rank_3()]
    for r in recs:
        r.cell = 5
    recs += [SpanRecord(rank=r, name="fwd", start=2.0, end=2.5, cell=6) for r in range(4)]
    lab = FakeLab(4, records=recs, num_cpus=4)
    view = show_breakdown(lab, compare=(5, 6), labels=("sync", "no comm"))
    assert ("trace", 5) in lab.calls and ("trace", 6) in lab.calls
    fig = view.figures[0]
    assert len(fig.data) == 8 and [t.showlegend for t in fig.data].count(True) == 4
    assert [a.text for a in fig.layout.annotations] == [
        "sync: straggler rank 3, the others waited 240.0 ms for it",
        "no comm: no straggler",
    ]
    assert view.comparison is not None and "sync vs no comm" in view.to_text()
    assert "side by side" in view.to_html()
    with pytest.raises(ValueError, match="two cell ids"):
        show_breakdown(lab, compare=(5,))


def test_view_of_a_lab_shows_every_rank_and_takes_dicts() -> None:
    recs = [_ar(0, 1, 0.0, 0.5, (0, 1)), _ar(1, 1, 0.3, 0.5, (0, 1))]
    view = show_breakdown(FakeLab(3, records=recs, num_cpus=2))
    assert [r.rank for r in view.breakdown.rows] == [0, 1, 2]
    assert "3 ranks on 2 CPU cores" in view.warning
    same = show_breakdown([to_dict(r) for r in recs])
    assert same.breakdown.straggler == view.breakdown.straggler
    empty = show_breakdown([])
    assert empty.figures == [] and "no trace records" in empty.to_text()
