"""Time intervals as sorted, merged lists of (start, end) (pure; kernel side, any process).

The timeline, the breakdown and their tests measure a rank's compute, communication, overlap
and idle time with these: union, intersection, difference and the gaps in a window.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable

__all__ = ["Interval", "clip", "gaps", "intersect", "length", "subtract", "union"]

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, merged, non-overlapping intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def length(intervals: Iterable[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def gaps(busy: list[Interval], window: Interval) -> list[Interval]:
    """The parts of `window` outside `busy` (sorted, merged intervals)."""
    out, cursor = [], window[0]
    for start, end in busy:
        if start > cursor:
            out.append((cursor, start))
        cursor = max(cursor, end)
    if window[1] > cursor:
        out.append((cursor, window[1]))
    return out


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The intersection of two sorted, merged interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """`a` less `b` (both sorted and merged)."""
    if not a:
        return []
    window = (a[0][0], a[-1][1])
    return intersect(a, gaps(b, window))


def clip(intervals: list[Interval], lo: float, hi: float) -> list[Interval]:
    """The intervals (sorted, merged) that reach into (lo, hi), found by bisection: what
    `subtract` needs of a long list to take it from one short interval."""
    first = bisect_right(intervals, lo, key=lambda iv: iv[1])
    last = bisect_left(intervals, hi, lo=first, key=lambda iv: iv[0])
    return intervals[first:last]
