"""Records of every `torch.distributed` call a rank makes (runs on the rank).

`install()` wraps the point-to-point and collective functions of `torch.distributed` in place,
so user code keeps calling the real API (`dist.all_reduce(x)`) and each call leaves a
`labkit.wire.records.CommRecord`: op, per-group sequence number, group ranks, peer, bytes, dtype and
shape, start and end, and the cell line that made it. Async calls (`async_op=True`, `isend`,
`irecv`) are completed when their work's `wait()` returns or its future completes.

Communication that does not go through those functions is caught where it starts:

- the functions are replaced both in `torch.distributed` and in `distributed_c10d`, so code that
  imported them from there, `P2POp(dist.isend, ...)` (which checks identity) and
  `batch_isend_irecv` (which calls each op's function) all reach the wrapper; a batch leaves one
  `isend`/`irecv` record per op, as torch.distributed.pipelining issues them;
- DDP's reducer calls the process group from C++, so at a DDP module's first forward, when no
  comm hook is registered, labkit registers `default_hooks.allreduce_hook`: the same average
  (divide by the group size, then sum), issued through `dist.all_reduce`, one record per bucket;
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

import functools
import importlib.abc
import inspect
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from labkit.wire.records import P2P_OPS, CommRecord, SpanRecord

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
    "all_gather_single": ("output_tensor", None),  # torch 2.13's name; FSDP2 calls it
    "reduce_scatter": ("input_list", None),
    "reduce_scatter_tensor": ("input", None),
    "reduce_scatter_single": ("input", None),
    "all_to_all": ("input_tensor_list", None),
    "all_to_all_single": ("input", None),
    "barrier": (None, None),
    "batch_isend_irecv": ("p2p_op_list", None),
}
ASYNC_ALWAYS = {"isend", "irecv", "batch_isend_irecv"}
KEEP_CELLS = 20
FUNCOL = "torch.distributed._functional_collectives"
# functional collective -> (op name in records, bytes are the gathered output)
FUNCOL_OPS: dict[str, tuple[str, bool]] = {
    "broadcast": ("broadcast", False),
    "all_reduce": ("all_reduce", False),
    "all_reduce_coalesced": ("all_reduce_coalesced", False),
    "all_gather_single": ("all_gather_into_tensor", True),
    "all_gather_single_autograd": ("all_gather_into_tensor", True),
    "all_gather_single_coalesced": ("all_gather_into_tensor", True),
    "reduce_scatter_single": ("reduce_scatter_tensor", False),
    "reduce_scatter_single_autograd": ("reduce_scatter_tensor", False),
    "reduce_scatter_single_coalesced": ("reduce_scatter_tensor", False),
    "all_to_all_single": ("all_to_all_single", False),
    "all_to_all_single_autograd": ("all_to_all_single", False),
}


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


STATE = _State()


def begin_cell(cell: int, rank: int) -> None:
    STATE.cell, STATE.rank = cell, rank
    STATE.records[cell] = []
    STATE.waiting.clear()
    STATE.groups.clear()  # a group may have been destroyed and another made since
    STATE.order.append(cell)
    while len(STATE.order) > KEEP_CELLS:
        STATE.records.pop(STATE.order.popleft(), None)


def records(cell: int | None = None) -> list[CommRecord | SpanRecord]:
    """Records of one cell (default: the last one)."""
    if cell is None:
        cell = STATE.order[-1] if STATE.order else 0
    _resolve_events()
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
            return {
                "seq": dict(STATE.seq),
                "sent": {peer: n for (kind, peer), n in STATE.p2p.items() if kind == "sent"},
                "received": {
                    peer: n for (kind, peer), n in STATE.p2p.items() if kind == "received"
                },
            }
        except RuntimeError:
            continue
    return {}


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


def _new_record(
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


def _cuda_event(tensors: list[Any]) -> Any:
    """A recorded timing event on the current stream when the op's tensors are on CUDA."""
    if not tensors or not tensors[0].is_cuda:
        return None
    import torch

    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _end_event(rec: CommRecord, start_event: Any) -> None:
    if start_event is not None:
        import torch

        end = torch.cuda.Event(enable_timing=True)
        end.record()
        STATE.events.append((rec, start_event, end))


def _resolve_events() -> None:
    """Fill `device_time` of records whose CUDA events have completed."""
    pending = []
    for rec, start, end in STATE.events:
        if end.query():
            rec.device_time = start.elapsed_time(end) / 1e3
        else:
            pending.append((rec, start, end))
    STATE.events = pending[-10_000:]


def _wrap(op: str, fn: Any) -> Any:
    sig = inspect.signature(fn)
    tensor_arg, peer_arg = OPS[op]
    default_op = sig.parameters["op"].default if "op" in sig.parameters else None
    names = list(sig.parameters)  # binding by position is ~10x cheaper than sig.bind_partial

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        if not STATE.enabled:
            return fn(*args, **kwargs)
        main = threading.get_ident() == STATE.main  # DDP's hooks may run on autograd threads
        if main and STATE.inside:
            return fn(*args, **kwargs)
        bound = dict(zip(names, args))
        bound.update(kwargs)
        if op == "batch_isend_irecv":
            return _batch(fn, args, kwargs, main)
        ranks = _group_ranks(bound.get("group"))
        tensors = _tensors(bound.get(tensor_arg)) if tensor_arg else []
        peer = bound.get(peer_arg) if peer_arg else None
        if peer is None and peer_arg and bound.get("group_" + peer_arg) is not None:
            peer = ranks[bound["group_" + peer_arg]] if ranks else None
        reduce_op = bound.get("op", default_op)
        rec = _new_record(
            op,
            ranks,
            tensors,
            peer=peer,
            async_op=op in ASYNC_ALWAYS or bool(bound.get("async_op")),
            reduce_op=str(reduce_op).rsplit(".", 1)[-1] if reduce_op is not None else None,
        )
        _record(rec)
        if STATE.batch is not None and main:
            STATE.batch.append(rec)
        event = _cuda_event(tensors)
        if rec.async_op:
            work = fn(*args, **kwargs)
            rec.end = time.time()  # issued; completion moves it later
            return _complete_on_wait(work, [rec], event)
        if main:
            STATE.current, STATE.since, STATE.inside = rec, rec.start, True
        try:
            return fn(*args, **kwargs)
        finally:
            rec.end = time.time()
            _end_event(rec, event)
            if main:
                STATE.current, STATE.inside = None, False

    traced.__labkit_traced__ = fn  # type: ignore[attr-defined]
    return traced


def _batch(fn: Any, args: Any, kwargs: Any, main: bool) -> Any:
    """batch_isend_irecv: each P2POp's isend/irecv records itself; the batch's works (one per
    op, or one for a coalesced batch on NCCL) complete all of them."""
    if not main:
        return fn(*args, **kwargs)
    STATE.batch = batch = []
    try:
        works = fn(*args, **kwargs)
    finally:
        STATE.batch = None
    if works and not any(isinstance(w, TracedWork) for w in works):  # coalesced
        return [TracedWork(w, batch, None) for w in works]
    return works


class TracedWork:
    """Wraps an async op's Work so that its completion stamps the records' end time."""

    def __init__(self, work: Any, recs: list[CommRecord], event: Any):
        self._work = work
        self._recs = recs
        self._event = event
        self._done = False

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            now = time.time()
            for rec in self._recs:
                rec.end = max(rec.end, now)
                _end_event(rec, self._event)

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        main = threading.get_ident() == STATE.main
        if main:
            STATE.current, STATE.since = (self._recs[0] if self._recs else None), time.time()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            if main:
                STATE.current = None
            self._finish()

    def is_completed(self) -> bool:
        done = self._work.is_completed()
        if done:
            self._finish()
        return done

    def get_future(self) -> Any:
        fut = self._work.get_future()
        fut.add_done_callback(lambda _: self._finish())
        return fut

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _complete_on_wait(work: Any, recs: list[CommRecord], event: Any = None) -> Any:
    if work is None:
        for rec in recs:
            _end_event(rec, event)
        return work
    if isinstance(work, list):
        return [TracedWork(w, recs, event) for w in work]
    return TracedWork(work, recs, event)


# -- functional collectives (DTensor) --------------------------------------------------------
def _funcol_ranks(funcol: Any, group: Any) -> tuple[int, ...]:
    import torch.distributed as dist

    try:
        resolved = funcol._resolve_group(group)
        if not isinstance(resolved, dist.ProcessGroup):
            resolved = dist.distributed_c10d._resolve_process_group(resolved)
        return tuple(dist.get_process_group_ranks(resolved))
    except Exception:  # a traced (compiled) group, or one this rank cannot resolve
        return ()


def _wrap_funcol(funcol: Any, name: str, fn: Any) -> Any:
    op, gathered = FUNCOL_OPS[name]
    sig = inspect.signature(fn)
    first_arg = next(iter(sig.parameters))

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        if not STATE.enabled or STATE.inside or threading.get_ident() != STATE.main:
            return fn(*args, **kwargs)
        bound = sig.bind_partial(*args, **kwargs).arguments
        ranks = _funcol_ranks(funcol, bound.get("group"))
        tensors = _tensors(bound.get(first_arg))
        reduce_op = bound.get("reduceOp")
        rec = _new_record(
            op,
            ranks,
            tensors,
            peer=bound.get("src"),
            async_op=True,
            reduce_op=str(reduce_op).upper() if reduce_op is not None else None,
        )
        if gathered:
            rec.bytes *= max(len(ranks), 1)
        _record(rec)
        event = _cuda_event(tensors)
        STATE.inside = True
        try:
            out = fn(*args, **kwargs)
        finally:
            STATE.inside = False
            rec.end = time.time()
        for res in out if isinstance(out, list) else [out]:
            elem = getattr(res, "elem", None)  # an AsyncCollectiveTensor: waited on later
            if elem is not None and not getattr(res, "completed", True):
                STATE.waiting[id(elem)] = (elem, rec, event)
            else:
                _end_event(rec, event)
        return out

    traced.__labkit_traced__ = fn  # type: ignore[attr-defined]
    return traced


def _wrap_wait_tensor(fn: Any) -> Any:
    @functools.wraps(fn)
    def wait_tensor(tensor: Any) -> Any:
        entry = STATE.waiting.pop(id(tensor), None)
        if entry is None or threading.get_ident() != STATE.main:
            return fn(tensor)
        _, rec, event = entry
        STATE.current, STATE.since = rec, time.time()
        try:
            return fn(tensor)
        finally:
            STATE.current = None
            rec.end = max(rec.end, time.time())
            _end_event(rec, event)

    wait_tensor.__labkit_traced__ = fn  # type: ignore[attr-defined]
    return wait_tensor


def _install_funcol(funcol: Any) -> None:
    for name in FUNCOL_OPS:
        fn = getattr(funcol, name, None)
        if fn is not None and not hasattr(fn, "__labkit_traced__"):
            setattr(funcol, name, _wrap_funcol(funcol, name, fn))
    if not hasattr(funcol.wait_tensor, "__labkit_traced__"):
        funcol.wait_tensor = _wrap_wait_tensor(funcol.wait_tensor)


class _OnImport(importlib.abc.MetaPathFinder):
    """Runs a patch right after a module is first imported (so the import stays lazy)."""

    def __init__(self, patches: dict[str, Any]):
        self.patches = patches

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        patch = self.patches.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


# -- DDP ---------------------------------------------------------------------------------------
def _install_ddp() -> None:
    """Trace DDP's bucket all_reduces: register the documented default hook at first forward."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if hasattr(DDP.forward, "__labkit_traced__"):
        return
    forward, builtin = DDP.forward, DDP._register_builtin_comm_hook

    @functools.wraps(builtin)
    def register_builtin(self: Any, *args: Any, **kwargs: Any) -> Any:
        self._labkit_hooked = True
        return builtin(self, *args, **kwargs)

    @functools.wraps(forward)
    def traced_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "_labkit_hooked", False):
            self._labkit_hooked = True
            if STATE.enabled and not self._comm_hooks:
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                # Same math as DDP without a hook: divide by the group size, sum (an average);
                # but issued through dist.all_reduce, which is traced.
                self.register_comm_hook(self.process_group, default_hooks.allreduce_hook)
        return forward(self, *args, **kwargs)

    traced_forward.__labkit_traced__ = forward  # type: ignore[attr-defined]
    DDP.forward = traced_forward  # type: ignore[method-assign]
    DDP._register_builtin_comm_hook = register_builtin  # type: ignore[method-assign]


def install() -> None:
    """Wrap torch.distributed's p2p and collective functions (once per process)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if STATE.installed:
        return
    for op in OPS:
        fn = getattr(dist, op, None)
        if fn is not None and not hasattr(fn, "__labkit_traced__"):
            traced = _wrap(op, fn)
            setattr(dist, op, traced)
            if getattr(c10d, op, None) is fn:
                setattr(c10d, op, traced)
    _install_ddp()
    if FUNCOL in sys.modules:
        _install_funcol(sys.modules[FUNCOL])
    else:
        sys.meta_path.insert(0, _OnImport({FUNCOL: _install_funcol}))
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
