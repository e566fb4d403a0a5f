"""The test process's descendants, read from /proc, and ending them by pid (test process, Linux).

A process is named by its key, (pid, start time in clock ticks), so a pid the kernel reuses for
a new process is never mistaken for the old one. Zombies count as gone: they hold no CPU, no
memory and no sockets, only an entry in the process table until their parent reaps them.

`become_subreaper()` makes this process the one that inherits any orphan of its descendants
(PR_SET_CHILD_SUBREAPER) instead of init: a torchrun worker whose agent was killed, or a rank
whose fork server died, is then still a descendant of the test process, so the orphan check
sees it instead of losing it to init.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

Key = tuple[int, int]  # (pid, start time in clock ticks since boot)
PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Adopt the orphans of our descendants (Linux only); False where it is not possible."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return fields[0], int(fields[1]), int(fields[19])


def pid_alive(pid: int) -> bool:
    """True if the process exists and is not a zombie."""
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def alive(key: Key) -> bool:
    """True if the process of `key` (not a later one with its pid) runs and is not a zombie."""
    st = _stat(key[0])
    return st is not None and st[0] != "Z" and st[2] == key[1]


def table() -> dict[int, tuple[str, int, int]]:
    """{pid: (state, ppid, start time)} of every process, read once from /proc."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                out[int(name)] = st
    return out


def descendants(*roots: int, procs: dict[int, tuple[str, int, int]] | None = None) -> set[Key]:
    """Every live, non-zombie process below `roots` (default: this process), by key."""
    procs = table() if procs is None else procs
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    found: set[Key] = set()
    todo = list(roots or [os.getpid()])
    while todo:
        for pid in children.get(todo.pop(), []):
            todo.append(pid)
            state, _, start = procs[pid]
            if state != "Z":
                found.add((pid, start))
    return found


BESIDE: set[Key] = set()  # processes that run beside the tests (the notebooks' runner)


def started_by_tests(procs: dict[int, tuple[str, int, int]] | None = None) -> set[Key]:
    """This process's live descendants less those running beside the tests (`BESIDE` and
    everything below them): what the running test and the fixtures it uses started."""
    procs = table() if procs is None else procs
    return descendants(procs=procs) - subtree(BESIDE, procs)


def subtree(keys: set[Key], procs: dict[int, tuple[str, int, int]] | None = None) -> set[Key]:
    """`keys` still alive, with every live descendant of each."""
    procs = table() if procs is None else procs
    live = {k for k in keys if k[0] in procs and procs[k[0]][0] != "Z" and procs[k[0]][2] == k[1]}
    return live | descendants(*(pid for pid, _ in live), procs=procs) if live else set()


def describe(keys: set[Key]) -> str:
    """One line per process: its pid and command line."""
    lines = []
    for pid, _ in sorted(keys):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            cmd = "?"
        lines.append(f"  pid {pid}: {cmd[:200] or '?'}")
    return "\n".join(lines)


def wait_gone(keys: set[Key], timeout: float) -> set[Key]:
    """Poll until every process of `keys` has ended or `timeout` passes; those left."""
    deadline = time.monotonic() + timeout
    left = {k for k in keys if alive(k)}
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = {k for k in left if alive(k)}
    return left


def end(keys: set[Key], grace: float = 5.0) -> set[Key]:
    """SIGTERM each process, wait up to `grace` s, then SIGKILL; those that outlived even that."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for key in keys:
            if alive(key):  # checked just before, so a reused pid is not hit
                try:
                    os.kill(key[0], sig)
                except ProcessLookupError:
                    pass
        keys = wait_gone(keys, wait)
        if not keys:
            break
    return keys


def key(pid: int) -> Key | None:
    """The key of a running process, or None if it is gone."""
    st = _stat(pid)
    return None if st is None or st[0] == "Z" else (pid, st[2])
