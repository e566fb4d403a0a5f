"""Every private or version-specific torch API labkit uses, found in one place (rank side).

labkit reaches past torch's public API in a few places; each is a `FEATURES` entry here, probed
once per process, and the code that needs one asks `get(name)` (None when this torch lacks it)
and says `missing(name)` instead of failing: the lab works, without that feature.

- `flight_recorder`: `torch._C._distributed_c10d._dump_fr_trace` / `_dump_fr_trace_json`, the
  Flight Recorder's dump (`labkit.flight_recorder`, `%lab logs --fr`, the last collectives in a
  stuck rank's stacks, and the trace's records of collectives torch issues from C++: DDP's
  buckets).
- `group_registry`: `distributed_c10d._world.pg_names` / `pg_map` and `_get_default_group()`,
  torch's table of process groups (the group of those C++ collectives' records; the members of
  each group for the hang verdict; a cell's `destroy_process_group()` destroying the user's
  groups while the lab keeps its default one).
- `join_hook`: `Join.notify_join_context` in torch's join.py, whose all_reduce hands its Work to
  DDP's C++ reducer: the tracer recognises that call and lets torch's own Work through. Without
  it the tracer never wraps an async all_reduce's Work (its record ends when it is issued).
- `functional_collectives`: `torch.distributed._functional_collectives`'s `wait_tensor` and
  `_resolve_group_name`, and `distributed_c10d._resolve_process_group` (records of DTensor's
  and FSDP2's communication, and their groups).
- `dtensor_local_shape`: `torch.distributed.tensor._utils.compute_local_shape_and_global_offset`
  (the placement view's slices of a DTensor, `labkit.parallel.two_d.local_piece`).
- `fake_world`: `torch.testing._internal.distributed.fake_pg.FakeStore` (the "fake" backend),
  `tensor._utils._compute_local_shape_and_global_offset` and the functions that clear DTensor's
  sharding caches (`labkit.simulate`, `labkit.rank.fake_world`).
- `profiler_event_tree`: `torch._C._profiler._EventType` (`labkit.parallel.zero_redundancy`'s
  allocation peaks from the profiler's event tree).

Renames: torch 2.13 named `all_gather_single` / `reduce_scatter_single` (the curriculum's
names); `provide_renames()` gives an older torch those two names, bound to the functions they
replaced (`all_gather_into_tensor`, `reduce_scatter_tensor`: same arguments, same result), and
nothing else; rank 0 says so at the first call of one. The tracer wraps them under the new names,
so records and views show the name the user called (and torch's own calls of the old names,
FSDP2's, are recorded under the new ones, as torch 2.13's FSDP2 makes them: see
labkit.rank.dist_tracing).

`TESTED` is the range CI runs (the oldest and the newest torch of it); `in_range(version)` says
whether a torch lies inside it. `disable(name)` (or `LABKIT_TORCH_OFF=name,name` in a rank's
environment) makes a feature unavailable, as an older torch would: the tests run each so.

This module never imports IPython, ipywidgets or plotly.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

TESTED = ("2.11", "2.14.1")  # the oldest and the newest torch CI runs (pyproject: torch>=2.11)
OFF_ENV = "LABKIT_TORCH_OFF"
RENAMES = {  # torch 2.13's name -> the older name with the same arguments and result
    "all_gather_single": "all_gather_into_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
}
RENAMED_FROM = {old: new for new, old in RENAMES.items()}


def _flight_recorder() -> Any:
    """(pickled dump, JSON dump) of the recorder gloo's groups write, then of NCCL's (None, None
    where torch has no NCCL): NCCL's groups keep their own recorder (CUDA events), dumped by
    `_dump_nccl_trace`; a rank with `cpu:gloo,cuda:nccl` has entries in both."""
    from torch._C import _distributed_c10d as c

    nccl = getattr(c, "_dump_nccl_trace", None), getattr(c, "_dump_nccl_trace_json", None)
    return c._dump_fr_trace, c._dump_fr_trace_json, *nccl


def _group_registry() -> Any:
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    world.pg_names.items()  # noqa: B018 - probes: each must exist
    world.pg_map.keys()  # noqa: B018
    return world, c10d._get_default_group


def _join_hook() -> Any:
    import inspect

    from torch.distributed.algorithms.join import Join

    fn = Join.notify_join_context
    code = fn.__code__
    if "all_reduce" not in code.co_names and "all_reduce" not in inspect.getsource(fn):
        raise LookupError("Join.notify_join_context no longer calls all_reduce")
    return code.co_name, os.path.basename(code.co_filename)


def _functional_collectives() -> Any:
    import importlib

    funcol = importlib.import_module("torch.distributed._functional_collectives")
    from torch.distributed import distributed_c10d as c10d

    return funcol.wait_tensor, funcol._resolve_group_name, c10d._resolve_process_group


def _dtensor_local_shape() -> Any:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset


def _fake_world() -> Any:
    import torch
    import torch.distributed.tensor._redistribute as redistribute
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.testing._internal.distributed.fake_pg import FakeStore

    propagator = DTensor._op_dispatcher.sharding_propagator
    native = torch._C._clear_DTensor_sharding_propagator_cache

    def clear_caches() -> None:
        propagator.propagate_op_sharding.cache_clear()
        redistribute.clear_redistribute_planner_cache()
        native()

    return {
        "store": FakeStore,
        "local_shape": _compute_local_shape_and_global_offset,
        "clear_caches": clear_caches,
    }


def _profiler_event_tree() -> Any:
    from torch._C._profiler import _EventType

    _EventType.Allocation  # noqa: B018
    return _EventType


# name -> (what works without it no more, probe: returns what the feature uses, or raises)
FEATURES: dict[str, tuple[str, Callable[[], Any]]] = {
    "flight_recorder": (
        "lab.flight_recorder / %lab logs --fr, the Flight Recorder lines in a rank's stacks, "
        "and the trace's records of collectives torch issues from C++ (DDP's buckets)",
        _flight_recorder,
    ),
    "group_registry": (
        "groups for the Flight Recorder's records (so none are made), the members of a "
        "subgroup in the hang verdict (only the ranks that recorded it are expected), and no "
        "destruction of a cell's own groups by destroy_process_group() (they stay)",
        _group_registry,
    ),
    "join_hook": (
        "end time for an async all_reduce's record (it ends when issued): labkit cannot tell "
        "Join's all_reduce, whose Work must stay torch's own, from the others",
        _join_hook,
    ),
    "functional_collectives": (
        "records of the functional collectives (DTensor's and FSDP2's communication)",
        _functional_collectives,
    ),
    "dtensor_local_shape": (
        "slices of a DTensor in the placement view, and no labkit.parallel.two_d.local_piece",
        _dtensor_local_shape,
    ),
    "fake_world": (
        "labkit.simulate (torch's fake process group, FakeStore, DTensor's local-shape rule "
        "for a given coordinate, and DTensor's sharding caches cleared between simulated ranks)",
        _fake_world,
    ),
    "profiler_event_tree": (
        "allocation peaks from the profiler's event tree (labkit.parallel.zero_redundancy)",
        _profiler_event_tree,
    ),
}

_said: list[str] = []  # the renamed call that said so (once per process)
_found: dict[str, tuple[Any, str | None]] = {}  # name -> (what the probe returned, why missing)
_disabled: set[str] = set()


def _check(name: str) -> None:
    if name not in FEATURES:
        raise KeyError(f"no torch feature {name!r}; the features are {sorted(FEATURES)}")


def _probe(name: str) -> tuple[Any, str | None]:
    _check(name)
    off = {n.strip() for n in os.environ.get(OFF_ENV, "").split(",") if n.strip()}
    if name in _disabled or name in off:
        return None, f"made unavailable ({'disable()' if name in _disabled else OFF_ENV})"
    if name not in _found:
        try:
            _found[name] = (FEATURES[name][1](), None)
        except Exception as exc:  # noqa: BLE001 - any failure means: this torch lacks it
            _found[name] = (None, f"{type(exc).__name__}: {exc}")
    return _found[name]


def get(name: str) -> Any:
    """What feature `name` uses from torch (a function, a tuple of them), or None when missing."""
    return _probe(name)[0]


def available(name: str) -> bool:
    return _probe(name)[1] is None


def missing(name: str) -> str:
    """One sentence: which feature this torch lacks, why, and what is missing with it."""
    import torch

    what, _ = FEATURES[name]
    why = _probe(name)[1] or "available"
    return f"labkit: torch {torch.__version__} lacks {name} ({why}): no {what}"


def unavailable() -> dict[str, str]:
    """{feature: why} for every feature this torch lacks (`labkit doctor` prints it)."""
    return {n: why for n in FEATURES if (why := _probe(n)[1]) is not None}


def disable(*names: str) -> None:
    """Make features unavailable in this process, as an older torch would (for tests)."""
    for name in names:
        _check(name)
    _disabled.update(names)


def enable(*names: str) -> None:
    """Undo `disable` (all when no name is given)."""
    for name in names:
        _check(name)
    _disabled.difference_update(names or set(_disabled))


def version_tuple(version: str) -> tuple[int, ...]:
    """The version's numbers: "2.11.0+cu130" -> (2, 11, 0) (local and dev parts dropped)."""
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3])


def in_range(version: str) -> bool:
    """Whether `version` lies inside `TESTED` (a newer patch of the newest counts as inside)."""
    v = version_tuple(version)
    low, high = (version_tuple(t) for t in TESTED)
    return low <= v[: len(low)] and v[: len(high) - 1] <= high[:-1]


def provided(new: str) -> bool:
    """Whether labkit provided torch 2.13's name `new` on this torch (provide_renames)."""
    import torch.distributed as dist

    return hasattr(getattr(dist, new, None), "__labkit_renamed__")


def renames_needed() -> list[str]:
    """torch 2.13's names this torch lacks (provided by `provide_renames`)."""
    import torch.distributed as dist

    return [new for new, old in RENAMES.items() if not hasattr(dist, new) and hasattr(dist, old)]


def provide_renames() -> list[str]:
    """Give this torch the 2.13 names it lacks (bound to the functions they replaced, in
    torch.distributed and in distributed_c10d); returns the names added (idempotent)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    added = []
    for new in renames_needed():
        renamed = _renamed(new, getattr(dist, RENAMES[new]))
        setattr(dist, new, renamed)
        if not hasattr(c10d, new):
            setattr(c10d, new, renamed)
        added.append(new)
    return added


def _renamed(new: str, old: Callable[..., Any]) -> Callable[..., Any]:
    import inspect

    def renamed(*args: Any, **kwargs: Any) -> Any:
        if not _said and os.environ.get("RANK", "0") == "0":  # once, on rank 0 only
            _said.append(new)
            print(renames_note(), flush=True)
        return old(*args, **kwargs)

    renamed.__name__ = renamed.__qualname__ = new
    renamed.__module__ = old.__module__
    renamed.__signature__ = inspect.signature(old)  # type: ignore[attr-defined]
    renamed.__doc__ = f"torch 2.13's name for {old.__name__}, provided by labkit on this torch"
    renamed.__labkit_renamed__ = old  # type: ignore[attr-defined]
    return renamed


def renames_note() -> str:
    import torch
    import torch.distributed as dist

    added = [n for n in RENAMES if hasattr(getattr(dist, n, None), "__labkit_renamed__")]
    names = " and ".join(f"dist.{n} (torch's {RENAMES[n]})" for n in added)
    return (
        f"labkit: torch {torch.__version__} predates torch 2.13's names; the ranks provide "
        f"{names}, and the trace records them under the name called"
    )
