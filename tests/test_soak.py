"""A short soak: many cells and restarts in one kernel leak no memory, fds, threads or ranks.

The full soak is `python -m labkit.tools.soak --cells 5000 --restarts 200` (prints a table).
"""

from __future__ import annotations

import pytest

from labkit.tools.soak import soak

pytestmark = pytest.mark.timeout(300)


def test_short_soak_is_flat():
    out = soak(cells=300, restarts=15, ranks=2)
    start, end = out["start"], out["end"]
    assert out["restarts"] == 15
    assert end["live rank processes"] == start["live rank processes"] == 2
    assert end["kernel fds"] <= start["kernel fds"] + 2, (start, end)
    assert end["kernel threads"] == start["kernel threads"], (start, end)
    assert end["kernel RSS MiB"] <= start["kernel RSS MiB"] + 20, (start, end)
    assert end["rank fds (max)"] <= start["rank fds (max)"] + 2, (start, end)
    assert end["rank threads (max)"] == start["rank threads (max)"], (start, end)
