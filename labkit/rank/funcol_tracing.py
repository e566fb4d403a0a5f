"""Traced functional collectives, the ones DTensor and FSDP2 communicate through (rank side).

`_functional_collectives.all_reduce`, `all_gather_single`, `reduce_scatter_single`,
`all_to_all_single`, ... are wrapped when that module is imported (it costs 65 ms, so it is
not imported for you: `install()` adds an import hook instead), and an op completes when
`wait_tensor` is called on its result.

Records carry the names `torch.distributed` gives the same op in torch 2.13 (`all_gather_single`,
`reduce_scatter_single`, ...), so a DTensor's gather and a plain `dist.all_gather_single` read
alike in the views; the bytes are nccl-tests' S (the gathered output, the unsplit input).
"""

from __future__ import annotations

import functools
import importlib.abc
import inspect
import sys
import threading
import time
from typing import Any

from labkit.rank import funcol_staging, torch_compat
from labkit.rank.trace_state import (
    STATE,
    add_record,
    compiling_check,
    cuda_event,
    end_event,
    issued,
    new_record,
    tensors_of,
)

FUNCOL = "torch.distributed._functional_collectives"
# functional collective -> (op name in records, bytes are the gathered output)
FUNCOL_OPS: dict[str, tuple[str, bool]] = {
    "broadcast": ("broadcast", False),
    "all_reduce": ("all_reduce", False),
    "all_reduce_coalesced": ("all_reduce_coalesced", False),
    "all_gather_single": ("all_gather_single", True),
    "all_gather_single_autograd": ("all_gather_single", True),
    "all_gather_single_coalesced": ("all_gather_single", True),
    "reduce_scatter_single": ("reduce_scatter_single", False),
    "reduce_scatter_single_autograd": ("reduce_scatter_single", False),
    "reduce_scatter_single_coalesced": ("reduce_scatter_single", False),
    "all_to_all_single": ("all_to_all_single", False),
    "all_to_all_single_autograd": ("all_to_all_single", False),
    # the names before torch 2.13 (DTensor calls them there; 2.13's forward to the above)
    "all_gather_tensor": ("all_gather_single", True),
    "all_gather_tensor_autograd": ("all_gather_single", True),
    "all_gather_into_tensor_coalesced": ("all_gather_single", True),
    "reduce_scatter_tensor": ("reduce_scatter_single", False),
    "reduce_scatter_tensor_autograd": ("reduce_scatter_single", False),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter_single", False),
}


def _funcol_ranks(funcol: Any, group: Any) -> tuple[int, ...]:
    import torch.distributed as dist

    try:
        _, group_name, process_group = torch_compat.get("functional_collectives")
        resolved = group if isinstance(group, dist.ProcessGroup) else None
        if resolved is None:  # a mesh, (mesh, dim), a group's name, a list of ranks
            resolved = process_group(group_name(group))
        return tuple(dist.get_process_group_ranks(resolved))
    except Exception:  # a traced (compiled) group, or one this rank cannot resolve
        return ()


def _wrap_funcol(funcol: Any, name: str, fn: Any) -> Any:
    op, gathered = FUNCOL_OPS[name]
    sig = inspect.signature(fn)
    first_arg = next(iter(sig.parameters))
    compiling = compiling_check()

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        if compiling():  # torch.compile traces torch's function, not this wrapper
            return fn(*args, **kwargs)
        if not STATE.enabled or STATE.inside or threading.get_ident() != STATE.main:
            return fn(*args, **kwargs)
        if not torch_compat.available("functional_collectives"):  # made so after install
            _say_missing()
            return fn(*args, **kwargs)
        bound = sig.bind_partial(*args, **kwargs).arguments
        ranks = _funcol_ranks(funcol, bound.get("group"))
        tensors = tensors_of(bound.get(first_arg))
        reduce_op = bound.get("reduceOp")
        rec = new_record(
            op,
            ranks,
            tensors,
            peer=bound.get("src"),
            async_op=True,
            reduce_op=str(reduce_op).upper() if reduce_op is not None else None,
        )
        if gathered:
            rec.bytes *= max(len(ranks), 1)
        add_record(rec)
        event = cuda_event(tensors)
        STATE.inside = True
        funcol_staging.take()
        try:
            out = fn(*args, **kwargs)
        finally:
            STATE.inside = False
            issued(rec)
            rec.end = time.time()
        moved = funcol_staging.take()  # run on host copies (gloo, CUDA): the record says so
        if moved is not None:
            rec.staged, rec.stage_time = moved
        for res in out if isinstance(out, list) else [out]:
            elem = getattr(res, "elem", None)  # an AsyncCollectiveTensor: waited on later
            if elem is not None and not getattr(res, "completed", True):
                STATE.waiting[id(elem)] = (elem, rec, event)
            else:
                end_event(rec, event)
        return out

    traced.__labkit_traced__ = fn  # type: ignore[attr-defined]
    return traced


def _wrap_wait_tensor(fn: Any) -> Any:
    compiling = compiling_check()

    @functools.wraps(fn)
    def wait_tensor(tensor: Any) -> Any:
        if compiling():
            return fn(tensor)
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
            end_event(rec, event)

    wait_tensor.__labkit_traced__ = fn  # type: ignore[attr-defined]
    return wait_tensor


_said: list[bool] = []


def _say_missing() -> None:
    if not _said:
        _said.append(True)
        print(torch_compat.missing("functional_collectives"), file=sys.stderr, flush=True)


def _install_funcol(funcol: Any) -> None:
    # first, and whatever the tracing can do on this torch (it keeps ranks alive): the tracer
    # then wraps the staged functions
    funcol_staging.install(funcol)
    if not torch_compat.available("functional_collectives"):
        _say_missing()
        return
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


def install() -> None:
    """Wrap the functional collectives now if they are imported, else as soon as they are."""
    if FUNCOL in sys.modules:
        _install_funcol(sys.modules[FUNCOL])
    else:
        sys.meta_path.insert(0, _OnImport({FUNCOL: _install_funcol}))
