"""A soak: thousands of cells and hundreds of restarts in one kernel (run from a shell).

    python -m labkit.tools.soak --cells 5000 --restarts 200 --ranks 2

Runs small cells (no-ops, all_reduce, printing, a value back) on a CPU lab, restarting the
ranks evenly in between, and prints kernel and rank memory (RSS), open file descriptors and
threads at the start and at the end, plus the fork server's live children (ranks), so a leak
shows as a growing number. `soak()` returns the same figures for tests.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from typing import Any

CELLS = (
    "None",
    "t = torch.ones(4)\ndist.all_reduce(t)",
    "print('soak', rank)",
    "rank * 2",
)
RANK_PROBE = (
    "import os, threading\n"
    "(int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0]) // 1024,\n"
    " len(os.listdir('/proc/self/fd')), threading.active_count())"
)


def _kernel_figures(server_pid: int | None) -> dict[str, float]:
    with open("/proc/self/status") as f:
        status = f.read()
    rss = int(status.split("VmRSS:")[1].split()[0]) // 1024
    children = 0
    if server_pid is not None:
        try:
            with open(f"/proc/{server_pid}/task/{server_pid}/children") as f:
                children = len(f.read().split())
        except OSError:
            pass
    return {
        "kernel RSS MiB": rss,
        "kernel fds": len(os.listdir("/proc/self/fd")),
        "kernel threads": threading.active_count(),
        "live rank processes": children,
    }


def _figures(lab: Any) -> dict[str, float]:
    figures = _kernel_figures(lab.server.proc.pid if lab.server else None)
    ranks = lab.run(RANK_PROBE, display=False).values_by_rank
    figures["rank RSS MiB (max)"] = max(v[0] for v in ranks.values())
    figures["rank fds (max)"] = max(v[1] for v in ranks.values())
    figures["rank threads (max)"] = max(v[2] for v in ranks.values())
    return figures


def soak(cells: int, restarts: int, ranks: int = 2, quiet: bool = True) -> dict[str, Any]:
    """Run the soak; return {"start": figures, "end": figures, "seconds": s, ...}."""
    import contextlib
    import io

    from labkit.kernel.lab import Lab

    sink = io.StringIO()
    with Lab(ranks, device="cpu") as lab:
        for _ in range(20):  # warm up: first-use allocations are not leaks
            lab.run(CELLS[1])
        start = _figures(lab)
        every = max(1, cells // (restarts + 1)) if restarts else cells + 1
        done_restarts = 0
        t0 = time.perf_counter()
        for i in range(cells):
            with contextlib.redirect_stdout(sink) if quiet else contextlib.nullcontext():
                lab.run(CELLS[i % len(CELLS)], display=False)
            if i % 500 == 0:
                sink.seek(0)
                sink.truncate()
            if (i + 1) % every == 0 and done_restarts < restarts:
                lab.restart()
                done_restarts += 1
        while done_restarts < restarts:
            lab.restart()
            done_restarts += 1
        seconds = time.perf_counter() - t0
        for _ in range(20):
            lab.run(CELLS[1])
        end = _figures(lab)
    return {
        "start": start,
        "end": end,
        "seconds": seconds,
        "cells": cells,
        "restarts": done_restarts,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m labkit.tools.soak", description=__doc__.split("\n")[0]
    )
    p.add_argument("--cells", type=int, default=5000)
    p.add_argument("--restarts", type=int, default=200)
    p.add_argument("--ranks", type=int, default=2)
    args = p.parse_args(argv)
    out = soak(args.cells, args.restarts, args.ranks)
    print(
        f"{out['cells']} cells and {out['restarts']} restarts on {args.ranks} CPU ranks "
        f"in {out['seconds']:.1f} s"
    )
    print(f"{'figure':<24}{'start':>10}{'end':>10}{'change':>10}")
    for name, first in out["start"].items():
        last = out["end"][name]
        print(f"{name:<24}{first:>10}{last:>10}{last - first:>+10}")


if __name__ == "__main__":
    main()
