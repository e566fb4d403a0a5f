"""The Stop board of a forked lab: one number both sides map (written by the kernel, read by
its ranks).

A rank must not start a cell whose Stop was pressed before the rank took it, so each rank
looks for a Stop at the start of every cell. Reading the side socket there (ZeroMQ) cost a
rank 20-30 us of a no-op cell after a pause, four ranks' worth on the cell's two cores. On one
machine the kernel also writes the Stop here: the highest cell id Stop was pressed for, an
8-byte integer in a 0600 file in the channel's private 0700 directory, which every forked rank
maps read-only. A rank's check is then one read of its own memory, and only a cell whose id the
board has reached goes on to read the side socket (labkit.rank.side).

The board only says "Stop was pressed for cell N". The `interrupt` message on the side socket
still goes to each rank: it is what interrupts a cell that has started, and what ranks
attached over TCP, which have no board, go by. The kernel writes the board before it queues
the message, so a rank that reads the message has the board's value too. Cell ids only grow
for a lab's lifetime, so a value never stops a later cell.

No message is unpickled from the board: it holds a number, in a file only this user can open.
"""

from __future__ import annotations

import mmap
import os

SIZE = 8  # one little-endian signed 64-bit integer, aligned: one store, one load


class StopBoard:
    """The board at `path`: `create` (the kernel's, writable) or map an existing one (a rank's,
    read-only)."""

    def __init__(self, path: str, create: bool = False):
        self.path = path
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL if create else os.O_RDONLY
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, SIZE)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if create else 0)
            self._map = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, prot)
        finally:
            os.close(fd)
        self.cells = memoryview(self._map).cast("q")  # cells[0]: the latest cell stopped

    def latest(self) -> int:
        """The highest cell id Stop was pressed for (0: none yet)."""
        return self.cells[0]

    def press(self, cell: int) -> None:
        """Stop pressed for `cell` (kernel side); the board never goes back."""
        if cell > self.cells[0]:
            self.cells[0] = cell

    def close(self) -> None:
        self.cells.release()
        self._map.close()
