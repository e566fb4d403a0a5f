"""Multipart messages over a Unix stream socket: the ctrl link of forked ranks (both sides).

ZeroMQ hands every message to an I/O thread of its own on each side, so a request and its reply
wake four threads besides the two that send and read them. A forked rank's ctrl link is a plain
Unix stream socket instead: the kernel writes a request straight into the rank's socket, and the
rank's main thread, blocked in `recv`, is the one that wakes (labkit.kernel.channel.direct is the
kernel's end, labkit.rank.link the rank's). Ranks attached over TCP keep ZeroMQ.

A message is a list of frames (what `labkit.wire.codec.Codec.encode` returns), sent as

    [n: u32] [len_0: u64] ... [len_n-1: u64] [frame_0] ... [frame_n-1]

`Inbox` takes the bytes as they come, in any pieces, and gives back whole messages; a large frame
is read straight into a buffer of its own. `Outbox` sends as much as a socket takes and keeps
the rest.

A stream must never lose a byte: a KeyboardInterrupt raised after `recv` returned and before
its bytes were kept would lose them, and every message after them. So neither class may be
interrupted between a read or write and its bookkeeping: the kernel holds SIGINT back around
them (labkit.kernel.channel.sigint.uninterrupted), and a rank reads and writes its link only where
its SIGINT handler does not raise (outside user code).
"""

from __future__ import annotations

import itertools
import socket
import struct
from collections import deque
from typing import Any

SCHEME = "unix://"
COUNT = struct.Struct("<I")
MAX_FRAMES = 4096  # more frames than any message has: a corrupt stream, not a message
# the most bytes a message may carry, checked before anything is allocated for it (tensors go
# through shared memory and are not in it; a rank sends a value of at most 1 GiB)
MAX_MESSAGE = 2 << 30
CHUNK = 256 * 1024  # one read; a frame larger than this is read into a buffer of its own
IOV_MAX = 512  # buffers per sendmsg (Linux allows 1024)


class LinkBroken(ConnectionError):
    """The other end closed the link (`clean`: between messages), or sent bytes that are not
    framed messages."""

    def __init__(self, why: str, clean: bool = False):
        super().__init__(why)
        self.clean = clean


_PREFIXES: dict[int, struct.Struct] = {}  # frame count -> the struct of its length prefix


def _prefix(n: int) -> struct.Struct:
    """The struct of a message's length prefix, for `n` frames (made once per count)."""
    prefix = _PREFIXES.get(n)
    if prefix is None:
        prefix = _PREFIXES[n] = struct.Struct(f"<I{n}Q")
    return prefix


def header(frames: list[Any]) -> tuple[bytes, int]:
    """The length prefix of `frames` (bytes, or any contiguous buffers), and the message's
    size with it."""
    sizes = [len(f) if type(f) is bytes else memoryview(f).nbytes for f in frames]
    prefix = _prefix(len(sizes))
    return prefix.pack(len(sizes), *sizes), prefix.size + sum(sizes)


class Outbox:
    """Bytes queued for one socket, sent as far as it takes them (`flush`)."""

    def __init__(self) -> None:
        self.parts: deque[memoryview] = deque()

    def send(self, sock: socket.socket, frames: list[Any]) -> bool:
        """Send `frames` as one message, after what is queued; what the socket does not take
        now is queued (a blocking socket takes it all). True once nothing is queued."""
        head, size = header(frames)
        if not self.parts and len(frames) < IOV_MAX:  # the common case: one call, no queue
            try:
                sent = sock.sendmsg([head, *frames])
            except (BlockingIOError, InterruptedError):
                sent = 0
            if sent == size:
                return True
        else:
            sent = 0
        self.parts.append(memoryview(head))
        self.parts.extend(memoryview(f).cast("B") for f in frames)
        self._drop(sent)
        return self.flush(sock)

    def flush(self, sock: socket.socket) -> bool:
        """Send what the socket takes now (or, blocking, everything); True once all is sent."""
        while self.parts:
            try:
                sent = sock.sendmsg(list(itertools.islice(self.parts, IOV_MAX)))
            except (BlockingIOError, InterruptedError):
                return False
            self._drop(sent)
        return True

    def _drop(self, sent: int) -> None:
        while self.parts and sent >= self.parts[0].nbytes:
            sent -= self.parts.popleft().nbytes
        if sent:
            self.parts[0] = self.parts[0][sent:]


class Inbox:
    """Whole messages from the bytes of a stream, read in whatever pieces they come."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.lengths: deque[int] | None = None  # the current message's frames still to come
        self.parts: list[Any] = []
        self.big: bytearray | None = None  # a large frame, read straight into its own buffer
        self.big_at = 0
        self.messages: deque[list[Any]] = deque()
        self.scratch = bytearray(CHUNK)  # each read lands here (a fresh bytes per read costs
        self.view = memoryview(self.scratch)  # a large allocation)
        self.drained = False  # the last read emptied the socket (it took less than it could)

    def feed(self, sock: socket.socket) -> None:
        """One read from `sock` (BlockingIOError if it has nothing; LinkBroken at its end)."""
        if self.big is not None:
            self._read_big(sock)
            if self.big is None:  # the frame is whole: on with the frames after it
                self._parse_held()
            return
        n = sock.recv_into(self.scratch)
        self.drained = n < CHUNK
        if not n:
            cut = bool(self.buf) or self.lengths is not None
            raise LinkBroken(
                "the link was closed" + (" in the middle of a message" if cut else ""),
                clean=not cut,
            )
        if self.buf:  # the rest of a message read before: parse it from the start
            self.buf += self.view[:n]
            self._parse_held()
        else:  # the common case: whole messages straight from the read, only a tail kept
            used = self._take(self.view, n)
            self.buf += self.view[used:n]

    def _read_big(self, sock: socket.socket) -> None:
        assert self.big is not None and self.lengths is not None
        n = sock.recv_into(memoryview(self.big)[self.big_at :])
        self.drained = False  # a large frame streams in: read on until the socket is dry
        if not n:
            raise LinkBroken("the link was closed in the middle of a message")
        self.big_at += n
        if self.big_at == len(self.big):
            self.parts.append(self.big)
            self.big = None
            self.lengths.popleft()

    def _parse_held(self) -> None:
        with memoryview(self.buf) as view:
            used = self._take(view, len(view))
        del self.buf[:used]

    def _take(self, view: memoryview, end: int) -> int:
        """Whole messages (and the frames of one begun) from `view[:end]`; the bytes used. A
        large frame is begun in a buffer of its own (`big`), which takes the rest of `view`."""
        pos = 0
        while True:
            if self.lengths is None:
                if end - pos < COUNT.size:
                    return pos
                (n,) = COUNT.unpack_from(view, pos)
                if not 0 < n <= MAX_FRAMES:
                    raise LinkBroken(f"a message of {n} frames: the stream is not labkit's")
                if end - pos < COUNT.size + 8 * n:
                    return pos
                self.lengths = deque(_prefix(n).unpack_from(view, pos)[1:])
                if (total := sum(self.lengths)) > MAX_MESSAGE:
                    raise LinkBroken(
                        f"a message of {total} bytes, over the {MAX_MESSAGE >> 20} "
                        "MiB a message may carry: the stream is not labkit's"
                    )
                pos += COUNT.size + 8 * n
            lengths = self.lengths
            while lengths:
                size = lengths[0]
                if end - pos >= size:
                    self.parts.append(bytes(view[pos : pos + size]))
                    pos += size
                    lengths.popleft()
                elif size - (end - pos) > CHUNK:
                    self.big = bytearray(size)
                    self.big[: end - pos] = view[pos:end]
                    self.big_at = end - pos
                    return end
                else:
                    return pos
            self.messages.append(self.parts)
            self.parts, self.lengths = [], None
