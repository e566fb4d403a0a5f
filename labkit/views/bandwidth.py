"""Bandwidth arithmetic as nccl-tests reports it (pure functions; kernel or rank).

algbw = S / t, where S is the size of the buffer in bytes (for all_gather and reduce_scatter,
the whole gathered / unsplit buffer) and t the time of one call. busbw = algbw x factor, the
factor turning algbw into the bandwidth one link must carry, so it is comparable across ops and
rank counts: all_reduce 2(n-1)/n; reduce_scatter, all_gather, all_to_all (n-1)/n; broadcast,
reduce and point-to-point 1.
"""

from __future__ import annotations

__all__ = ["algbw", "busbw", "busbw_factor", "canonical_op"]

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
