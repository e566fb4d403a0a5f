"""`import labkit` has no side effect, even inside a Jupyter kernel; prewarming is explicit."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

# Runs in a fresh interpreter that looks like a Jupyter kernel's (ipykernel imported), and
# prints how many child processes and threads it has at each step.
PROBE = textwrap.dedent(
    """
    import os, sys, threading
    import ipykernel  # what made labkit prewarm at import time

    def children():
        return len(open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split())

    print("before", children(), threading.active_count())
    import labkit
    labkit.Lab, labkit.show_tensors, labkit.load_ipython_extension  # the lazy names load too
    print("imported", children(), threading.active_count())
    if "prewarm" in sys.argv:
        labkit.prewarm()
        print("prewarmed", children(), threading.active_count())
        from labkit.kernel.launch import spawn
        spawn.take().close()
    """
)


def _probe(*args: str, env: dict[str, str] | None = None) -> dict[str, tuple[int, int]]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.split()[0].isalpha()]
    return {name: (int(kids), int(threads)) for name, kids, threads in rows}


def test_import_inside_a_kernel_starts_nothing():
    counts = _probe()
    assert counts["imported"] == counts["before"], counts


def test_prewarm_starts_a_fork_server():
    # the counting above sees a started process: prewarm() starts exactly one child
    counts = _probe("prewarm")
    assert counts["imported"][0] == counts["before"][0], counts
    assert counts["prewarmed"][0] == counts["before"][0] + 1, counts


def test_fork_server_says_when_its_warm_up_is_done():
    from labkit.kernel.launch import spawn

    server = spawn.ForkServer()
    try:
        server.wait_facts()
        assert server.wait_warm(timeout=90), server.read_log()
    finally:
        server.close()
    assert not server.alive()
