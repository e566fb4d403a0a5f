"""A saturated CPU for tests that must also pass on a busy machine (test process).

`busy_cpus()` starts one `while True: pass` process per CPU this process may run on (at least
two), so every core is contended while the block runs, and ends exactly those processes, by
pid, when it leaves. conftest.py wraps it in fixtures: `cpu_load` for one test, and `load`, a
module-scoped fixture with params "idle" and "loaded" that runs each test of a module twice,
once on a quiet machine and once under load (`pytest -k loaded` runs only the loaded half).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

BUSY = "while True: pass"


def num_busy() -> int:
    """How many busy loops saturate the CPUs this process may use."""
    return max(2, len(os.sched_getaffinity(0)))


@contextmanager
def busy_cpus(n: int | None = None) -> Iterator[list[int]]:
    """Run `n` busy-loop processes (default: one per usable CPU) for the block; yields pids."""
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(n or num_busy()):
            procs.append(subprocess.Popen([sys.executable, "-c", BUSY]))
        yield [p.pid for p in procs]
    finally:
        for p in procs:  # our own children, by their Popen handles
            p.kill()
        for p in procs:
            p.wait()
