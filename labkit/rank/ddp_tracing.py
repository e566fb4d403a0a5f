"""Tracing DDP's bucket all_reduces, which its C++ reducer issues (rank side).

The reducer calls the process group from C++, past the wrapped `torch.distributed` functions.
So at a DDP module's first forward, when no comm hook is registered, labkit registers
`default_hooks.allreduce_hook`: the same average (divide by the group size, then sum), issued
through `dist.all_reduce`, one record per bucket. A module whose user registers a hook (or a
built-in one) keeps it.

DDP hands the work of the all_reduce that `Join` makes at each forward to its C++ reducer, which
takes only torch's own Work: `Join.notify_join_context` is wrapped so that the reducer gets the
real Work, while the traced record still ends when that all_reduce completes.
"""

from __future__ import annotations

import functools
from typing import Any

from labkit.rank.trace_state import STATE


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
            return work._work  # the C++ reducer takes torch's Work only
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
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                # Same math as DDP without a hook: divide by the group size, sum (an average);
                # but issued through dist.all_reduce, which is traced.
                self.register_comm_hook(self.process_group, default_hooks.allreduce_hook)
        return forward(self, *args, **kwargs)

    traced_forward.__labkit_traced__ = forward  # type: ignore[attr-defined]
    DDP.forward = traced_forward  # type: ignore[method-assign]
    DDP._register_builtin_comm_hook = register_builtin  # type: ignore[method-assign]
    Join.notify_join_context = staticmethod(notify_join_context)  # type: ignore[method-assign]
