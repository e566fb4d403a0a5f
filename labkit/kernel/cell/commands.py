"""Run a command such as torchrun from a cell, and end its whole process tree when the cell is
stopped or runs past its timeout (kernel side).

`subprocess.run` ends only its own child, and with SIGKILL: a torchrun killed that way cannot
stop its workers, which then live on with no parent, holding CPU, memory and ports.
`run_command` sends the command SIGTERM first (torchrun's agent then stops its workers and
exits), waits up to `grace` seconds, and then SIGKILLs, by pid, whatever is left of the process
tree it saw. Only processes that the command started are ever signalled.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from typing import Any

Key = tuple[int, int]  # (pid, start time in clock ticks): a reused pid is never mistaken for it
KILLED_WAIT_S = 5.0  # how long end_tree waits for killed processes to be gone


def run_command(
    cmd: Sequence[Any],
    *,
    timeout: float | None = None,
    grace: float = 10.0,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `cmd` (a list of arguments), capture its stdout and stderr as text, and return a
    `subprocess.CompletedProcess`, as `subprocess.run(cmd, capture_output=True, text=True)`.

    On Stop (KeyboardInterrupt) or past `timeout` seconds, the command gets SIGTERM and `grace`
    seconds to end its own children; what is still running then is killed. The exception is
    raised again: `subprocess.TimeoutExpired` carries the output captured so far. Kernel side
    (or any process): the command runs as a child of the caller, not on the lab's ranks.
    Example::

        done = labkit.run_command(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "train.py"],
            timeout=600,
        )
        print(done.returncode, done.stdout[-500:])
    """
    if isinstance(cmd, (str, bytes)) or not isinstance(cmd, Sequence) or not cmd:
        raise TypeError(
            "cmd must be a non-empty list of arguments, such as [sys.executable, '-m', "
            f"'torch.distributed.run', '--nproc-per-node=2', 'train.py'], got {cmd!r}"
        )
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout}")
    if grace < 0:
        raise ValueError(f"grace must be >= 0 seconds, got {grace}")
    args = [os.fspath(a) if isinstance(a, os.PathLike) else str(a) for a in cmd]
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=None if env is None else dict(env),
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = end_tree(proc, grace)
        raise subprocess.TimeoutExpired(args, timeout or 0.0, output=out, stderr=err) from None
    except BaseException:
        end_tree(proc, grace)
        raise
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def end_tree(proc: subprocess.Popen[str], grace: float) -> tuple[str, str]:
    """SIGTERM `proc`, wait up to `grace` s for it, then SIGKILL what is left of its tree (the
    descendants seen before and after, by pid and start time). Returns the output left."""
    seen = tree(proc.pid)
    deadline = time.monotonic() + grace
    out = err = ""
    try:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=grace)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):  # a second Stop: no more waiting
        seen |= tree(proc.pid)
        proc.kill()
        deadline = time.monotonic()
    seen |= tree(proc.pid)
    while any(_alive(k) for k in seen) and time.monotonic() < deadline:
        time.sleep(0.05)  # the command's children end on their own after its SIGTERM
    for pid, start in seen:
        if _alive((pid, start)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    until = time.monotonic() + KILLED_WAIT_S  # SIGKILL is not instant: return once they are gone
    while any(_alive(k) for k in seen) and time.monotonic() < until:
        time.sleep(0.01)
    if proc.returncode is None:
        try:
            more_out, more_err = proc.communicate(timeout=5.0)
            out, err = out + (more_out or ""), err + (more_err or "")
        except subprocess.TimeoutExpired:  # a pipe held open by a process outside the tree
            proc.kill()
            proc.wait()
    return out or "", err or ""


def tree(pid: int) -> set[Key]:
    """The live descendants of `pid` (not `pid` itself), read from /proc (Linux)."""
    found: set[Key] = set()
    todo = [pid]
    while todo:
        for child in _children(todo.pop()):
            start = _start(child)
            if start is not None:
                found.add((child, start))
                todo.append(child)
    return found


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return kids


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[19])


def _start(pid: int) -> int | None:
    st = _stat(pid)
    return None if st is None else st[1]


def _alive(key: Key) -> bool:
    st = _stat(key[0])
    return st is not None and st[0] != "Z" and st[1] == key[1]
