"""Exercise of the pipeline-schedules notebook 40 (kernel side).

`check_zero_bubble` tests a learner's closed form for the idle fraction of torch's zero-bubble
schedule against the step that torch's own order makes on paper (`simulated_bubble` of
`torch_orders`), for several pipeline depths, micro-batch counts, chunks per rank and times,
with m != p so that swapping them shows. Named slips: interleaved 1F1B's or plain 1F1B's
bubble, "zero", no division by v, idle over ideal time, m and p swapped.

`check_one_f_one_b` tests a learner's 1F1B order for one stage, [("F" | "B", microbatch)],
against `pipeline_parallel.stage_order` for every stage of several pipelines, and runs the
stages' orders together on paper (`simulate`). Named slips: a backward before its forward,
micro-batches out of order, GPipe's order, the warm-up counted from the wrong end or one
forward too long, orders that deadlock.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from labkit.exercises import Verdict, reveal, right, wrong

__all__ = [
    "check_one_f_one_b",
    "check_zero_bubble",
    "solution_one_f_one_b",
    "solution_zero_bubble",
]

CASES = (
    (2, 6, 2, (1.0, 1.0, 1.0)),
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
        "m and p are swapped: the warm-up and drain grow with the pipeline's depth p, the "
        "work with the micro-batches m": (m - 1)
        * (tf + tb - tw)
        / v
        / (p * (tf + tb + tw) + (m - 1) * (tf + tb - tw) / v),
        "that is plain 1F1B's (p-1)/(m+p-1): with v chunks per rank the warm-up is v times "
        "shorter, and the W's fill part of it": (p - 1) / (m + p - 1),
        "zero bubble still idles: the first F must cross every rank before the last can work, "
        "(p-1)(tf+tb-tw)/v per rank": 0.0,
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


ORDER_CASES = ((2, 4), (4, 4), (4, 8), (3, 2))


def _broken(got: list) -> str | None:
    """What makes a stage's order impossible whatever the other stages do, or None."""
    if sorted(got) != sorted(set(got)) or any(k not in "FB" for k, _ in got):
        return "every micro-batch's F and B exactly once, as ('F', j) / ('B', j)"
    for i, (kind, j) in enumerate(got):
        if kind == "B" and ("F", j) not in got[:i]:
            return (
                f"the backward of micro-batch {j} runs before its forward: it needs that "
                "forward's activations (and the next stage's gradient)"
            )
    for kind in "FB":
        seq = [j for k, j in got if k == kind]
        if seq != sorted(seq):
            return (
                f"the {kind}'s take the micro-batches out of order {seq}: a stage receives "
                "them from its neighbour in order 0, 1, 2, ..."
            )
    return None


def _order_slip(got: list, p: int, m: int, stage: int) -> str:
    from labkit.parallel.pipeline_parallel import stage_order

    if got == stage_order(p, m, stage, "gpipe"):
        return (
            "that is GPipe's order: all m forwards first hold m micro-batches' activations; "
            "1F1B starts the backwards after p-stage-1 warm-up forwards"
        )
    # forwards before the first B: the p-s-1 of the warm-up and the steady state's first
    leading = next((i for i, (k, _) in enumerate(got) if k == "B"), len(got))
    if leading == min(stage + 1, m):
        return "the warm-up is counted from the wrong end: stage s runs p-s-1 forwards first"
    if leading == min(p - stage + 1, m):
        return "one warm-up forward too many: stage s runs p-s-1 forwards, then one F one B"
    return f"{leading} forwards before the first B, then not 1F1B's alternation of one F, one B"


def check_one_f_one_b(fn: Callable[..., Any]) -> Verdict:
    """`fn(p, m, stage)` -> the 1F1B order of `stage`: [("F" | "B", microbatch), ...]."""
    from labkit.parallel.pipeline_parallel import stage_order
    from labkit.parallel.pipeline_schedules import simulate

    for p, m in ORDER_CASES:
        orders = {}
        for stage in range(p):
            try:
                orders[stage] = [(str(k), int(j)) for k, j in fn(p, m, stage)]
            except Exception as exc:  # noqa: BLE001 - a learner's error is a verdict
                return wrong(f"raised {type(exc).__name__}: {exc}")
        for stage, got in orders.items():
            why = _broken(got)
            if why is not None:
                return wrong(f"p={p}, m={m}, stage {stage}: got {got}; {why}")
        try:
            simulate(
                {s: [(k if k == "F" else "BW", s, j) for k, j in o] for s, o in orders.items()},
                p,
                (1.0, 1.0, 0.0),
            )
        except ValueError:
            return wrong(
                f"p={p}, m={m}: these orders deadlock, some stage waits for an op that never "
                f"runs: {orders}"
            )
        for stage, got in orders.items():
            if got != stage_order(p, m, stage, "1f1b"):
                why = _order_slip(got, p, m, stage)
                return wrong(f"p={p}, m={m}, stage {stage}: got {got}; {why}")
    return right(f"1F1B's order on every stage of {len(ORDER_CASES)} pipelines, m < p included")


def solution_one_f_one_b() -> Any:
    return reveal("""
def one_f_one_b(p, m, stage):
    warmup = min(p - stage - 1, m)                 # forwards before the first backward
    order = [("F", j) for j in range(warmup)]
    for i in range(m - warmup):                    # steady state: one F, one B
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", j) for j in range(m - warmup, m)]   # drain
""")
