"""pdb on a rank, typed in the notebook: post-mortem and `breakpoint()` (runs on the rank).

A rank has no terminal, so its `pdb.Pdb` reads and writes through the rank's ctrl socket (the
main thread's, as every request's): whenever pdb wants a line, the rank sends what pdb wrote so
far and its prompt (`DebugPrompt`) and waits for the line the user typed (`DebugInput`); the
kernel (labkit.kernel.inspection.debug) shows the output and reads the line with `input()`, which a
notebook shows as an input box. The session ends when pdb does (`c`, `q`), when the kernel
sends no line (`line` None: it has no input box to ask in), or when Stop is latched for it.

- post-mortem (`lab.debug(rank)`, a `debug` request): the last exception a cell raised on the
  rank is kept (`keep`, as `sys.last_exc` and `sys.last_traceback`); pdb opens on its frames,
  without labkit's own. `q` or `c` returns the rank to serving cells.
- `breakpoint()` in a cell stops that rank there while the other ranks go on; the heartbeat says
  the rank is `debugging`, so the kernel's live status and watchdog know it waits for the user.
  `c` continues the cell, `q` ends it (BdbQuit); Stop (latched by the heartbeat thread for the
  session's request) ends the session and raises KeyboardInterrupt in the cell.

This module never imports IPython, ipywidgets or plotly.
"""

from __future__ import annotations

import bdb
import io
import os
import pdb
import sys
from types import TracebackType
from typing import Any

import zmq

from labkit.wire.framed import LinkBroken
from labkit.wire.messages import DebugPrompt

_OWN = (os.path.join("labkit", "rank", ""), os.path.join("labkit", "wire", ""))
_POLL_MS = 100  # how often a waiting session looks for Stop


def keep(exc: BaseException) -> None:
    """Keep the exception a cell raised for a later post-mortem (as the Python REPL does)."""
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
    sys.last_exc = exc  # Python 3.12's name; set on 3.11 too: one place to read it


class _Output(io.StringIO):
    def take(self) -> str:
        text = self.getvalue()
        self.seek(0)
        self.truncate()
        return text


class _Input:
    def __init__(self, session: Session):
        self.session = session

    def readline(self) -> str:
        return self.session.ask()


class RankPdb(pdb.Pdb):
    """pdb whose terminal is the notebook: see the module's docstring."""

    def __init__(self, session: Session):
        self.session = session
        super().__init__(stdin=_Input(session), stdout=session.out, nosigint=True, readrc=False)
        self.prompt = "(Pdb) "

    def interaction(self, frame: Any, traceback: Any) -> None:
        rank = self.session.rank
        rank.debugging = True
        # out of user code while pdb waits: Stop is seen by `Session._wait`, never raised in
        # the middle of reading the ctrl link (labkit.rank.link)
        was, rank.in_user_code = rank.in_user_code, False
        try:
            super().interaction(frame, traceback)
        finally:
            rank.debugging = False
            rank.in_user_code = was
        if self.session.stopped:
            self.set_continue()
            raise KeyboardInterrupt(f"Stop was pressed while rank {rank.rank} was in the debugger")
        if self.quitting and frame is not None:  # q at a breakpoint: the cell ends here
            raise bdb.BdbQuit(f"q in pdb ended the cell on rank {rank.rank}")


class Session:
    """One debugging session of request `request` (the cell at a breakpoint, or the `debug`)."""

    def __init__(self, rank: Any, request: int):
        self.rank = rank
        self.request = request
        self.out = _Output()
        self.stopped = False  # Stop was pressed: the session ends, the cell raises
        self.ended = False  # the kernel sent no line: end the session
        self.pdb = RankPdb(self)

    def _stop_latched(self) -> bool:
        return self.rank.stop_cell is not None and self.rank.stop_cell >= self.request

    def ask(self) -> str:
        """pdb wants a line: send its output and prompt, wait for the user's line."""
        end = "continue\n"  # ends a breakpoint's session and a post-mortem alike
        if self.ended or self._stop_latched():
            self.stopped = self.stopped or self._stop_latched()
            return end
        text = self.out.take()
        prompt = self.pdb.prompt
        if text.endswith(prompt):
            text = text[: -len(prompt)]
        self.rank.reply(
            DebugPrompt(type="debug_prompt", id=self.request, output=text, prompt=prompt)
        )
        line = self._wait()
        if line is None:
            self.ended = True
            return end
        return line.rstrip("\r\n") + "\n"

    def _wait(self) -> str | None:
        """The user's line, or None: the kernel sent none, or Stop was latched meanwhile."""
        ctrl = self.rank.ctrl
        while True:
            try:
                if self._stop_latched():
                    self.stopped = True
                    return None
                if not ctrl.poll(_POLL_MS):
                    continue
                msg = self.rank.codec.decode(ctrl.recv_multipart(copy=False))
            except KeyboardInterrupt:  # the heartbeat's Stop: seen on the next turn
                continue
            except (zmq.ZMQError, LinkBroken):  # the socket is gone: never spin on it
                raise
            except Exception as exc:  # noqa: BLE001 - forged: log it, never unpickle
                print(f"labkit rank {self.rank.rank}: rejected a message: {exc}", file=sys.stderr)
                continue
            if msg["type"] == "debug_input" and msg["id"] == self.request:
                return msg["line"]
            if msg["type"] == "exit":
                self.rank.capture.flush(timeout=1.0)
                os._exit(0)
            print(
                f"labkit rank {self.rank.rank}: ignored a {msg['type']!r} request: it is in "
                "the debugger",
                file=sys.stderr,
            )


def _user_traceback(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from the first frame of the user's code on (labkit's own left out)."""
    while tb is not None and tb.tb_next is not None:
        if not any(own in tb.tb_frame.f_code.co_filename for own in _OWN):
            break
        tb = tb.tb_next
    return tb


def post_mortem(rank: Any, request: int) -> tuple[bool, bool]:
    """A pdb session on the rank's last exception: (whether there was one, whether Stop ended
    the session)."""
    exc = getattr(sys, "last_exc", None)
    if exc is None or exc.__traceback__ is None:
        return False, False
    session = Session(rank, request)
    print(
        f"post-mortem of rank {rank.rank}: {type(exc).__name__}: {exc}\n"
        "(pdb: p NAME prints a value, up/down move between frames, q or c ends the session)",
        file=session.out,
    )
    session.pdb.reset()
    try:
        session.pdb.interaction(None, _user_traceback(exc.__traceback__))
    except KeyboardInterrupt:
        pass
    return True, session.stopped


def breakpoint_hook(rank: Any) -> Any:
    """`sys.breakpointhook` for a rank: `breakpoint()` in a cell opens a session on its frame."""

    def hook(*args: Any, **kwargs: Any) -> None:
        if rank.busy_cell is None:
            raise RuntimeError(
                f"breakpoint() stops rank {rank.rank} only in a cell (%%ranks or lab.run), "
                "where the notebook waits for it"
            )
        session = Session(rank, rank.busy_cell)
        print(
            f"rank {rank.rank} is at breakpoint() (pdb: p NAME prints a value, n runs the next "
            "line, c continues the cell)",
            file=session.out,
        )
        session.pdb.set_trace(sys._getframe(1))

    return hook
