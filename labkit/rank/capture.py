"""Capture a rank's stdout and stderr at the file-descriptor level (runs on the rank).

File descriptors 1 and 2 are replaced by pipes, so everything the process writes is caught:
Python's print, C++ logs from gloo/NCCL, warnings, subprocesses. One reader thread per pipe
appends the raw bytes to the rank's log file the moment it has read them, then splits them
into whole lines (a `\\r` counts as a line end, for progress bars) and forwards them with
`send(name, text)`. A partial line is forwarded after a short quiet period, so a prompt without
a newline still shows. The log is written first because the rank may die at any moment: bytes
still in a pipe are drained into the log by the fork server, which outlives the rank
(labkit.rank.fork_server), and bytes already read are in the log, so a partial line written
just before a SIGKILL, a segfault or `os._exit` is never lost (the kernel shows the log's tail
as the dead rank's last output).

`flush()` is the barrier the worker uses at the end of a cell: it writes a marker through each
pipe and waits until the reader has forwarded everything written before it.
"""

from __future__ import annotations

import codecs
import os
import select
import socket
import stat
import sys
import threading
from collections.abc import Callable, Sequence
from typing import BinaryIO

from labkit.wire.logfile import LOG_HEADER

MARKER = b"\x1e\x1flabkit-flush\x1f\x1e"
CHUNK = 64 * 1024
QUIET = 0.05  # seconds before a partial line is forwarded


def _marker_prefix_len(buf: bytes) -> int:
    """Length of the longest tail of `buf` that could begin a marker."""
    for n in range(min(len(buf), len(MARKER) - 1), 0, -1):
        if MARKER.startswith(buf[-n:]):
            return n
    return 0


class _Reader(threading.Thread):
    def __init__(self, name: str, fd: int, send: Callable[[str, str], None], log: BinaryIO | None):
        super().__init__(name=f"labkit-{name}", daemon=True)
        self.stream_name = name
        self.fd = fd
        self.send = send
        self.log = log
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        # the fork server's stdout/stderr are socket pairs, so bytes can be logged before
        # they are taken (see `_read`); the sockets this process makes itself are pipes
        self.sock = socket.socket(fileno=fd) if stat.S_ISSOCK(os.fstat(fd).st_mode) else None
        self.pending = b""
        self.log_held = b""  # the start of a marker, maybe, held back from the log
        self.flushed = threading.Semaphore(0)
        self.busy = False  # between a select() that woke and the bytes being forwarded

    def _log_raw(self, data: bytes) -> None:
        """Append what was just read to the log at once, markers left out."""
        if self.log is None:
            return
        buf = (self.log_held + data).replace(MARKER, b"")
        keep = _marker_prefix_len(buf) if data else 0  # at the end of the pipe: all of it
        self.log_held = buf[len(buf) - keep :] if keep else b""
        out = buf[: len(buf) - keep]
        if out:
            self.log.write(out)
            self.log.flush()

    def _emit(self, data: bytes) -> None:
        if not data:
            return
        text = self.decoder.decode(data)
        for i in range(0, len(text), CHUNK):
            self.send(self.stream_name, text[i : i + CHUNK])

    def _take(self, data: bytes) -> None:
        buf = self.pending + data
        while True:
            at = buf.find(MARKER)
            if at < 0:
                break
            self._emit(buf[:at])
            buf = buf[at + len(MARKER) :]
            self.flushed.release()
        end = max(buf.rfind(b"\n"), buf.rfind(b"\r"))
        # keep a possible partial marker at the end for the next read
        self._emit(buf[: end + 1])
        self.pending = buf[end + 1 :]

    def _marker_prefix_len(self) -> int:
        """Length of the longest tail of `pending` that could begin a marker."""
        return _marker_prefix_len(self.pending)

    def _emit_pending(self) -> None:
        keep = self._marker_prefix_len()
        cut = len(self.pending) - keep
        self._emit(self.pending[:cut])
        self.pending = self.pending[cut:]

    def _read(self) -> bytes:
        """The next bytes, already in the log when this returns.

        On the fork server's sockets the bytes are peeked, logged, and only then taken out of
        the socket: a rank killed in between leaves them there for the server to drain, so
        they may reach the log twice but never not at all. On a plain pipe (a rank nobody
        outlives to drain it) they are read, then logged."""
        if self.sock is None:
            data = os.read(self.fd, CHUNK)
            self._log_raw(data)
            return data
        data = self.sock.recv(CHUNK, socket.MSG_PEEK)
        self._log_raw(data)
        if data:
            self.sock.recv(len(data))  # the same bytes: this thread is their only reader
        return data

    def run(self) -> None:
        while True:
            quiet = bool(self.pending) and self._marker_prefix_len() < len(self.pending)
            ready, _, _ = select.select([self.fd], [], [], QUIET if quiet else None)
            self.busy = True
            try:
                if not ready:
                    self._emit_pending()  # a partial line, quiet for a while: show it
                    continue
                try:
                    data = self._read()
                except BlockingIOError:
                    continue
                if not data:
                    self._emit(self.pending)
                    return
                self._take(data)
                if len(self.pending) > CHUNK:  # a very long line: forward it in pieces
                    self._emit_pending()
            finally:
                self.busy = False


class Capture:
    """Replaces fds 1 and 2 of this process with pipes read by forwarding threads."""

    def __init__(
        self,
        send: Callable[[str, str], None],
        log_path: str | None = None,
        read_fds: Sequence[int] | None = None,
        header: str = "",
    ):
        """`read_fds`: read ends of pipes already on fds 1 and 2 (made by the fork server)."""
        self.log = None
        if log_path:
            self.log = os.fdopen(
                os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab"
            )
            self.log.write(f"{LOG_HEADER}{header} -----\n".encode())
            self.log.flush()
        self.readers: list[_Reader] = []
        for i, (fd, name) in enumerate(((1, "stdout"), (2, "stderr"))):
            if read_fds:
                r = read_fds[i]  # non-blocking: the server shares it to drain after a crash
            else:
                r, w = os.pipe()
                os.dup2(w, fd)
                os.close(w)
            reader = _Reader(name, r, send, self.log)
            reader.start()
            self.readers.append(reader)
        self._pipes = select.poll()  # both pipes, registered once: one poll() per cell's end
        for reader in self.readers:
            self._pipes.register(reader.fd, select.POLLIN)
        sys.stdout = open(
            1, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False
        )
        sys.stderr = open(
            2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False
        )

    def flush(self, timeout: float = 5.0) -> None:
        """Forward everything written so far (called by the rank's main thread)."""
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        if self._quiet():
            return  # the common quiet cell: no marker round trip, no thread wake-ups
        for fd in (1, 2):
            os.write(fd, MARKER)
        for reader in self.readers:
            reader.flushed.acquire(timeout=timeout)

    def _quiet(self) -> bool:
        """Nothing written is waiting to be forwarded (checked by the rank's main thread, at
        every cell's end: one poll() for both pipes).

        The pipes are read first: a reader sets `busy` before it reads and clears it once the
        bytes are forwarded, so if both pipes were empty and then no reader is busy, whatever
        was in them has been forwarded (or waits in `pending`, a partial line).
        """
        if self._pipes.poll(0):
            return False
        return not any(r.busy or r.pending for r in self.readers)
