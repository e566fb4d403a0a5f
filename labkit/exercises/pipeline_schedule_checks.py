"""Exercise of the pipeline-schedules notebook 40 (kernel side).

`check_zero_bubble` tests a learner's closed form for the idle fraction of torch's zero-bubble
schedule against the step that torch's own order makes on paper (`simulated_bubble` of
`torch_orders`), for several pipeline depths, micro-batch counts, chunks per rank and times.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from labkit.exercises import Verdict, reveal, right, wrong

__all__ = ["check_zero_bubble", "solution_zero_bubble"]

CASES = (
    (2, 4, 1, (1.0, 1.0, 1.0)),
    (2, 2, 2, (1.0, 1.0, 1.0)),
    (4, 8, 1, (1.0, 2.0, 1.0)),
    (3, 6, 2, (2.0, 3.0, 1.0)),
    (4, 4, 2, (1.0, 1.0, 0.5)),
)


def _describe(got: float, p: int, m: int, v: int, times: tuple[float, float, float]) -> str:
    tf, tb, tw = times
    guesses = {
        "that is interleaved 1F1B's bubble, (p-1)(tf+tb+tw)/v idle: the W's that run in "
        "the bubble shorten it, (p-1)(tf+tb-tw)/v": (p - 1) / (v * m + p - 1),
        "each of the v chunks does 1/v of the work: the idle time is divided by v": (p - 1)
        * (tf + tb - tw)
        / (m * (tf + tb + tw) + (p - 1) * (tf + tb - tw)),
        "that is idle over ideal time; the fraction of the step divides by the whole step": (
            (p - 1) * (tf + tb - tw) / v / (m * (tf + tb + tw))
        ),
    }
    for why, value in guesses.items():
        if math.isclose(got, value, rel_tol=1e-6):
            return why
    return "not the idle fraction torch's schedule has"


def check_zero_bubble(fn: Callable[..., Any]) -> Verdict:
    """`fn(p, m, v, tf, tb, tw)` -> the idle fraction of one zero-bubble step (tf, tb, tw: a
    micro-batch's forward, input gradient and weight gradient on one rank, all chunks)."""
    from labkit.parallel.pipeline_schedules import simulated_bubble, torch_orders

    for p, m, v, times in CASES:
        chunk = tuple(t / v for t in times)
        want = simulated_bubble(torch_orders("zero_bubble", p, m, v), p * v, chunk)
        try:
            got = float(fn(p, m, v, *times))
        except Exception as exc:  # noqa: BLE001 - a learner's error is a verdict
            return wrong(f"raised {type(exc).__name__}: {exc}")
        if not math.isclose(got, want, rel_tol=1e-6):
            why = _describe(got, p, m, v, times)
            return wrong(
                f"p={p}, m={m}, v={v}, (tf, tb, tw)={times}: got {got:.4f}, torch's order "
                f"idles {want:.4f}: {why}"
            )
    return right(f"equal to torch's zero-bubble order on paper in all {len(CASES)} cases")


def solution_zero_bubble() -> Any:
    return reveal("""
def zero_bubble(p, m, v, tf, tb, tw):
    idle = (p - 1) * (tf + tb - tw) / v      # warm-up and drain, shortened by the W's
    return idle / (m * (tf + tb + tw) + idle)  # over the whole step: work plus idle
""")
