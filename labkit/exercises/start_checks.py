"""Exercises of notebook 00 (kernel side).

`check_global_max` runs the learner's function on every rank (through `lab.run`) and reads the
trace: the numbers must be right on every rank and come from the ranks' values, not from
arithmetic on `world_size`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from labkit.exercises import (
    Verdict,
    comm_ops,
    reduce_leftovers,
    reveal,
    right,
    run_on_ranks,
    wrong,
)


def _number(value: Any) -> float | None:
    """`value` as one float (a number or a one-element tensor), else None."""
    if isinstance(value, torch.Tensor):
        return float(value.item()) if value.numel() == 1 else None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def check_global_max(lab: Any, fn: Callable[..., Any]) -> Verdict:
    """`fn(rank)` runs on every rank and must return the largest `(rank + 1) ** 2` of all (a
    number or a one-element tensor), found with a collective over the ranks' values."""
    results, bad = run_on_ranks(lab, fn)
    if bad is not None:
        return bad
    expected = float(lab.world_size**2)
    for r, value in sorted(results.values_by_rank.items()):
        got = _number(value)
        if got is None:
            return wrong(f"rank {r} returned {value!r}, expected one number ({expected:g})")
        if got != expected:
            return wrong(f"rank {r} returned {got:g}, expected {expected:g}")
    ops = comm_ops(lab)
    if any(not o for o in ops.values()):
        quiet = [r for r, o in sorted(ops.items()) if not o]
        return wrong(
            f"right numbers, but ranks {quiet} called no collective: the answer must come "
            "from the ranks' values, not from world_size"
        )
    if (partial := reduce_leftovers(lab)) is not None:
        return partial
    if all(set(o) == {"broadcast"} for o in ops.values()):
        return wrong(
            "right numbers, but only a broadcast: that assumes you know which rank holds the "
            "largest value; combine every rank's value (a MAX reduction)"
        )
    return right(f"every rank holds {expected:g}")


def solution_global_max() -> Any:
    return reveal("""
def global_max(rank):
    t = torch.tensor(float((rank + 1) ** 2))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t
""")
