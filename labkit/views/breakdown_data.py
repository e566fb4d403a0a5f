"""Where each rank's time went in a cell, as data (kernel side; pure: no torch, no widgets).

`timeline_summary(records)` splits each rank's time over the cell's window (the earliest start
to the latest end of any rank's record) into compute, communication and idle; the timeline's
table shows it. `breakdown(records)` splits it further, as Holistic Trace Analysis does for
profiler traces, and names the straggler:

- compute: the rank's spans (`labkit.span`), less the time it was blocked in a call;
- communication: the union of its calls, each from its issue to its completion. An async op
  (`async_op=True`, `isend`, `irecv`) counts from its issue to its `wait()`: while it is in
  flight and the rank computes, that time is *overlapped* (hidden under compute); the rest is
  *exposed*. A blocking call can hide nothing (the rank's thread is inside it), even when a span
  encloses it. An async op counts until its `wait()` even if it finished earlier: overlapped is
  the time the rank computed with an op in flight, not the time the wire was busy. On CUDA a
  call that carries `device_time` (CUDA events on the current stream) counts as that long from
  its host issue. NCCL returns to the host once a call is queued, even a blocking one, but the
  stream orders a blocking call between the kernels queued before and after it, so it still
  hides nothing; an async op's device time runs from its issue to its `wait()` on the current
  stream. Spans are host time (they time the kernels only if they end with a synchronize), and
  the device intervals are placed from the host's issue: overlap of compute and communication
  kernels themselves is in the device's own trace (torch.profiler, HTA);
- waiting: the part of the exposed communication spent in a collective before its last rank
  entered it (collectives matched across ranks by group and sequence number), by the hosts'
  entries: on GPU ranks the host runs ahead of the device, so it names a late host;
- idle: the rest of the window (outside every span and call);
- the straggler: the rank the others waited for the longest, summed over the cell's
  collectives, with how long each of them waited for it.

    compute - overlapped + overlapped + exposed + idle = window, on every rank

and, on host records (no `device_time`: the timeline's table counts host time),
`timeline_summary`'s compute is `compute - overlapped`, its comm `overlapped + exposed`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from labkit.views.intervals import Interval, clip, intersect, length, subtract, union
from labkit.views.text import columns
from labkit.wire.records import P2P_OPS, CommRecord, SpanRecord

__all__ = [
    "Breakdown",
    "Comparison",
    "RankTime",
    "Straggler",
    "breakdown",
    "compare",
    "timeline_summary",
]

Record = CommRecord | SpanRecord


def timeline_summary(records: list[Record]) -> dict[int, dict[str, float]]:
    """Per rank: seconds of compute, comm, idle and the window total, and their percentages."""
    if not records:
        return {}
    window = (min(r.start for r in records), max(r.end for r in records))
    total = window[1] - window[0]
    out = {}
    for rank in sorted({r.rank for r in records}):
        mine = [r for r in records if r.rank == rank]
        comm = union((r.start, r.end) for r in mine if isinstance(r, CommRecord))
        busy = union((r.start, r.end) for r in mine)
        row = {"comm": length(comm), "total": total}
        row["compute"] = length(busy) - row["comm"]
        row["idle"] = total - length(busy)
        for key in ("compute", "comm", "idle"):
            row[f"{key}_pct"] = 100 * row[key] / total if total > 0 else 0.0
        out[rank] = row
    return out


def can_overlap(r: CommRecord) -> bool:
    """True for a call that can run beside the rank's compute: an async op (issue to wait) or
    a collective torch issued from C++ (DDP's buckets). A blocking call cannot, on CUDA too:
    its host call returns once NCCL has queued it, but NCCL's stream waits for the kernels
    queued before it on the current stream and the current stream waits for it (`wait()`),
    so the kernels before and after it do not overlap it."""
    return r.async_op or r.op in ("isend", "irecv") or r.recorded_by == "flight_recorder"


def comm_interval(r: CommRecord) -> Interval:
    """The time a call counts as communication: its device time from its issue on CUDA,
    else its host time (issue to completion)."""
    if r.device_time is not None:
        return (r.start, r.start + r.device_time)
    return (r.start, r.end)


@dataclass(frozen=True)
class RankTime:
    """One rank's time in seconds over the window (`total`); see the module docstring."""

    rank: int
    compute: float
    comm: float
    overlapped: float
    exposed: float
    waiting: float
    idle: float
    total: float
    source: str = "host"  # where comm came from: "host", "device" (CUDA events), "host+device"

    @property
    def overlap_pct(self) -> float:
        """The share of communication hidden under compute (0 when there is none)."""
        return 100 * self.overlapped / self.comm if self.comm > 0 else 0.0


@dataclass(frozen=True)
class Straggler:
    """The rank the others waited for the longest: `waited` seconds summed over them and
    `by_rank` for each; it entered `last` of the cell's `matched` collectives (those that two
    or more ranks entered) last."""

    rank: int
    waited: float
    by_rank: dict[int, float]
    last: int
    matched: int


@dataclass
class Breakdown:
    """A cell's time per rank (`rows`), its straggler (None when no rank waited) and window."""

    rows: list[RankTime]
    straggler: Straggler | None
    window: Interval
    cell: int | None = None
    label: str = ""
    incomplete: list[tuple[str, int, tuple[int, ...]]] = field(default_factory=list)
    untimed: int = 0  # collectives with no measured duration (DDP's buckets on gloo)

    @property
    def untimed_line(self) -> str:
        """What the numbers leave out: collectives torch issued from C++ whose end no one
        measured (DDP's bucket all-reduces read from the Flight Recorder on gloo), or ""."""
        if not self.untimed:
            return ""
        return (
            f"{self.untimed} collective(s) issued by torch itself (DDP's buckets, from the "
            "Flight Recorder) have no measured duration here: their time is not in comm"
        )

    def row(self, rank: int) -> RankTime:
        return next(r for r in self.rows if r.rank == rank)

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        return f"cell {self.cell}" if self.cell is not None else "trace"

    @property
    def straggler_line(self) -> str:
        s = self.straggler
        if s is None:
            return "straggler: none (no rank waited in a collective)"
        each = ", ".join(f"rank {r} {_ms(t)}" for r, t in sorted(s.by_rank.items()))
        return (
            f"straggler: rank {s.rank}; the others waited for it {_ms(s.waited)} in all "
            f"({each}); last into {s.last} of {s.matched} collectives"
        )

    @property
    def text(self) -> str:
        """The breakdown as a plain-text table (a terminal, a log, a docs page)."""
        if not self.rows:
            return f"{self.name}: no trace records"
        total = self.window[1] - self.window[0]
        sources = sorted({r.source for r in self.rows})
        head = [
            f"{self.name}: {len(self.rows)} ranks over {_ms(total)}; communication from "
            + " and ".join(SOURCE_WORDS[s] for s in sources)
        ]
        table = [TEXT_HEADERS] + [text_row(r) for r in self.rows]
        lines = head + columns(table) + [self.straggler_line]
        if self.untimed:
            lines.append(self.untimed_line)
        for op, seq, missing in self.incomplete:
            ranks = ", ".join(str(r) for r in missing)
            lines.append(f"{op} #{seq}: rank(s) {ranks} of its group never entered it")
        return "\n".join(lines)


# which calls had CUDA events (device_time) -> where a rank's communication time came from
SOURCES = {frozenset({True}): "device", frozenset({True, False}): "host+device"}
SOURCE_WORDS = {
    "host": "host records",
    "device": "CUDA events (device time)",
    "host+device": "CUDA events where a call has them, host records elsewhere",
}
TEXT_HEADERS = ["rank", "compute", "comm", "overlapped", "exposed", "waiting", "idle"]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole > 0 else "0%"


def text_row(r: RankTime) -> list[str]:
    return [
        str(r.rank),
        f"{_ms(r.compute)} ({_pct(r.compute, r.total)})",
        f"{_ms(r.comm)} ({_pct(r.comm, r.total)})",
        f"{_ms(r.overlapped)} ({r.overlap_pct:.0f}% of comm)",
        _ms(r.exposed),
        _ms(r.waiting),
        f"{_ms(r.idle)} ({_pct(r.idle, r.total)})",
    ]


def _collectives(comms: list[CommRecord]) -> dict[tuple, dict[int, CommRecord]]:
    """Collective calls matched across ranks: (group, seq, op) -> {rank: record}."""
    out: dict[tuple, dict[int, CommRecord]] = {}
    for r in comms:
        if r.op in P2P_OPS or len(r.group) < 2:
            continue
        out.setdefault((tuple(r.group), r.seq, r.op), {}).setdefault(r.rank, r)
    return out


def breakdown(
    records: list[Record],
    ranks: Iterable[int] | None = None,
    *,
    cell: int | None = None,
    label: str = "",
) -> Breakdown:
    """Split each rank's time over the records' window, and name the straggler (kernel side,
    pure). `ranks` adds rows for ranks without records (all idle); by default the ranks of the
    records and of their calls' groups. `cell` and `label` name it (by default the cell of
    the records, when they all come from one). Example: ``breakdown(lab.trace()).text``."""
    known = {r.rank for r in records}
    for r in records:
        if isinstance(r, CommRecord):
            known |= set(r.group)
    all_ranks = sorted(known | set(ranks or ()))
    if cell is None and len({r.cell for r in records}) == 1:
        cell = records[0].cell  # one cell's records (lab.trace()): name it
    if not records:
        return Breakdown([], None, (0.0, 0.0), cell, label)
    ends = [comm_interval(r)[1] if isinstance(r, CommRecord) else r.end for r in records]
    window = (min(r.start for r in records), max(ends))
    total = window[1] - window[0]
    comms = [r for r in records if isinstance(r, CommRecord)]
    by_rank: dict[int, list[Record]] = {rank: [] for rank in all_ranks}
    for r in records:
        by_rank[r.rank].append(r)
    computing: dict[int, list[Interval]] = {}
    parts = {}
    for rank, mine in by_rank.items():
        spans = union((r.start, r.end) for r in mine if isinstance(r, SpanRecord))
        calls = [r for r in mine if isinstance(r, CommRecord)]
        blocking = union(comm_interval(r) for r in calls if not can_overlap(r))
        hiding = union(comm_interval(r) for r in calls if can_overlap(r))
        computing[rank] = subtract(spans, blocking)
        timed = frozenset(r.device_time is not None for r in calls)
        parts[rank] = (spans, union(blocking + hiding), hiding, SOURCES.get(timed, "host"))
    waits, straggler, incomplete = _waits(comms, computing)
    untimed = sum(
        r.recorded_by == "flight_recorder" and r.device_time is None and r.end <= r.start
        for r in comms
    )
    rows = []
    for rank, (spans, comm, hiding, source) in parts.items():
        overlapped = length(intersect(hiding, computing[rank]))
        rows.append(
            RankTime(
                rank=rank,
                compute=length(computing[rank]),
                comm=length(comm),
                overlapped=overlapped,
                exposed=length(comm) - overlapped,
                waiting=length(subtract(union(waits.get(rank, [])), computing[rank])),
                idle=total - length(union(spans + comm)),
                total=total,
                source=source,
            )
        )
    return Breakdown(rows, straggler, window, cell, label, incomplete, untimed)


def _waits(
    comms: list[CommRecord], computing: dict[int, list[Interval]]
) -> tuple[dict[int, list[Interval]], Straggler | None, list]:
    """Each rank's waiting intervals, the straggler and the collectives some rank never
    entered. A rank waits in a collective from its entry until the last rank entered it (or
    its call ended, if sooner), less the time it computed meanwhile (an async op); waiting in
    several collectives at once (async ops in flight together) counts once."""
    waits: dict[int, list[Interval]] = {}
    spells: dict[tuple[int, int], list[Interval]] = {}  # (waited for, waiter) -> intervals
    last_count: dict[int, int] = {}
    incomplete, entered = [], 0
    peers: dict[int, set[int]] = {}  # the ranks that share a collective with a rank
    for (group, seq, op), calls in _collectives(comms).items():
        missing = tuple(r for r in group if r not in calls)
        if missing:
            incomplete.append((op, seq, missing))
        if len(calls) < 2:
            continue  # no one to wait for it
        entered += 1
        for rank in calls:
            peers.setdefault(rank, set()).update(group)
        last = max(calls.values(), key=lambda c: (c.start, -c.rank))
        last_count[last.rank] = last_count.get(last.rank, 0) + 1
        for rank, c in calls.items():
            until = min(last.start, comm_interval(c)[1])
            if rank != last.rank and until > c.start:
                busy = clip(computing.get(rank, []), c.start, until)
                spell = subtract([(c.start, until)], busy)
                waits.setdefault(rank, []).extend(spell)
                spells.setdefault((last.rank, rank), []).extend(spell)
    # async ops in flight together: a spell of waiting for the same rank counts once
    by: dict[int, dict[int, float]] = {}
    for (late, rank), found in spells.items():
        by.setdefault(late, {})[rank] = length(union(found))
    caused = {late: sum(each.values()) for late, each in by.items()}
    straggler = None
    if caused and max(caused.values()) > 0:
        rank = max(caused, key=lambda r: (caused[r], -r))
        others = {r: by[rank].get(r, 0.0) for r in sorted(peers[rank]) if r != rank}
        straggler = Straggler(rank, caused[rank], others, last_count[rank], entered)
    return waits, straggler, incomplete


METRICS = ("compute", "comm", "overlapped", "exposed", "waiting", "idle")


@dataclass
class Comparison:
    """Two breakdowns side by side: `rows` are (metric, a, b) in seconds, each a mean over
    the ranks, after the window's length; `.text` is the table."""

    a: Breakdown
    b: Breakdown

    @property
    def rows(self) -> list[tuple[str, float, float]]:
        def window(one: Breakdown) -> float:
            return one.window[1] - one.window[0]

        out = [("window", window(self.a), window(self.b))]
        for key in METRICS:
            out.append((key, _mean(self.a, key), _mean(self.b, key)))
        return out

    @property
    def text(self) -> str:
        head = ["", self.a.name, self.b.name, "change"]
        table = [head] + [[k, _ms(x), _ms(y), f"{(y - x) * 1e3:+.1f} ms"] for k, x, y in self.rows]
        table.append(["overlap", f"{_overlap(self.a):.0f}%", f"{_overlap(self.b):.0f}%", ""])
        table.append(["straggler", _who(self.a), _who(self.b), ""])
        title = f"{self.a.name} vs {self.b.name} (mean per rank; window: the whole cell)"
        return "\n".join([title, *columns(table)])


def compare(a: Breakdown, b: Breakdown) -> Comparison:
    """Two cells' breakdowns side by side (kernel side, pure). Example:
    ``compare(breakdown(lab.trace(3), label="sync"), breakdown(lab.trace(4))).text``."""
    return Comparison(a, b)


def _mean(one: Breakdown, key: str) -> float:
    return sum(getattr(r, key) for r in one.rows) / len(one.rows) if one.rows else 0.0


def _overlap(one: Breakdown) -> float:
    comm = sum(r.comm for r in one.rows)
    return 100 * sum(r.overlapped for r in one.rows) / comm if comm > 0 else 0.0


def _who(one: Breakdown) -> str:
    s = one.straggler
    return "none" if s is None else f"rank {s.rank} ({_ms(s.waited)})"
