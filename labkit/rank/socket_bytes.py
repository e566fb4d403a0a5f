"""Bytes this rank really put on the wire, as the operating system counts them (rank side).

A check of "bytes sent per rank" that multiplies the traced buffer size by the same
bus-bandwidth factor as the formula it checks can never fail. This module asks the kernel
instead: for every TCP socket the rank process holds, Linux keeps byte counters in
`struct tcp_info` (getsockopt TCP_INFO). gloo's TCP transport moves collective and
point-to-point data over such sockets, so the change of their sum over a block of code is what
gloo sent and received, headers included, whichever algorithm it chose. "Sent" counts every
byte the process wrote once: transmitted (`tcpi_bytes_sent`) less retransmitted
(`tcpi_bytes_retrans`: a busy host makes spurious ones) plus still queued
(`tcpi_notsent_bytes`: a call can return before TCP transmits its last bytes).

Left out: the store's connections (the local or remote port is MASTER_PORT), and the lab's own
control connections when they are TCP (`exclude_ports`). Inside one rank, nothing else talks
TCP while a cell runs a collective. On NCCL (GPU) most bytes go over NVLink or shared memory,
which no socket counts: `measure()` then reads near zero, and says nothing about NCCL.

    from labkit.rank.socket_bytes import measure
    with measure() as wire:
        dist.all_reduce(t)
    wire.sent, wire.received   # ints, bytes

Every rank measures its own sockets; nothing here is a collective.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass, field

# struct tcp_info (linux/tcp.h): offsets of the counters used here. tcpi_bytes_sent (u64, Linux
# >= 4.19) counts bytes when TCP transmits them, retransmissions included; tcpi_bytes_retrans
# (u64, >= 4.19) those retransmitted; tcpi_notsent_bytes (u32, >= 4.6) those written but still
# queued (the peer's window is full). A send can return with its bytes queued, and a busy host
# makes spurious retransmissions (tail-loss probes), so `sent` is
# bytes_sent - bytes_retrans + notsent_bytes: every byte the process wrote, counted once.
# tcpi_bytes_acked (>= 4.1) is the fallback on an older kernel.
_NOTSENT = 144
_BYTES_ACKED = 120
_BYTES_RECEIVED = 128
_BYTES_SENT = 200
_BYTES_RETRANS = 208
_TCP_INFO_LEN = 216


def _socket_inodes() -> dict[int, int]:
    """fd -> socket inode for every socket this process holds."""
    out = {}
    fd_dir = "/proc/self/fd"
    for name in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, name))
        except OSError:  # closed between listdir and readlink
            continue
        if target.startswith("socket:["):
            out[int(name)] = int(target[8:-1])
    return out


def _store_port() -> int | None:
    port = os.environ.get("MASTER_PORT")
    return int(port) if port and port.isdigit() else None


def tcp_totals(exclude_ports: tuple[int, ...] = ()) -> tuple[int, int]:
    """(bytes sent, bytes received) summed over this process's TCP connections,
    leaving out those whose local or remote port is the store's or in `exclude_ports`."""
    skip = set(exclude_ports)
    store = _store_port()
    if store is not None:
        skip.add(store)
    sent = received = 0
    for fd in _socket_inodes():
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (
                socket.AF_INET,
                socket.AF_INET6,
            ):
                continue
            try:
                local, peer = sock.getsockname()[1], sock.getpeername()[1]
            except OSError:  # a listening socket has no peer
                continue
            if local in skip or peer in skip:
                continue
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
            if len(info) < _BYTES_RECEIVED + 8:
                continue  # a kernel older than the counters
            received += struct.unpack_from("Q", info, _BYTES_RECEIVED)[0]
            if len(info) >= _BYTES_RETRANS + 8:
                sent += (
                    struct.unpack_from("Q", info, _BYTES_SENT)[0]
                    - struct.unpack_from("Q", info, _BYTES_RETRANS)[0]
                    + struct.unpack_from("I", info, _NOTSENT)[0]
                )
            else:
                sent += struct.unpack_from("Q", info, _BYTES_ACKED)[0]
        finally:
            sock.close()  # closes the duplicate only
    return sent, received


@dataclass
class Measured:
    """What `measure()` counted: bytes sent and received over TCP."""

    sent: int = 0
    received: int = 0
    _start: tuple[int, int] = field(default=(0, 0), repr=False)
    _exclude: tuple[int, ...] = field(default=(), repr=False)

    def __enter__(self) -> Measured:
        self._start = tcp_totals(self._exclude)
        return self

    def __exit__(self, *exc: object) -> None:
        sent, received = tcp_totals(self._exclude)
        self.sent = sent - self._start[0]
        self.received = received - self._start[1]


def measure(exclude_ports: tuple[int, ...] = ()) -> Measured:
    """A context manager counting the TCP bytes this rank sends and receives inside it.

    Call it around blocking calls, or wait for async work inside it."""
    return Measured(_exclude=tuple(exclude_ports))
