"""Large tensors through shared memory instead of the sockets (runs on both sides).

A forked lab and its ranks share one machine, so a tensor of `MIN_BYTES` or more need not be
copied through a Unix socket: the sender writes its bytes into a file in the lab's own
directory under /dev/shm (made by `new_dir`, mode 0700, named `labkit-shm-*`), created with
`O_EXCL` and mode 0600 under a random name, and only its path travels, inside the signed
message (`labkit.wire.codec`). The receiver checks the path, opens the file, unlinks it at once
and maps it copy-on-write: the tensor it gets is backed by that mapping (no copy in the
receiver), and the memory goes back to the system when the tensor is freed. A request the
kernel sends to several ranks writes each tensor once: every rank maps the same file (its
writes stay its own) without unlinking it, and the kernel reuses or unlinks it once every rank
has replied (`Shared.settle`, below).

Segments a rank sends to the kernel are recycled: writing into fresh tmpfs pages, and freeing
them, costs several times a copy (page allocation), so each rank keeps up to `POOL_BYTES` of
segments (a `Pool`). The kernel maps such a segment without unlinking it; when the last tensor
using the mapping is freed, it renames the file to `<name>.free`, and the rank takes it back by
renaming it again (atomic: a segment is either the kernel's or the rank's) and writes the next
tensor into its pages. A segment is never written while the kernel maps it, so a tensor the
kernel keeps never changes under it.

Segments the kernel sends to several ranks are recycled too (a `Shared` pool, the same
`POOL_BYTES`): each rank that maps one holds a hard link to it (`<name>.hold-<random>`) until
its tensor is freed, and the kernel writes a segment again only once every rank answered the
message that named it and its link count is back to 1. A child a rank forks (a DataLoader
worker, say) inherits its mappings, so it makes holds of its own at once (`_hold_again`).

Nothing is left in /dev/shm: a file whose message was never received (its sender or receiver
died, or the message was dropped) lies in the lab's directory, which the kernel empties at each
restart and removes at stop, and which the fork server removes when the kernel dies
(`labkit.rank.fork_server`). Ranks attached over TCP (torchrun, other machines) never use it.
"""

from __future__ import annotations

import mmap
import os
import secrets
import shutil
import tempfile
import warnings
import weakref
from typing import Any

ROOT = "/dev/shm"
PREFIX = "labkit-shm-"
MIN_BYTES = 1 << 20  # smaller tensors go through the socket: a file costs more than it saves
POOL_BYTES = 64 << 20  # segments one rank keeps for reuse (the rest are unlinked when mapped)
FREE = ".free"  # suffix of a recycled segment that the kernel no longer maps
HOLD = ".hold-"  # a rank's hard link to a `Shared` segment it maps (the rest is random)
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux


def new_dir() -> str | None:
    """A private (0700) directory for one lab's segments, or None where /dev/shm is missing."""
    if not os.path.isdir(ROOT) or not os.access(ROOT, os.W_OK):
        return None
    return tempfile.mkdtemp(prefix=PREFIX, dir=ROOT)


def is_lab_dir(path: str) -> bool:
    """Whether `path` is a segment directory labkit made (what the cleanups may remove)."""
    return os.path.dirname(path) == ROOT and os.path.basename(path).startswith(PREFIX)


def sweep(directory: str | None) -> None:
    """Unlink every segment left in `directory` (messages that were never received)."""
    if directory is None or not is_lab_dir(directory):
        return
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        try:
            os.unlink(os.path.join(directory, name))
        except OSError:
            pass


def remove(directory: str | None) -> None:
    """Remove a lab's segment directory and whatever is in it."""
    if directory is not None and is_lab_dir(directory):
        shutil.rmtree(directory, ignore_errors=True)


def release(paths: list[str]) -> None:
    """Unlink segments that every receiver has mapped (a message sent to several ranks)."""
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass


def write(directory: str, raw: memoryview) -> str:
    """Write `raw` (bytes of a contiguous tensor) into a new 0600 segment; returns its path."""
    path = os.path.join(directory, secrets.token_hex(16))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        done, total = 0, raw.nbytes
        while done < total:
            done += os.write(fd, raw[done : done + (1 << 30)])
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return path


class Pool:
    """The segments one sender (a rank) reuses: `write` fills a free one when it can."""

    def __init__(self, limit: int = POOL_BYTES):
        self.limit = limit
        self.owned: dict[str, tuple[int, mmap.mmap]] = {}  # path -> (size, shared mapping)
        self.written: list[str] | None = None  # while a list: the paths `write` hands out

    def write(self, directory: str, raw: memoryview) -> tuple[str, bool]:
        """Write `raw` into a segment; returns its path and whether the receiver gives it back
        (`recycle`) rather than unlinking it."""
        path, pooled = self._write(directory, raw)
        if self.written is not None:
            self.written.append(path)
        return path, pooled

    def give_back(self, paths: list[str]) -> None:
        """The segments of a message that was never sent: free for reuse, or removed."""
        for path in paths:
            try:
                if path in self.owned:
                    os.rename(path, path + FREE)
                else:
                    os.unlink(path)
            except OSError:  # swept meanwhile
                pass

    def _write(self, directory: str, raw: memoryview) -> tuple[str, bool]:
        nbytes = raw.nbytes
        for path, (size, mm) in sorted(self.owned.items(), key=lambda kv: kv[1][0] != nbytes):
            if size < nbytes and self.used() - size + nbytes > self.limit:
                continue
            if not self._take(path):
                continue
            if size != nbytes:
                mm = self._map(path, nbytes)
            mm[:nbytes] = raw
            self.owned[path] = (nbytes, mm)
            return path, True
        path = write(directory, raw)
        if self.used() + nbytes > self.limit:
            return path, False
        try:
            self.owned[path] = (nbytes, self._map(path, nbytes))
        except OSError:
            return path, False
        return path, True

    def used(self) -> int:
        return sum(size for size, _ in self.owned.values())

    def clear(self) -> None:
        """Forget every segment (the lab's directory was swept or removed)."""
        for _, mm in self.owned.values():
            mm.close()
        self.owned.clear()

    def _take(self, path: str) -> bool:
        try:
            os.rename(path + FREE, path)  # taken back: the kernel no longer maps it
        except OSError:
            return False  # still in use (or swept)
        return True

    def _map(self, path: str, nbytes: int) -> mmap.mmap:
        old = self.owned.pop(path, None)
        if old is not None:
            old[1].close()
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            os.ftruncate(fd, nbytes)
            # populated: the first reuse writes into mapped pages, not through 4 KiB faults
            return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE)
        finally:
            os.close(fd)


class Shared(Pool):
    """The segments the kernel reuses for messages to several ranks. `write` names a segment
    busy until `settle` says whether every rank answered its message; an answered segment is
    written again once no rank holds a link to it."""

    def __init__(self, limit: int = POOL_BYTES):
        super().__init__(limit)
        self.busy: set[str] = set()

    def write(self, directory: str, raw: memoryview) -> tuple[str, bool]:
        path, pooled = super().write(directory, raw)
        if pooled:
            self.busy.add(path)
        return path, pooled

    def settle(self, paths: list[str], answered: bool) -> None:
        """A message's segments: unlinked (not pooled, every rank answered), kept for reuse
        (pooled, every rank answered) or left for the restart's sweep (not answered)."""
        for path in paths:
            self.busy.discard(path)
            if path not in self.owned:
                if answered:
                    release([path])
            elif not answered:
                self.owned.pop(path)[1].close()

    def clear(self) -> None:
        super().clear()
        self.busy.clear()

    def _take(self, path: str) -> bool:
        if path in self.busy:
            return False
        try:
            return os.stat(path).st_nlink == 1  # no rank holds it any more
        except OSError:  # swept
            self.owned.pop(path)[1].close()
            return False


_HELD: weakref.WeakKeyDictionary[mmap.mmap, str] = weakref.WeakKeyDictionary()  # -> segment


def _hold(buf: mmap.mmap, path: str) -> None:
    """Link to `path` for as long as this process maps it through `buf`."""
    link = path + HOLD + secrets.token_hex(8)
    os.link(path, link, follow_symlinks=False)
    weakref.finalize(buf, _unhold, link, os.getpid()).atexit = False
    _HELD[buf] = path


def _hold_again() -> None:
    """In a forked child: the mappings it inherited are its own to hold (else the kernel could
    rewrite a segment once the parent freed its tensor). A child that ends without running
    finalizers (`os._exit`) leaves its holds, and the segment is not reused until a restart."""
    for buf, path in list(_HELD.items()):
        try:
            _hold(buf, path)
        except OSError:  # swept (a restart), or the lab stopped
            pass


os.register_at_fork(after_in_child=_hold_again)


def _unhold(link: str, pid: int) -> None:
    """A rank's last tensor on a `Shared` segment is gone: drop its hold (see `_give_back`)."""
    if os.getpid() == pid:
        try:
            os.unlink(link)
        except OSError:
            pass


def _give_back(path: str, pid: int) -> None:
    """The kernel's last tensor on a recycled segment is gone: the rank may write it again.
    Only the process that mapped it gives it back (not a forked child freeing its copy)."""
    if os.getpid() != pid:
        return
    try:
        os.rename(path, path + FREE)
    except OSError:  # swept at a restart, or the lab stopped
        pass


def read(
    path: str, nbytes: int, unlink: bool = True, recycle: bool = False, hold: bool = False
) -> mmap.mmap:
    """Open, unlink (unless the sender will: a message to several ranks, or a segment to give
    back) and map (copy-on-write) a segment that a signed message named. `recycle`: rename it
    for its sender to reuse once the mapping is freed. `hold`: link to it until then (a
    `Shared` segment, which the kernel writes again once no rank holds it)."""
    directory = os.path.dirname(path)
    if not is_lab_dir(directory) or os.path.basename(path) in ("", ".", ".."):
        raise ValueError(f"not a labkit shared-memory segment: {path!r}")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        if unlink and not recycle and not hold:
            os.unlink(path)  # the mapping keeps the memory; the name goes at once
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise ValueError(f"segment {path} holds {size} bytes, the message said {nbytes}")
        buf = mmap.mmap(fd, nbytes, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    if hold:  # before the rank replies: the kernel only rewrites a segment nobody links to
        _hold(buf, path)  # (an error here fails the message: its tensor is never used)
    if recycle:  # when every tensor (and view) on the mapping is gone, and it is unmapped
        weakref.finalize(buf, _give_back, path, os.getpid()).atexit = False
    return buf


def rebuild_tensor(
    path: str,
    nbytes: int,
    dtype: str,
    shape: tuple[int, ...],
    requires_grad: bool,
    is_param: bool,
    unlink: bool = True,
    recycle: bool = False,
    hold: bool = False,
) -> Any:
    """The receiver's half (called while a verified message is unpickled)."""
    import torch

    buf = read(path, nbytes, unlink, recycle, hold)
    with warnings.catch_warnings():  # torch warns about non-writable buffers; this one is ours
        warnings.simplefilter("ignore", UserWarning)
        t = torch.frombuffer(buf, dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)
    if is_param:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad) if requires_grad else t
