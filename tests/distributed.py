"""Run a function on N CPU ranks with gloo, for tests of rank-side code (runs in the test process).

`run_ranks(fn, world_size, *args)` spawns `world_size` processes, initialises a gloo process
group in each, calls `fn(rank, world_size, *args)` and returns the per-rank return values as a
list. A rank that raises fails the call with that rank's traceback; a hang fails after
`timeout` seconds instead of freezing the suite. `fn` must be importable (defined at module
level in a test module).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world_size, port, args, queue):
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        queue.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120) -> list:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, args, queue))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout)
            if not ok:
                raise AssertionError(f"rank {rank} raised:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world_size)]
