"""Deciding that a running cell can never finish (kernel side, pure functions).

The kernel knows which ranks run the cell, which have finished, and, from each rank's
heartbeat, which `torch.distributed` op a rank is blocked in and for how long. A cell is stuck
for certain when:

- a rank waits in an op whose group (or p2p peer) contains a rank that is not running the cell:
  it finished, raised, died, or was never asked (a rank-subset cell calling a collective);
- every member of a group is blocked in that group's op with the same sequence number, but
  they disagree on op, shape or dtype (a mismatched collective), or on the sequence number
  itself (collectives called in a different order);
- two ranks wait on each other in point-to-point ops (both `recv` first, or both `send` first).

Only ops blocked for longer than `grace` seconds count, so a slow but healthy op is left alone.
"""

from __future__ import annotations

from typing import Any

from labkit.wire.records import P2P_OPS

GRACE = 1.0
LONG_GRACE = 5.0  # when every absent peer already made its side of the op
UNDIAGNOSED = {"batch_isend_irecv"}  # a batch mixes peers and directions: Stop or timeout only


def _p2p_peer(op: dict[str, Any]) -> int | None:
    return op.get("peer") if op["op"] in P2P_OPS else None


def _fmt_ranks(ranks: Any) -> str:
    ranks = sorted(ranks)
    return ", ".join(map(str, ranks))


def op_text(op: dict[str, Any]) -> str:
    """A comm op a rank is inside, as every message names it: "all_reduce #17 on group [0, 1]"."""
    peer = f" with peer {op['peer']}" if _p2p_peer(op) is not None else ""
    return f"{op['op']} #{op['seq']} on group [{_fmt_ranks(op['group'])}]{peer}"


def _op_text(rank: int, op: dict[str, Any]) -> str:
    where = f", line {op['line']}" if op.get("line") else ""
    shape = tuple(op.get("shape") or ())
    return f"rank {rank} waits in {op_text(op)} ({op.get('dtype') or '-'} {shape}{where})"


def _did_its_part(r: int, op: dict[str, Any], other: dict[str, Any] | None) -> bool:
    """Whether rank `other` (by its progress counters) already made its side of r's op."""
    if not other:
        return False
    if op["op"] in ("send", "isend"):
        return other.get("received", {}).get(r, 0) >= op["seq"]
    if op["op"] in ("recv", "irecv"):
        return other.get("sent", {}).get(r, 0) >= op["seq"]
    return other.get("seq", {}).get(tuple(op["group"]), 0) >= op["seq"]


def diagnose(
    blocked: dict[int, dict[str, Any]],
    running: set[int],
    why_not: dict[int, str],
    grace: float = GRACE,
    progress: dict[int, dict[str, Any]] | None = None,
) -> str | None:
    """Why the cell is stuck, or None. `blocked[r]` is rank r's current op with `blocked_s`.

    `running` holds the ranks still executing the cell; `why_not[r]` says why a rank is not
    ("finished", "raised ZeroDivisionError", "not in this cell", "died"). `progress[r]`, where
    known, counts the collectives rank r called per group and its p2p messages per peer
    (`labkit.rank.trace.progress`): a peer that finished after doing its side of an op is no reason
    to call that op stuck before `LONG_GRACE` (it completes once the bytes arrive, however
    loaded the machine).
    """
    progress = progress or {}
    long = {
        r: op
        for r, op in blocked.items()
        if r in running and op["blocked_s"] >= grace and op["op"] not in UNDIAGNOSED
    }
    for r, op in sorted(long.items()):
        peer = _p2p_peer(op)
        needed = set(op["group"]) if peer is None else {peer}
        absent = sorted(needed - running)
        if op["blocked_s"] < LONG_GRACE:
            # a peer that made its side of the op may just be ahead of a starved rank; but if
            # the op still has not completed after LONG_GRACE, it never will (a gloo mismatch
            # can complete on the others and leave this rank waiting)
            absent = [a for a in absent if not _did_its_part(r, op, progress.get(a))]
        if absent:
            reasons = "; ".join(f"rank {a} {why_not.get(a, 'is not running')}" for a in absent)
            return f"{_op_text(r, op)}, which can never complete: {reasons}."
    by_group: dict[tuple[int, ...], dict[int, dict[str, Any]]] = {}
    for r, op in long.items():
        if _p2p_peer(op) is None:
            by_group.setdefault(tuple(op["group"]), {})[r] = op
    for group, ops in by_group.items():
        if set(ops) != set(group):
            continue
        keys = {
            (op["seq"], op["op"], tuple(op.get("shape") or ()), op.get("dtype"))
            for op in ops.values()
        }
        if len(keys) > 1:
            what = "order" if len({op["seq"] for op in ops.values()}) > 1 else "op, shape or dtype"
            lines = "\n  ".join(_op_text(r, op) for r, op in sorted(ops.items()))
            head = f"mismatched collectives on group [{_fmt_ranks(group)}] ({what} differs)"
            return f"{head}:\n  {lines}"
    for r, op in long.items():
        peer = _p2p_peer(op)
        other = long.get(peer) if peer is not None else None
        if other is not None and _p2p_peer(other) == r:
            a, b = op["op"].lstrip("i"), other["op"].lstrip("i")
            either_sent = _did_its_part(r, op, progress.get(peer)) or _did_its_part(
                peer, other, progress.get(r)
            )
            if a == b and not either_sent:
                return (
                    f"ranks {r} and {peer} both wait to {a} to each other first:\n  "
                    f"{_op_text(r, op)}\n  {_op_text(peer, other)}"
                )
    return None
