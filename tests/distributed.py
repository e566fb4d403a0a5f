"""Run a function on N CPU ranks with gloo, for tests of rank-side code (runs in the test process).

`run_ranks(fn, world_size, *args)` spawns `world_size` processes, initialises a gloo process
group in each, calls `fn(rank, world_size, *args)` and returns the per-rank return values as a
list. A rank that raises fails the call with that rank's traceback, a rank that dies without
answering fails it with its exit code, and a hang fails after `timeout` seconds instead of
freezing the suite. `fn` must be importable (defined at module level in a test module).

Each rank answers with plain pickle bytes on its own pipe. Not a multiprocessing queue: once
torch is imported, a queue pickles tensors as shared-memory handles that the receiver fetches
from the sender, so a rank that exits before the test process reads its answer breaks the read
(FileNotFoundError in rebuild_storage_fd). Bytes in a pipe outlive the process that wrote them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any


def _entry(fn, rank, world_size, port, args, conn):
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    try:
        # the store is run_ranks' own, already listening: every rank is its client
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        answer = (True, fn(rank, world_size, *args))
    except BaseException:
        answer = (False, traceback.format_exc())
    try:
        data = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)  # tensors by value
    except Exception:
        data = pickle.dumps(
            (False, f"the return value cannot be pickled:\n{traceback.format_exc()}")
        )
    try:
        conn.send_bytes(data)
        conn.close()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _context() -> mp.context.BaseContext:
    """A forkserver that has imported torch once: each rank is a fork of it, which starts in
    tens of milliseconds, where a spawned rank spends ~2 s of CPU importing torch again (the
    suite starts a few hundred ranks on a 2-core machine). Fork itself is not used: the test
    process has threads (labs' readers), and a fork of a threaded process may deadlock."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


def forkserver_pid() -> int | None:
    """The forkserver's pid once started (a helper that lives as long as the test process)."""
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def stop_forkserver() -> None:
    """End the forkserver and remove its socket's temporary directory now (at exit would be
    too late: the session's private TMPDIR that holds it is gone by then)."""
    from multiprocessing import forkserver, util

    server = forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) is not None:
        server._stop()
    for finalizer in list(util._finalizer_registry.values()):
        if getattr(finalizer, "_callback", None) is util._remove_temp_dir:
            finalizer()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240) -> list:
    import torch.distributed as dist

    ctx = _context()
    # the rendezvous store listens here, on a port the OS gave it: a port found free and then
    # bound by rank 0 could be taken in between by the other pytest's ranks (a loaded run's
    # rank then joined another test's store and failed in connectFullMesh)
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    port = store.port
    conns, procs = {}, {}
    try:
        for r in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            procs[r] = ctx.Process(target=_entry, args=(fn, r, world_size, port, args, send))
            procs[r].start()
            send.close()  # the rank holds the only write end: EOF means it ended
            conns[r] = recv
        return _collect(conns, procs, time.monotonic() + timeout, timeout)
    finally:
        for p in procs.values():
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        for c in conns.values():
            c.close()
        del store  # closes its port


def _collect(conns: dict, procs: dict, deadline: float, timeout: float) -> list:
    """Each rank's answer, read as it comes; a rank that raised or died fails the call."""
    results: dict[int, Any] = {}
    while len(results) < len(procs):
        pending = [r for r in procs if r not in results]
        left = deadline - time.monotonic()
        if left <= 0 or not wait([conns[r] for r in pending], timeout=left):
            raise AssertionError(f"ranks {pending} did not answer within {timeout:.0f} s")
        for r in pending:
            if not conns[r].poll():
                continue
            try:
                ok, value = pickle.loads(conns[r].recv_bytes())
            except EOFError:  # it closed its pipe without a word: it died
                procs[r].join(timeout=5)
                raise AssertionError(
                    f"rank {r} died without answering (exit code {procs[r].exitcode})"
                ) from None
            if not ok:
                raise AssertionError(f"rank {r} raised:\n{value}")
            results[r] = value
    return [results[r] for r in range(len(procs))]
