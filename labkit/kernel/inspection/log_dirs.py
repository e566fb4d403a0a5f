"""Where labs keep their ranks' logs, and how much of that is kept (kernel side).

Every lab writes its ranks' logs in a directory of its own, inside one per-user root:
`$LABKIT_LOG_DIR` if set, else `<tmp>/labkit-logs-<uid>` (made 0700; refused if it is a link
or another user's). The logs outlive the lab, so `%lab logs` and a post-mortem still find them,
but not forever: each new lab first removes the oldest directories of labs whose kernel has
exited, keeping at most `KEEP_LABS` of them and at most `KEEP_BYTES` in all. A directory of a
kernel that still runs is never removed. `Lab(log_dir=...)` puts one lab's logs elsewhere, and
nothing prunes that. A fork server's own log (what it printed while starting, quoted when it
fails) lies beside them as `forkserver-pid<kernel>-*.log`, removed when the server closes, or
by the next lab's pruning once its kernel has exited.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import time

ENV = "LABKIT_LOG_DIR"
KEEP_LABS = 20  # directories of exited kernels' labs kept, newest first
KEEP_BYTES = 100 << 20  # and at most this much of them in all
FORK_SERVER_LOG = "forkserver-"  # the name's start of a fork server's log file


def log_root() -> str:
    """The per-user directory the labs' log directories are made in."""
    return os.environ.get(ENV) or os.path.join(tempfile.gettempdir(), f"labkit-logs-{os.getuid()}")


def _own_private_dir(path: str) -> None:
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise RuntimeError(
            f"labkit's log directory {path} is not a directory of this user's (a link, or "
            f"another user's): remove it, or set {ENV} to a directory of your own"
        )
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)


def _kernel_pid(name: str) -> int | None:
    """The kernel pid in a directory name made by `new_log_dir` ("...-pid123-...")."""
    for part in name.split("-"):
        if part.startswith("pid") and part[3:].isdigit():
            return int(part[3:])
    return None


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _size(path: str) -> int:
    total = 0
    for top, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(top, name)).st_size
            except OSError:
                pass
    return total


def prune(root: str, keep: int = KEEP_LABS, keep_bytes: int = KEEP_BYTES) -> list[str]:
    """Remove the oldest log directories of exited kernels' labs beyond `keep` directories or
    `keep_bytes` bytes; return the removed paths. Live kernels' directories are left alone."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    dead = []
    for name in names:
        path = os.path.join(root, name)
        if name.startswith(FORK_SERVER_LOG) and not _alive(_kernel_pid(name)):
            try:  # a killed kernel's fork server never closed: nobody reads its log now
                os.unlink(path)
            except OSError:
                pass
            continue
        if os.path.isdir(path) and not os.path.islink(path) and not _alive(_kernel_pid(name)):
            try:
                dead.append((os.stat(path).st_mtime, path))
            except OSError:
                pass
    dead.sort(reverse=True)  # newest first
    removed, total = [], 0
    for i, (_, path) in enumerate(dead):
        total += _size(path)
        if i >= keep or total > keep_bytes:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def fork_server_log() -> str:
    """A new, empty file for a fork server's output, under `log_root()`."""
    root = log_root()
    _own_private_dir(root)
    fd, path = tempfile.mkstemp(
        prefix=f"{FORK_SERVER_LOG}pid{os.getpid()}-", suffix=".log", dir=root
    )
    os.close(fd)
    return path


def new_log_dir() -> str:
    """A new lab's log directory under `log_root()`, after pruning old ones."""
    root = log_root()
    _own_private_dir(root)
    prune(root)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return tempfile.mkdtemp(prefix=f"{stamp}-pid{os.getpid()}-", dir=root)
