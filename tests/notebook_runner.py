"""Runs notebooks a few at a time in a process of its own, beside the rest of the suite (test
harness; `python notebook_runner.py OUT.json JOBS PATH...`).

The suite starts it when its first test starts (conftest's `notebook_batch`), so the notebooks,
which mostly wait (kernels and ranks starting, collectives waiting for peers), run while the
other tests do, at a lower CPU priority (nice 10): they fill the gaps the other tests leave
rather than slowing the tests that time Stop and watchdogs; tests/test_notebooks.py reads
OUT.json at the end. This process adopts the orphans of its descendants (a rank whose kernel
died), and before it writes OUT.json it waits for every process the notebooks started, ending
and naming any that is left.
"""

from __future__ import annotations

import json
import multiprocessing.resource_tracker
import os
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from processes import become_subreaper, descendants, describe, end, wait_gone

from labkit.tools.cli import execute_notebook

# where each notebook that passed is saved, executed, for the course site (tests/test_notebooks.py)
SAVE_DIR = os.environ.get("LABKIT_EXECUTED_DIR") or None


NICE = 10  # the notebooks yield the CPU to the other tests, whose timing matters more


def main(out: str, jobs: int, paths: list[str]) -> None:
    become_subreaper()
    os.nice(NICE)  # inherited by the kernels and ranks the notebooks start
    t0 = time.perf_counter()
    spans: dict[str, list[float]] = {}  # path -> [started, ended], seconds after t0

    def run(path: str) -> tuple[bool, float, str, str]:
        """(passed, seconds, the error's summary, the whole error: the failed cell, its
        traceback)."""
        spans[path] = [time.perf_counter() - t0]
        try:
            return execute_notebook(path, 600, SAVE_DIR)
        finally:
            spans[path].append(time.perf_counter() - t0)

    with ThreadPoolExecutor(jobs) as pool:
        runs = list(pool.map(run, paths))
    tracker = getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None)
    left = wait_gone({k for k in descendants(os.getpid()) if k[0] != tracker}, 5.0)
    named = describe(left) if left else ""
    end(left)
    used = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    result = {
        "wall": time.perf_counter() - t0,
        "jobs": jobs,
        "nice": NICE,
        "runs": {p: list(r) for p, r in zip(paths, runs)},
        "spans": spans,
        # CPU seconds of this process and every descendant it reaped (kernels, ranks)
        "cpu": sum(u.ru_utime + u.ru_stime for u in used),
        "left": named,
    }
    with open(out + ".part", "w") as f:
        json.dump(result, f)
    os.replace(out + ".part", out)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
