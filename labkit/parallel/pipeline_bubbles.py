"""Idle fractions of a pipeline step: in closed form, on paper and from measured events (pure).

- `zero_bubble_fraction`: the idle fraction of torch's zero-bubble schedule in closed form.
- `simulate` / `simulated_bubble`: the step a set of per-rank orders makes when every F, B and
  W takes a given time, messages free (the prediction a measurement is checked against).
- `measured_bubble`: 1 - busy / (ranks * span) of one step's events (all ranks gathered).
- `replayed_bubble`: the bubble those events would have had with free, instant messages (each
  op replayed with the time it really took): a lower bound the wall clock cannot beat, so the
  measured bubble minus it is what messages, torch's bookkeeping and waking a rank that waited
  for one cost (a rank woken late after a sleep inside an op stamps that delay in the op).

Events are `labkit.parallel.pipeline_schedules.ChunkEvent`s, or anything with the same fields
(rank, chunk, kind, microbatch, start, end, duration).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "measured_bubble",
    "replayed_bubble",
    "simulate",
    "simulated_bubble",
    "zero_bubble_fraction",
]


def zero_bubble_fraction(
    num_stages: int,
    num_microbatches: int,
    num_chunks: int,
    seconds: Sequence[float],
) -> float:
    """Idle fraction of a zero-bubble step: b / (m*(tf+tb+tw) + b), b = (p-1)(tf+tb-tw)/v.

    `seconds` = (tf, tb, tw): one micro-batch's forward, input gradient and weight gradient
    on one rank (all its chunks together)."""
    p, m, v = num_stages, num_microbatches, num_chunks
    if p < 1 or m < 1 or v < 1:
        raise ValueError(
            f"num_stages, num_microbatches, num_chunks must be in [1, inf), got {p, m, v}"
        )
    tf, tb, tw = seconds
    if min(tf, tb, tw) < 0 or tw > tf:
        raise ValueError(f"seconds must be >= 0 with tw <= tf, got {tuple(seconds)}")
    bubble = (p - 1) * (tf + tb - tw) / v
    return bubble / (m * (tf + tb + tw) + bubble)


def measured_bubble(events: Sequence[Any]) -> float:
    """1 - busy / (ranks * span): the idle fraction of one step, from all ranks' events."""
    if not events:
        raise ValueError("events must be non-empty")
    span = max(e.end for e in events) - min(e.start for e in events)
    ranks = len({e.rank for e in events})
    busy = sum(e.duration for e in events)
    return 1.0 - busy / (ranks * span) if span > 0 else 0.0


def _needs(kind: str, chunk: int, microbatch: int, num_chunks: int) -> list[tuple[str, int, int]]:
    """What an op waits for: F(c, j) for F(c-1, j); B (or BW) of (c, j) for F(c, j) and B of
    (c+1, j); W for the B of its own (c, j)."""
    if kind == "F":
        return [("F", chunk - 1, microbatch)] if chunk > 0 else []
    if kind == "W":
        return [("B", chunk, microbatch)]
    after = [("B", chunk + 1, microbatch)] if chunk < num_chunks - 1 else []
    return [("F", chunk, microbatch)] + after


def replayed_bubble(events: Sequence[Any], split_backward: bool = False) -> float:
    """The idle fraction one step's events (all ranks) would have had with free messages.

    Each rank's ops are replayed in the order they ran, each with the duration it really took,
    each as early as its rank and its inputs allow (the dependencies of `simulate`). A full
    backward (GPipe, 1F1B, interleaved 1F1B) records B then W but sends the input gradient only
    after both; with `split_backward` (zero bubble) it goes as soon as B is done. No real op can
    start before its replay, so `measured_bubble(events)` is at least this; the difference is
    time lost between ops (messages, torch's bookkeeping, waking a rank). With every op as long
    as planned it is `simulated_bubble` of the same orders.

    `split_backward` must say how the step ran: False on a zero-bubble step makes a B that is
    followed by its own W wait for it, which the real step did not, and the result is then no
    lower bound. Events must be one step's, with no two ops of a rank overlapping. (torch 2.13's
    zero bubble skips the first stage's B and runs it inside that stage's W: recorded B then W,
    which changes nothing here, as nobody waits for the first stage's input gradient.)
    """
    if not events:
        raise ValueError("events must be non-empty")
    num_chunks = max(e.chunk for e in events) + 1
    by_rank: dict[int, list[Any]] = {}
    for e in sorted(events, key=lambda e: e.start):
        by_rank.setdefault(e.rank, []).append(e)
    done: dict[tuple[str, int, int], float] = {}  # op -> when it ended
    sent: dict[tuple[str, int, int], float] = {}  # ("B", c, j) -> when its gradient left
    free = dict.fromkeys(by_rank, 0.0)
    pos = dict.fromkeys(by_rank, 0)
    while any(pos[r] < len(ops) for r, ops in by_rank.items()):
        progressed = False
        for r, ops in by_rank.items():
            while pos[r] < len(ops):
                e = ops[pos[r]]
                deps = _needs(e.kind, e.chunk, e.microbatch, num_chunks)
                ready = [(done if d[0] == "F" or e.kind == "W" else sent).get(d) for d in deps]
                if None in ready:
                    break
                free[r] = max([free[r]] + ready) + e.duration  # type: ignore[arg-type]
                key = (e.kind, e.chunk, e.microbatch)
                done[key] = free[r]
                pos[r] += 1
                then = ops[pos[r]] if pos[r] < len(ops) else None
                if e.kind == "W" and not split_backward and ("B",) + key[1:] not in sent:
                    sent[("B",) + key[1:]] = free[r]  # a full backward: its gradient leaves now
                elif e.kind == "B" and (
                    split_backward
                    or then is None
                    or (then.kind, then.chunk, then.microbatch) != ("W",) + key[1:]
                ):
                    sent[key] = free[r]
                progressed = True
        if not progressed:
            raise ValueError("these events cannot be replayed: an op waits for one not among them")
    span = max(free.values())
    busy = sum(e.duration for e in events)
    return 1.0 - busy / (len(by_rank) * span) if span > 0 else 0.0


def simulate(
    orders: dict, num_chunks: int, seconds: Sequence[float]
) -> list[tuple[int, int, str, int, float, float]]:
    """Run `orders` on paper: each rank does its work in order, each op as early as allowed.

    `seconds` = (F, B, W) per chunk; a full backward BW takes B + W. F(c, j) waits for
    F(c-1, j); B (or BW) of (c, j) waits for F(c, j) and for B of (c+1, j) on the next chunk;
    W waits for B of its own (c, j). Messages are free. Returns (rank, chunk, kind, microbatch,
    start, end) for every op.
    """
    tf, tb, tw = seconds
    cost = {"F": tf, "B": tb, "W": tw, "BW": tb + tw}
    done: dict[tuple[str, int, int], float] = {}  # ("F" | "B" | "W", chunk, mb) -> end
    free = dict.fromkeys(orders, 0.0)
    pos = dict.fromkeys(orders, 0)
    out = []
    while any(pos[r] < len(orders[r]) for r in orders):
        progressed = False
        for r in orders:
            while pos[r] < len(orders[r]):
                kind, c, j = orders[r][pos[r]]
                deps = _needs(kind, c, j, num_chunks)
                if not all(d in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                end = start + cost[kind]
                out.append((r, c, kind, j, start, end))
                free[r] = end
                for k in ("B", "W") if kind == "BW" else (kind,):
                    done[(k, c, j)] = end
                pos[r] += 1
                progressed = True
        if not progressed:
            raise ValueError("these orders deadlock: some op waits for one that never runs")
    return out


def simulated_bubble(orders: dict, num_chunks: int, seconds: Sequence[float]) -> float:
    """The idle fraction of the step `simulate` predicts: 1 - busy / (ranks * span)."""
    ops = simulate(orders, num_chunks, seconds)
    span = max(o[5] for o in ops) - min(o[4] for o in ops)
    busy = sum(o[5] - o[4] for o in ops)
    return 1.0 - busy / (len(orders) * span)
