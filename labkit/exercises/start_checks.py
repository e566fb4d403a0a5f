"""Exercises of notebook 00 (kernel side).

`check_global_max` runs the learner's function on every rank (through `lab.run`) twice: as
given, and with the values dealt in reverse (the function is told rank world_size-1-r on rank
r, so the largest value sits on rank 0). It reads the calls and the trace: the numbers must be
right on every rank, in both runs, and come from a reduction of the ranks' values, with every
async request waited for.

Classic wrong answers it rejects (tests/test_checkers_collectives.py): SUM instead of MAX;
`reduce` to rank 0 without a broadcast (the other ranks keep partial results); a broadcast
from the rank assumed to hold the largest, or all_gather then the last element (right only
while the largest sits on the last rank: the reversed run); `all_reduce(async_op=True)`
without wait (right by luck of timing); arithmetic on world_size (with or without a barrier:
a barrier moves no value); a collective on rank 0 only (a hang).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from labkit.exercises import (
    SYNC_ONLY,
    Verdict,
    comm_ops,
    reduce_leftovers,
    reveal,
    right,
    run_on_ranks,
    unwaited,
    watching_factory,
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


def _dealt_in_reverse(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn called with rank world_size-1-r on rank r (it takes the same names, and world_size)."""
    import inspect

    sig = inspect.signature(fn)
    takes = set(sig.parameters)

    def task(**names: Any) -> Any:
        names["rank"] = names["world_size"] - 1 - names["rank"]
        return fn(**{k: v for k, v in names.items() if k in takes})

    params = list(sig.parameters.values())
    if "world_size" not in takes:
        params.append(inspect.Parameter("world_size", inspect.Parameter.POSITIONAL_OR_KEYWORD))
    if "rank" not in takes:
        params.append(inspect.Parameter("rank", inspect.Parameter.POSITIONAL_OR_KEYWORD))
    task.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return task


def check_global_max(lab: Any, fn: Callable[..., Any]) -> Verdict:
    """`fn(rank)` runs on every rank and must return the largest `(rank + 1) ** 2` of all (a
    number or a one-element tensor), found with a collective over the ranks' values. It runs
    a second time with the values dealt in reverse (the largest on rank 0)."""
    expected = float(lab.world_size**2)
    watch = watching_factory()
    for reverse in (False, True):
        results, bad = run_on_ranks(lab, watch(_dealt_in_reverse(fn) if reverse else fn))
        if bad is not None and reverse:  # right as dealt: say what changed
            return wrong(
                "right while rank r is told it is rank r, but with the values dealt in reverse "
                "(rank r told it is rank world_size-1-r, so the largest sits on rank 0): "
                f"{bad.message}. Find the largest with a collective every rank calls the same "
                "way, whichever rank holds it"
            )
        if bad is not None:
            return bad
        out = results.values_by_rank
        if (bad := unwaited({r: got["calls"] for r, got in out.items()})) is not None:
            return bad
        for r, got in sorted(out.items()):
            value = _number(got["value"])
            if value is None:
                return wrong(
                    f"rank {r} returned {got['value']!r}, expected one number ({expected:g})"
                )
            if value != expected and reverse:
                return wrong(
                    f"right while the largest value sits on the last rank, but with the values "
                    f"dealt in reverse (the largest, {expected:g}, on rank 0) rank {r} returned "
                    f"{value:g}: the answer must not assume which rank holds the largest; "
                    "combine every rank's value (a MAX reduction)"
                )
            if value != expected:
                return wrong(f"rank {r} returned {value:g}, expected {expected:g}")
        ops = comm_ops(lab)
        if any(not set(o) - SYNC_ONLY for o in ops.values()):
            quiet = [r for r, o in sorted(ops.items()) if not set(o) - SYNC_ONLY]
            return wrong(
                f"right numbers, but ranks {quiet} called no collective: the answer must come "
                "from the ranks' values, not from world_size"
            )
        if (partial := reduce_leftovers(lab)) is not None:
            return partial
    return right(f"every rank holds {expected:g}, wherever the largest value sits")


def solution_global_max() -> Any:
    return reveal("""
def global_max(rank):
    t = torch.tensor(float((rank + 1) ** 2))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t
""")
