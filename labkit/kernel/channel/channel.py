"""The kernel's channel to its ranks: two sockets, one I/O thread, one waiting loop (kernel side).

- `ctrl` is used only by the thread that calls the lab: requests out, replies in. Forked ranks'
  ctrl links are plain Unix stream sockets, written and read by that thread itself
  (labkit.kernel.channel.direct: no I/O thread between a request and its rank); ranks started by
  torchrun connect to a ZeroMQ ROUTER over TCP.
- `side` (ZeroMQ) is read by the `labkit-io` thread (labkit.kernel.channel.side_io): output lines,
  heartbeats, answers to `ask_stacks`; Stop, `leave` and `ask_stacks` go out on it.

Forked ranks connect over Unix sockets in a private 0700 directory; ranks started by torchrun
connect over TCP on the address the user chose (loopback by default).

`pump` is the one loop that waits for replies. While it waits it prints rank output as it
arrives, notices dead ranks (the fork server reports exits at once) and calls the caller's
`watch` (the watchdog, the live status); Ctrl-C surfaces from it as KeyboardInterrupt.

Routes: a rank's sockets have no fixed identity. The kernel learns the route of a rank's
ctrl socket from its signed `hello` (or `attach`) and afterwards takes that rank's replies only
from that route, so another process cannot take a rank's place by claiming its name. An
`attach` for a rank that attached already, or after the lab stopped waiting (`attaching`), is
turned away with `refused`. Over TCP, `allow` (networks) limits which hosts may send at all:
a message from another address is dropped before its signature is even read, and warned of.

Generations: each (re)start of the ranks has a new number, and messages from an older
generation are dropped, so a restart never mixes old and new replies.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from typing import Any

import zmq

from labkit.kernel.channel.admission import Admission
from labkit.kernel.channel.direct import DirectRouter
from labkit.kernel.channel.output import RankOutput
from labkit.kernel.channel.side_io import SideIO
from labkit.kernel.channel.sigint import uninterrupted
from labkit.kernel.inspection.logs import read_tail
from labkit.kernel.results import LabError, LabkitWarning
from labkit.wire import framed, shm, sock_dir
from labkit.wire.codec import AuthenticationError, Codec
from labkit.wire.messages import Done, KernelToRank
from labkit.wire.stop_board import StopBoard

CATCH_UP_S = 10.0  # the longest wait for output lines a `done` says were sent before it


class Stuck(Exception):
    """A wait that cannot end: the message says why (`died`: a rank whose death is the cause)."""

    def __init__(self, reason: str, died: int | None = None):
        super().__init__(reason)
        self.died = died


class Channel(Admission, SideIO):
    """The sockets, the I/O thread and the waiting loop between a kernel and its ranks."""

    def __init__(self, codec: Codec, log_dir: str, listen: tuple[str, int] | None = None):
        self.codec = codec
        self.log_dir = log_dir
        self.listen = listen  # (host, port): ranks connect over TCP (started by torchrun)
        self.ctx = zmq.Context()
        self.sock_dir = sock_dir.new()  # 0700: only this user gets in (labkit.wire.sock_dir)
        self.shm_dir = shm.new_dir() if listen is None else None  # large tensors, same machine
        codec.shm_dir = self.shm_dir
        codec.shared = shm.Shared() if self.shm_dir else None  # pushed segments, reused
        # forked ranks see a Stop at a cell's start here, without reading their side socket
        self.stop_board = StopBoard(self._path("stop"), create=True) if listen is None else None
        self.gen = 0
        self.status: dict[int, dict[str, Any]] = {}  # rank -> its last heartbeat
        self.stacks: dict[int, dict[int, dict[str, Any]]] = {}  # ask id -> rank -> `stacks`
        self._ask_ids = itertools.count(1)  # next() is atomic: any thread may ask
        self.events: deque[tuple[Any, ...]] = deque()
        self.routes: dict[int, bytes] = {}  # rank -> ZeroMQ routing id of its ctrl socket
        self.dead: dict[int, int] = {}  # rank -> exit code (negative: signal)
        self.rejected = 0
        self.allow: list[Any] | None = None  # networks ranks may connect from (TCP; None: any)
        self.attaching = False  # whether an `attach` is welcome now (Lab.attach is waiting)
        self.output = RankOutput()
        self.closed = False
        self._seen_seq: dict[int, int] = {}
        self._side_out: deque[tuple[int, int, KernelToRank]] = deque()  # (gen, rank, message)
        self._side_routes: dict[int, bytes] = {}
        self.ctrl: zmq.Socket | DirectRouter = (
            self._bind("ctrl") if listen is not None else DirectRouter(self._path("ctrl"))
        )
        self.side = self._bind("side")
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        self.poller: zmq.Poller | None = None
        if isinstance(self.ctrl, DirectRouter):  # one epoll_wait for replies and wake-ups
            self.ctrl.watch(self.wake_r)
        else:
            self.poller = zmq.Poller()
            self.poller.register(self.ctrl, zmq.POLLIN)
            self.poller.register(self.wake_r, zmq.POLLIN)
        self._io = threading.Thread(target=self._io_loop, name="labkit-io", daemon=True)
        self._io.start()

    # -- sockets ----------------------------------------------------------------------------
    def _path(self, name: str) -> str:
        return os.path.join(self.sock_dir, name)

    def _bind(self, name: str) -> zmq.Socket:
        """A ROUTER on a Unix socket in a private directory (faster than TCP loopback)."""
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.listen is not None:  # attached ranks: TCP on the address the user chose
            host, port = self.listen
            sock.bind(f"tcp://{host}:{port if name == 'ctrl' else 0}")
            return sock
        sock.bind(f"ipc://{self._path(name)}")
        return sock

    def endpoint(self, name: str) -> str:
        """The address ranks connect to: `name` is "ctrl" or "side"."""
        sock = self.ctrl if name == "ctrl" else self.side
        if isinstance(sock, DirectRouter):
            return sock.endpoint
        return sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    def new_generation(self) -> int:
        """Forget everything about the ranks before a (re)start; returns the new number."""
        self.gen += 1
        self.routes.clear()
        self._side_routes.clear()
        self.status.clear()
        self.stacks.clear()
        self.events.clear()
        self.dead.clear()
        self._seen_seq = {}
        shm.sweep(self.shm_dir)  # segments the old ranks sent or were sent and never mapped
        if self.codec.shared is not None:
            self.codec.shared.clear()
        return self.gen

    def close(self) -> None:
        self.closed = True
        self._io.join(timeout=2)
        if isinstance(self.ctrl, DirectRouter):
            self.ctrl.close()
        if self.stop_board is not None:
            self.stop_board.close()
        self.ctx.destroy(linger=0)
        os.close(self.wake_r)
        os.close(self.wake_w)
        shutil.rmtree(self.sock_dir, ignore_errors=True)
        shm.remove(self.shm_dir)
        if self.codec.shared is not None:
            self.codec.shared.clear()

    # -- sending ----------------------------------------------------------------------------
    def encode_for_all(self, msg: KernelToRank) -> tuple[list[Any], list[str]]:
        """`msg` encoded once for several ranks, and the shared-memory segments it names (the
        ranks map them without unlinking: `settle` them once all replied, or gave up)."""
        kept: list[str] = []
        frames = self.codec.encode(msg, kept=kept)
        size = framed.header(frames)[1]
        if size > framed.MAX_MESSAGE:  # a rank's link would close on it: send nothing
            self.settle(kept, True)
            raise ValueError(
                f"this {msg['type']} is {size / 2**20:.0f} MiB once pickled, over the "
                f"{framed.MAX_MESSAGE >> 20} MiB a message to the ranks may carry; tensors "
                "travel through shared memory and do not count: send the data as tensors, "
                "or in parts"
            )
        return frames, kept

    def settle(self, segments: list[str], answered: bool) -> None:
        """The segments of a message from `encode_for_all`, once every rank `answered` it (kept
        for the next push, or unlinked) or not (left for the restart's sweep)."""
        if self.codec.shared is not None:
            self.codec.shared.settle(segments, answered)
        elif answered:
            shm.release(segments)

    def send(
        self,
        ranks: Iterable[int],
        msg: KernelToRank,
        frames: list[Any] | None = None,
        sent: list[int] | None = None,
    ) -> None:
        """Send `msg` (or its `frames` from `encode_for_all`) to each of `ranks`, appending each
        rank to `sent` once its request is out. Over direct links, Ctrl-C comes before the
        first or after the last (`uninterrupted`), so `sent` says exactly who has it."""
        ranks = list(ranks)  # shared memory only for one receiver: it unlinks what it maps
        for r in ranks:
            if r not in self.routes:
                raise LabError(f"rank {r} has not signed in, so nothing can be sent to it")
        if frames is None:
            frames = self.codec.encode(msg, shared=len(ranks) == 1)
        with uninterrupted() if isinstance(self.ctrl, DirectRouter) else nullcontext():
            for r in ranks:
                self.ctrl.send_multipart([self.routes[r], *frames], copy=False)
                if sent is not None:
                    sent.append(r)

    # -- the one waiting loop ---------------------------------------------------------------
    def pump(
        self,
        pending: set[int],
        expect: str,
        *,
        msg_id: int | None = None,
        deadline: float | None = None,
        replies: dict[int, dict[str, Any]] | None = None,
        watch: Callable[[set[int]], None] | None = None,
        on_other: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[int, dict[str, Any]]:
        """Wait for `expect` replies (with `msg_id`) from every rank in `pending`.

        Raises `Stuck` past `deadline` or when a rank dies, and `LabError` for a rank that could
        not start (`fatal`); `watch(pending)` runs between polls; `on_other(msg)` gets the
        other messages (a debugger's prompt: labkit.kernel.inspection.debug).
        """
        replies = {} if replies is None else replies
        pending = set(pending) - set(replies)
        while pending:
            if self._wait(self.output.wait_ms(100)):
                while (other := self._take(expect, msg_id, replies, pending)) is not None:
                    if on_other is not None:
                        on_other(other)
            self.drain_events()
            if deadline is not None and time.monotonic() > deadline and pending:
                raise Stuck(f"no reply from rank(s) {sorted(pending)} in time")
            if watch is not None and pending:
                watch(pending)
        return replies

    def _take(
        self,
        expect: str,
        msg_id: int | None,
        replies: dict[int, dict[str, Any]],
        pending: set[int],
    ) -> dict[str, Any] | None:
        """Receive what is waiting on ctrl: each reply awaited goes into `replies`; returns the
        first other message (None once nothing waits). A reply taken off the socket is kept
        even if Ctrl-C comes meanwhile (`uninterrupted`): one dropped there would leave its
        rank looking stuck."""
        with uninterrupted():
            while self._waiting():
                msg = self._receive(expect, msg_id)
                if msg is None:
                    continue
                if msg["type"] != expect or msg.get("id") != msg_id:
                    return msg
                msg["received"] = time.monotonic()  # when the watchdog knows it ended
                replies[msg["rank"]] = msg
                pending.discard(msg["rank"])
        return None

    def _wait(self, timeout_ms: int) -> bool:
        """Wait at most `timeout_ms` for a ctrl message or a wake-up of the I/O thread (output,
        a death); whether a ctrl message can be taken now."""
        if self.poller is None:  # direct links: one epoll_wait, which also reads the replies
            if not self.ctrl.received:  # else read already (a Ctrl-C came as it was read)
                self.ctrl.wait(timeout_ms)
            return bool(self.ctrl.received)
        ready = dict(self.poller.poll(timeout_ms))
        if self.wake_r in ready:
            try:
                os.read(self.wake_r, 65536)
            except BlockingIOError:
                pass
        return self.ctrl in ready

    def _waiting(self) -> bool:
        """Whether a ctrl message can be taken now. Direct links' replies are read by the
        waiting loop's epoll_wait: no second system call to learn that none is left."""
        if self.poller is None:
            return bool(self.ctrl.received)
        return self.ctrl.poll(0)

    def _receive(self, expect: str, msg_id: int | None) -> dict[str, Any] | None:
        """One ctrl message of this generation, or None for one to drop."""
        frames = self.ctrl.recv_multipart(copy=False)
        route = frames[0] if isinstance(frames[0], bytes) else frames[0].bytes
        if not self._allowed(frames[-1], warn=True):
            return None
        try:
            msg = self.codec.decode(frames[1:])
        except AuthenticationError as exc:
            self.rejected += 1
            warnings.warn(f"labkit rejected a message: {exc}", LabkitWarning, stacklevel=4)
            return None
        except Exception as exc:  # noqa: BLE001 - signed, but the kernel cannot unpickle it
            msg = self._undecodable(route, exc, expect, msg_id)
            if msg is None:
                return None
        if msg.get("gen") != self.gen:
            return None
        if not self._from_its_route(msg, route):
            return None
        if msg["type"] == "fatal":
            err = msg["error"]
            raise LabError(
                f"rank {msg['rank']} failed to start: {err['type']}: "
                f"{err['message']}\n{err['traceback']}"
            )
        return msg

    def _undecodable(
        self, ident: bytes, exc: Exception, expect: str, msg_id: int | None
    ) -> Done | None:
        """A genuine reply whose value the kernel cannot rebuild: report it, do not hang."""
        rank = next((r for r, i in self.routes.items() if i == ident), None)
        if rank is None or expect != "done" or msg_id is None:
            return None
        return Done(
            type="done",
            id=msg_id,
            rank=rank,
            gen=self.gen,
            error=None,
            value_error=f"the value could not be rebuilt in the kernel: "
            f"{type(exc).__name__}: {exc}",
        )

    def drain_events(self) -> None:
        """Show queued output; raise `Stuck` for a rank that died; warn of rejected messages."""
        while self.events:
            kind, *rest = self.events.popleft()
            if kind == "stream":
                self._seen_seq[rest[0]["rank"]] = rest[0]["seq"]
                self.output.show(rest[0])  # a `progress` goes to the call's bars
            elif kind == "exit":
                rank, code = rest
                self.output.release(force=True)  # its last lines before the report of its death
                raise Stuck(self.death_text(rank, code), died=rank)
            elif kind == "rejected":
                warnings.warn(f"labkit rejected a message: {rest[0]}", LabkitWarning, stacklevel=3)
        self.output.release()  # a burst of lines, once it is due, in rank order

    def death_text(self, rank: int, code: int) -> str:
        how = (
            f"killed by signal {signal.Signals(-code).name}"
            if code < 0
            else f"exited with code {code}"
        )
        text = f"rank {rank} died ({how})"
        tail = read_tail(self.log_dir, rank, lines=12, drop_noise=True)
        if tail:
            last = "".join(f"  | {line}" for line in tail.splitlines(True))
            text += f"; its last output (all of it: %lab logs {rank}):\n{last.rstrip()}"
        return text

    def catch_up_streams(self, replies: dict[int, dict[str, Any]]) -> None:
        """Output travels beside replies: wait for every line sent before `done`.

        Only lines known to be on their way are waited for (a `done` names the last one), so
        the bound, `CATCH_UP_S`, is reached only on a starved machine, never on a quiet one.
        """
        deadline = time.monotonic() + CATCH_UP_S
        try:
            while time.monotonic() < deadline:
                self.drain_events()
                if all(
                    self._seen_seq.get(r, 0) >= m.get("stream_seq", 0) for r, m in replies.items()
                ):
                    return
                time.sleep(0.001)
        finally:
            self.output.release(force=True)  # the call's output is all here: show it now
