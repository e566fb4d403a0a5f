"""The kernel's side channel: its I/O thread, and what goes out on `side` (kernel side).

A mixin of `Channel` (labkit.kernel.channel.channel). The `labkit-io` thread reads every rank's
`side` socket: output lines are queued for the caller to print (`events`), heartbeats update each
rank's `status` (the line it runs, the comm op it is inside), answers to `ask_stacks` are kept in
`stacks` (any thread may ask: labkit.kernel.inspection.stacks).
What the kernel sends on `side` (Stop,
`leave`, `ask_stacks`) is queued and sent by that thread once the rank's first heartbeat has
shown its route, so the rank's heartbeat thread reads it even while its user code runs.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import zmq

from labkit.wire.codec import AuthenticationError
from labkit.wire.logfile import log_path
from labkit.wire.messages import AskStacks, Interrupt, KernelToRank, Leave
from labkit.wire.stop_board import StopBoard


class SideIO:
    """The `labkit-io` thread's half of a `Channel`."""

    codec: Any
    side: zmq.Socket
    gen: int
    closed: bool
    listen: tuple[str, int] | None
    log_dir: str
    wake_w: int
    rejected: int
    events: deque[tuple[Any, ...]]
    status: dict[int, dict[str, Any]]
    stacks: dict[int, dict[int, dict[str, Any]]]
    dead: dict[int, int]
    _ask_ids: Any
    _side_out: deque[tuple[int, int, KernelToRank]]
    _side_routes: dict[int, bytes]
    _allowed: Callable[[Any, bool], bool]  # Admission's
    stop_board: StopBoard | None

    def _post(self, *event: Any) -> None:
        self.events.append(event)
        try:
            os.write(self.wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def rank_exited(self, rank: int, code: int) -> None:
        """A rank's process ended (called from the fork server's reader thread)."""
        self.dead[rank] = code
        self._post("exit", rank, code)

    def _io_loop(self) -> None:
        remote = self.listen is not None
        while not self.closed:
            try:
                self._send_side_out()
                if not self.side.poll(50):  # often: queued Stop messages go out on the next turn
                    continue
                frames = self.side.recv_multipart(copy=False)
            except zmq.ZMQError:
                return
            if not self._allowed(frames[-1], warn=False):
                continue
            try:
                msg = self.codec.decode(frames[1:])
            except AuthenticationError as exc:
                self.rejected += 1
                self._post("rejected", str(exc))
                continue
            if msg.get("gen") != self.gen:
                continue
            self._side_routes[msg["rank"]] = frames[0].bytes
            if msg["type"] == "stream" and remote:  # their logs are on other machines
                self._log_remote(msg)
            if msg["type"] == "status":
                msg["received"] = time.monotonic()
                self.status[msg["rank"]] = msg
            elif msg["type"] in ("stream", "progress"):  # output and tqdm bars, in order
                self._post("stream", msg)
            elif msg["type"] == "stacks" and msg["id"] in self.stacks:
                self.stacks[msg["id"]][msg["rank"]] = msg

    def _send_side_out(self) -> None:
        """Send queued side messages (Stop, leave) to ranks whose side route is known; keep the
        others until their rank's first heartbeat shows the route; drop an older generation's."""
        held = []
        while self._side_out:
            gen, rank, out = self._side_out.popleft()
            if gen != self.gen:
                continue
            if rank in self._side_routes:
                frames = self.codec.encode(out, shared=False)
                self.side.send_multipart([self._side_routes[rank], *frames])
            else:
                held.append((gen, rank, out))
        self._side_out.extend(held)

    def _log_remote(self, msg: dict[str, Any]) -> None:
        try:
            fd = os.open(
                log_path(self.log_dir, msg["rank"]), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600
            )
            with os.fdopen(fd, "ab") as f:
                f.write(msg["text"].encode(errors="replace"))
        except OSError:
            pass

    def send_side(self, ranks: Iterable[int], msg: Interrupt | AskStacks | Leave) -> None:
        """A message on `side` (read by the rank's heartbeat thread, even while its user code
        runs), sent by the I/O thread once the rank's first heartbeat has shown its route."""
        for r in ranks:
            self._side_out.append((self.gen, r, msg))

    def flush_side(self, timeout: float) -> bool:
        """Wait (at most `timeout` s) until the I/O thread has sent every queued side message."""
        deadline = time.monotonic() + timeout
        while self._side_out and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._side_out

    def ask_stacks(self, ranks: Iterable[int]) -> int:
        """Ask `ranks` for their stacks now; the answers land in `stacks[id]` (id returned)."""
        ask = next(self._ask_ids)
        self.stacks[ask] = {}
        self.send_side(ranks, AskStacks(type="ask_stacks", id=ask))
        return ask

    def send_interrupt(self, ranks: Iterable[int], cell: int) -> None:
        """Stop for `cell`: the rank latches it (see labkit.rank.side). The Stop board, where
        there is one, says so first: a rank that has not started the cell sees it there."""
        if self.stop_board is not None:
            self.stop_board.press(cell)
        self.send_side(ranks, Interrupt(type="interrupt", cell=cell))
