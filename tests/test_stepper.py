"""The Next/Previous stepper and the ring view, tested through widget state (no ranks)."""

from __future__ import annotations

import pytest

from labkit.parallel.ring_allreduce import RingStep
from labkit.views.stepper_view import Stepper, ring_grid, ring_steps, show_ring


def _records() -> dict[int, list[RingStep]]:
    """A 2-rank ring by hand: 2 chunks, 1 reduce-scatter step and 1 all-gather step."""
    return {
        0: [
            RingStep(0, "start", 0, chunks=[[1.0], [1.0]]),
            RingStep(1, "reduce-scatter", 0, 0, 1, 1, 1, 4, [[1.0], [11.0]]),
            RingStep(2, "all-gather", 0, 1, 1, 0, 1, 4, [[11.0], [11.0]]),
        ],
        1: [
            RingStep(0, "start", 1, chunks=[[10.0], [10.0]]),
            RingStep(1, "reduce-scatter", 1, 1, 0, 0, 0, 4, [[11.0], [10.0]]),
            RingStep(2, "all-gather", 1, 0, 0, 1, 0, 4, [[11.0], [11.0]]),
        ],
    }


def test_stepper_buttons_move_and_disable_at_the_ends() -> None:
    s = Stepper([("a", "<p>A</p>"), ("b", "<p>B</p>"), ("c", "<p>C</p>")])
    assert (s.index, s.body.value) == (0, "<p>A</p>") and s.prev_button.disabled
    s.next_button.click()
    s.next_button.click()
    assert (s.index, s.body.value) == (2, "<p>C</p>") and s.next_button.disabled
    s.next()  # stays at the end
    s.prev_button.click()
    assert s.index == 1 and "2/3" in s.label.value and not s.prev_button.disabled
    with pytest.raises(IndexError, match=r"\[0, 3\)"):
        s.show(3)
    with pytest.raises(ValueError):
        Stepper([])


def test_ring_steps_groups_records_by_step_and_accepts_dicts() -> None:
    steps = ring_steps(_records())
    assert len(steps) == 3 and all(sorted(s) == [0, 1] for s in steps)
    from dataclasses import asdict

    flat = [asdict(r) for recs in _records().values() for r in recs]
    assert ring_steps(flat) == steps
    with pytest.raises(ValueError, match="no ring step records"):
        ring_steps({})
    with pytest.raises(ValueError, match="step 1 has records of ranks"):
        ring_steps([*_records()[0], *_records()[1][:1]])


def test_ring_grid_marks_sent_and_received_chunks() -> None:
    html = ring_grid(ring_steps(_records())[1])
    assert html.count(">rank ") == 2 and "chunk 1" in html
    assert html.count("outline:2px") == 2 and html.count("background:#bbf7d0") == 2
    assert "sends chunk 0 → rank 1; adds chunk 1 from rank 1" in html


def test_show_ring_frames_follow_the_steps() -> None:
    view = show_ring(_records())
    assert len(view.frames) == 3 and "before the first step" in view.label.value
    view.next()
    assert "step 1 of 2 (reduce-scatter)" in view.label.value and ">11<" in view.body.value
    view.next()
    assert "all-gather" in view.label.value and view.body.value.count(">11<") == 4
    assert "ring all-reduce on 2 ranks" in view.to_html()
