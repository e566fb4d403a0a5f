"""The breakdown of real cells on 4 CPU gloo ranks: a rank that sleeps before an all_reduce is
the straggler, and the others' waiting comes out near its sleep; an async all_reduce in flight
while a rank computes is overlapped.

The bounds hold on a saturated 2-core machine (4 ranks take turns, so a rank may start late or
be slow to wake) and still reject a breakdown that ignores waiting (it would read ~0 s) or
counts the whole all_reduce as waiting regardless of who came last.
"""

from __future__ import annotations

import pytest

from labkit.views import show_breakdown

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("error::labkit.views.ViewWarning"),
]
SLEEP = 0.4  # rank 2's sleep before the all_reduce, s

LATE = f"""
import time
t = torch.ones(1024)
dist.barrier()  # start together
if rank == 2:
    time.sleep({SLEEP})
dist.all_reduce(t)
"""

OVERLAPPED = """
import time
t = torch.ones(1024)
work = dist.all_reduce(t, async_op=True)
with labkit.span("compute"):
    end = time.perf_counter() + 0.2
    while time.perf_counter() < end:
        pass
work.wait()
"""


def test_the_others_wait_for_the_rank_that_sleeps(lab, load) -> None:
    lab.run("import torch, labkit\nimport torch.distributed as dist").raise_for_errors()
    lab.run(LATE).raise_for_errors()
    view = show_breakdown(lab)
    b = view.breakdown
    s = b.straggler
    assert s is not None and s.rank == 2, b.text
    for r in (0, 1, 3):
        assert 0.5 * SLEEP < s.by_rank[r] < SLEEP + 1.5, b.text  # waited about its sleep
        assert b.row(r).waiting == pytest.approx(s.by_rank[r], abs=0.3), b.text  # + barrier
    assert b.row(2).waiting < min(s.by_rank.values()), b.text  # it never waited for itself
    assert b.row(2).idle >= 0.5 * SLEEP  # it slept outside any call or span
    assert "straggler: rank 2" in view.to_text()


def test_an_async_all_reduce_in_flight_during_compute_is_overlapped(lab) -> None:
    lab.run("import torch, labkit\nimport torch.distributed as dist").raise_for_errors()
    lab.run(LATE.replace("rank == 2", "False")).raise_for_errors()
    sync = lab.last_cell
    lab.run(OVERLAPPED).raise_for_errors()
    overlapped = lab.last_cell
    view = show_breakdown(lab, compare=(sync, overlapped), labels=("sync", "async"))
    first, second = view.parts
    spans = [s for s in lab.trace(overlapped) if s.kind == "span"]
    for r in second.rows:  # in flight for the whole 0.2 s span: all of the span is hidden
        span = sum(s.duration for s in spans if s.rank == r.rank)  # the trace's own record
        assert r.overlapped == pytest.approx(span, abs=1e-6), second.text
        assert 0.2 <= r.overlapped <= r.compute + 1e-9, second.text
        assert r.overlap_pct > 50, second.text
    assert all(r.overlapped == 0 for r in first.rows), first.text  # blocking calls hide nothing
    assert "sync vs async" in view.to_text()
