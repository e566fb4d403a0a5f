"""Multipart messages over a Unix stream socket: the ctrl link of forked ranks (both sides).

ZeroMQ hands every message to an I/O thread of its own on each side, so a request and its reply
wake four threads besides the two that send and read them. A forked rank's ctrl link is a plain
Unix stream socket instead: the kernel writes a request straight into the rank's socket, and the
rank's main thread, blocked in `recv`, is the one that wakes (labkit.kernel.direct is the
kernel's end, labkit.rank.link the rank's). Ranks attached over TCP keep ZeroMQ.

A message is a list of frames (what `labkit.wire.codec.Codec.encode` returns), sent as

    [n: u32] [len_0: u64] ... [len_n-1: u64] [frame_0] ... [frame_n-1]

`Inbox` takes the bytes as they come, in any pieces, and gives back whole messages; a large frame
is read straight into a buffer of its own. `Outbox` sends as much as a socket takes and keeps
the rest.

A stream must never lose a byte: a KeyboardInterrupt raised after `recv` returned and before
its bytes were kept would lose them, and every message after them. So neither class may be
interrupted between a read or write and its bookkeeping: the kernel holds SIGINT back around
them (labkit.kernel.sigint.uninterrupted), and a rank reads and writes its link only where its
SIGINT handler does not raise (outside user code).
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


def header(frames: list[Any]) -> tuple[bytes, int]:
    """The length prefix of `frames` (bytes, or any contiguous buffers), and the message's
    size with it."""
    sizes = [len(f) if type(f) is bytes else memoryview(f).nbytes for f in frames]
    head = struct.pack(f"<I{len(sizes)}Q", len(sizes), *sizes)
    return head, len(head) + sum(sizes)


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
        self._read(sock)
        self._parse()

    def _read(self, sock: socket.socket) -> None:
        if self.big is not None:
            n = sock.recv_into(memoryview(self.big)[self.big_at :])
            self.drained = False  # a large frame streams in: read on until the socket is dry
            if not n:
                raise LinkBroken("the link was closed in the middle of a message")
            self.big_at += n
            if self.big_at == len(self.big):
                assert self.lengths is not None
                self.parts.append(self.big)
                self.big = None
                self.lengths.popleft()
        else:
            n = sock.recv_into(self.scratch)
            self.drained = n < CHUNK
            if not n:
                cut = bool(self.buf) or self.lengths is not None
                raise LinkBroken(
                    "the link was closed" + (" in the middle of a message" if cut else ""),
                    clean=not cut,
                )
            self.buf += self.view[:n]

    def _parse(self) -> None:
        buf = self.buf
        while self.big is None:
            if self.lengths is None:
                if len(buf) < COUNT.size:
                    return
                (n,) = COUNT.unpack_from(buf)
                if not 0 < n <= MAX_FRAMES:
                    raise LinkBroken(f"a message of {n} frames: the stream is not labkit's")
                if len(buf) < COUNT.size + 8 * n:
                    return
                self.lengths = deque(struct.unpack_from(f"<{n}Q", buf, COUNT.size))
                if (total := sum(self.lengths)) > MAX_MESSAGE:
                    raise LinkBroken(
                        f"a message of {total} bytes, over the {MAX_MESSAGE >> 20} "
                        "MiB a message may carry: the stream is not labkit's"
                    )
                del buf[: COUNT.size + 8 * n]
            while self.lengths:
                size = self.lengths[0]
                if len(buf) >= size:
                    self.parts.append(bytes(buf[:size]))
                    del buf[:size]
                    self.lengths.popleft()
                elif size - len(buf) > CHUNK:
                    self.big = bytearray(size)
                    self.big[: len(buf)] = buf
                    self.big_at = len(buf)
                    buf.clear()
                    return
                else:
                    return
            self.messages.append(self.parts)
            self.parts, self.lengths = [], None
