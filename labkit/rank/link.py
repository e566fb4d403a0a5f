"""A forked rank's end of its ctrl link to the kernel (runs on the rank).

`CtrlLink` is a blocking Unix stream socket with the calls of a ZeroMQ socket that a rank makes
of its ctrl socket (send_multipart, recv_multipart, poll): messages framed as
labkit.wire.framed says, and no thread in between, so a request wakes the rank's main thread
itself. The main thread alone uses it, and only outside user code, where the rank's SIGINT
handler does not raise (labkit.rank.side; the debugger counts as outside): a KeyboardInterrupt
between a read and its bookkeeping would lose bytes of the stream.
"""

from __future__ import annotations

import select
import socket
from typing import Any

from labkit.wire.framed import SCHEME, Inbox, Outbox


class CtrlLink:
    def __init__(self, endpoint: str):
        if not endpoint.startswith(SCHEME):
            raise ValueError(f"a ctrl link's endpoint starts with {SCHEME}, got {endpoint!r}")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(endpoint.removeprefix(SCHEME))
        self.inbox = Inbox()
        self.outbox = Outbox()

    def fileno(self) -> int:
        return self.sock.fileno()

    def send_multipart(self, frames: list[Any], copy: bool = False) -> None:
        self.outbox.send(self.sock, frames)  # blocking: all of it

    def poll(self, timeout_ms: int = 0) -> bool:
        """Whether a whole message can be read now, waiting at most `timeout_ms` for bytes."""
        if not self.inbox.messages and select.select([self.sock], [], [], timeout_ms / 1000)[0]:
            self.inbox.feed(self.sock)
        return bool(self.inbox.messages)

    def recv_multipart(self, copy: bool = False) -> list[Any]:
        """The next message (LinkBroken once the kernel closed the link)."""
        while not self.inbox.messages:
            self.inbox.feed(self.sock)
        return self.inbox.messages.popleft()

    def close(self) -> None:
        self.sock.close()
