"""The test harness itself: run_ranks, the /proc helpers of the orphan check, the CPU load."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import processes
import pytest
import torch
from distributed import run_ranks
from load import busy_cpus
from processes import alive, descendants, describe, end, key, started_by_tests, wait_gone

SLEEP = "import time; time.sleep(60)"


def _many_tensors(rank, world_size):
    return [torch.full((16,), float(rank)) for _ in range(300)]


def _dies(rank, world_size):
    if rank == 1:
        os._exit(3)
    return rank


@pytest.mark.parametrize("attempt", range(3))
def test_run_ranks_returns_tensors_from_ranks_that_exit_at_once(attempt):
    # each rank exits right after answering; with a multiprocessing queue the test process
    # then failed to fetch the tensors' shared memory from the gone rank (FileNotFoundError)
    out = run_ranks(_many_tensors, 2)
    assert [len(v) for v in out] == [300, 300]
    assert [v[-1].tolist() for v in out] == [[0.0] * 16, [1.0] * 16]


def test_run_ranks_names_a_rank_that_died_without_answering():
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank 1 died without answering \(exit code 3\)"):
        run_ranks(_dies, 2, timeout=120)
    assert time.monotonic() - t0 < 60  # told when it died, not at the timeout


def test_descendants_include_an_orphan_and_end_stops_them_by_key():
    # a child starts a grandchild and exits: the test process (a subreaper) adopts it
    code = (
        "import subprocess, sys\n"
        f"p = subprocess.Popen([sys.executable, '-c', {SLEEP!r}],\n"
        "    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(p.pid)"
    )
    pid = int(subprocess.run([sys.executable, "-c", code], capture_output=True).stdout)
    orphan = key(pid)
    assert orphan is not None and orphan in descendants()
    assert f"pid {pid}: " in describe({orphan}) and "time.sleep(60)" in describe({orphan})
    assert wait_gone({orphan}, 0.2) == {orphan}
    assert end({orphan}) == set() and not alive(orphan)
    assert orphan not in descendants()  # a zombie counts as gone


def test_what_runs_beside_the_tests_is_not_counted_as_started_by_the_test(monkeypatch):
    # the notebooks' runner and its kernels are descendants too: a test that counts what it
    # left running must not count them (a notebook's ranks started meanwhile failed CI)
    child = f"subprocess.Popen([sys.executable, '-c', {SLEEP!r}])"
    code = f"import subprocess, sys, time; {child}; {SLEEP}"
    beside = subprocess.Popen([sys.executable, "-c", code])
    own = subprocess.Popen([sys.executable, "-c", SLEEP])
    try:
        deadline = time.monotonic() + 60
        while len(descendants() & processes.subtree({key(beside.pid)})) < 2:
            assert time.monotonic() < deadline, "the grandchild never started"
            time.sleep(0.05)
        below = processes.subtree({key(beside.pid)})
        monkeypatch.setattr(processes, "BESIDE", {key(beside.pid)})
        mine = started_by_tests()
        assert key(own.pid) in mine and not below & mine and below <= descendants()
    finally:
        end(processes.subtree({key(beside.pid)}) | {key(own.pid)})
        beside.wait()
        own.wait()


def test_a_reused_pid_is_not_the_same_process():
    p = subprocess.Popen([sys.executable, "-c", SLEEP])
    try:
        k = key(p.pid)
        assert k is not None and alive(k)
        assert not alive((p.pid, k[1] + 1))  # same pid, another start time
    finally:
        p.kill()
        p.wait()


def test_busy_cpus_saturate_and_end():
    with busy_cpus() as pids:
        assert len(pids) >= 2
        time.sleep(0.5)
        keys = {key(p) for p in pids}
        ticks = [_cpu_ticks(p) for p in pids]
        time.sleep(1.0)
        assert all(_cpu_ticks(p) > t for p, t in zip(pids, ticks)), "a busy loop is not running"
    assert not any(k and alive(k) for k in keys)


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime
