"""Bandwidth arithmetic as nccl-tests reports it (pure functions; kernel or rank).

algbw = S / t, where S is the size of the buffer in bytes (for all_gather and reduce_scatter,
the whole gathered / unsplit buffer) and t the time of one call. busbw = algbw x factor, the
factor turning algbw into the bandwidth one link must carry, so it is comparable across ops and
rank counts: all_reduce 2(n-1)/n; reduce_scatter, all_gather, all_to_all (n-1)/n; broadcast,
reduce and point-to-point 1.

The same factor times S is the number of bytes each rank sends in one call under the algorithm
nccl-tests assumes (ring all_reduce, all_gather and reduce_scatter; a pipelined broadcast):
`wire_formula`. `check_wire` holds a count of bytes really sent (labkit.rank.socket_bytes reads
it from the OS) against it within a few per cent, so a backend that moves twice, or five
times, the bytes is caught, whatever the machine's load does to the times.
"""

from __future__ import annotations

__all__ = ["algbw", "busbw", "busbw_factor", "canonical_op", "check_wire", "wire_formula"]

# Aliases the tracer may report, mapped to the op whose bus factor applies.
_ALIASES = {
    "allreduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather_single": "all_gather",  # torch 2.13's name
    "all_gather_into_tensor": "all_gather",  # its deprecated form
    "_all_gather_base": "all_gather",
    "allgather": "all_gather",
    "all_gather_object": "all_gather",
    "reduce_scatter_single": "reduce_scatter",  # torch 2.13's name
    "reduce_scatter_tensor": "reduce_scatter",  # its deprecated form
    "_reduce_scatter_base": "reduce_scatter",
    "reducescatter": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "alltoall": "all_to_all",
    "broadcast_object_list": "broadcast",
    "isend": "send",
    "irecv": "recv",
}
_RING = {"all_gather", "reduce_scatter", "all_to_all"}
_ONE = {"broadcast", "reduce", "send", "recv", "gather", "scatter"}


def canonical_op(op: str) -> str:
    """The op name with tracer aliases folded ("all_gather_single" -> "all_gather")."""
    return _ALIASES.get(op, op)


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor of `op` on `n` ranks (0 for barrier, 1 when unknown).

    all_reduce: 2(n-1)/n; reduce_scatter, all_gather, all_to_all: (n-1)/n; broadcast, reduce,
    send/recv: 1. Raises ValueError when n < 1.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1 (number of ranks), got {n}")
    op = canonical_op(op)
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in _RING:
        return (n - 1) / n
    if op == "barrier":
        return 0.0
    return 1.0


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth in bytes per second: bytes / seconds (0 when seconds <= 0)."""
    return nbytes / seconds if seconds > 0 else 0.0


def busbw(op: str, nbytes: float, seconds: float, n: int) -> float:
    """Bus bandwidth in bytes per second: algbw(nbytes, seconds) x busbw_factor(op, n)."""
    return algbw(nbytes, seconds) * busbw_factor(op, n)


def wire_formula(op: str, nbytes: float, n: int) -> float:
    """Bytes each rank sends in one `op` call on S = `nbytes` over `n` ranks, under the algorithm
    the bus factor assumes: busbw_factor(op, n) x nbytes (all_reduce 2(n-1)/n x S, ...)."""
    return busbw_factor(op, n) * nbytes


def check_wire(
    op: str, nbytes: float, n: int, measured: float, *, times: float = 1.0, rel: float = 0.02
) -> float:
    """measured / wire_formula(op, nbytes, n), after checking that it is `times` within `rel`.

    `measured` is what one rank really sent (or received), counted by something other than the
    formula: the OS's TCP counters. `times` states a known departure from the formula, e.g. 2 for
    gloo's reduce_scatter, which runs all_reduces. Raises ValueError, with both numbers, when the
    ratio is off by more than `rel` (2 %: gloo's headers add well under 1 % at 1 MiB and more).
    """
    expected = wire_formula(op, nbytes, n)
    if expected <= 0 or times <= 0 or rel <= 0:
        raise ValueError(
            f"{op} on {n} ranks: nothing to compare (formula {expected} bytes, times {times}, "
            f"rel {rel}); the formula, times and rel must all be > 0"
        )
    ratio = measured / expected
    if abs(ratio / times - 1) > rel:
        raise ValueError(
            f"{op} of {nbytes:,.0f} bytes on {n} ranks moved {measured:,.0f} bytes per rank: "
            f"{ratio:.2f} x the formula's {expected:,.0f}, expected {times:g} x within {rel:.0%}"
        )
    return ratio
