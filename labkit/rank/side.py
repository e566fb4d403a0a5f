"""The rank's side channel: heartbeat, Stop, stacks and leaving (runs on the rank).

`SideChannel` is the part of `labkit.rank.worker.Rank` that works beside the main thread:

- `side` (any thread, behind `side_lock`): output lines (`stream`) and the heartbeat (`status`:
  busy or idle, the cell line running, the comm op the rank is inside, the last request taken).
  The heartbeat thread reads the kernel's `side` messages every `SIDE_POLL_S`: Stop
  (`interrupt`), `leave`, `ask_stacks` (answered with `stacks`, labkit.rank.stacks, even while
  busy).
- Stop is latched, never lost: the kernel sends `interrupt` for a cell and re-sends it while it
  waits; the heartbeat thread reads it within `SIDE_POLL_S` while a cell runs (within
  `SIDE_POLL_IDLE_S` of the start of a cell that came after `DROWSY_AFTER_S` of quiet: an idle
  rank's thread wakes less often). The rank remembers the cell; if its user code runs, it
  raises KeyboardInterrupt there (again every `RESTOP_S` while it keeps running); if the cell
  has not started yet, it is not run at all. At a cell's start a forked rank looks for it on
  the lab's Stop board, which costs no socket read (labkit.wire.stop_board); an attached rank
  reads its side socket there.
- A rank attached over TCP leaves when the kernel's link drops; a forked one when its parent
  dies.

This module never imports IPython, ipywidgets or plotly.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

import zmq

from labkit.rank import cuda_memory, stacks, trace
from labkit.wire.config import RankConfig
from labkit.wire.key_file import remove_orphaned_key
from labkit.wire.messages import RankToKernel, Stacks, Status
from labkit.wire.stop_board import StopBoard

HEARTBEAT_IDLE = 1.0
HEARTBEAT_BUSY = 0.25
SIDE_POLL_S = 0.05  # how often the heartbeat thread reads Stop and requests for stacks
# ... and how often once the rank has had no cell for DROWSY_AFTER_S: an idle lab's ranks
# wake 4 times a second instead of 20 (a Stop for the next cell is read as it begins anyway)
SIDE_POLL_IDLE_S = 0.25
DROWSY_AFTER_S = 2.0
LINE_AFTER_S = 1.0  # a cell's line is read from the threads' stacks once it has run this long
RESTOP_S = 1.0  # a stopped cell whose code goes on running is interrupted again after this


class SideChannel:
    """The heartbeat thread's half of a rank (mixed into `labkit.rank.worker.Rank`)."""

    rank: int
    gen: int
    codec: Any
    ctrl: zmq.Socket
    side: zmq.Socket
    side_lock: threading.Lock
    stream_seq: int
    busy_cell: int | None
    quiet_since: float  # when the last cell ended (the main thread sets it)
    busy_since = 0.0  # when the running cell began (the main thread sets it)
    in_user_code: bool
    taken: int
    stop_cell: int | None
    stopped_at: float
    stacks_out: list[Stacks]
    board: StopBoard | None  # the lab's Stop board (forked ranks)
    capture: Any
    debugging = False  # in a pdb session, waiting for the user (labkit.rank.debugger)
    cfg: RankConfig

    def _leave_when_kernel_goes(self) -> None:
        """An attached rank has no parent in the lab: leave when the kernel's link drops."""
        monitor = self.ctrl.get_monitor_socket(zmq.EVENT_DISCONNECTED)

        def watch() -> None:
            from zmq.utils.monitor import recv_monitor_message

            recv_monitor_message(monitor)  # the link dropped (or its heartbeats timed out)
            print(f"labkit rank {self.rank}: the lab's kernel is gone; leaving", file=sys.stderr)
            if self.cfg.key_file and self.cfg.kernel:  # the key file a killed kernel left
                remove_orphaned_key(self.cfg.key_file, *self.cfg.kernel)
            time.sleep(0.2)  # let the capture thread log that line
            os._exit(1)

        threading.Thread(target=watch, name="labkit-kernel-link", daemon=True).start()

    def _take_stop(self, cell: int) -> None:
        """At the start of `cell` (main thread): latch a Stop pressed for it before this rank
        took it. A forked rank looks at the lab's Stop board first, and reads the side socket
        only when the board has reached this cell (labkit.wire.stop_board); an attached rank,
        with no board, reads the side socket at every cell's start."""
        board = self.board
        pressed = board.cells[0] if board is not None else 0
        if board is not None and pressed < cell:  # the common cell: one load, no socket
            return
        with self.side_lock:
            if board is not None:  # latched now: its message may still be on its way
                self.stop_cell = max(pressed, self.stop_cell or 0)
            self._take_side()

    def _take_side(self) -> None:
        """Read what the kernel sent on `side` (call with `side_lock` held): Stop, leave, and
        requests for stacks (taken before a Stop read in the same turn interrupts the cell)."""
        # EVENTS, not poll(0): no Poller built and no poll() call each cell
        while self.side.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                msg = self.codec.decode(self.side.recv_multipart(copy=False))
            except Exception as exc:  # noqa: BLE001 - forged: log it, never unpickle
                print(f"labkit rank {self.rank}: rejected a message: {exc}", file=sys.stderr)
                continue
            if msg.get("type") == "interrupt" and msg["cell"] >= self.taken:
                self.stop_cell = max(msg["cell"], self.stop_cell or 0)
            elif msg.get("type") == "ask_stacks":
                text, where, fr = stacks.snapshot(self.busy_cell)
                self.stacks_out.append(
                    Stacks(
                        type="stacks",
                        id=msg["id"],
                        busy=self.busy_cell,
                        text=text,
                        where=where,
                        fr=fr,
                    )
                )
            elif msg.get("type") == "leave":
                print(f"labkit rank {self.rank}: leaving: {msg['why']}", file=sys.stderr)
                self.capture.flush(timeout=1.0)
                os._exit(1)
        self._stop_if_latched()

    def _stop_if_latched(self) -> None:
        """Raise KeyboardInterrupt in the user code of a cell whose Stop is latched."""
        if (
            self.stop_cell is not None
            and self.busy_cell == self.stop_cell
            and self.in_user_code
            and time.monotonic() - self.stopped_at >= RESTOP_S
        ):
            self.stopped_at = time.monotonic()
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    def send_side(self, msg: RankToKernel) -> None:  # stream, status, stacks, progress
        msg.update(rank=self.rank, gen=self.gen)
        with self.side_lock:
            if msg["type"] in ("stream", "progress"):  # one numbering: `done` follows both
                self.stream_seq += 1
                msg["seq"] = self.stream_seq
            self.side.send_multipart(self.codec.encode(msg, shared=False), copy=False)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.in_user_code:
            self.stopped_at = time.monotonic()
            raise KeyboardInterrupt

    def _heartbeat(self) -> None:
        parent = os.getppid()
        while True:  # the first heartbeat goes at once: the kernel learns the side route
            if os.getppid() != parent:  # our parent died: the lab is gone
                os._exit(1)
            self._read_side()
            status = Status(type="status", busy=self.busy_cell, time=time.time(), taken=self.taken)
            if self.debugging:
                status["debugging"] = True
            memory = cuda_memory.snapshot()
            if memory is not None:
                status["cuda_memory"] = memory
            if self.busy_cell is not None:
                op = trace.current()
                status.update(line=self._cell_line(op), op=op, progress=trace.progress())
            try:
                self.send_side(status)
            except zmq.ZMQError:
                return
            busy = self.busy_cell is not None
            until = time.monotonic() + (HEARTBEAT_BUSY if busy else HEARTBEAT_IDLE)
            while time.monotonic() < until:
                time.sleep(self._poll_interval())
                if self.busy_cell is not None and not busy:
                    break  # a cell began: say so now
                self._read_side()

    def _cell_line(self, op: dict[str, Any] | None) -> int | None:
        """The line the running cell is at, for the kernel's status: a traced call's own (the
        tracer took it on the main thread); else, once the cell has run LINE_AFTER_S, read
        from faulthandler's dump of every thread's stack. That dump reads the other threads'
        states without the interpreter's locks and killed a rank with SIGSEGV once in a whole
        run (CPython 3.11, python/cpython#116008: threads made and ended meanwhile, as gloo's
        callbacks do around collectives), so it is taken as seldom as the status needs it:
        not for short cells, and not inside collectives."""
        if op is not None:
            return op.get("line")
        if time.monotonic() - self.busy_since < LINE_AFTER_S:
            return None
        return stacks.running_line()

    def _poll_interval(self) -> float:
        """SIDE_POLL_S while a cell runs or soon after one; SIDE_POLL_IDLE_S once quiet."""
        if self.busy_cell is not None or self.debugging:
            return SIDE_POLL_S
        return (
            SIDE_POLL_S
            if time.monotonic() - self.quiet_since < DROWSY_AFTER_S
            else SIDE_POLL_IDLE_S
        )

    def _read_side(self) -> None:
        """Take what the kernel sent on `side`, then send the stacks it asked for."""
        with self.side_lock:
            self._take_side()
        while self.stacks_out:
            self.send_side(self.stacks_out.pop(0))
