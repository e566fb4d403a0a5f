"""Traced versions of torch.distributed's point-to-point and collective functions (rank side).

`install()` replaces each function of `OPS` both in `torch.distributed` and in
`distributed_c10d`, so code that imported them from there, `P2POp(dist.isend, ...)` (which
checks identity) and `batch_isend_irecv` (which calls each op's function) all reach the
wrapper; a batch leaves one `isend`/`irecv` record per op, as torch.distributed.pipelining
issues them. Async calls (`async_op=True`, `isend`, `irecv`) complete when their work's
`wait()` returns or its future completes (`TracedWork`).

Each call is recorded under the name the user called, torch 2.13's `all_gather_single` /
`reduce_scatter_single` as well as their deprecated forms `all_gather_into_tensor` /
`reduce_scatter_tensor` (which call the new ones: one call, one record);
`labkit.views.bandwidth.canonical_op` folds them into `all_gather` / `reduce_scatter`. On a torch
older than 2.13 the ranks provide the new names (`labkit.rank.torch_compat.provide_renames`), and
torch's own calls of the old ones (FSDP2's) are recorded under the new names, as torch 2.13's
FSDP2 makes them, so a trace reads the same on every torch of the range.

Point-to-point calls and the list `all_to_all` on CUDA tensors over gloo, which gloo cannot move,
are run on host copies by `labkit.rank.host_staging`, tracing on or off; the record is the user's
call, with the copies noted in it (`staged`, `stage_time`).

`Join.notify_join_context` hands the Work of its all_reduce of ones to DDP's C++ reducer, which
takes torch's own Work only: that call goes straight to torch, unwrapped, and is recorded from
the Flight Recorder like DDP's buckets (labkit.rank.ddp_tracing). Each traced call marks when
torch has it (`trace_state.issued`), so the Flight Recorder's entry it made is not recorded twice.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import time
from typing import Any

from labkit.rank import host_staging, torch_compat
from labkit.rank.trace_state import (
    STATE,
    add_record,
    compiling_check,
    cuda_event,
    end_event,
    group_ranks,
    issued,
    new_record,
    tensors_of,
)
from labkit.wire.records import CommRecord

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
    "all_gather_single": ("output_tensor", None),  # torch 2.13's name; FSDP2 calls it
    "all_gather_into_tensor": ("output_tensor", None),  # deprecated in 2.13 for the above
    "reduce_scatter": ("input_list", None),  # bytes: the whole unsplit input, as nccl-tests
    "reduce_scatter_single": ("input", None),  # torch 2.13's name
    "reduce_scatter_tensor": ("input", None),  # deprecated in 2.13 for the above
    "all_to_all": ("input_tensor_list", None),
    "all_to_all_single": ("input", None),
    "barrier": (None, None),
    "batch_isend_irecv": ("p2p_op_list", None),
}
ASYNC_ALWAYS = {"isend", "irecv", "batch_isend_irecv"}


def _from_join() -> bool:
    """Whether the caller of the traced all_reduce is `Join.notify_join_context`, whose Work goes
    to DDP's C++ reducer (torch_compat's `join_hook`: its function's name and file)."""
    join = torch_compat.get("join_hook")
    if join is None:
        return False
    code = sys._getframe(2).f_code
    return code.co_name == join[0] and code.co_filename.endswith(join[1])


def _torch_dir() -> str:
    import torch

    return os.path.dirname(torch.__file__) + os.sep


def _recorded_as(op: str) -> str:
    """torch 2.13's name for an older torch's own call of a function 2.13 renamed (FSDP2's
    all_gather_into_tensor on torch 2.11); any other call keeps the name it was called by."""
    new = torch_compat.RENAMED_FROM.get(op)
    if new is None or not torch_compat.provided(new):
        return op
    return new if sys._getframe(2).f_code.co_filename.startswith(_torch_dir()) else op


def _wrap(op: str, fn: Any) -> Any:
    sig = inspect.signature(fn)
    tensor_arg, peer_arg = OPS[op]
    default_op = sig.parameters["op"].default if "op" in sig.parameters else None
    names = list(sig.parameters)  # binding by position is ~10x cheaper than sig.bind_partial

    staged_op = op in host_staging.OPS
    compiling = compiling_check()

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        if compiling():  # torch.compile traces torch's function, not this wrapper
            return fn(*args, **kwargs)
        call = fn
        if staged_op:
            staging = host_staging.plan(op, args, kwargs)
            if staging is not None:
                call = staging.bind(fn)
        if not STATE.enabled or (op == "all_reduce" and _from_join()):
            return call(*args, **kwargs)
        main = threading.get_ident() == STATE.main  # DDP's hooks may run on autograd threads
        if main and STATE.inside:
            return call(*args, **kwargs)
        bound = dict(zip(names, args))
        bound.update(kwargs)
        if op == "batch_isend_irecv":
            return _batch(fn, args, kwargs, main)
        ranks = group_ranks(bound.get("group"))
        tensors = tensors_of(bound.get(tensor_arg)) if tensor_arg else []
        peer = bound.get(peer_arg) if peer_arg else None
        if peer is None and peer_arg and bound.get("group_" + peer_arg) is not None:
            peer = ranks[bound["group_" + peer_arg]] if ranks else None
        reduce_op = bound.get("op", default_op)
        rec = new_record(
            _recorded_as(op) if op in torch_compat.RENAMED_FROM else op,
            ranks,
            tensors,
            peer=peer,
            async_op=op in ASYNC_ALWAYS or bool(bound.get("async_op")),
            reduce_op=str(reduce_op).rsplit(".", 1)[-1] if reduce_op is not None else None,
        )
        add_record(rec)
        if call is not fn:
            staging.record = rec
        if STATE.batch is not None and main:
            STATE.batch.append(rec)
        event = cuda_event(tensors)
        if rec.async_op:
            # a deprecated name calls its successor (all_gather_into_tensor ->
            # all_gather_single): while the call is issued, nested traced calls stay unrecorded
            if main:
                STATE.inside = True
            try:
                work = call(*args, **kwargs)
            finally:
                if main:
                    STATE.inside = False
                issued(rec)
            rec.end = time.time()  # issued; completion moves it later
            if op == "all_reduce" and not torch_compat.available("join_hook"):
                return work  # it may be Join's, whose Work DDP's reducer takes as torch's own
            return _complete_on_wait(work, [rec], event)
        if main:
            STATE.current, STATE.since, STATE.inside = rec, rec.start, True
        try:
            return call(*args, **kwargs)
        finally:
            issued(rec)
            rec.end = time.time()
            end_event(rec, event)
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
    called = time.time()
    try:
        works = fn(*args, **kwargs)
    finally:
        STATE.batch = None
        # a coalesced batch (NCCL) may make its entry after its last op's call returned
        STATE.windows.append((called, time.time(), ()))
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
                end_event(rec, self._event)

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
            end_event(rec, event)
        return work
    if isinstance(work, list):
        return [TracedWork(w, recs, event) for w in work]
    return TracedWork(work, recs, event)


def install() -> None:
    """Wrap each function of `OPS` in torch.distributed and in distributed_c10d (idempotent)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for op in OPS:
        fn = getattr(dist, op, None)
        if fn is not None and not hasattr(fn, "__labkit_traced__"):
            traced = _wrap(op, fn)
            setattr(dist, op, traced)
            if getattr(c10d, op, None) is fn:
                setattr(c10d, op, traced)
