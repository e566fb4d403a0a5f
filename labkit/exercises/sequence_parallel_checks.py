"""Exercise of the sequence-parallel notebook 38 (kernel side).

`check_gather_sequence` runs a learner's `gather_sequence(x_local, rank, world_size)` on every
rank: each rank holds its contiguous s/n positions of one [batch, seq, hidden] tensor and must
return the whole tensor, with one all_gather (no all_reduce, which would move twice the
bytes). The usual slips are named: gathering along dim 0 (the batch), the positions in the
wrong order after a reshape, a zero-padded all_reduce.

`check_scatter_sequence` runs `scatter_sequence(partial, rank, world_size)`, the collective
after the row-parallel layer: every rank holds its partial sums over the whole sequence and
must return the total's s/n positions, with one reduce_scatter. Each rank's partial differs
(so a sum, a mean and one rank's own share all differ), and the batch is a multiple of the
ranks too (so scattering along dim 0 runs, and is named). Named slips: an all_reduce then a
slice (the right numbers at twice a ring reduce-scatter's bytes), scattering along dim 0, an
average instead of the sum, no reduction at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from labkit.exercises import Verdict, comm_ops, reveal, right, run_on_ranks, wrong

__all__ = [
    "check_gather_sequence",
    "check_scatter_sequence",
    "solution_gather_sequence",
    "solution_scatter_sequence",
]

BATCH, SEQ, HIDDEN = 2, 8, 3


def _inputs_factory() -> Callable[[int, int], tuple[Any, Any]]:
    """The function giving (full, x_local) to a rank, pickled by value (ranks do not import
    this kernel-side module)."""

    def _inputs(rank: int, world_size: int) -> tuple[Any, Any]:
        import torch

        g = torch.Generator().manual_seed(0)
        full = torch.randn(2, 8, 3, generator=g)
        c = 8 // world_size
        return full, full[:, rank * c : (rank + 1) * c].clone()

    return _inputs


def _diagnosis(got: Any, full: Any, world_size: int) -> str:
    import torch

    chunks = full.chunk(world_size, dim=1)
    by_batch = torch.cat(chunks, dim=0)  # what all_gather_single gives without moving dims
    if got.shape == by_batch.shape and torch.allclose(got, by_batch):
        return (
            "it gathered along dim 0, the batch: the collective concatenates along dim 0, so "
            "move the sequence dim first (movedim / transpose) and back after"
        )
    if got.numel() == full.numel() and torch.allclose(got.reshape(-1), by_batch.reshape(-1)):
        return (
            "it reshaped a gather along dim 0 to [batch, seq, hidden]: the numbers are there but "
            "the positions are in the wrong order"
        )
    if got.shape != full.shape:
        return f"returned shape {tuple(got.shape)}, expected {tuple(full.shape)}"
    return "it is not the whole sequence, every rank's slice in rank order"


def check_gather_sequence(lab: Any, fn: Callable[..., Any]) -> Verdict:
    """`fn(x_local, rank, world_size)` on every rank -> the whole [2, 8, 3] tensor, by one
    all_gather along the sequence (dim 1)."""
    import torch

    n = lab.world_size
    if SEQ % n:
        return wrong(f"this exercise cuts 8 positions evenly: it needs 1, 2, 4 or 8 ranks, not {n}")
    inputs = _inputs_factory()
    full, _ = inputs(0, n)

    def task(rank: int, world_size: int) -> Any:
        return fn(inputs(rank, world_size)[1], rank, world_size)

    results, bad = run_on_ranks(lab, task, display=False)
    if bad is not None:
        return bad
    for r, out in sorted(results.values_by_rank.items()):
        if not isinstance(out, torch.Tensor):
            return wrong(f"rank {r} returned {type(out).__name__}, expected a tensor")
        got = out.detach().float().cpu()
        if got.shape != full.shape or not torch.allclose(got, full, atol=1e-6):
            return wrong(f"rank {r}: {_diagnosis(got, full, n)}")
    ops = comm_ops(lab)
    for r, called in sorted(ops.items()):
        if called != ["all_gather"]:
            return wrong(
                f"right tensor, but rank {r} called {called or 'no collective'}; "
                "one all_gather is what sequence parallelism uses: an all_reduce of a "
                "zero-padded buffer sends twice the bytes, 2(n-1)/n of it instead of (n-1)/n"
            )
    return right("every rank holds the whole sequence, in order, after one all_gather")


def solution_gather_sequence() -> Any:
    return reveal("""
def gather_sequence(x_local, rank, world_size):
    first = x_local.movedim(1, 0).contiguous()         # [s/n, b, h]: the sequence first
    out = first.new_empty((world_size * first.shape[0], *first.shape[1:]))
    dist.all_gather_single(out, first)                 # concatenates along dim 0
    return out.movedim(0, 1)                           # back to [b, s, h]
""")


def _partials_factory() -> Callable[[int, int], tuple[Any, Any]]:
    """(every rank's partial sums, stacked; this rank's), [4, 8, 3] each, different per rank,
    with magnitudes far from 1 so a sum and a mean differ clearly. Pickled by value."""

    def _partials(rank: int, world_size: int) -> tuple[Any, Any]:
        import torch

        parts = torch.stack(
            [
                torch.randn(4, 8, 3, generator=torch.Generator().manual_seed(10 + r)) * (r + 2)
                for r in range(world_size)
            ]
        )
        return parts, parts[rank].clone()

    return _partials


def _scatter_diagnosis(got: Any, parts: Any, rank: int, n: int) -> str:
    import torch

    total = parts.sum(0)
    c = SEQ // n
    mine = slice(rank * c, (rank + 1) * c)
    guesses = {
        "it returned the whole sum, as an all_reduce does: keep only your s/n positions "
        "(a reduce_scatter sums and cuts in one collective)": total,
        "it scattered along dim 0, the batch: the collective cuts dim 0, so move the sequence "
        "dim first and back after": total.chunk(n, dim=0)[rank],
        "it averaged: the row-parallel layer's partial outputs add up to the output, so sum "
        "them (ReduceOp.SUM), do not divide by the number of ranks": total[:, mine] / n,
        "it kept only this rank's own partial sum: the other ranks' shares are missing": parts[
            rank
        ][:, mine],
    }
    for why, value in guesses.items():
        if got.shape == value.shape and torch.allclose(got, value, atol=1e-5):
            return why
    if got.shape != total[:, mine].shape:
        return f"returned shape {tuple(got.shape)}, expected {tuple(total[:, mine].shape)}"
    return "it is not the sum over ranks of this rank's s/n positions"


def check_scatter_sequence(lab: Any, fn: Callable[..., Any]) -> Verdict:
    """`fn(partial, rank, world_size)` on every rank -> the sum over ranks of `partial`
    [4, 8, 3], this rank's contiguous 8/n positions along dim 1, by one reduce_scatter."""
    import torch

    n = lab.world_size
    if SEQ % n or 4 % n:
        return wrong(
            f"this exercise cuts 8 positions and 4 rows evenly: it needs 1, 2 or 4 ranks, not {n}"
        )
    partials = _partials_factory()
    parts, _ = partials(0, n)

    def task(rank: int, world_size: int) -> Any:
        return fn(partials(rank, world_size)[1], rank, world_size)

    results, bad = run_on_ranks(lab, task, display=False)
    if bad is not None:
        return bad
    c = SEQ // n
    for r, out in sorted(results.values_by_rank.items()):
        if not isinstance(out, torch.Tensor):
            return wrong(f"rank {r} returned {type(out).__name__}, expected a tensor")
        got = out.detach().float().cpu()
        want = parts.sum(0)[:, r * c : (r + 1) * c]
        if got.shape != want.shape or not torch.allclose(got, want, atol=1e-5):
            return wrong(f"rank {r}: {_scatter_diagnosis(got, parts, r, n)}")
    for r, called in sorted(comm_ops(lab).items()):
        if called != ["reduce_scatter"]:
            return wrong(
                f"right tensor, but rank {r} called {called or 'no collective'}; one "
                "reduce_scatter is what sequence parallelism uses after the row-parallel layer: "
                "an all_reduce sends 2(n-1)/n of the buffer in a ring, a reduce_scatter (n-1)/n"
            )
    return right("every rank holds the sum of its s/n positions, after one reduce_scatter")


def solution_scatter_sequence() -> Any:
    return reveal("""
def scatter_sequence(partial, rank, world_size):
    first = partial.movedim(1, 0).contiguous()         # [s, b, h]: the sequence first
    out = first.new_empty((first.shape[0] // world_size, *first.shape[1:]))
    dist.reduce_scatter_single(out, first)             # sums, then cuts dim 0
    return out.movedim(0, 1)                           # [b, s/n, h]
""")
