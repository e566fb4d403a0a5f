"""tqdm progress bars on a rank, reported to the kernel instead of drawn (rank side).

`install(send)` (called once at rank start) makes every tqdm bar a cell creates report its
state, `Progress` messages sent with `send` (the rank's side socket), instead of writing `\\r`
redraws to the captured stderr: the kernel draws one bar per rank (labkit.views.progress_view).
The hook costs nothing when tqdm is not installed: tqdm's classes already imported (torch
imports tqdm when it is there) are replaced at once by subclasses that report (`lab_tqdm`), in
`tqdm`, `tqdm.std`, `tqdm.asyncio`, `tqdm.auto` and `tqdm.autonotebook`; a finder on
`sys.meta_path` does the same for `tqdm.std` and `tqdm.notebook` when they are imported later.
Everything built on `tqdm.std.tqdm` after that (`trange`, `tqdm.contrib`, ...) reports too;
`tqdm.notebook` gets the reporting std class (a rank has no widgets to draw).

A bar reports at most every `MIN_INTERVAL` seconds (tqdm itself redraws at most every 0.1 s by
default; this holds even with `mininterval=0`), and always its final state when it closes.

This module never imports IPython, ipywidgets or plotly; it imports tqdm only when the user does.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import itertools
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from labkit.wire.messages import Progress

MIN_INTERVAL = 0.1  # seconds between two reports of one bar (the final state always goes)
PATCHED = ("tqdm.std", "tqdm.notebook")  # patched when imported after `install`
LOADED = ("tqdm.std", "tqdm", "tqdm.asyncio", "tqdm.autonotebook", "tqdm.auto", "tqdm.notebook")

_send: Callable[[Progress], None] | None = None
_cell: Callable[[], int | None] = lambda: None  # noqa: E731
_ids = itertools.count(1)


class _Nowhere:
    """The file a reporting bar writes to: tqdm's own `\\r` redraws go nowhere."""

    encoding = "utf-8"

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def state(bar: Any, closed: bool = False) -> Progress:
    """A bar's state as the kernel shows it: n, total, desc, rate, elapsed, postfix, closed."""
    d = bar.format_dict
    n, elapsed = d.get("n", 0), d.get("elapsed", 0.0) or 0.0
    scale = d.get("unit_scale")
    return Progress(
        type="progress",
        bar=bar._labkit_id,
        cell=_cell(),
        n=n,
        total=d.get("total"),
        desc=str(d.get("prefix") or ""),
        unit=str(d.get("unit") or "it"),
        unit_scale=scale if isinstance(scale, (bool, int, float)) else False,
        rate=d.get("rate") or (n / elapsed if elapsed else None),
        elapsed=elapsed,
        postfix=str(d.get("postfix") or ""),
        leave=bool(bar.leave) if bar.leave is not None else bar.pos == 0,
        closed=closed,
    )


def report(bar: Any, final: bool = False) -> bool:
    """Send `bar`'s state unless one went less than `MIN_INTERVAL` ago (`final`: send it).
    Returns whether it was sent. Never raises: a bar must not break the user's loop."""
    now = time.monotonic()
    if _send is None or (not final and now - bar._labkit_sent < MIN_INTERVAL):
        return False
    try:
        msg = state(bar, closed=final)
        bar._labkit_sent = now
        _send(msg)
    except Exception:  # noqa: BLE001 - the channel is gone or the state unreadable: no bar
        return False
    return True


def lab_tqdm(base: type) -> type:
    """`base` (tqdm's class), reporting to the kernel instead of drawing."""

    class LabTqdm(base):  # type: ignore[misc, valid-type]
        """tqdm on a labkit rank: the kernel draws this bar (one per rank, live)."""

        _labkit = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._labkit_id = next(_ids)
            self._labkit_sent = float("-inf")
            self._labkit_done = False
            if kwargs.get("file") in (None, sys.stdout, sys.stderr):
                kwargs["file"] = _Nowhere()
            super().__init__(*args, **kwargs)

        def display(self, msg: Any = None, pos: Any = None) -> bool:
            if not self.disable and not self._labkit_done:
                report(self)
            return True

        def close(self) -> None:
            was_done = self.disable or self._labkit_done
            self._labkit_done = True
            super().close()
            if not was_done:
                report(self, final=True)

    LabTqdm.__name__ = LabTqdm.__qualname__ = "tqdm"
    LabTqdm.__module__ = base.__module__
    return LabTqdm


_made: dict[type, type] = {}  # tqdm's class -> its reporting subclass


def _ours(cls: type) -> type:
    if getattr(cls, "_labkit", False):
        return cls
    if cls not in _made:
        _made[cls] = lab_tqdm(cls)
    return _made[cls]


def _patch(module: Any) -> None:
    """Put reporting classes in place of tqdm's in `module` (torch imports tqdm, so the
    rank may have `tqdm`, `tqdm.std`, `tqdm.auto`... already; `trange` looks its class up)."""
    if module.__name__ == "tqdm.notebook":  # widgets cannot draw on a rank: the std class
        ours = _ours(sys.modules["tqdm.std"].tqdm)
        module.tqdm = module.tqdm_notebook = ours
        module.trange = module.tnrange = lambda *a, **k: ours(range(*a), **k)
        return
    for attr in ("tqdm", "tqdm_asyncio"):
        cls = getattr(module, attr, None)
        if isinstance(cls, type) and hasattr(cls, "format_meter"):
            setattr(module, attr, _ours(cls))


class _Finder(importlib.abc.MetaPathFinder):
    """Patches `PATCHED` modules right after they are executed (the user's import)."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if name not in PATCHED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        execute = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            try:
                _patch(module)
            except Exception as exc:  # noqa: BLE001 - the user's import must still work
                print(f"labkit: tqdm bars stay as tqdm draws them: {exc}", file=sys.stderr)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_lock = threading.Lock()


def install(send: Callable[[Progress], None], cell: Callable[[], int | None]) -> None:
    """Report tqdm bars with `send`; `cell()` says which cell runs. Idempotent."""
    global _send, _cell
    with _lock:
        _send, _cell = send, cell
        if not any(isinstance(f, _Finder) for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder())
        for name in LOADED:  # imported already: torch imports tqdm when it is installed
            if sys.modules.get(name) is not None:  # (None: an import that was blocked)
                try:
                    _patch(sys.modules[name])
                except Exception as exc:  # noqa: BLE001 - an odd tqdm must not stop the rank
                    print(f"labkit: tqdm bars stay as tqdm draws them: {exc}", file=sys.stderr)
