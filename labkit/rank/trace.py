"""Records of every `torch.distributed` call a rank makes (runs on the rank).

`install()` wraps the point-to-point and collective functions of `torch.distributed` in place,
so user code keeps calling the real API (`dist.all_reduce(x)`) and each call leaves a
`labkit.wire.records.CommRecord`: op, per-group sequence number, group ranks, peer, bytes, dtype and
shape, start and end, and the cell line that made it. Async calls (`async_op=True`, `isend`,
`irecv`) are completed when their work's `wait()` returns or its future completes.

Communication that does not go through those functions is caught where it starts (each way in
its own module: `dist_tracing`, `ddp_tracing`, `funcol_tracing`; the state they share and the
record they build is `trace_state`):

- the functions are replaced both in `torch.distributed` and in `distributed_c10d`, so code that
  imported them from there, `P2POp(dist.isend, ...)` (which checks identity) and
  `batch_isend_irecv` (which calls each op's function) all reach the wrapper; a batch leaves one
  `isend`/`irecv` record per op, as torch.distributed.pipelining issues them;
- DDP's reducer calls the process group from C++ (its bucket all_reduces, its start-up
  broadcast): labkit leaves DDP untouched and, at the end of each cell (`end_cell`), turns the
  entries torch's Flight Recorder made for collectives no traced call issued into records
  marked `recorded_by="flight_recorder"`, issue time as start, no end measured on gloo
  (`ddp_tracing`);
- DTensor communicates through functional collectives (`_functional_collectives.all_reduce`,
  `all_gather_single`, `reduce_scatter_single`, `all_to_all_single`, ...): those are wrapped
  when that module is imported (it costs 65 ms, so it is not imported for you), and an op
  completes when `wait_tensor` is called on its result.

On CUDA each record also gets `device_time` from a pair of CUDA events on the current stream.

`current()` is the op the main thread is inside right now; the worker's heartbeat reports it so
the kernel can say "rank 1 inside all_reduce #17 on group [0, 1] since 4.2 s, line 3" and spot
deadlocks. `span(name)` marks compute regions for the timeline.

Times are this rank's `time.time()`; the kernel shifts them by the clock offset it measured.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from labkit.rank import ddp_tracing, dist_tracing, funcol_tracing
from labkit.rank.trace_state import KEEP_CELLS, STATE, add_record, resolve_events
from labkit.wire.records import CommRecord, SpanRecord

__all__ = [
    "begin_cell",
    "current",
    "end_cell",
    "install",
    "progress",
    "records",
    "set_enabled",
    "span",
]


def install() -> None:
    """Wrap torch.distributed's p2p and collective functions (once per process)."""
    if STATE.installed:
        return
    dist_tracing.install()
    funcol_tracing.install()
    STATE.installed = True


def begin_cell(cell: int, rank: int) -> None:
    STATE.cell, STATE.rank = cell, rank
    STATE.records[cell] = []
    STATE.waiting.clear()
    STATE.groups.clear()  # a group may have been destroyed and another made since
    STATE.order.append(cell)
    while len(STATE.order) > KEEP_CELLS:
        STATE.records.pop(STATE.order.popleft(), None)
    ddp_tracing.begin()


def end_cell() -> None:
    """The cell's code has returned: record the collectives torch issued from C++ (ddp_tracing)."""
    try:
        ddp_tracing.collect()
    except Exception as exc:  # noqa: BLE001 - the trace may miss them; the cell's result stands
        import sys

        print(
            f"labkit: the Flight Recorder's collectives were not recorded: {exc!r}", file=sys.stderr
        )


def records(cell: int | None = None) -> list[CommRecord | SpanRecord]:
    """Records of one cell (default: the last one)."""
    if cell is None:
        cell = STATE.order[-1] if STATE.order else 0
    resolve_events()
    return list(STATE.records.get(cell, []))


def current() -> dict[str, Any] | None:
    rec = STATE.current
    if rec is None:
        return None
    return {
        "op": rec.op,
        "seq": rec.seq,
        "group": rec.group,
        "peer": rec.peer,
        "since": STATE.since,  # an async op: since its wait() began, not since it was issued
        "line": rec.line,
        "shape": rec.shape,
        "dtype": rec.dtype,
    }


def progress() -> dict[str, Any]:
    """How far this rank got: collectives per group, p2p messages per peer (for the watchdog)."""
    for _ in range(3):  # read from the heartbeat thread while the main thread may add keys
        try:
            added = STATE.fr_added  # this cell's, numbered at its end: not traced calls
            return {
                "seq": {g: n - added.get(g, 0) for g, n in STATE.seq.items()},
                "sent": {peer: n for (kind, peer), n in STATE.p2p.items() if kind == "sent"},
                "received": {
                    peer: n for (kind, peer), n in STATE.p2p.items() if kind == "received"
                },
            }
        except RuntimeError:
            continue
    return {}


def set_enabled(on: bool) -> None:
    STATE.enabled = on
    STATE.switches.append((time.time(), on))  # collectives torch ran while off stay unrecorded


@contextmanager
def span(name: str) -> Iterator[None]:
    """Mark a compute region on this rank for the timeline (rank side: in a `%%ranks` cell or
    a function given to `lab.run`; `show_timeline` and `save_trace` draw it). Example::

        with labkit.span("forward"):
            loss = model(x).sum()
    """
    start = time.time()
    try:
        yield
    finally:
        add_record(
            SpanRecord(rank=STATE.rank, name=name, start=start, end=time.time(), cell=STATE.cell)
        )
