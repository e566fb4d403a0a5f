"""A lab's private directory for its sockets, Stop board and default key file (both sides).

The kernel makes one per lab, `<tmp>/labkit-XXXXXXXX` (`tempfile.mkdtemp`: mode 0700, only its
user gets in), and writes `OWNER` in it: the kernel's host and pid. The kernel removes the
directory when its lab stops; when the kernel is killed, its fork server removes it (forked
ranks), or its attached ranks on that host do (`labkit.wire.key_file.remove_orphaned_key`).
Where neither can (ranks on other hosts, the fork server killed too), the next lab this user
starts on the machine removes it: `sweep()` removes every such directory whose kernel is gone,
and nothing else (no `OWNER`, another host, a pid that runs, a link, another user's: kept).

Imports only the standard library.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time

__all__ = ["OWNER", "kernel_alive", "new", "sweep"]

PREFIX = "labkit-"
OWNER = "kernel"  # "<host> <pid>" of the kernel that made the directory


def new() -> str:
    """A new private directory owned by this process (kernel); older ones of dead kernels go."""
    sweep()
    path = tempfile.mkdtemp(prefix=PREFIX)
    with open(os.path.join(path, OWNER), "w") as f:
        f.write(f"{socket.gethostname()} {os.getpid()}\n")
    return path


def sweep(root: str | None = None) -> list[str]:
    """Remove the directories in `root` (the temporary directory) of this user's kernels on
    this host that are gone; returns what it removed. Never raises."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    host = socket.gethostname()
    for entry in entries:
        if not entry.name.startswith(PREFIX) or entry.is_symlink():
            continue
        try:
            if not entry.is_dir() or entry.stat().st_uid != os.getuid():
                continue
            with open(os.path.join(entry.path, OWNER)) as f:
                owner_host, pid = f.read().split()
        except (OSError, ValueError):  # not a lab's directory, or being made just now
            continue
        if owner_host == host and not kernel_alive(int(pid), wait=0.0):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def kernel_alive(pid: int, wait: float = 1.0) -> bool:
    """Whether `pid` runs; a zombie (killed, its parent has not reaped it yet: Jupyter takes a
    moment) is waited for up to `wait` seconds, then counted as gone."""
    deadline = time.monotonic() + wait
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process has that pid now
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:  # no /proc (macOS): a pid that answers is alive
            return True
        if not zombie:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
