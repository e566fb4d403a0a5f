"""Records of every `torch.distributed` call a rank makes (runs on the rank).

`install()` wraps the point-to-point and collective functions of `torch.distributed` in place,
so user code keeps calling the real API (`dist.all_reduce(x)`) and each call leaves a
`labkit.records.CommRecord`: op, per-group sequence number, group ranks, peer, bytes, dtype and
shape, start and end, and the cell line that made it. Async calls (`async_op=True`, `isend`,
`irecv`, `batch_isend_irecv`) are completed when their work's `wait()` returns.

`current()` is the op the main thread is inside right now; the worker's heartbeat reports it so
the kernel can say "rank 1 inside all_reduce #17 on group [0, 1] since 4.2 s, line 3" and spot
deadlocks. `span(name)` marks compute regions for the timeline.

Times are this rank's `time.time()`; the kernel shifts them by the clock offset it measured.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from labkit.records import CommRecord, SpanRecord

# op name -> (argument holding the tensor(s), argument naming the peer or root)
OPS: dict[str, tuple[str | None, str | None]] = {
    "send": ("tensor", "dst"),
    "recv": ("tensor", "src"),
    "isend": ("tensor", "dst"),
    "irecv": ("tensor", "src"),
    "broadcast": ("tensor", "src"),
    "scatter": ("tensor", "src"),
    "gather": ("tensor", "dst"),
    "reduce": ("tensor", "dst"),
    "all_reduce": ("tensor", None),
    "all_gather": ("tensor_list", None),  # bytes: the whole gathered buffer, as nccl-tests
    "all_gather_into_tensor": ("output_tensor", None),
    "reduce_scatter": ("input_list", None),
    "reduce_scatter_tensor": ("input", None),
    "all_to_all": ("input_tensor_list", None),
    "all_to_all_single": ("input", None),
    "barrier": (None, None),
    "batch_isend_irecv": ("p2p_op_list", None),
}
ASYNC_ALWAYS = {"isend", "irecv", "batch_isend_irecv"}
KEEP_CELLS = 20


class _State:
    def __init__(self) -> None:
        self.enabled = True
        self.rank = 0
        self.cell = 0
        self.records: dict[int, list[CommRecord | SpanRecord]] = {}
        self.order: deque[int] = deque()
        self.seq: dict[tuple[int, ...], int] = {}
        self.current: CommRecord | None = None
        self.main = threading.main_thread().ident
        self.installed = False


STATE = _State()


def begin_cell(cell: int, rank: int) -> None:
    STATE.cell, STATE.rank = cell, rank
    STATE.records[cell] = []
    STATE.order.append(cell)
    while len(STATE.order) > KEEP_CELLS:
        STATE.records.pop(STATE.order.popleft(), None)


def records(cell: int | None = None) -> list[CommRecord | SpanRecord]:
    """Records of one cell (default: the last one)."""
    if cell is None:
        cell = STATE.order[-1] if STATE.order else 0
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
        "since": rec.start,
        "line": rec.line,
        "shape": rec.shape,
        "dtype": rec.dtype,
    }


def _record(rec: CommRecord | SpanRecord) -> None:
    STATE.records.setdefault(STATE.cell, []).append(rec)


def _tensors(obj: Any) -> list[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        out = []
        for item in obj:
            out.extend(_tensors(getattr(item, "tensor", item)))
        return out
    return []


def _group_ranks(group: Any) -> tuple[int, ...]:
    import torch.distributed as dist

    try:
        return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    except Exception:  # a group this rank is not part of, or no group yet
        return ()


def _user_line() -> tuple[str, int | None]:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "torch" not in name and "labkit" not in name or name.startswith("<"):
            return name, frame.f_lineno
        frame = frame.f_back
    return "", None


def _wrap(op: str, fn: Any) -> Any:
    sig = inspect.signature(fn)
    tensor_arg, peer_arg = OPS[op]

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        if not STATE.enabled or threading.get_ident() != STATE.main:
            return fn(*args, **kwargs)
        bound = sig.bind_partial(*args, **kwargs).arguments
        group = bound.get("group")
        if op == "batch_isend_irecv":
            ops = bound.get("p2p_op_list") or []
            group = getattr(ops[0], "group", None) if ops else None
        ranks = _group_ranks(group)
        tensors = _tensors(bound.get(tensor_arg)) if tensor_arg else []
        first = tensors[0] if tensors else None
        peer = bound.get(peer_arg) if peer_arg else None
        if peer is None and peer_arg and bound.get("group_" + peer_arg) is not None:
            peer = ranks[bound["group_" + peer_arg]] if ranks else None
        STATE.seq[ranks] = seq = STATE.seq.get(ranks, 0) + 1
        filename, line = _user_line()
        reduce_op = bound.get("op")
        rec = CommRecord(
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
            async_op=op in ASYNC_ALWAYS or bool(bound.get("async_op")),
            reduce_op=str(reduce_op).rsplit(".", 1)[-1] if reduce_op is not None else None,
        )
        _record(rec)
        if rec.async_op:
            work = fn(*args, **kwargs)
            return _complete_on_wait(work, rec)
        STATE.current = rec
        try:
            return fn(*args, **kwargs)
        finally:
            rec.end = time.time()
            STATE.current = None

    traced.__labkit_traced__ = fn  # type: ignore[attr-defined]
    return traced


class TracedWork:
    """Wraps an async op's Work so that `wait()` stamps the record's completion time."""

    def __init__(self, work: Any, rec: CommRecord):
        self._work = work
        self._rec = rec

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        STATE.current = self._rec
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            STATE.current = None
            self._rec.end = max(self._rec.end, time.time())

    def is_completed(self) -> bool:
        done = self._work.is_completed()
        if done and not self._rec.end:
            self._rec.end = time.time()
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _complete_on_wait(work: Any, rec: CommRecord) -> Any:
    if work is None:
        rec.end = time.time()
        return work
    if isinstance(work, list):
        return [TracedWork(w, rec) for w in work]
    return TracedWork(work, rec)


def install() -> None:
    """Wrap torch.distributed's p2p and collective functions (once per process)."""
    import torch.distributed as dist

    if STATE.installed:
        return
    for op in OPS:
        fn = getattr(dist, op, None)
        if fn is not None and not hasattr(fn, "__labkit_traced__"):
            setattr(dist, op, _wrap(op, fn))
    STATE.installed = True


def set_enabled(on: bool) -> None:
    STATE.enabled = on


@contextmanager
def span(name: str) -> Iterator[None]:
    """Mark a compute region on this rank for the timeline: `with labkit.span("forward"):`."""
    start = time.time()
    try:
        yield
    finally:
        _record(
            SpanRecord(rank=STATE.rank, name=name, start=start, end=time.time(), cell=STATE.cell)
        )
