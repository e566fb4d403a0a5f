"""The hang verdict: every rank's Flight Recorder entries merged into one finding (kernel side,
pure: no torch, no sockets, no clock).

torch's Flight Recorder (labkit.rank.flight_recorder) gives each rank's recent collectives. Each
process group numbers its collectives 1, 2, 3, ... on every member alike (its collective sequence
number) and its point-to-point ops apart (its p2p sequence number), so entries are matched by
(group, sequence number), never by their place in a rank's list: ranks that use different
groups hold different lists. As torch's own analyser (`torch.distributed.flight_recorder`) does,
a group expects only its members (a subgroup's outsiders are never blamed), the comparison
starts where every member's ring still holds entries (a wrapped ring lost the older ones), and
collectives whose per-rank sizes may differ by design (all_to_all, scatter, gather) are not
compared by shape.

The verdict, first thing, is one of:
- `missing`: the first collective (by when it was entered) that some members never entered,
  with the ranks that did and what the others did last ("ranks 1, 3 never entered all_reduce
  #7 of group 0 (default_pg)"); a divergence whose missing ranks all wait inside another
  group's op (a tp rank stuck in its tp all_reduce never enters the dp one) is that op's
  consequence, and comes after every other finding;
- `mismatch`: members entered the same sequence number with a different op, shape or dtype
  (both named, with their ranks);
- `unfinished`: every member entered the same collective alike and it has not completed;
- `p2p`: no collective diverged, but point-to-point ops still wait (numbered apart and paired
  rank to rank: named, not matched);
- `completed`: every member entered and completed the same collectives, so the hang is not in
  a collective (the stacks say where each rank is);
- `unknown`: no entries to judge (the recorder is off, or unreadable), said as such.
Notes say what limits the finding: ranks without entries, wrapped rings, unknown membership.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TITLE = "Hang verdict (Flight Recorder)"
# input sizes that may differ rank to rank (NCCL's all_gather_v: an uneven list all_gather)
UNSIZED = ("all_to_all", "alltoall", "scatter", "gather", "all_gather_v", "allgather_v")
ELSEWHERE = (
    "a hung cell waits elsewhere: see where each rank's main thread is (lab.stacks()); "
    "gloo records no send/recv, so a point-to-point wait shows only there"
)
# gloo under TORCH_DISTRIBUTED_DEBUG=DETAIL (torch 2.13): every group's entries, and those of the
# wrapper's own checks (all_gathers of each call's fingerprint), have group name "" (seen in a run)
UNNAMED = "entries of no named group (TORCH_DISTRIBUTED_DEBUG=DETAIL records them so): not compared"
_FIELDS = (("op", "op"), ("shape", "input_sizes"), ("dtype", "dtypes"))


@dataclass(frozen=True)
class Mismatch:
    """One way the members' entries for a collective differ: `what` ("op", "shape", "dtype")
    and each value seen with the ranks that had it."""

    what: str
    values: dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class HangVerdict:
    """What the merged entries say; `text` reads in a terminal, the fields are the data."""

    kind: str  # missing | mismatch | unfinished | p2p | completed | unknown
    text: str
    group_id: str | None = None  # torch's name of the group ("0"), and its description
    group: str | None = None
    seq: int | None = None  # the first divergent collective's sequence number in its group
    op: str | None = None
    missing: tuple[int, ...] = ()  # members that never entered it
    entered: tuple[int, ...] = ()  # members that did
    mismatches: tuple[Mismatch, ...] = ()
    waiting: dict[int, str] = field(default_factory=dict)  # rank -> the op it is inside
    notes: tuple[str, ...] = ()

    @property
    def key(self) -> tuple[str, int] | None:
        """(group_id, seq) of the first divergent collective, or None."""
        return (self.group_id, self.seq) if self.group_id is not None else None

    def __str__(self) -> str:
        return self.text

    __repr__ = __str__


def _ranks(ranks: Any) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}"


def _group(gid: str, desc: Any) -> str:
    """A group as the verdict names it: `group 0 (default_pg)`, or `group 1` for one made
    without a description (torch calls it "undefined")."""
    return f"group {gid}" if desc in (None, "", "undefined", "?") else f"group {gid} ({desc})"


def _dtypes(e: dict[str, Any]) -> str:
    return ",".join(sorted(set(e.get("dtypes") or []))).lower() or "-"


def _value(e: dict[str, Any], key: str) -> str:
    return _dtypes(e) if key == "dtypes" else str(e.get(key))


def _what(e: dict[str, Any], gid: str) -> str:
    """An entry as the verdict names it: `all_reduce #7 of group 0 (default_pg), in [[4]] float`."""
    kind = " p2p" if e.get("p2p") else ""
    return (
        f"{e['op']}{kind} #{e['seq']} of {_group(gid, e.get('group'))}, "
        f"in {e.get('input_sizes')} {_dtypes(e)}"
    )


def _index(
    usable: dict[int, list[dict[str, Any]]],
) -> tuple[dict[str, dict[int, dict[int, dict[str, Any]]]], dict[int, str], dict[str, str], Any]:
    """{group_id: {rank: {seq: entry}}} of collectives, {rank: p2p ops still waiting}, and
    each group's description. A later entry with the same key wins: a group made again, or
    NCCL's coalesced ops (batch_isend_irecv, a coalescing manager), each op recorded under the
    group's number and never retired, then one `coalesced` entry that is, with the same number.
    Entries of unnamed groups (UNNAMED) are left out, their ranks returned."""
    coll: dict[str, dict[int, dict[int, dict[str, Any]]]] = {}
    unnamed: set[int] = set()
    waiting: dict[int, str] = {}
    desc: dict[str, str] = {}
    for r, got in usable.items():
        p2p: dict[tuple[str, int], dict[str, Any]] = {}
        for e in got:
            gid = str(e.get("group_id", e.get("group", "?")))
            if not gid:
                unnamed.add(r)
                continue
            desc.setdefault(gid, str(e.get("group", "?")))
            if e.get("p2p"):
                p2p[(gid, e["seq"])] = e
                continue
            coll.setdefault(gid, {}).setdefault(r, {})[e["seq"]] = e
        for (gid, _), e in p2p.items():
            if e.get("state") != "completed":
                waiting[r] = _what(e, gid)
    return coll, waiting, desc, unnamed


def _differences(present: dict[int, dict[str, Any]]) -> tuple[Mismatch, ...]:
    """How the members' entries differ: the op alone when ops differ (their sizes differ
    with them), else shape and dtype."""
    found = []
    for what, key in _FIELDS:
        if found:  # the ops differ: that is the finding
            break
        if what == "shape" and any(str(e["op"]).startswith(UNSIZED) for e in present.values()):
            continue
        seen: dict[str, list[int]] = {}
        for r, e in sorted(present.items()):
            seen.setdefault(_value(e, key), []).append(r)
        if len(seen) > 1:
            found.append(Mismatch(what, {v: tuple(rs) for v, rs in seen.items()}))
    return tuple(found)


def _elsewhere(got: list[dict[str, Any]], gid: str) -> bool:
    """Whether a rank waits inside an op of another group, or a p2p op: its latest entry
    has not completed (a slow rank still inside an earlier collective of `gid` is not)."""
    if not got or got[-1].get("state") == "completed":
        return False
    return bool(got[-1].get("p2p")) or str(got[-1].get("group_id", "?")) != gid


def _last_of(rank: int, usable: dict[int, list[dict[str, Any]]], gid: str, held: Any) -> str:
    """What a rank that never entered a collective did last: in that group, and where it is."""
    if held:
        e = held[max(held)]
        said = f"last entered #{e['seq']} of that group ({e.get('state')})"
    else:
        said = "entered no collective of this group"
    latest = usable.get(rank) or []
    if latest and latest[-1].get("state") != "completed":
        e = latest[-1]
        said += f"; waiting in {_what(e, str(e.get('group_id', '?')))}"
    return said


def verdict(
    recorded: dict[int, Any],
    groups: dict[str, dict[str, Any]] | None = None,
    wrapped: Any = (),
    where: dict[int, str | None] | None = None,
    world: Any = None,
) -> HangVerdict:
    """Merge every rank's Flight Recorder entries into a `HangVerdict` (kernel side, pure).

    `recorded`: {rank: [entry, ...] oldest first, as labkit.rank.flight_recorder gives them,
    or a str saying why there are none}; `groups`: {group_id: {"desc", "ranks"}}, the groups'
    members (global ranks), where known; `wrapped`: ranks whose ring had wrapped; `where`:
    {rank: the line its main thread runs}, said of ranks that never entered; `world`: every
    rank (default: those in `recorded`; the default group's members).
    Example: ``verdict({0: [e7], 1: [e6]}).text`` names rank 1 as never entering e7.
    """
    groups, where, wrapped = groups or {}, where or {}, set(wrapped)
    world = sorted(set(world if world is not None else recorded) | set(recorded))
    usable = {r: list(got) for r, got in recorded.items() if isinstance(got, list)}
    notes = [
        f"{_ranks([r])}: no entries ({got})"
        for r, got in sorted(recorded.items())
        if not isinstance(got, list)
    ]
    notes += [f"{_ranks([r])}: no answer" for r in world if r not in recorded]
    if not any(usable.values()):
        if not usable:
            return _finish("unknown", "no verdict: no rank's Flight Recorder could be read", notes)
        text = f"no rank has entered a collective yet; {ELSEWHERE}"
        return _finish("completed", text, notes)
    coll, waiting, desc, unnamed = _index(usable)
    if unnamed:
        notes.append(f"{_ranks(unnamed)}: {UNNAMED}")
        if not coll and not waiting:
            return _finish("unknown", "no verdict: no entry names its group", notes)
    found: list[tuple[Any, HangVerdict]] = []  # ((class, created_ns, gid, seq), verdict)
    unfinished: list[tuple[Any, HangVerdict]] = []
    last: tuple[Any, str] | None = None
    unknown: set[int] = set()  # members of some group whose entries did not come
    for gid, by_rank in sorted(coll.items()):
        if gid in groups:
            members = set(groups[gid]["ranks"])
        elif desc[gid] == "default_pg":
            members = set(world)
        else:
            members = set(by_rank)
            notes.append(
                f"{_group(gid, desc[gid])}: its members are not known; only the ranks that "
                f"recorded it ({', '.join(map(str, sorted(members)))}) are expected in it"
            )
        judged = sorted(r for r in members if r in usable)
        unread = sorted(members - set(usable))  # members whose entries did not come
        unknown |= set(unread)
        lost = [r for r in judged if r in wrapped and r not in by_rank]
        if lost:
            said = "no entry of it, and a wrapped ring (older entries are lost): not judged"
            notes.append(f"{_group(gid, desc[gid])}: {_ranks(lost)}: {said}")
        judged = [r for r in judged if r not in lost]
        held = {r: by_rank.get(r, {}) for r in judged}
        starts = [min(s) for s in held.values() if s]
        if not starts:  # only outsiders recorded it (membership read wrong): nothing to judge
            continue
        start, end = max(starts), max(max(s) for s in held.values() if s)
        if start > 1 and any(r in wrapped for r in judged):
            notes.append(
                f"{_group(gid, desc[gid])}: a ring wrapped; compared from #{start} "
                "(older entries are lost on some rank)"
            )
        open_at: tuple[Any, HangVerdict] | None = None  # the group's first unfinished one
        for seq in range(start, end + 1):
            present = {r: s[seq] for r, s in held.items() if seq in s}
            if not present:  # a number no member holds (a group made again): nothing to match
                continue
            absent = [r for r in judged if r not in present]
            any_e = next(iter(present.values()))
            order = (min((e.get("created_ns") or 0) for e in present.values()), gid, seq)
            diffs = _differences(present)
            if absent or diffs:
                # ranks that never entered it because they wait inside another group's op are
                # victims of that one: such a divergence ranks after every other finding
                victims = not diffs and all(_elsewhere(usable[r], gid) for r in absent)
                found.append(
                    (
                        (2 if victims else 0, *order),
                        _diverged(gid, seq, present, absent, diffs, held, usable, where),
                    )
                )
                break
            not_done = [r for r, e in present.items() if e.get("state") != "completed"]
            if not_done and open_at is None:
                text = (
                    f"every member entered {_what(any_e, gid)} alike, and it has not completed "
                    f"on {_ranks(not_done)}: the ranks agree, so it waits in the transport "
                    "(gloo, NCCL, a GPU kernel); see the stacks"
                )
                if unread:  # they may be the ones that never entered it: say so, not "agree"
                    text = (
                        f"{_ranks(judged)} entered {_what(any_e, gid)} alike, and it has not "
                        f"completed on {_ranks(not_done)}; whether {_ranks(unread)} of its "
                        "members entered it is not known (no entries came from them)"
                    )
                found_here = HangVerdict(
                    "unfinished", text, gid, any_e.get("group"), seq, any_e["op"],
                    entered=tuple(sorted(present)),
                )  # fmt: skip
                open_at = ((1, *order), found_here)
            last = max(last or (order, ""), (order, _what(any_e, gid)))
        if open_at is not None:
            unfinished.append(open_at)
    # the first finding: a divergence whose missing ranks are not inside another collective
    # (or a mismatch), else a collective every member entered, else one whose missing ranks
    # wait in another; by when it was entered within each
    first = min(found + unfinished or [(None, None)], key=lambda x: x[0] or ())[1]
    if first is not None:
        return _finish(first.kind, first.text, notes, first, waiting)
    if waiting:
        text = (
            "no collective diverged, but point-to-point ops still wait: "
            + "; ".join(f"{_ranks([r])} in {w}" for r, w in sorted(waiting.items()))
            + " (p2p ops are numbered apart and pair two ranks: check each send has its recv)"
        )
        return _finish("p2p", text, notes, waiting=waiting)
    who = "every rank" if not unknown else f"every rank but {', '.join(map(str, sorted(unknown)))}"
    text = (
        f"{who} entered and completed the same collectives (the last: "
        f"{last[1] if last else '-'}): none is stuck in one, so {ELSEWHERE}"
    )
    return _finish("completed", text, notes)


def _diverged(
    gid: str,
    seq: int,
    present: dict[int, dict[str, Any]],
    absent: list[int],
    diffs: tuple[Mismatch, ...],
    held: dict[int, dict[int, dict[str, Any]]],
    usable: dict[int, list[dict[str, Any]]],
    where: dict[int, str | None],
) -> HangVerdict:
    """The verdict on the first collective of a group where the members diverged."""
    any_e = next(iter(present.values()))
    if diffs:
        parts = []
        for m in diffs:
            if m.what == "op":  # name each side whole: op, sizes, dtype
                values = "; ".join(
                    f"{op} in {present[rs[0]].get('input_sizes')} {_dtypes(present[rs[0]])} "
                    f"on {_ranks(rs)}"
                    for op, rs in m.values.items()
                )
            else:
                values = ", ".join(f"{v} on {_ranks(rs)}" for v, rs in m.values.items())
            parts.append(f"{m.what}s: {values}")
        text = (
            f"the ranks entered #{seq} of {_group(gid, any_e.get('group'))} with different "
            + "; ".join(parts)
        )
        if absent:
            text += f"; {_ranks(absent)} never entered it"
        return HangVerdict(
            "mismatch", text, gid, any_e.get("group"), seq, any_e["op"],
            tuple(absent), tuple(sorted(present)), diffs,
        )  # fmt: skip
    said: dict[str, list[int]] = {}
    for r in absent:
        at = where.get(r)
        line = _last_of(r, usable, gid, held[r]) + (f"; now at {at}" if at else "")
        said.setdefault(line, []).append(r)
    text = f"{_ranks(absent)} never entered {_what(any_e, gid)}; {_ranks(present)} entered it"
    text += "".join(f"\n  {_ranks(rs)}: {line}" for line, rs in said.items())
    return HangVerdict(
        "missing", text, gid, any_e.get("group"), seq, any_e["op"],
        tuple(absent), tuple(sorted(present)),
    )  # fmt: skip


def _finish(
    kind: str,
    text: str,
    notes: list[str],
    found: HangVerdict | None = None,
    waiting: dict[int, str] | None = None,
) -> HangVerdict:
    waiting = waiting or {}
    head, _, rest = text.partition("\n")
    lines = [f"{TITLE}: {head}."] + ([rest] if rest else [])
    if waiting and kind != "p2p":
        lines += [f"  {_ranks([r])} also waits in {w}" for r, w in sorted(waiting.items())]
    lines += [f"  ({n})" for n in notes]
    keys = ("group_id", "group", "seq", "op", "missing", "entered", "mismatches")
    data = {k: getattr(found, k) for k in keys} if found is not None else {}
    return HangVerdict(kind, "\n".join(lines), waiting=waiting, notes=tuple(notes), **data)


def merge(
    snapshots: dict[int, Any], where: dict[int, str | None] | None = None, world: Any = None
) -> HangVerdict:
    """The verdict from each rank's `FrSnapshot` (labkit.wire.flight_records: what a rank's
    stacks and its `flight_recorder.snapshot()` carry), a str (why a rank has none), or None
    (its recorder is off). Group members are the union of what each member rank reports."""
    recorded: dict[int, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    wrapped = set()
    for r, snap in snapshots.items():
        if snap is None:
            recorded[r] = "the Flight Recorder is off on this rank"
        elif isinstance(snap, str):
            recorded[r] = snap
        else:
            recorded[r] = snap["entries"]
            if snap.get("wrapped"):
                wrapped.add(r)
            for gid, g in (snap.get("groups") or {}).items():
                groups.setdefault(gid, {"desc": g["desc"], "ranks": set()})["ranks"] |= set(
                    g["ranks"]
                )
    return verdict(recorded, groups, wrapped, where, world)
