"""The kernel's end of forked ranks' ctrl links: one listening Unix socket (kernel side).

`DirectRouter` stands where a ZeroMQ ROUTER stood, with the calls `labkit.kernel.channel.channel`
makes of one: `send_multipart([route, *frames])`, `poll`, `recv_multipart() -> [route, *frames]`,
and `fileno()` to wait on beside other sockets. Each rank connects once (labkit.wire.framed); the
route of a connection is a name the router gives it, which the channel ties to a rank only when a
signed `hello` comes over it, as it did ZeroMQ's routing ids.

Everything runs on the thread that calls it, with no thread of its own: a request is written
into the rank's socket by the call that sends it, and a reply is read by the call that waits
for it. The sockets are non-blocking, so no call waits on a rank: what a busy rank's socket does
not take now stays queued and goes out from `poll` (the channel's waiting loop) as it drains.
All of the router's sockets are in one epoll set, whose own descriptor `fileno()` returns: it is
readable when any of them has something to do.

The thread that calls a lab is the one Ctrl-C (Stop) interrupts, and a stream must not lose a
byte (labkit.wire.framed): each send, and each turn of reads, runs `uninterrupted`
(labkit.kernel.channel.sigint), which holds SIGINT back for its microseconds and raises it right
after.
"""

from __future__ import annotations

import itertools
import os
import select
import socket
import time
from collections import deque
from typing import Any

from labkit.kernel.channel.sigint import uninterrupted
from labkit.wire.framed import SCHEME, Inbox, LinkBroken, Outbox

READS_PER_TURN = 64  # reads of one link per wake-up (up to 16 MiB); SIGINT waits for them


def listen(path: str) -> socket.socket:
    """A non-blocking listening socket at `path` (in the channel's private 0700 directory)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    os.chmod(path, 0o600)
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class _Link:
    def __init__(self, sock: socket.socket, route: bytes):
        self.sock = sock
        self.route = route
        self.inbox = Inbox()
        self.outbox = Outbox()


class DirectRouter:
    """Listens at `path` for ranks' ctrl links; sends and receives framed messages."""

    def __init__(self, path: str):
        self.path = path
        self.listener = listen(path)
        self.epoll = select.epoll()
        self.epoll.register(self.listener, select.EPOLLIN)
        self.links: dict[int, _Link] = {}  # fd -> link
        self.by_route: dict[bytes, _Link] = {}
        self.received: deque[list[Any]] = deque()  # [route, *frames], in the order they came
        self._names = itertools.count(1)
        self.broken = 0  # links closed mid-message or with bytes that were not messages
        self.watched: set[int] = set()  # other descriptors its epoll wakes for (`watch`)

    @property
    def endpoint(self) -> str:
        return SCHEME + self.path

    def fileno(self) -> int:
        return self.epoll.fileno()

    def send_multipart(self, frames: list[Any], copy: bool = False) -> None:
        """Send `frames[1:]` over the link named `frames[0]`; a link that is gone drops it."""
        link = self.by_route.get(bytes(frames[0]))
        if link is None:
            return
        with uninterrupted():
            try:
                sent = link.outbox.send(link.sock, frames[1:])
            except OSError:  # the rank is gone: its exit is reported by whoever started it
                self._close(link)
                return
            if not sent:  # the rest goes out as the socket drains
                self.epoll.modify(link.sock, select.EPOLLIN | select.EPOLLOUT)

    def watch(self, fd: int) -> None:
        """Wake on `fd` too, the read end of a non-blocking pipe that only says "look" (the
        channel's wake-up pipe): its bytes are read and dropped here, so one epoll_wait is all
        the waiting loop needs for replies and wake-ups alike."""
        self.epoll.register(fd, select.EPOLLIN)
        self.watched.add(fd)

    def wait(self, timeout_ms: int) -> None:
        """Wait at most `timeout_ms` for any socket or watched descriptor, then do what they
        are ready for (replies land in `received`)."""
        self._serve(timeout_ms / 1000)

    def poll(self, timeout_ms: int = 0) -> bool:
        """Whether a message is waiting, after doing what the sockets are ready for (accepting
        links, reading, sending what was queued), waiting at most `timeout_ms` for that."""
        deadline = time.monotonic() + timeout_ms / 1000
        while not self.received:
            self._serve(max(0.0, deadline - time.monotonic()))
            if time.monotonic() >= deadline:
                break
        return bool(self.received)

    def recv_multipart(self, copy: bool = False) -> list[Any]:
        while not self.received:
            self._serve(-1)
        return self.received.popleft()

    def _serve(self, timeout: float) -> None:
        try:
            events = self.epoll.poll(timeout)
        except InterruptedError:
            return
        if events:
            with uninterrupted():  # a byte read must be kept: see labkit.wire.framed
                self._handle(events)

    def _handle(self, events: list[tuple[int, int]]) -> None:
        for fd, event in events:
            if fd == self.listener.fileno():
                self._accept()
                continue
            if fd in self.watched:
                try:
                    os.read(fd, 65536)
                except OSError:  # drained already, or closed by its owner
                    pass
                continue
            link = self.links.get(fd)
            if link is None:
                continue
            if event & select.EPOLLOUT:
                self._drain(link)
            if event & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
                self._read(link)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            sock.setblocking(False)
            link = _Link(sock, b"link-%d" % next(self._names))
            self.links[sock.fileno()] = link
            self.by_route[link.route] = link
            self.epoll.register(sock, select.EPOLLIN)
            self._read(link)  # what it sent already, in this turn: its events come in the next

    def _read(self, link: _Link) -> None:
        try:
            for _ in range(READS_PER_TURN):  # a large reply: many reads, Stop held back for few
                link.inbox.feed(link.sock)
                if link.inbox.drained:  # nothing more now: no read just to hear EAGAIN
                    break
        except BlockingIOError:
            pass
        except LinkBroken as exc:
            self.broken += not exc.clean
            self._close(link)
        except OSError:
            self._close(link)
        while link.inbox.messages:
            self.received.append([link.route, *link.inbox.messages.popleft()])

    def _drain(self, link: _Link) -> None:
        try:
            done = link.outbox.flush(link.sock)
        except OSError:
            self._close(link)
            return
        if done:
            self.epoll.modify(link.sock, select.EPOLLIN)

    def _close(self, link: _Link) -> None:
        if self.links.pop(link.sock.fileno(), None) is None:
            return
        self.by_route.pop(link.route, None)
        try:
            self.epoll.unregister(link.sock)
        except (OSError, ValueError):
            pass
        link.sock.close()

    def close(self) -> None:
        for link in list(self.links.values()):
            self._close(link)
        self.epoll.close()
        self.listener.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
