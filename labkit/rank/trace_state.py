"""What the comm tracer keeps in a rank process, and how one call becomes a record (rank side).

`STATE` holds the records of the last `KEEP_CELLS` cells, the per-group and per-peer call
counts, the op the main thread is inside and the CUDA events not yet resolved. The wrappers
(`dist_tracing`, `funcol_tracing`) build each record with `new_record`, time it on the device
with `cuda_event` / `end_event` and mark with `issued` the moment torch has the call (so
`ddp_tracing` can tell the Flight Recorder's entries they made from those torch issued from
C++); `labkit.rank.trace` is the public face.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from typing import Any

from labkit.wire.records import P2P_OPS, CommRecord, SpanRecord

KEEP_CELLS = 20


class _State:
    def __init__(self) -> None:
        self.enabled = True
        self.rank = 0
        self.cell = 0
        self.records: dict[int, list[CommRecord | SpanRecord]] = {}
        self.order: deque[int] = deque()
        self.seq: dict[tuple[int, ...], int] = {}  # collectives called per group
        self.p2p: dict[tuple[str, int], int] = {}  # ("sent"|"received", peer) -> count
        self.current: CommRecord | None = None
        self.groups: dict[Any, tuple[int, ...]] = {}  # process group -> its global ranks
        self.since = 0.0  # when the main thread started waiting in `current`
        self.main = threading.main_thread().ident
        self.installed = False
        self.inside = False  # the main thread is inside a traced call (nested ones are not)
        self.batch: list[CommRecord] | None = None  # records of the batch_isend_irecv running
        self.waiting: dict[int, tuple[Any, CommRecord]] = {}  # funcol result -> its record
        self.events: list[tuple[CommRecord, Any, Any]] = []  # CUDA events not yet resolved
        # this cell's traced calls: (called, issued, group ranks); a Flight Recorder entry
        # created inside one of them on its group is that call's (labkit.rank.ddp_tracing)
        self.windows: list[tuple[float, float, tuple[int, ...]]] = []
        self.cell_start = 0.0  # time.time() when this cell began
        self.cell_traced = False  # tracing was on when this cell began
        self.switches: list[tuple[float, bool]] = []  # (time.time(), on): `set_enabled` in it
        self.fr_enqueued: Any = None  # the Flight Recorder's per-group counts at cell start
        # the last Flight Recorder entry (record_id) read, per recorder (gloo's, NCCL's)
        self.fr_last: dict[Any, int] = {}
        self.fr_added: dict[tuple[int, ...], int] = {}  # seq numbers given to them this cell


STATE = _State()


def compiling_check() -> Any:
    """torch's `torch.compiler.is_compiling` (a function of no arguments; always False where this
    torch has none). labkit's wrappers ask it first and, while torch.compile traces them, call
    torch's own function at once: the compiled graph then holds the collective as torch would
    capture it, with no graph break of labkit's making (the wrappers' clocks, thread ids and
    records are not traceable). Such collectives run as compiled code: DDP's and the Flight
    Recorder's records still see them, labkit's own wrappers do not."""
    import torch

    check = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return check if check is not None else (lambda: False)


def add_record(rec: CommRecord | SpanRecord) -> None:
    STATE.records.setdefault(STATE.cell, []).append(rec)


def issued(rec: CommRecord, group: tuple[int, ...] | None = None) -> None:
    """torch has the call `rec` made: the Flight Recorder's entries on its group created since
    `rec.start` are this call's, not collectives torch issued on its own."""
    STATE.windows.append((rec.start, time.time(), rec.group if group is None else group))


def tensors_of(obj: Any) -> list[Any]:
    """The tensors in an op's tensor argument: a tensor, a list of them, or a list of P2POps."""
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        out = []
        for item in obj:
            out.extend(tensors_of(getattr(item, "tensor", item)))
        return out
    return []


def group_ranks(group: Any) -> tuple[int, ...]:
    ranks = STATE.groups.get(group)
    if ranks is not None:
        return ranks
    import torch.distributed as dist

    try:
        ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    except Exception:  # a group this rank is not part of, or no group yet
        return ()
    STATE.groups[group] = ranks
    return ranks


def _user_line() -> tuple[str, int | None]:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "torch" not in name and "labkit" not in name or name.startswith("<"):
            return name, frame.f_lineno
        frame = frame.f_back
    return "", None


def new_record(
    op: str, ranks: tuple[int, ...], tensors: list[Any], *, peer: Any = None, **extra: Any
) -> CommRecord:
    first = tensors[0] if tensors else None
    if op in P2P_OPS and isinstance(peer, int):
        # point-to-point calls are numbered per peer and direction ("the 3rd send to rank 1"),
        # so collectives keep the same numbers on every rank of a group
        key = ("sent" if op in ("send", "isend") else "received", peer)
        STATE.p2p[key] = seq = STATE.p2p.get(key, 0) + 1
    else:
        STATE.seq[ranks] = seq = STATE.seq.get(ranks, 0) + 1
    filename, line = _user_line()
    return CommRecord(
        rank=STATE.rank,
        op=op,
        seq=seq,
        group=ranks,
        peer=peer,
        bytes=sum(t.numel() * t.element_size() for t in tensors),
        dtype=str(first.dtype).removeprefix("torch.") if first is not None else "",
        shape=tuple(first.shape) if first is not None else (),
        start=time.time(),
        cell=STATE.cell,
        line=line,
        filename=filename,
        **extra,
    )


def cuda_event(tensors: list[Any]) -> Any:
    """A recorded timing event on the current stream when the op's tensors are on CUDA."""
    if not tensors or not tensors[0].is_cuda:
        return None
    import torch

    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def end_event(rec: CommRecord, start_event: Any) -> None:
    if start_event is not None:
        import torch

        end = torch.cuda.Event(enable_timing=True)
        end.record()
        STATE.events.append((rec, start_event, end))


def resolve_events() -> None:
    """Fill `device_time` of records whose CUDA events have completed."""
    pending = []
    for rec, start, end in STATE.events:
        if end.query():
            rec.device_time = start.elapsed_time(end) / 1e3
        else:
            pending.append((rec, start, end))
    STATE.events = pending[-10_000:]
