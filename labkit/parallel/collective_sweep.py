"""Timing collectives over message sizes (runs on the ranks; every rank calls the same sweep).

`time_collective(op, nbytes)` times one op on buffers of `nbytes` (S as nccl-tests defines it:
for all_gather the gathered output, for reduce_scatter the unsplit input), after `warmup` calls,
and returns the median over `repeats` of the slowest rank's time: a collective is as fast as its
slowest rank, so each rank's time is all-reduced with MAX. `sweep(ops, sizes)` returns one row
per (op, size): {"op", "bytes", "seconds", "world_size"}, the same on every rank.
`wire_bytes(op, nbytes)` counts instead the bytes this rank really sent and received in one call,
from the OS's TCP counters (`labkit.rank.socket_bytes`): what the algorithm the backend chose
moved, independent of any formula and of the machine's load.

This module never imports IPython, ipywidgets or plotly.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from labkit.rank.socket_bytes import measure

__all__ = ["OPS", "sweep", "time_collective", "wire_bytes"]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def _call(op: str, nbytes: int, device: Any, group: Any) -> Callable[[], Any]:
    p = dist.get_world_size(group)
    numel = max(p, nbytes // 4 // p * p)  # float32, divisible by p
    if op == "all_reduce":
        buf = torch.ones(numel, device=device)
        return lambda: dist.all_reduce(buf, group=group)
    if op == "broadcast":
        buf = torch.ones(numel, device=device)
        src = dist.get_process_group_ranks(group or dist.group.WORLD)[0]
        return lambda: dist.broadcast(buf, src=src, group=group)
    if op == "all_gather":
        mine = torch.ones(numel // p, device=device)
        out = [torch.empty_like(mine) for _ in range(p)]
        return lambda: dist.all_gather(out, mine, group=group)
    if op == "reduce_scatter":
        parts = list(torch.ones(numel, device=device).chunk(p))
        out = torch.empty_like(parts[0])
        return lambda: dist.reduce_scatter(out, parts, group=group)
    raise ValueError(f"op must be one of {', '.join(OPS)}; got {op!r}")


def _sync(device: Any) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_collective(
    op: str,
    nbytes: int,
    *,
    repeats: int = 5,
    warmup: int = 1,
    device: Any = "cpu",
    group: Any = None,
) -> float:
    """Median seconds of one `op` call on `nbytes`, the slowest rank's (rank side, all ranks)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    call = _call(op, nbytes, device, group)
    for _ in range(warmup):
        call()
    _sync(device)
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        call()
        _sync(device)
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor(times, dtype=torch.float64)
    if torch.device(device).type == "cuda":  # NCCL reduces CUDA tensors only
        slowest = slowest.to(device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return float(statistics.median(slowest.cpu().tolist()))


def sweep(
    ops: Iterable[str] = OPS,
    sizes: Iterable[int] = (4 << 10, 64 << 10, 1 << 20, 16 << 20),
    *,
    repeats: int = 3,
    warmup: int = 1,
    device: Any = "cpu",
    group: Any = None,
) -> list[dict[str, Any]]:
    """One row per (op, size): op, bytes (S), seconds (median of the slowest rank), world_size."""
    p = dist.get_world_size(group)
    rows = []
    for op in ops:
        for nbytes in sizes:
            seconds = time_collective(
                op, nbytes, repeats=repeats, warmup=warmup, device=device, group=group
            )
            actual = max(p, nbytes // 4 // p * p) * 4
            rows.append({"op": op, "bytes": actual, "seconds": seconds, "world_size": p})
    return rows


def wire_bytes(op: str, nbytes: int, *, device: Any, group: Any = None) -> tuple[int, int]:
    """(bytes sent, bytes received) by this rank in one `op` call on `nbytes` (S as above), as
    the OS counts them on the rank's TCP sockets, after one warm-up call (rank side; every rank
    of the group calls it). gloo moves every byte over TCP; NCCL moves most of them over NVLink,
    PCIe or shared memory, which no socket counts, so there it reads near 0."""
    call = _call(op, nbytes, device, group)
    call()  # warm-up: connections and buffers made outside the count
    _sync(device)
    dist.barrier(group=group)
    with measure() as wire:
        call()
        _sync(device)
    dist.barrier(group=group)
    return wire.sent, wire.received
