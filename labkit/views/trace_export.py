"""A lab's trace as Chrome Trace Event JSON, for Perfetto, chrome://tracing and HTA (kernel side).

`save_trace(lab_or_records, path)` writes what `show_timeline` draws (the same records, on the
kernel's clock, so ranks line up) as a Chrome Trace Event file:

- one process per rank (`pid` = rank, named "rank N"), its threads being tracks: the host
  track holds the spans (`labkit.span`) and the `torch.distributed` calls nested in them; calls
  that overlap on a rank (async ops in flight together) go to further host tracks, since a
  track's slices must nest; on CUDA, each call's device time (CUDA events) is a slice on a
  "device" track, placed at the host issue time (the events measure a duration, not a start);
- every call and span is a complete event ("X", `ts` and `dur` in microseconds since the first
  record; `otherData.t0_unix_s` is that instant) with op, bytes, group, seq and peer in `args`;
- flow events ("s" then "f", bound to the enclosing slice) join the calls of one collective
  (same group and sequence number): from the start of the call of the rank that called it
  last, the one the others waited for, to the end of each other rank's call; and from each
  send's start to the end of its receive (the n-th send from A to B with the n-th receive on B
  from A).

`per_rank=True` writes one file per rank, each with a top-level `distributedInfo` (backend,
rank, world_size and the groups seen) as torch.profiler writes it, which is what Holistic
Trace Analysis reads to know a file's rank. Those files carry no flows (a flow needs both ranks).
A path ending in `.gz` is written gzip-compressed (Perfetto and HTA read it). The operators of a
cell run under torch.profiler (`labkit.kernel.inspection.profiling`) join their rank's process.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from labkit.views._common import Record, is_lab, records_from
from labkit.wire.records import P2P_OPS, CommRecord, SpanRecord

__all__ = ["chrome_trace", "save_trace", "trace_events"]

DEVICE_TID = 1000  # device tracks start here, so host tracks (0, 1, ...) come first
SENDS = frozenset({"send", "isend"})
RECVS = frozenset({"recv", "irecv"})


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)  # microseconds, kept to the nanosecond


class _Track:
    """The slices of one track, placed so that they nest (a call may sit inside a span only)."""

    def __init__(self) -> None:
        self.open: list[tuple[float, bool]] = []  # (end, is_span) of the slices still open

    def fits(self, start: float, end: float, is_span: bool) -> bool:
        while self.open and self.open[-1][0] <= start:
            self.open.pop()
        if not self.open:
            return True
        top_end, top_is_span = self.open[-1]
        return top_is_span and end <= top_end

    def add(self, end: float, is_span: bool) -> None:
        self.open.append((end, is_span))


def _place(slices: list[tuple[float, float, bool, Any]]) -> dict[int, int]:
    """Track index per slice (keyed by id of its payload): the first track it fits on."""
    tracks: list[_Track] = []
    where: dict[int, int] = {}
    # sorted by start, longer first (a parent before its children), spans before calls
    for start, end, is_span, payload in sorted(slices, key=lambda s: (s[0], -s[1], not s[2])):
        i = next((k for k, t in enumerate(tracks) if t.fits(start, end, is_span)), len(tracks))
        if i == len(tracks):
            tracks.append(_Track())
        tracks[i].add(end, is_span)
        where[id(payload)] = i
    return where


def _args(rec: CommRecord) -> dict[str, Any]:
    args: dict[str, Any] = {
        "op": rec.op,
        "bytes": rec.bytes,
        "group": list(rec.group),
        "seq": rec.seq,
    }
    if rec.peer is not None:
        args["peer"] = rec.peer
    if rec.dtype:
        args["dtype"] = rec.dtype
        args["shape"] = list(rec.shape)
    if rec.reduce_op:
        args["reduce_op"] = rec.reduce_op
    args["async_op"] = rec.async_op
    if rec.device_time is not None:
        args["device_us"] = _us(rec.device_time)
    args["cell"] = rec.cell
    if rec.line is not None:
        args["line"] = rec.line
        args["file"] = rec.filename
    return args


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "ts": 0, "args": args}


def trace_events(
    records: list[Record], *, flows: bool = True, t0: float | None = None
) -> list[dict[str, Any]]:
    """The Chrome Trace Event list of `records` (metadata, slices, then flows). Pure.

    Times are microseconds since `t0` (kernel clock, seconds; default: the first record).
    """
    if not records:
        return []
    if t0 is None:
        t0 = min(r.start for r in records)
    events: list[dict[str, Any]] = []
    where: dict[int, tuple[int, int, float, float]] = {}  # id(record) -> pid, tid, ts, dur
    for rank in sorted({r.rank for r in records}):
        mine = [r for r in records if r.rank == rank]
        host = [(_us(r.start - t0), _us(r.end - t0), isinstance(r, SpanRecord), r) for r in mine]
        on_host = _place(host)
        device = [
            (_us(r.start - t0), _us(r.start - t0 + r.device_time), False, r)
            for r in mine
            if isinstance(r, CommRecord) and r.device_time is not None
        ]
        on_device = _place(device)
        events.append(_meta("process_name", rank, 0, {"name": f"rank {rank}"}))
        events.append(_meta("process_sort_index", rank, 0, {"sort_index": rank}))
        for i in sorted(set(on_host.values())):
            name = "host" if i == 0 else f"host: overlapping calls {i}"
            events.append(_meta("thread_name", rank, i, {"name": name}))
            events.append(_meta("thread_sort_index", rank, i, {"sort_index": i}))
        for i in sorted(set(on_device.values())):
            name = "device (CUDA events)" + (f" {i + 1}" if i else "")
            events.append(_meta("thread_name", rank, DEVICE_TID + i, {"name": name}))
            events.append(
                _meta("thread_sort_index", rank, DEVICE_TID + i, {"sort_index": 1000 + i})
            )
        for ts, end, is_span, rec in host:
            tid = on_host[id(rec)]
            where[id(rec)] = (rank, tid, ts, end - ts)
            event = {"ph": "X", "pid": rank, "tid": tid, "ts": ts, "dur": round(end - ts, 3)}
            if is_span:
                event.update(name=rec.name, cat="span", args={"cell": rec.cell})
            else:
                cat = "p2p" if rec.op in P2P_OPS else "collective"
                event.update(name=rec.op, cat=cat, args=_args(rec))
            events.append(event)
        for ts, end, _, rec in device:
            events.append(
                {
                    "ph": "X",
                    "pid": rank,
                    "tid": DEVICE_TID + on_device[id(rec)],
                    "ts": ts,
                    "dur": round(end - ts, 3),
                    "name": rec.op,
                    "cat": "device",
                    "args": _args(rec),
                }
            )
    if flows:
        comms = [r for r in records if isinstance(r, CommRecord)]
        for number, (cat, src, dst) in enumerate(flow_pairs(comms), start=1):
            for ph, rec in (("s", src), ("f", dst)):
                pid, tid, ts, dur = where[id(rec)]
                # from the source's start to the target's end, a nanosecond inside each slice
                # (which the flow event binds to): the last caller let the others return
                step = min(0.001, dur / 2)
                event = {
                    "ph": ph,
                    "id": number,
                    "name": src.op if cat == "collective" else "send -> recv",
                    "cat": cat,
                    "pid": pid,
                    "tid": tid,
                    "ts": round(ts + step if ph == "s" else ts + dur - step, 3),
                }
                if ph == "f":
                    event["bp"] = "e"
                events.append(event)
    return events


def flow_pairs(comms: list[CommRecord]) -> list[tuple[str, CommRecord, CommRecord]]:
    """(category, from, to) for each arrow: a collective's last caller to each other caller
    (same cell, group and seq, ranks differing), and each send to the receive that took it."""
    pairs: list[tuple[str, CommRecord, CommRecord]] = []
    calls: dict[tuple[int, tuple[int, ...], int], list[CommRecord]] = {}
    for rec in comms:
        if rec.op not in P2P_OPS and len(rec.group) > 1:  # a restart numbers groups anew
            calls.setdefault((rec.cell, rec.group, rec.seq), []).append(rec)
    for recs in calls.values():
        by_rank = {r.rank: r for r in recs}  # a rank calls a collective slot once
        if len(by_rank) < 2:
            continue
        last = max(by_rank.values(), key=lambda r: (r.start, r.rank))
        pairs += [("collective", last, r) for rank, r in sorted(by_rank.items()) if r is not last]
    recvs = {(r.peer, r.rank, r.seq): r for r in comms if r.op in RECVS and isinstance(r.peer, int)}
    for send in comms:
        if send.op in SENDS and isinstance(send.peer, int):
            recv = recvs.get((send.rank, send.peer, send.seq))
            if recv is not None:
                pairs.append(("p2p", send, recv))
    return pairs


def _groups(records: Iterable[Record]) -> list[tuple[int, ...]]:
    return sorted({r.group for r in records if isinstance(r, CommRecord) and r.group})


def _distributed_info(records: list[Record], rank: int, world_size: int, backend: Any) -> dict:
    groups = _groups(records)
    info: dict[str, Any] = {"rank": rank, "world_size": world_size}
    if backend:
        info["backend"] = backend
    info["pg_count"] = len(groups)
    info["pg_config"] = [
        {
            "pg_name": str(i),
            "pg_desc": "default_pg" if g == tuple(range(world_size)) else "",
            "backend_config": backend or "",
            "pg_size": len(g),
            "ranks": list(g),
        }
        for i, g in enumerate(groups)
    ]
    return info


def chrome_trace(
    records: list[Record],
    *,
    rank: int | None = None,
    world_size: int | None = None,
    backend: str | None = None,
    profile: dict[int, Any] | None = None,
) -> dict[str, Any]:
    """The trace document: every rank with flows, or (`rank` given) that rank's file for HTA.

    `profile` is {rank: its torch.profiler events} (`labkit.kernel.inspection.profiling.Profile`),
    merged under each rank's process.
    """
    from labkit import __version__
    from labkit.kernel.inspection.profiling import profile_start, profiler_events

    profile = profile or {}
    if world_size is None:  # the highest rank seen, in a record or in a group
        seen = {r.rank for r in records}.union(*(g for g in _groups(records)), profile)
        world_size = 1 + max(seen)
    starts = [r.start for r in records] + [profile_start(profile) or float("inf")]
    t0 = min(starts)
    if t0 == float("inf"):
        raise ValueError("nothing to save: no trace records and no profiled operators")
    other = {"labkit_version": __version__, "t0_unix_s": t0, "world_size": world_size}
    if backend:
        other["backend"] = backend
    if rank is None:
        events = trace_events(records, t0=t0)
        events += profiler_events(profile, t0)
        doc = {"traceEvents": events}
    else:
        # the same origin in every rank's file, so HTA lines the ranks up
        events = trace_events([r for r in records if r.rank == rank], flows=False, t0=t0)
        events += profiler_events({r: p for r, p in profile.items() if r == rank}, t0)
        doc = {
            "schemaVersion": 1,
            "distributedInfo": _distributed_info(records, rank, world_size, backend),
            "traceEvents": events,
        }
    doc["displayTimeUnit"] = "ms"
    doc["otherData"] = other
    return doc


def _write(doc: dict[str, Any], path: Path) -> None:
    # json's default ", " and ": ": HTA 0.5 finds a file's rank with the pattern '"rank":\s+N'
    text = json.dumps(doc)
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            fh.write(text)
    else:
        path.write_text(text, encoding="utf-8")


def _folder_must_exist(path: Path) -> None:
    folder = path.parent
    if not folder.is_dir():
        raise FileNotFoundError(
            f"cannot write the trace to {str(path)!r}: the folder {str(folder)!r} does not exist "
            "(create it first)"
        )


def _rank_paths(path: str, ranks: list[int]) -> dict[int, Path]:
    if "{rank}" in path:
        return {r: Path(path.replace("{rank}", str(r))) for r in ranks}
    if Path(path).is_dir():
        return {r: Path(path) / f"rank{r}.json" for r in ranks}
    raise ValueError(
        f"per_rank=True needs an existing folder (each rank's file is FOLDER/rankN.json) or a "
        f"path with {{rank}} in it, such as 'traces/rank{{rank}}.json'; got {path!r}"
    )


def _profile_of(lab: Any, records: list[Record], cell: int | None) -> dict[int, Any] | None:
    """The lab's last torch.profiler profile when it is of the cell being saved: `cell`, or
    the traced cell, or (no records in the last cell) the profiled one."""
    from labkit.kernel.inspection.profiling import last_profile

    kept = last_profile(lab)
    if kept is None:
        return None
    profiled, events = kept
    if cell is None and records:
        cell = records[0].cell
    return events if cell is None or cell == profiled else None


def _records(lab_or_records: Any, cell: int | None) -> tuple[list[Record], Any]:
    if is_lab(lab_or_records):
        records, lab = records_from(lab_or_records, cell)
        if not records and _profile_of(lab, records, cell) is None:
            which = f"cell {cell}" if cell is not None else "the last cell"
            raise ValueError(
                f"nothing to save: {which} left no trace records (no torch.distributed call, "
                "no labkit.span, no labkit.profile). Run a cell that communicates first, or "
                "pass cell=N for an earlier one (the ranks keep the last 20)."
            )
        return records, lab
    if isinstance(lab_or_records, (str, bytes, dict)) or not isinstance(lab_or_records, Iterable):
        raise TypeError(
            "save_trace() takes a lab or a list of trace records (CommRecord, SpanRecord or "
            f"their dicts, as lab.trace() returns), not {type(lab_or_records).__name__}"
        )
    items = list(lab_or_records)
    for i, item in enumerate(items):
        if not isinstance(item, CommRecord | SpanRecord | dict):
            raise TypeError(
                f"trace record {i} is a {type(item).__name__}; expected a CommRecord, a "
                "SpanRecord or the dict of one"
            )
    try:
        records, _ = records_from(items, cell)
    except TypeError as err:  # a dict with missing or unknown fields
        raise ValueError(
            f"a trace record's dict is not a CommRecord or SpanRecord: {err}"
        ) from None
    if not records:
        raise ValueError(
            "nothing to save: no trace records" + (f" of cell {cell}" if cell is not None else "")
        )
    return records, None


def save_trace(
    lab_or_records: Any, path: str | os.PathLike[str], *, cell: int | None = None,
    per_rank: bool = False,
) -> str | list[str]:  # fmt: skip
    """Write a trace as Chrome Trace Event JSON; return the path(s) written (kernel side).

    `lab_or_records` is a lab (its `trace(cell)`: the last cell by default) or a list of
    CommRecord/SpanRecord or their dicts (`cell` filters them). Open the file in Perfetto
    (ui.perfetto.dev) or chrome://tracing. With `per_rank=True`, `path` is an existing folder
    (files `rank0.json`, `rank1.json`, ...) or a pattern with `{rank}` (`"t/rank{rank}.json"`),
    and each file has the `distributedInfo` Holistic Trace Analysis needs. A `.gz` path is
    compressed. The folder must exist; files already there are replaced. After
    `labkit.profile(lab, code)` (or a `%%ranks --profile` cell), saving that cell also writes
    the torch.profiler operators of each rank under its process. Example:
    ``labkit.save_trace(lab, "trace.json")``, then open the file at ui.perfetto.dev.
    """
    records, lab = _records(lab_or_records, cell)
    path = os.path.expanduser(os.fspath(path))
    world_size = backend = profile = None
    if lab is not None:
        world_size = getattr(lab, "world_size", None) or None
        backend = getattr(lab, "backend", None)
        profile = _profile_of(lab, records, cell)
    meta = {"world_size": world_size, "backend": backend, "profile": profile}
    if not per_rank:
        target = Path(path)
        _folder_must_exist(target)
        _write(chrome_trace(records, **meta), target)
        return str(target)
    targets = _rank_paths(path, sorted({r.rank for r in records} | set(profile or {})))
    for target in targets.values():
        _folder_must_exist(target)
    written = []
    for rank, target in targets.items():
        doc = chrome_trace(records, rank=rank, **meta)
        _write(doc, target)
        written.append(str(target))
    return written
