"""Deciding that a running cell can never finish (kernel side, pure: no clock, no sockets).

The kernel knows which ranks run the cell, which have finished (and when their reply came), and,
from each rank's heartbeat, which `torch.distributed` op a rank is blocked in, since when, and
when that heartbeat arrived. A heartbeat is a snapshot: it is up to a few tenths of a second old
on an idle machine and older on a loaded one, so a rank it shows "blocked" may have left the op
already. The watchdog therefore calls a cell stuck only on certain evidence:

- a rank waits in an op (for longer than `GRACE`) whose group or p2p peer holds a rank that is
  not running the cell (finished, raised, died, or never asked: a rank-subset cell calling a
  collective) and that, by its final progress counters, never called its side of that op;
- a rank waits in an op whose absent peers all *did* their side, and a heartbeat that arrived
  at least `LONG_GRACE` after the last of their replies (kernel time: from the peers' finish,
  not from when the waiting rank entered) still shows the rank in that same op (a gloo mismatch
  can complete on the others and leave one rank waiting). Every running member of the op must
  have called it too (a root waits for a straggler while the others finish), and since the
  kernel learns that only from heartbeats, the `LONG_GRACE` then counts again, as below;
- every member of a group is blocked in that group's op but they disagree on op, shape, dtype or
  sequence number (a mismatched collective, or collectives called in a different order), or two
  ranks wait on each other in point-to-point ops (both `recv` first, or both `send` first).
  These rest on ranks that are all still running, so a `Watchdog` confirms them: the same
  verdict, seen without a break, still shown by a heartbeat from every rank involved that
  arrived `CONFIRM` seconds (`Verdict.hold`) or more after the kernel first saw it.

A rank still running user code (not inside an op) is never a reason: a straggler that computes
for a minute before its all_reduce is healthy, and so are the peers waiting for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from labkit.wire.records import P2P_OPS

GRACE = 1.0  # seconds an op must be blocked before it counts at all
LONG_GRACE = 5.0  # after a peer that did its side of the op finished (kernel time)
CONFIRM = 1.0  # seconds a verdict about running ranks must hold, with fresh heartbeats
UNDIAGNOSED = {"batch_isend_irecv"}  # a batch mixes peers and directions: Stop or timeout only


@dataclass(frozen=True)
class Verdict:
    """Why a cell is stuck. `confirm`: the running ranks it rests on (empty: certain now), whose
    heartbeats must still show it `hold` seconds after the kernel first saw it."""

    text: str
    confirm: frozenset[int] = frozenset()
    hold: float = CONFIRM

    def __str__(self) -> str:
        return self.text


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


def _absent_verdict(
    r: int,
    op: dict[str, Any],
    absent: list[int],
    running: set[int],
    why_not: dict[int, str],
    progress: dict[int, Any],
    finished: dict[int, float],
) -> Verdict | None:
    """Whether ranks not running the cell make r's op certain never to complete."""
    missing = [a for a in absent if not _did_its_part(r, op, progress.get(a))]
    if missing:  # they never called their side, and they will not now: they are not running
        return Verdict(_never(r, op, missing, why_not))
    # every absent rank did its side: the op may complete any moment, however late r's
    # heartbeat says so. Evidence is a heartbeat that left r LONG_GRACE after the last of them
    # finished, still inside the op; and a member still computing (the root of a gather waits
    # for a straggler) explains any wait, so every running member must have called it too
    seen = op.get("received")
    if seen is None or any(a not in finished for a in absent):
        return None
    if seen - max(finished[a] for a in absent) < LONG_GRACE:
        return None
    others = (set(op["group"]) if _p2p_peer(op) is None else {op["peer"]}) & running - {r}
    if not all(_did_its_part(r, op, progress.get(m)) for m in others):
        return None
    # when the others joined, the kernel knows only from their heartbeats: it counts the
    # LONG_GRACE again from the moment it saw them all in
    confirm = frozenset(others | {r}) if others else frozenset()
    return Verdict(_never(r, op, absent, why_not), confirm, LONG_GRACE)


def _never(r: int, op: dict[str, Any], absent: list[int], why_not: dict[int, str]) -> str:
    reasons = "; ".join(f"rank {a} {why_not.get(a, 'is not running')}" for a in absent)
    return f"{_op_text(r, op)}, which can never complete: {reasons}."


def diagnose(
    blocked: dict[int, dict[str, Any]],
    running: set[int],
    why_not: dict[int, str],
    grace: float = GRACE,
    progress: dict[int, dict[str, Any]] | None = None,
    finished: dict[int, float] | None = None,
) -> Verdict | None:
    """Why the cell is stuck, or None. `blocked[r]` is rank r's current op from its last heartbeat.

    `blocked[r]` holds the op (op, seq, group, peer, shape, dtype, line), `blocked_s` (how long
    r has been inside it, by r's clock) and `received` (when that heartbeat reached the kernel).
    `running` holds the ranks still executing the cell; `why_not[r]` says why a rank is not
    ("finished", "raised ZeroDivisionError", "is not running this cell", "died"). `progress[r]`
    counts the collectives rank r called per group and its p2p messages per peer
    (`labkit.rank.trace.progress`), final for a finished rank; `finished[r]` is when rank r's
    reply reached the kernel. Times are the kernel's `time.monotonic()`.

    A verdict with a non-empty `confirm` rests on running ranks only: pass it to `Watchdog`.
    """
    progress, finished = progress or {}, finished or {}
    long = {
        r: op
        for r, op in blocked.items()
        if r in running and op["blocked_s"] >= grace and op["op"] not in UNDIAGNOSED
    }
    for r, op in sorted(long.items()):
        peer = _p2p_peer(op)
        absent = sorted((set(op["group"]) if peer is None else {peer}) - running)
        verdict = absent and _absent_verdict(r, op, absent, running, why_not, progress, finished)
        if verdict:
            return verdict
    by_group: dict[tuple[int, ...], dict[int, dict[str, Any]]] = {}
    for r, op in long.items():
        if _p2p_peer(op) is None:
            by_group.setdefault(tuple(op["group"]), {})[r] = op
    for group, ops in sorted(by_group.items()):
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
            return Verdict(f"{head}:\n  {lines}", frozenset(group), CONFIRM)
    for r, op in sorted(long.items()):
        peer = _p2p_peer(op)
        other = long.get(peer) if peer is not None else None
        if other is not None and _p2p_peer(other) == r:
            a, b = op["op"].lstrip("i"), other["op"].lstrip("i")
            either_sent = _did_its_part(r, op, progress.get(peer)) or _did_its_part(
                peer, other, progress.get(r)
            )
            if a == b and not either_sent:
                return Verdict(
                    f"ranks {r} and {peer} both wait to {a} to each other first:\n  "
                    f"{_op_text(r, op)}\n  {_op_text(peer, other)}",
                    frozenset({r, peer}),
                    CONFIRM,
                )
    return None


class Watchdog:
    """Turns `diagnose` verdicts into a decision, one cell at a time (kernel side, no clock).

    A certain verdict stands at once. One that rests on running ranks stands once it has been
    seen without a break and every rank in `Verdict.confirm` has sent a heartbeat that arrived
    `Verdict.hold` seconds or more after the kernel first saw it, still showing it (a verdict is
    recomputed from the latest heartbeats): a stale snapshot, a rank that already left the op,
    shows itself as a changed verdict, which starts the wait again.
    """

    def __init__(self) -> None:
        self._held: tuple[Verdict, float] | None = None

    def check(self, verdict: Verdict | None, now: float, beats: dict[int, float]) -> str | None:
        """The reason to stop the cell, or None. `beats[r]`: when r's last heartbeat arrived."""
        if verdict is None or not verdict.confirm:
            self._held = None
            return verdict.text if verdict else None
        if self._held is None or self._held[0] != verdict:
            self._held = (verdict, now)
            return None
        since = self._held[1] + verdict.hold
        fresh = all(beats.get(r, since - 1) >= since for r in verdict.confirm)
        return verdict.text if fresh else None
