"""Holding Ctrl-C back while the kernel reads or writes a ctrl link (kernel side).

A stream must never lose or repeat a byte (labkit.wire.framed), and Ctrl-C (Stop) can come
between any two Python calls of the thread that calls a lab. `uninterrupted()` holds SIGINT back
for its block and hands it, right after, to the handler that was set (which raises
KeyboardInterrupt, as usual). Only the main thread ever gets KeyboardInterrupt, so a block on
another thread changes nothing.

The holding is done by one handler, `_catch`, put in place by the outermost block. A cell
enters a block for each send and each reading of replies, and each change of handler is a
system call (`rt_sigaction`): 15 of a 4-rank no-op cell's 33 system calls when every block did
it. So `armed()` keeps `_catch` in place for a whole cell (labkit.kernel.cell.cell_run), and the
blocks inside only count. Between blocks `_catch` passes Ctrl-C on at once.

`_signal.signal` is `signal.signal` without its enum conversions (10x cheaper).
"""

from __future__ import annotations

import _signal
import signal
import threading
from typing import Any

_MAIN = threading.main_thread().ident
_SIGINT = int(signal.SIGINT)


class _State:
    armed = False  # `_catch` is SIGINT's handler
    old: Any = None  # the handler it stands in for
    depth = 0  # `uninterrupted` blocks open on the main thread
    caught = False  # a Ctrl-C came in a block and waits for its end


_S = _State()


def _catch(signum: int, frame: Any) -> None:
    if _S.depth:
        _S.caught = True
    else:
        _deliver(frame)


def _deliver(frame: Any = None) -> None:
    old = _S.old
    if callable(old):
        old(_SIGINT, frame)
    elif old == _signal.SIG_DFL:
        raise KeyboardInterrupt


def _arm() -> bool:
    """Put `_catch` in place; whether this call did (not off the main thread, not twice, and
    not over a handler set outside Python, which could not be put back)."""
    if _S.armed or threading.get_ident() != _MAIN:
        return False
    old = _signal.getsignal(_SIGINT)
    if old is None:
        return False
    _signal.signal(_SIGINT, _catch)
    _S.old, _S.armed = old, True
    return True


def _disarm() -> None:
    _S.armed = False
    if _signal.getsignal(_SIGINT) is _catch:  # else someone set another handler meanwhile
        _signal.signal(_SIGINT, _S.old)


class uninterrupted:  # noqa: N801 - used as a `with` block, as contextlib's are
    """Hold SIGINT back in this block (main thread), then hand it to the handler that was set."""

    __slots__ = ("counted", "set_it")

    def __enter__(self) -> None:
        self.counted = threading.get_ident() == _MAIN
        if self.counted:
            self.set_it = _arm()  # the outermost block, outside `armed()`
            _S.depth += 1

    def __exit__(self, *exc: object) -> None:
        if not self.counted:
            return
        _S.depth -= 1
        if self.set_it:
            _disarm()
        if _S.caught and not _S.depth:
            _S.caught = False
            _deliver()


class armed:  # noqa: N801
    """Keep the holding handler in place for a whole call, so the blocks inside it cost no
    system call. Outside its blocks Ctrl-C is raised at once, as without it."""

    __slots__ = ("did",)

    def __enter__(self) -> None:
        self.did = _arm()

    def __exit__(self, *exc: object) -> None:
        if self.did:
            _disarm()
