"""Functional all-gathers of CUDA tensors over gloo, moved through host memory (rank side).

DTensor (`full_tensor()`, a redistribute from Shard to Replicate, sequence parallelism's
gathers) communicates through `torch.distributed._functional_collectives`, and its all-gather
(`all_gather_tensor`; torch 2.13: `all_gather_single`) over gloo on CUDA tensors killed every
rank with SIGSEGV on an H200 with torch 2.11, in plain processes under torchrun as in a lab
(scripts/gpu_probe_ops.py, 2026-11-27; `dist.all_gather_into_tensor` on the same tensors worked,
as did the functional reduce-scatter, all-reduce and all-to-all). On a group whose backend is
plain gloo, a rank therefore runs these functions on host copies:

- the input is copied to the host on the current stream (a blocking copy: it waits for the
  kernels that wrote the input);
- torch's own function runs on the copy, over the same group, every other argument unchanged;
- the gathered result (torch's AsyncCollectiveTensor: the copy waits for it) is copied back to
  the input's device.

The call returns once the gather is done, where torch's returns at once and waits in
`wait_tensor`; values, shapes and dtypes are torch's, and both copies are differentiable, so the
`_autograd` variants still give the input its gradient. The trace record says what was copied
(`staged` "d2h+h2d", `stage_time`). NCCL groups, mixed backends and tensors of other device
types go to torch untouched. `host_staging.set_device_types` says which device types are staged,
as for point-to-point (tests use {"cpu"}).
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from typing import Any

from labkit.rank import host_staging, torch_compat
from labkit.rank.trace_state import compiling_check

# the functional all-gathers, under each torch's names (2.13 added the *_single ones)
STAGED = (
    "all_gather_tensor",
    "all_gather_tensor_autograd",
    "all_gather_into_tensor_coalesced",
    "all_gather_single",
    "all_gather_single_autograd",
    "all_gather_single_coalesced",
)
_last = threading.local()  # (staged, seconds) of this thread's last staged call, for the trace
# torch 2.13's old names call the new ones (all_gather_tensor -> all_gather_single, both
# wrapped): the inner call is on the host copy already and is not staged again (it would be
# where CPU tensors count as staged, as in the tests)
_inside = threading.local()


def take() -> tuple[str, float] | None:
    """What the last staged call on this thread copied ("d2h+h2d", seconds), once; else None."""
    got = getattr(_last, "value", None)
    _last.value = None
    return got


def resolve_group(group: Any) -> Any:
    """The ProcessGroup a functional collective's `group` names (a group, a mesh, (mesh, dim),
    a group's name, a list of ranks), or None where this rank cannot resolve it."""
    import torch.distributed as dist

    if isinstance(group, dist.ProcessGroup):
        return group
    found = torch_compat.get("functional_collectives")
    if found is None:
        return None
    _, group_name, process_group = found
    try:
        return process_group(group_name(group))
    except Exception:  # noqa: BLE001 - a traced (compiled) group, or not this rank's
        return None


def wrap(fn: Any) -> Any:
    """`fn` (a functional all-gather) run on host copies where its group is plain gloo and its
    input is on a staged device type; else `fn` itself."""
    sig = inspect.signature(fn)
    first = next(iter(sig.parameters))
    compiling = compiling_check()

    @functools.wraps(fn)
    def staged(*args: Any, **kwargs: Any) -> Any:
        if compiling() or getattr(_inside, "on", False):  # compiled code: torch's own call
            return fn(*args, **kwargs)
        try:
            bound = sig.bind(*args, **kwargs).arguments
        except TypeError:
            return fn(*args, **kwargs)  # torch's own error, as without labkit
        given = bound.get(first)
        many = isinstance(given, (list, tuple))
        tensors = list(given) if many else [given]
        if not any(host_staging.staged(t) for t in tensors):
            return fn(*args, **kwargs)
        group = resolve_group(bound.get("group"))
        if group is None or not host_staging.plain_gloo(group):
            return fn(*args, **kwargs)
        since = time.perf_counter()
        # only the tensors on a staged device (a coalesced list may mix devices)
        host = [t.to("cpu", copy=True) if host_staging.staged(t) else t for t in tensors]
        seconds = time.perf_counter() - since
        bound[first] = host if many else host[0]
        _inside.on = True
        try:
            out = fn(**bound)
        except Exception as err:
            err.add_note(explain(fn.__name__, tensors))
            raise
        finally:
            _inside.on = False
        since = time.perf_counter()
        if many:
            result: Any = [
                o.to(t.device, copy=True) if host_staging.staged(t) else o
                for o, t in zip(out, tensors, strict=True)
            ]
        else:
            result = out.to(tensors[0].device, copy=True)
        _last.value = ("d2h+h2d", seconds + time.perf_counter() - since)
        return result

    staged.__labkit_staged__ = fn  # type: ignore[attr-defined]
    return staged


def explain(name: str, tensors: list[Any]) -> str:
    devices = ", ".join(sorted({str(t.device) for t in tensors}))
    return (
        f"rank {host_staging.rank()}: labkit ran this {name} on host copies of its {devices} "
        "tensors, since its group is on gloo, whose functional all-gather of CUDA tensors "
        "crashes (labkit.rank.funcol_staging)"
    )


def install(funcol: Any) -> None:
    """Wrap the module's functional all-gathers (before the tracer wraps them: the trace
    records the user's call)."""
    for name in STAGED:
        fn = getattr(funcol, name, None)
        if fn is not None and not hasattr(fn, "__labkit_staged__"):
            setattr(funcol, name, wrap(fn))
