"""Exercises of the expert-parallel notebook 35 (kernel side).

`check_token_exchange` runs a learner's dispatch step on the ranks: the count exchange, then
one `all_to_all_single` with uneven splits. Every row the checker hands out is labelled with
its source rank, its destination rank and its place, so a wrong answer is diagnosed from what
arrived: input and output splits swapped, even splits, rows at the wrong rank, padding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from labkit.exercises import OP_FAMILY, Verdict, reveal, right, run_on_ranks, wrong

__all__ = ["check_token_exchange", "solution_token_exchange", "token_matrices"]

WIDTH = 4  # a row: source rank, destination rank, place in its block, a value
_SEND_FIRST = (
    "output_split_sizes[s] must be the rows rank s sends here, which only rank s knows: "
    "exchange the counts first (all_to_all_single of send_counts), then the rows"
)


def token_matrices(n: int) -> list[list[list[int]]]:
    """The cases, as matrix[s][d] = rows rank s sends to rank d (kernel side): a circulant one
    whose row sums equal its column sums, so that swapped splits run (and give wrong rows)
    where n > 2, and a seeded irregular one whose ranks send and receive different totals."""
    import random

    base = [1, 3, 0, 4, 2, 6, 5, 7, 1, 2][:n] + [1] * max(0, n - 10)
    base[0] += -sum(base) % n  # the total divisible by n: even splits run too
    circulant = [[base[(d - s) % n] for d in range(n)] for s in range(n)]
    rng = random.Random(n)
    irregular = [[rng.randint(0, 5) for _ in range(n)] for _ in range(n)]
    irregular[0][n - 1] += 3  # rank 0 sends more than it receives
    return [circulant, irregular]


def _rows(matrix: list[list[int]], s: int, d: int) -> list[list[float]]:
    """The rows rank s sends to rank d (the value: a hash of the three labels, exact in float32)."""
    return [[s, d, i, ((s * 31 + d * 7 + i * 3) % 17) / 16] for i in range(matrix[s][d])]


def _received(matrix: list[list[int]], blocks_of: Callable[[int], list[list[list[float]]]]):
    """What each rank receives when rank s's rows are cut into blocks_of(s), block d to rank d."""
    n = len(matrix)
    return [[row for s in range(n) for row in blocks_of(s)[r]] for r in range(n)]


def _sent(matrix: list[list[int]], s: int) -> list[list[float]]:
    return [row for d in range(len(matrix)) for row in _rows(matrix, s, d)]


def _cut(rows: list, sizes: list[int]) -> list[list]:
    out, at = [], 0
    for size in sizes:
        out.append(rows[at : at + size])
        at += size
    return out


def _diagnosis(matrix: list[list[int]], got: list[list[float]], r: int) -> str:
    """Why rank r's rows are wrong, as precisely as the labels allow (kernel side)."""
    n = len(matrix)
    want = [row for s in range(n) for row in _rows(matrix, s, r)]
    swapped = _received(matrix, lambda s: _cut(_sent(matrix, s), [matrix[d][s] for d in range(n)]))
    total = [sum(row) for row in matrix]
    even = None
    if all(t % n == 0 for t in total):
        even = _received(matrix, lambda s: _cut(_sent(matrix, s), [total[s] // n] * n))
    if got == swapped[r] and got != want:
        return (
            "input and output split sizes are swapped: input_split_sizes[d] is what this rank "
            "sends to rank d (send_counts), output_split_sizes[s] what it receives from rank s"
        )
    if even is not None and got == even[r] and got != want:
        return (
            "the rows were cut into equal splits: routing makes them uneven; pass "
            "input_split_sizes and output_split_sizes"
        )
    stray = sorted({int(row[1]) for row in got if int(row[1]) != r})
    if stray:
        return (
            f"it holds rows meant for rank(s) {stray}: split d of the input goes to rank d, and "
            "the rows come grouped by destination, in the order of send_counts"
        )
    if len(got) != len(want):
        return f"it received {len(got)} rows, the other ranks send it {len(want)}; " + _SEND_FIRST
    if sorted(got) == sorted(want):
        return "the right rows in the wrong order: they arrive grouped by source rank, 0 first"
    return "its rows are not the ones the other ranks sent it"


def _inputs_factory() -> Callable[..., Any]:
    """The function that builds a rank's input, made here so that it is pickled by value (a
    rank does not import this kernel-side module)."""

    def inputs(matrix: list[list[int]], rank: int, device: Any) -> tuple[Any, Any]:
        import torch

        rows = [
            [rank, d, i, ((rank * 31 + d * 7 + i * 3) % 17) / 16]
            for d in range(len(matrix))
            for i in range(matrix[rank][d])
        ]
        tokens = torch.tensor(rows, dtype=torch.float32, device=device).reshape(-1, 4)
        return tokens, torch.tensor(matrix[rank], dtype=torch.int64, device=device)

    return inputs


def check_token_exchange(lab: Any, fn: Callable[..., Any]) -> Verdict:
    """`fn(tokens, send_counts, rank, world_size)` runs on every rank. `tokens` [N, 4] float32
    are this rank's rows grouped by destination rank: the first send_counts[0] for rank 0,
    then send_counts[1] for rank 1, ...; `send_counts` is an int64 tensor of world_size counts.
    It must return the rows every rank sent to this one, grouped by source rank (rank 0's
    first), exchanging the counts first and the rows with one all_to_all_single whose splits
    are the counts themselves (no padding)."""
    import torch

    n = lab.world_size
    inputs = _inputs_factory()
    for case, matrix in enumerate(token_matrices(n)):

        def task(rank: int, world_size: int, device: Any, matrix: list = matrix) -> Any:
            tokens, counts = inputs(matrix, rank, device)
            out = fn(tokens, counts, rank, world_size)
            return out.detach().cpu() if isinstance(out, torch.Tensor) else out

        results, bad = run_on_ranks(lab, task, display=False)
        if bad is not None:
            if "died" in bad.message:
                return wrong(
                    "the cell could not finish: a rank died, as gloo aborts when a rank "
                    f"receives a different number of rows than its peer sent; {_SEND_FIRST}"
                )
            return bad
        for r, out in sorted(results.values_by_rank.items()):
            if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[1] != WIDTH:
                what = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                return wrong(f"rank {r} returned {what}, expected a tensor of shape (rows, 4)")
            got = out.float().tolist()
            want = [row for s in range(n) for row in _rows(matrix, s, r)]
            if len(got) != len(want) or not torch.allclose(out.float(), torch.tensor(want)):
                return wrong(f"case {case + 1}, rank {r}: {_diagnosis(matrix, got, r)}")
        verdict = _check_trace(lab, matrix)
        if verdict is not None:
            return verdict
    return right(
        "counts first, then the rows with uneven splits: every rank got exactly what the "
        "others sent it, and no byte more"
    )


def _check_trace(lab: Any, matrix: list[list[int]]) -> Verdict | None:
    """The rows must travel by one all_to_all whose bytes are the rows sent, after the counts."""
    for r in range(len(matrix)):
        recs = [rec for rec in lab.trace() if rec.kind == "comm" and rec.rank == r]
        moved = [rec for rec in recs if rec.dtype == "float32"]
        names = [OP_FAMILY.get(rec.op, rec.op) for rec in moved]
        if names != ["all_to_all"]:
            return wrong(
                f"rank {r} moved the rows with {names or 'nothing'}: exchange them with one "
                "all_to_all_single"
            )
        if recs.index(moved[0]) == 0:
            return wrong(f"rank {r} sent the rows before it knew the counts; {_SEND_FIRST}")
        need = sum(matrix[r]) * WIDTH * 4
        if moved[0].bytes != need:
            return wrong(
                f"rank {r}'s all_to_all carried {moved[0].bytes} bytes, its rows are {need}: "
                "padding to even splits sends more than the rows; use the counts as the splits"
            )
    return None


def solution_token_exchange() -> Any:
    return reveal("""
def exchange(tokens, send_counts, rank, world_size):
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)      # counts: one per rank, even splits
    out = tokens.new_empty((int(recv_counts.sum()), tokens.shape[1]))
    dist.all_to_all_single(
        out, tokens,
        output_split_sizes=recv_counts.tolist(),          # rows from each source rank
        input_split_sizes=send_counts.tolist(),           # rows to each destination rank
    )
    return out
""")
