"""One simulated rank of `labkit.rank.fake_world`: the fake process group, the mesh, the user's
`setup` run on it, and what that rank then held and called (runs in the process that plays it).

`run_one` joins torch's fake process group as `rank` of the world, builds the `DeviceMesh`,
calls `setup(mesh)` with labkit's tracer recording its collectives in a cell of their own (a
lab's trace is never touched), describes the model's parameters (`placement_probe`), and leaves
no process group behind. `install_tracer` puts labkit's tracer in place, also in torch modules
that imported a collective by value before it was installed. Imports only torch and labkit's
rank side.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from labkit.wire.records import CommRecord

__all__ = ["Run", "install_tracer", "run_one"]


@dataclass
class Run:
    """What one representative rank held and called."""

    rank: int
    rows: list[dict[str, Any]]
    specs: list[Any]  # per row: (shape, placements, submesh ranks, its dims, element size)
    records: list[CommRecord]


def _flatten(nested: Any) -> list[int]:
    if isinstance(nested, list):
        return [q for item in nested for q in _flatten(item)]
    return [int(nested)]


def _dims(nested: Any) -> list[int]:
    dims = []
    while isinstance(nested, list):
        dims.append(len(nested))
        nested = nested[0] if nested else None
    return dims


def _spec(param: Any) -> Any:
    mesh = getattr(param, "device_mesh", None)
    if mesh is None:
        return None
    sub = mesh.mesh.tolist()
    return (tuple(param.shape), tuple(param.placements), tuple(_flatten(sub)), _dims(sub),
            param.element_size())  # fmt: skip


def install_tracer() -> None:
    """labkit's tracer, and its wrappers bound in torch's modules that imported a function
    by value before it was installed (`_collective_utils`' `scatter`, DTensor's scatter of
    the shards from the group's first rank): a lab's rank installs it before any such import,
    a notebook's kernel may have imported them already."""
    import sys

    import torch.distributed as dist

    from labkit.rank import dist_tracing, trace

    trace.install()
    for op in dist_tracing.OPS:
        traced = getattr(dist, op, None)
        original = getattr(traced, "__labkit_traced__", None)
        if original is None:
            continue
        for name, module in list(sys.modules.items()):
            if name.startswith("torch.distributed") and getattr(module, op, None) is original:
                setattr(module, op, traced)


def run_one(
    rank: int, shape: tuple[int, ...], names: tuple[str, ...], setup: Callable, parts: Any
) -> Run:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from labkit.rank import placement_probe, trace
    from labkit.rank.trace_state import STATE

    world = math.prod(shape)
    dist.init_process_group("fake", rank=rank, world_size=world, store=parts["store"]())
    cell = -1 - rank  # cells of its own, dropped below: a lab's trace is never touched
    try:
        STATE.seq.clear()
        STATE.p2p.clear()
        trace.begin_cell(cell, rank)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        built = setup(mesh)
        model, optimizer = built if isinstance(built, tuple) else (built, None)
        records = [r for r in trace.records(cell) if isinstance(r, CommRecord)]
        rows = placement_probe.describe_model(model, optimizer=optimizer, rank=rank)
        by_name = dict(model.named_parameters()) | dict(model.named_buffers())
        specs = [_spec(by_name[r["qualname"]]) for r in rows]
        return Run(rank, rows, specs, records)
    finally:
        STATE.records.pop(cell, None)
        if cell in STATE.order:
            STATE.order.remove(cell)
        if dist.is_initialized():
            dist.destroy_process_group()
        parts["clear_caches"]()
