"""Tracing DDP's bucket all_reduces, which its C++ reducer issues (rank side).

The reducer calls the process group from C++, past the wrapped `torch.distributed` functions.
So at a DDP module's first forward, when no comm hook is registered, labkit registers
`default_hooks.allreduce_hook`: the same average (divide by the group size, then sum), issued
through `dist.all_reduce`, one record per bucket. A module whose user registers a hook (or a
built-in one) keeps it.

DDP hands the work of the all_reduce that `Join` makes at each forward to its C++ reducer, which
takes only torch's own Work: `Join.notify_join_context` is wrapped so that the reducer gets the
real Work, while the traced record still ends when that all_reduce completes.

Without a hook the reducer divides by the group size, or, under
`Join(..., divide_by_initial_world_size=False)`, by the ranks that have not joined yet (the sum
of that forward's all_reduce of ones). `default_hooks.allreduce_hook` always divides by the group
size, so labkit's hook (`_allreduce_hook`) takes the divisor the reducer would have taken.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

from labkit.rank.trace_state import STATE


def _allreduce_hook(ddp_ref, bucket):  # noqa: ANN001, ANN202 - DDP rejects other annotations
    """`default_hooks.allreduce_hook` with the reducer's own divisor (see the module's doc)."""
    import torch.distributed as dist

    ddp = ddp_ref()
    group = ddp.process_group if ddp is not None else None
    divisor = dist.get_world_size(group)
    joined = getattr(ddp, "_labkit_join_work", None)  # this forward's all_reduce of ones
    if joined is not None and not getattr(ddp, "_divide_by_initial_world_size", True):
        joined.wait()
        divisor = int(joined.result()[0].item())  # the ranks that have not joined
    tensor = bucket.buffer().div_(divisor)
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def install() -> None:
    """Trace DDP's bucket all_reduces: register the documented default hook at first forward."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if hasattr(DDP.forward, "__labkit_traced__"):
        return
    from torch.distributed.algorithms.join import Join

    from labkit.rank.dist_tracing import TracedWork

    forward, builtin = DDP.forward, DDP._register_builtin_comm_hook
    notify = Join.notify_join_context

    @functools.wraps(notify)
    def notify_join_context(joinable: Any) -> Any:
        work = notify(joinable)
        if isinstance(work, TracedWork):
            work.get_future()  # the record ends when the all_reduce completes
            work = work._work  # the C++ reducer takes torch's Work only
        joinable._labkit_join_work = work  # the divisor of labkit's hook (None: not in Join)
        return work

    @functools.wraps(builtin)
    def register_builtin(self: Any, *args: Any, **kwargs: Any) -> Any:
        self._labkit_hooked = True
        return builtin(self, *args, **kwargs)

    @functools.wraps(forward)
    def traced_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "_labkit_hooked", False):
            self._labkit_hooked = True
            if STATE.enabled and not self._comm_hooks:
                # Same math as DDP without a hook (divide, then sum), but issued through
                # dist.all_reduce, which is traced.
                self.register_comm_hook(weakref.ref(self), _allreduce_hook)
        return forward(self, *args, **kwargs)

    traced_forward.__labkit_traced__ = forward  # type: ignore[attr-defined]
    DDP.forward = traced_forward  # type: ignore[method-assign]
    DDP._register_builtin_comm_hook = register_builtin  # type: ignore[method-assign]
    Join.notify_join_context = staticmethod(notify_join_context)  # type: ignore[method-assign]
