"""labkit.run_command: a command run from a cell (torchrun, or a stand-in that starts children
the way torchrun's agent does) is ended with its whole tree on a timeout and on Stop, where
subprocess.run leaves the children running without a parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from processes import alive, pid_alive, started_by_tests

from labkit import run_command
from labkit.kernel.cell.commands import end_tree, tree

# An "agent" that starts two workers which sleep, prints their pids, and (like torchrun's
# agent) on SIGTERM ends its workers before exiting, unless told to ignore SIGTERM.
AGENT = r"""
import signal, subprocess, sys, time
workers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
           for _ in range(2)]
def stop(*_):
    for w in workers:
        w.terminate()
    for w in workers:
        w.wait()
    sys.exit(3)
signal.signal(signal.SIGTERM, signal.SIG_IGN if sys.argv[1] == "ignore" else stop)
print(" ".join(str(w.pid) for w in workers), flush=True)
time.sleep(600)
"""


def _agent(mode: str) -> list[str]:
    return [sys.executable, "-c", AGENT, mode]


def _left(before: set[tuple[int, int]]) -> set[tuple[int, int]]:
    return {k for k in started_by_tests() - before if alive(k)}


@pytest.mark.timeout(60)
def test_returns_what_subprocess_run_returns() -> None:
    cmd = [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); exit(4)"]
    got = run_command(cmd, timeout=30)
    want = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout, want.stderr)
    assert got.returncode == 4 and got.stdout == "out\n" and got.stderr == "err\n"
    assert got.args == cmd
    assert run_command([Path(sys.executable), "-c", "print(1)"]).stdout == "1\n"  # paths too


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["obeys", "ignore"])
def test_timeout_ends_the_command_and_its_children(mode: str) -> None:
    before = started_by_tests()
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        run_command(_agent(mode), timeout=3, grace=2)
    took = time.monotonic() - t0
    pids = {int(p) for p in caught.value.output.split()}  # the output so far comes with it
    assert len(pids) == 2, caught.value.output
    deadline = time.monotonic() + 5
    while _left(before) and time.monotonic() < deadline:  # only zombies may be left to reap
        time.sleep(0.05)
    assert not _left(before), f"left running: {_left(before)}"
    # one that obeys SIGTERM ends at once; one that ignores it is killed after the grace
    assert took < 3 + (2 if mode == "obeys" else 4) + 5, took


@pytest.mark.timeout(60)
def test_subprocess_run_leaves_the_children_this_ends() -> None:
    """The defect run_command exists for, shown: the workers outlive subprocess.run."""
    before = started_by_tests()
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        subprocess.run(_agent("obeys"), capture_output=True, text=True, timeout=3)
    pids = {int(p) for p in (caught.value.output or b"").split()}
    left = _left(before)
    assert {pid for pid, _ in left} == pids  # both workers still run, their agent gone
    for pid, _ in left:  # ours to end (by pid)
        os.kill(pid, 9)


def press_stop() -> None:
    """What Kernel > Interrupt does to a running cell: SIGINT, to the main thread."""
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_stop_ends_the_tree_and_raises_keyboard_interrupt() -> None:
    before = started_by_tests()
    seen: list[set[tuple[int, int]]] = []

    def stop_once_running() -> None:
        deadline = time.monotonic() + 20
        while len(_left(before)) < 3 and time.monotonic() < deadline:  # agent + 2 workers
            time.sleep(0.05)
        seen.append(_left(before))
        press_stop()

    threading.Thread(target=stop_once_running, daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_command(_agent("obeys"), timeout=40, grace=5)
    assert time.monotonic() - t0 < 30  # Stop ended it, not the timeout
    assert len(seen[0]) == 3, seen
    assert not any(alive(k) for k in seen[0])


WAIT = """import os, pathlib, time
pathlib.Path(f"w{os.environ['RANK']}").write_text(str(os.getpid()))
time.sleep(600)
"""


@pytest.mark.timeout(180)
def test_torchrun_stopped_leaves_no_worker(tmp_path: Path) -> None:
    # real torchrun, stopped: it gets SIGTERM and ends its workers (the timeout path is the
    # same ending, covered by the stand-in agent above without waiting out a 25 s timeout)
    (tmp_path / "wait.py").write_text(WAIT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    before = started_by_tests()
    workers: list[int] = []

    def watch() -> None:  # note the workers once both run, then press Stop
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if all((tmp_path / f"w{r}").exists() for r in (0, 1)):
                time.sleep(0.2)  # both pids written in full
                workers.extend(int((tmp_path / f"w{r}").read_text()) for r in (0, 1))
                press_stop()
                return
            time.sleep(0.1)

    threading.Thread(target=watch, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        run_command([*cmd, "wait.py"], timeout=120, grace=20, cwd=tmp_path)
    assert len(workers) == 2, "torchrun's workers never started"
    deadline = time.monotonic() + 5
    while _left(before) and time.monotonic() < deadline:  # only zombies may be left to reap
        time.sleep(0.05)
    assert not _left(before), f"left running: {_left(before)}"
    assert not any(pid_alive(pid) for pid in workers)


@pytest.mark.timeout(60)
def test_tree_finds_the_grandchildren_and_end_tree_ends_them() -> None:
    agent = subprocess.Popen(_agent("ignore"), stdout=subprocess.PIPE, text=True)
    pids = {int(p) for p in agent.stdout.readline().split()}  # type: ignore[union-attr]
    found = tree(agent.pid)
    assert {pid for pid, _ in found} == pids  # the two workers, not the agent itself
    assert tree(next(iter(pids))) == set()  # a worker has no children
    end_tree(agent, grace=1)  # the agent ignores SIGTERM: killed after the grace, with them
    assert agent.returncode == -9
    assert not any(alive(k) for k in found)


@pytest.mark.parametrize(
    "cmd, match",
    [
        ("torchrun train.py", "non-empty list of arguments"),
        ([], "non-empty list of arguments"),
    ],
)
def test_bad_commands_say_what_is_allowed(cmd: object, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        run_command(cmd)  # type: ignore[arg-type]


def test_bad_timeout_and_grace() -> None:
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        run_command([sys.executable, "-c", "pass"], timeout=0)
    with pytest.raises(ValueError, match="grace must be >= 0"):
        run_command([sys.executable, "-c", "pass"], grace=-1)
