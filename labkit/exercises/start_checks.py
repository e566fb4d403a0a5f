"""Exercises of notebook 00 (kernel side)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from labkit.exercises import Verdict, reveal, right, wrong


def check_global_max(lab: Any, fn: Callable[..., Any]) -> Verdict:
    """`fn(rank)` runs on every rank and must return the largest `(rank + 1) ** 2` of all."""
    results = lab.run(fn)
    if results.errors:
        r = min(results.errors)
        return wrong(f"rank {r} raised {results.errors[r]['type']}: {results.errors[r]['message']}")
    expected = float(lab.world_size**2)
    for r, value in sorted(results.values_by_rank.items()):
        got = float(value.item() if isinstance(value, torch.Tensor) else value)
        if got != expected:
            return wrong(f"rank {r} returned {got}, expected {expected}")
    return right(f"every rank holds {expected:g}")


def solution_global_max() -> Any:
    return reveal("""
def global_max(rank):
    t = torch.tensor(float((rank + 1) ** 2))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t
""")
