"""Tensors gloo cannot move on their device, moved through host memory for the op (rank side).

Ranks that share a GPU talk over gloo (labkit.kernel.launch.policy: more ranks than GPUs,
`device="cuda"`). gloo's collectives take CUDA tensors, but its point-to-point calls (`send`,
`recv`, `isend`, `irecv`, and `batch_isend_irecv`, which calls them) hand the tensor's address
to gloo's TCP transport, which reads and writes host memory only (a CUDA address fails with
`writev ... Bad address`, often on one of gloo's threads, which aborts the rank), and the list
form of `all_to_all` is refused ("Backend gloo does not support alltoall"). Seen on an H200 with
torch 2.11 (issue 32).

`plan(op, args, kwargs)` says whether a call must be staged: one of `OPS`, a tensor of a device
type in `device_types()` (CUDA), a group whose backend is plain gloo, and this rank in it.
`Staging.bind(fn)` then runs torch's own function on host copies, with every other argument
(peer, group, group_dst/group_src, tag, async_op) passed unchanged:

- what is sent is copied to the host (D2H) when the call is made, as the device would read it;
- what is received lands in a host buffer and is copied into the user's tensor (H2D) only when
  the op has completed: for a blocking call before it returns, for an async one when `wait()`
  returns, `is_completed()` first says True or `get_future()`'s future completes (`StagedWork`);
  until then the user's tensor is untouched, as with any Work not yet waited for;
- a call that raises carries a note naming the rank and the staging.

Each staged call notes what it copied in its trace record (`CommRecord.staged`: "d2h", "h2d" or
"d2h+h2d", and `stage_time`, the seconds spent in the copies, measured on the host; an H2D copy
from pageable memory returns once the data is on its way). The trace itself stays the user's
call: op, bytes, shape and device are those of the user's tensors. NCCL groups, mixed backends
(`cpu:gloo,cuda:nccl`) and CPU tensors go straight to torch, untouched.

`set_device_types({"cpu"})` is a switch for tests: CPU tensors then count as needing staging, so
the copies, results and async semantics are checked on CPU ranks (tests/test_host_staging.py).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

# op -> (position and name of the sent tensor(s), of the received tensor(s)); group's position
OPS: dict[str, tuple[tuple[int, str] | None, tuple[int, str] | None, int]] = {
    "send": ((0, "tensor"), None, 2),
    "isend": ((0, "tensor"), None, 2),
    "recv": (None, (0, "tensor"), 2),
    "irecv": (None, (0, "tensor"), 2),
    "all_to_all": ((1, "input_tensor_list"), (0, "output_tensor_list"), 2),
}
ASYNC = frozenset({"isend", "irecv"})
_CUDA = frozenset({"cuda"})
_device_types: frozenset[str] = _CUDA
# a developers' switch: "cpu" stages CPU tensors as CUDA ones are, in every rank of a lab started
# with it set (the curriculum's staged paths run on CPU ranks: docs/gpu.md)
ENV = "LABKIT_STAGE_DEVICE_TYPES"
_inside = threading.local()  # torch's `send` calls `isend`: the host copy is not staged again


def device_types() -> frozenset[str]:
    """The device types whose tensors are staged through the host over gloo."""
    return _device_types


def set_device_types(types: Any) -> frozenset[str]:
    """Stage tensors of these device types (tests use {"cpu"}); returns the previous set.

    Runs on a rank; only that rank changes. Example: `set_device_types({"cpu"})`."""
    global _device_types
    allowed = {"cpu", "cuda", "xpu", "mps", "hpu", "privateuseone"}
    types = frozenset({types} if isinstance(types, str) else types)
    if not types <= allowed:
        raise ValueError(
            f"unknown device types {sorted(types - allowed)}; allowed: {sorted(allowed)}"
        )
    previous, _device_types = _device_types, types
    return previous


if os.environ.get(ENV):
    set_device_types(t.strip() for t in os.environ[ENV].split(",") if t.strip())


def _arg(args: tuple, kwargs: dict, where: tuple[int, str] | None) -> Any:
    if where is None:
        return None
    pos, name = where
    return args[pos] if len(args) > pos else kwargs.get(name)


def _tensors(obj: Any) -> list[Any]:
    if obj is None:
        return []
    return list(obj) if isinstance(obj, (list, tuple)) else [obj]


def staged(t: Any) -> bool:
    if _device_types == _CUDA:  # the usual case, without making a torch.device per call
        return getattr(t, "is_cuda", False) is True
    device = getattr(t, "device", None)
    return getattr(device, "type", None) in _device_types


def plain_gloo(group: Any) -> bool:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    try:
        backend = dist.get_backend(group)
        outside = c10d._rank_not_in_group(group)
    except Exception:  # noqa: BLE001 - no group yet, or not this rank's: torch says so itself
        return False
    return str(backend).lower() == "gloo" and not outside


def plan(op: str, args: tuple, kwargs: dict) -> Staging | None:
    """The staging `op` called with these arguments needs, or None: call torch as it is."""
    spec = OPS.get(op)
    if spec is None or getattr(_inside, "on", False):
        return None
    sent_at, received_at, group_pos = spec
    sent = _tensors(_arg(args, kwargs, sent_at))
    received = _tensors(_arg(args, kwargs, received_at))
    if not any(staged(t) for t in sent + received):
        return None
    group = args[group_pos] if len(args) > group_pos else kwargs.get("group")
    if not plain_gloo(group):
        return None
    return Staging(op, args, kwargs, sent, received)


def rank() -> int:
    import torch.distributed as dist

    try:
        return dist.get_rank()
    except Exception:  # noqa: BLE001 - only for a message
        return -1


class Staging:
    """One call's host copies: made by `bind`'s function, written back by `finish`."""

    def __init__(self, op: str, args: tuple, kwargs: dict, sent: list, received: list):
        self.op, self.args, self.kwargs = op, args, kwargs
        self.sent, self.received = sent, received
        self.host_received: list[Any] = []
        self.record: Any = None  # the trace record to note the copies in, if traced
        self.directions: list[str] = []
        self.seconds = 0.0
        self._finished = False

    def _note(self, direction: str, since: float) -> None:
        self.seconds += time.perf_counter() - since
        if direction not in self.directions:
            self.directions.append(direction)
        if self.record is not None:
            self.record.staged = "+".join(self.directions)
            self.record.stage_time = self.seconds

    def bind(self, fn: Any) -> Any:
        """`fn` (torch's function) called on host copies in place of the user's tensors."""

        def on_host(*args: Any, **kwargs: Any) -> Any:
            return self._call(fn, args, kwargs)

        return on_host

    def _host_args(self) -> tuple[tuple, dict]:
        import torch

        sent_at, received_at, _ = OPS[self.op]
        args, kwargs = list(self.args), dict(self.kwargs)

        def replace(where: tuple[int, str], value: Any) -> None:
            pos, name = where
            if len(args) > pos:
                args[pos] = value
            else:
                kwargs[name] = value

        if sent_at is not None and self.sent:
            since = time.perf_counter()
            # detached: the copy is data for the transport, not a step autograd should record
            host = [t.detach().to("cpu", copy=True) if staged(t) else t for t in self.sent]
            self._note("d2h", since)
            one = not isinstance(_arg(self.args, self.kwargs, sent_at), (list, tuple))
            replace(sent_at, host[0] if one else host)
        if received_at is not None and self.received:
            self.host_received = [
                torch.empty(t.shape, dtype=t.dtype, device="cpu") if staged(t) else t
                for t in self.received
            ]
            one = not isinstance(_arg(self.args, self.kwargs, received_at), (list, tuple))
            replace(received_at, self.host_received[0] if one else self.host_received)
        return tuple(args), kwargs

    def _call(self, fn: Any, args: tuple, kwargs: dict) -> Any:
        try:
            host_args, host_kwargs = self._host_args()
            _inside.on = True
            result = fn(*host_args, **host_kwargs)
        except Exception as err:
            err.add_note(self.explain())
            raise
        finally:
            _inside.on = False
        is_async = self.op in ASYNC or bool(host_kwargs.get("async_op"))
        if not is_async:
            self.finish()
            return result
        if result is None:  # torch gave no Work: nothing to wait for, nothing arrived
            return None
        return StagedWork(result, self)

    def finish(self) -> None:
        """The op completed: copy what arrived into the user's tensors (once)."""
        if self._finished:
            return
        self._finished = True
        import torch

        since = time.perf_counter()
        copied = False
        for user, host in zip(self.received, self.host_received):
            if host is not user:
                # as torch's recv writes its buffer: outside autograd, so a leaf that requires
                # grad (torch.distributed.pipelining's receive buffers) can be written
                with torch.no_grad():
                    user.copy_(host)
                copied = True
        if copied:
            self._note("h2d", since)
        self.host_received = []

    def explain(self) -> str:
        devices = sorted({str(t.device) for t in self.sent + self.received if staged(t)})
        return (
            f"rank {rank()}: labkit moved this dist.{self.op}'s {', '.join(devices)} tensors "
            "through host memory, since its group is on gloo, whose point-to-point and list "
            "all_to_all move host memory only (labkit.rank.host_staging)"
        )


class StagedWork:
    """An async staged op's Work: what arrived reaches the user's tensors when it completes."""

    def __init__(self, work: Any, staging: Staging):
        self._work = work
        self._staging = staging
        self._waited = False
        self._done: Any = None

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        if not self._waited:  # gloo's point-to-point Work waits again, for ever, if asked twice
            try:
                self._done = self._work.wait(*args, **kwargs)
            except Exception as err:
                err.add_note(self._staging.explain())
                raise
            self._waited = True
        self._staging.finish()
        return self._done

    def is_completed(self) -> bool:
        done = self._work.is_completed()
        if done and not self._waited:
            try:
                self.wait()  # returns at once; raises if the op failed
            except Exception:  # noqa: BLE001 - nothing arrived: the user's wait() raises it
                self._waited = False
        return done

    def get_future(self) -> Any:
        def arrived(fut: Any) -> Any:
            fut.value()  # raises the op's error, if any
            self._staging.finish()
            return self._staging.received or fut.value()

        return self._work.get_future().then(arrived)

    def result(self) -> Any:
        return self._staging.received or self._work.result()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)
