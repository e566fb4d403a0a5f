"""The benchmark's kernel measurements run, and time what they say they time (not their speed:
speed targets live in `python -m labkit.bench`, never in timed tests)."""

from __future__ import annotations

import math

import pytest

from labkit.tools.bench_labkit import kernel_cells

pytestmark = pytest.mark.timeout(240)


def test_kernel_cells_time_a_lab_run_inside_a_cell():
    out = kernel_cells(2, cells=5, pairs=3, later_s=0.1)
    assert set(out) == {"own", "ranks", "rss_growth", "inside_at_once_s", "inside_later_s"}
    for key in ("own", "ranks", "inside_at_once_s", "inside_later_s"):
        assert math.isfinite(out[key]) and out[key] > 0, out
    # a lab.run on 2 ranks is a round trip to two processes: far more than 50 us on any machine
    # (a timer around the wrong statement, or the sleep left out of `later`, would show here)
    assert out["inside_at_once_s"] > 50e-6 and out["inside_later_s"] > 50e-6, out
    assert out["inside_later_s"] < 0.1, out  # the sleep before it is not timed
