"""The ctrl links of forked ranks: framing (labkit.wire.framed), the kernel's router
(labkit.kernel.channel.direct) and a rank's end (labkit.rank.link)."""

from __future__ import annotations

import os
import random
import socket
import struct
import threading
import time

import pytest

from labkit.kernel.channel.direct import DirectRouter
from labkit.rank.link import CtrlLink
from labkit.wire import framed
from labkit.wire.framed import CHUNK, MAX_FRAMES, MAX_MESSAGE, Inbox, LinkBroken, Outbox, header

pytestmark = pytest.mark.timeout(60)


class Pieces:
    """A socket whose reads return `data` in the given piece sizes (then EOF)."""

    def __init__(self, data: bytes, sizes):
        self.data, self.at, self.sizes = memoryview(data), 0, sizes

    def _next(self, room: int) -> bytes:
        n = min(room, next(self.sizes), len(self.data) - self.at)
        out = self.data[self.at : self.at + n]
        self.at += n
        return bytes(out)

    def recv_into(self, buf) -> int:
        got = self._next(len(buf))
        buf[: len(got)] = got
        return len(got)


def stream(messages) -> bytes:
    return b"".join(header(m)[0] + b"".join(m) for m in messages)


MESSAGES = [
    [b"sig", b"head"],
    [b"s", b"", b"after an empty frame"],
    [b"x" * 32, os.urandom(3 * CHUNK + 17), b"tail"],  # a frame read into its own buffer
    [bytes([i]) * i for i in range(1, 40)],
    [b"last"],
]


@pytest.mark.parametrize("piece", ["1", "7", "random", "whole"])
def test_inbox_rebuilds_every_message_from_any_pieces(piece):
    data = stream(MESSAGES)
    rnd = random.Random(5)
    sizes = {
        "1": iter(lambda: 1, None),
        "7": iter(lambda: 7, None),
        "random": iter(lambda: rnd.randint(1, 3 * CHUNK), None),
        "whole": iter(lambda: len(data), None),
    }[piece]
    src, inbox = Pieces(data, sizes), Inbox()
    with pytest.raises(LinkBroken) as end:
        while True:
            inbox.feed(src)
    assert end.value.clean, "the stream ended between messages"
    assert [[bytes(f) for f in m] for m in inbox.messages] == MESSAGES


def test_inbox_tells_a_cut_message_and_a_foreign_stream():
    cut = stream(MESSAGES[:1])[:-2]
    inbox, src = Inbox(), Pieces(cut, iter(lambda: 4, None))
    with pytest.raises(LinkBroken, match="in the middle of a message") as end:
        while True:
            inbox.feed(src)
    assert not end.value.clean and not inbox.messages
    for count in (0, MAX_FRAMES + 1):
        junk = count.to_bytes(4, "little") + b"\0" * 64
        with pytest.raises(LinkBroken, match=f"a message of {count} frames"):
            Inbox().feed(Pieces(junk, iter(lambda: 100, None)))


def test_inbox_refuses_a_length_over_the_limit_before_allocating_it(monkeypatch):
    # the lengths arrive before the signature can be checked: 1 TiB is refused, not allocated
    for sizes in ([1 << 40], [MAX_MESSAGE, 1]):
        head = struct.pack(f"<I{len(sizes)}Q", len(sizes), *sizes)
        inbox = Inbox()
        with pytest.raises(LinkBroken, match=r"bytes, over the 2048 MiB a message may carry"):
            inbox.feed(Pieces(head + b"\0" * 64, iter(lambda: 100, None)))
        assert inbox.big is None and len(inbox.buf) < 100
    monkeypatch.setattr(framed, "MAX_MESSAGE", 10)  # up to the limit is a message
    inbox = Inbox()
    inbox.feed(Pieces(stream([[b"x" * 4, b"y" * 6]]), iter(lambda: 100, None)))
    assert [bytes(f) for f in inbox.messages[0]] == [b"x" * 4, b"y" * 6]
    with pytest.raises(LinkBroken, match="a message of 11 bytes, over the 0 MiB"):
        Inbox().feed(Pieces(stream([[b"x" * 11]]), iter(lambda: 100, None)))


def test_outbox_keeps_what_a_full_socket_does_not_take_and_sends_it_in_order():
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    a.setblocking(False)
    big = [b"sig", os.urandom(4 << 20)]
    out = Outbox()
    assert out.send(a, big) is False, "4 MiB cannot fit in a 64 KiB socket buffer"
    assert out.parts
    assert out.send(a, [b"second"]) is False  # queued behind the first, never before it
    inbox, b_done = Inbox(), threading.Event()

    def read():
        while len(inbox.messages) < 2:
            inbox.feed(b)
        b_done.set()

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 30
    while not out.flush(a):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    reader.join(30)
    assert b_done.is_set()
    assert [[bytes(f) for f in m] for m in inbox.messages] == [big, [b"second"]]
    a.close()
    b.close()


def test_router_routes_each_link_and_drops_what_is_for_a_closed_one(tmp_path):
    router = DirectRouter(str(tmp_path / "ctrl"))
    assert router.endpoint == f"unix://{tmp_path / 'ctrl'}"
    assert oct(os.stat(tmp_path / "ctrl").st_mode & 0o777) == "0o600"
    links = [CtrlLink(router.endpoint) for _ in range(3)]
    for i, link in enumerate(links):
        link.send_multipart([b"hello", str(i).encode()])
    routes = {}
    for _ in links:
        assert router.poll(10_000)
        route, _, who = router.recv_multipart()
        routes[int(who)] = route
    assert len(set(routes.values())) == 3
    for i in (2, 0, 1):
        router.send_multipart([routes[i], b"for", str(i).encode()])
    for i, link in enumerate(links):
        assert link.poll(10_000)
        assert link.recv_multipart() == [b"for", str(i).encode()]
        assert not link.poll(0), "each link gets its own messages only"
    links[1].close()
    assert not router.poll(300)  # the closed link: noticed, nothing to receive
    assert routes[1] not in router.by_route
    router.send_multipart([routes[1], b"dropped"])  # no error, as ZeroMQ's ROUTER
    assert router.broken == 0
    with pytest.raises(ValueError, match="starts with unix://"):
        CtrlLink("ipc:///tmp/x")
    router.close()
    with pytest.raises(LinkBroken, match="the link was closed"):
        links[0].recv_multipart()
    assert not os.path.exists(tmp_path / "ctrl")


def signed_in(tmp_path):
    """A router and one link that said hello, and the link's route."""
    router = DirectRouter(str(tmp_path / "ctrl"))
    link = CtrlLink(router.endpoint)
    link.send_multipart([b"hello"])
    assert router.poll(10_000)
    return router, link, router.recv_multipart()[0]


class CountedReads:
    """A socket whose reads are counted (what the router reads a link through)."""

    def __init__(self, sock):
        self.sock, self.reads = sock, 0

    def recv_into(self, *args):
        self.reads += 1
        return self.sock.recv_into(*args)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def test_the_router_reads_a_short_reply_once_and_a_long_one_whole(tmp_path):
    router, link, route = signed_in(tmp_path)
    counted = router.by_route[route].sock = CountedReads(router.by_route[route].sock)
    link.send_multipart([b"done", b"x" * 100])
    assert router.poll(10_000) and router.recv_multipart() == [route, b"done", b"x" * 100]
    assert counted.reads == 1, "a read that took less than it asked for emptied the socket"
    big = random.randbytes(3 * CHUNK + 5)
    sender = threading.Thread(target=link.send_multipart, args=([b"done", big],))
    sender.start()
    assert router.poll(10_000) and router.recv_multipart() == [route, b"done", big]
    sender.join(10)
    link.close()
    router.close()


def test_router_never_waits_on_a_link_that_does_not_read(tmp_path):
    router, link, route = signed_in(tmp_path)
    big = os.urandom(16 << 20)
    t0 = time.monotonic()
    router.send_multipart([route, b"sig", big])
    router.send_multipart([route, b"next"])
    assert time.monotonic() - t0 < 2.0, "the send waited for the rank to read"
    got = []
    reader = threading.Thread(target=lambda: got.extend([link.recv_multipart() for _ in "ab"]))
    reader.start()
    deadline = time.monotonic() + 30
    while reader.is_alive() and time.monotonic() < deadline:
        router.poll(50)  # the channel's waiting loop sends the rest as the link drains
    reader.join(1)
    assert got == [[b"sig", big], [b"next"]]
    link.close()
    router.close()


def test_a_link_that_sends_bytes_that_are_not_messages_is_closed_the_others_go_on(tmp_path):
    router, good, route = signed_in(tmp_path)
    junk = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    junk.connect(str(tmp_path / "ctrl"))
    junk.sendall(b"GET / HTTP/1.1\r\n\r\n")
    deadline = time.monotonic() + 10
    while router.broken == 0 and time.monotonic() < deadline:
        router.poll(50)
    assert router.broken == 1 and len(router.links) == 1
    good.send_multipart([b"still", b"here"])
    assert router.poll(10_000) and router.recv_multipart() == [route, b"still", b"here"]
    junk.close()
    good.close()
    router.close()
