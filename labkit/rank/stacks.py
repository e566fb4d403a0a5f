"""Each thread's Python stack, as the kernel shows it when asked or stuck (rank side).

The heartbeat thread calls `snapshot()` while the main thread is busy: in user code, in a C++
collective (which releases the GIL), or idle waiting for a request. The text reads like
`py-spy dump`: per thread its innermost frame first, one line per frame with the source line
under it (a cell's lines come from `linecache`, where `user_code.run_code` put them), and the
rank's own machinery (labkit.rank and labkit.wire: the request loop, the comm tracer's wrappers)
folded into one line such as `... 4 labkit frames`. The frames every thread starts with
(runpy, threading's bootstrap) are left out; so are threads that run only labkit's machinery
(`labkit-heartbeat`, the output capture), named at the end, and an idle main thread's frames
(it waits in labkit's request loop). When torch's Flight Recorder is on (labkit turns it on:
labkit.rank.flight_recorder), the last collectives the rank entered follow the threads.

This module never imports IPython, ipywidgets or plotly.
"""

from __future__ import annotations

import faulthandler
import os
import re
import sys
import sysconfig
import tempfile
import threading
import traceback
from types import FrameType

import labkit
from labkit.rank import flight_recorder
from labkit.wire.flight_records import FrSnapshot

_PACKAGE = os.path.dirname(os.path.abspath(labkit.__file__))
_ROOT = os.path.dirname(_PACKAGE)
_OWN_DIRS = tuple(os.path.join(_PACKAGE, d) + os.sep for d in ("rank", "wire"))
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
_THREADING = os.path.join(_STDLIB, "threading.py")
CELL_PREFIX = "<cell-"


def _own(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_OWN_DIRS) if filename[:1] != "<" else False


def _short(filename: str) -> str:
    """A frame's file as a reader wants it: torch/distributed/..., labkit/parallel/..."""
    if "site-packages" + os.sep in filename:
        return filename.rsplit("site-packages" + os.sep, 1)[1]
    for root in (_ROOT + os.sep, _STDLIB):
        if filename.startswith(root):
            return filename[len(root) :]
    return filename


def _start(fs: traceback.FrameSummary) -> bool:
    """A frame every process or thread starts with: runpy's, threading's bootstrap."""
    return fs.filename == "<frozen runpy>" or (
        fs.filename == _THREADING and fs.name in ("_bootstrap", "_bootstrap_inner", "run")
    )


def running_line() -> int | None:
    """The line of the cell the main thread runs now (the outermost cell frame's), or None.

    Read from faulthandler's dump of the threads' stacks, which C code writes from the
    interpreter's own frames while this thread holds the GIL, not by walking the running main
    thread's frame objects from this one: that walk (`sys._current_frames()`, then `f_back`),
    done by the heartbeat four times a second, once killed a rank with SIGSEGV on Python 3.11
    (a known class of 3.11 crashes when another thread's frames are read while it runs)."""
    return cell_line(_dump_threads(), threading.main_thread().ident)


_dump: tuple[int, object] | None = None  # (pid, an unlinked temporary file) for the dumps
_dump_lock = threading.Lock()
_THREAD = re.compile(r"^(?:Current thread|Thread) 0x([0-9a-f]+)")
_FILE_LINE = re.compile(r'^\s+File "(.*)", line (\d+) in ')


def _dump_threads() -> str:
    global _dump
    with _dump_lock:
        try:
            if _dump is None or _dump[0] != os.getpid():  # a forked child gets a file of its own
                _dump = (os.getpid(), tempfile.TemporaryFile())
            f = _dump[1]
            f.seek(0)
            f.truncate()
            faulthandler.dump_traceback(f, all_threads=True)
            f.seek(0)
            return f.read().decode(errors="replace")
        except (OSError, ValueError):  # no temporary file to be had: no line, the rank goes on
            return ""


def cell_line(dump: str, ident: int | None) -> int | None:
    """In faulthandler's text, the line of the outermost cell frame of thread `ident` (its
    frames come most recent first, so the last cell frame listed is the outermost)."""
    line, inside = None, False
    for text in dump.splitlines():
        head = _THREAD.match(text)
        if head:
            inside = int(head.group(1), 16) == ident
            continue
        found = _FILE_LINE.match(text) if inside else None
        if found and found.group(1).startswith(CELL_PREFIX):
            line = int(found.group(2))
    return line


def _frames(frame: FrameType) -> tuple[list[str], str | None]:
    """The lines of one thread's stack, innermost first, and where its user code is."""
    summary = [fs for fs in traceback.extract_stack(frame) if not _start(fs)]  # outermost first
    lines: list[str] = []
    cell_at = user_at = None  # the innermost cell frame; the outermost user frame
    folded = 0
    for fs in reversed(summary):
        if _own(fs.filename):
            folded += 1
            continue
        if folded:
            lines.append(f"    ... {folded} labkit frame{'s' if folded > 1 else ''}")
            folded = 0
        source = (fs.line or "").strip()
        lines.append(f"    {fs.name} ({_short(fs.filename)}:{fs.lineno})")
        if source:
            lines.append(f"        {source}")
        said = f": {source}" if source else ""
        if fs.filename.startswith(CELL_PREFIX):
            cell_at = cell_at or f"line {fs.lineno}{said}"
        user_at = f"{fs.name} ({_short(fs.filename)}:{fs.lineno}){said}"
    if folded:
        lines.append(f"    ... {folded} labkit frame{'s' if folded > 1 else ''}")
    return lines, cell_at or user_at


def snapshot(busy: int | None) -> tuple[str, str | None, FrSnapshot | None]:
    """Every thread's stack now (the main thread first), where the main thread's user code
    is ("line 3: time.sleep(60)" for a cell), or None when it runs none, and the Flight
    Recorder's entries (None when it is off). `busy`: the cell.

    Never raises: it runs on the heartbeat thread, which must go on reading Stop."""
    try:
        fr = flight_recorder.snapshot()  # read once: its last entries end the text too
    except Exception:  # noqa: BLE001 - a private API: the stacks go without the entries
        fr = None
    try:
        text, where = _snapshot(busy)
    except Exception as exc:  # noqa: BLE001 - say why instead of losing the heartbeat
        return f"(the stacks could not be read: {type(exc).__name__}: {exc})", None, fr
    recorded = flight_recorder.tail_text(snap=fr) if fr is not None else ""
    return (f"{text}\n{recorded}" if recorded else text), where, fr


def _snapshot(busy: int | None) -> tuple[str, str | None]:
    frames = sys._current_frames()
    main_id = threading.main_thread().ident
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    text: list[str] = []
    where = None
    service = []
    for ident in sorted(frames, key=lambda i: (i != main_id, names.get(i, ""), i)):
        if ident == me and me != main_id:  # the heartbeat thread, asking
            continue
        name = names.get(ident, f"Thread {ident:#x}")
        lines, at = _frames(frames[ident])
        if ident == main_id:
            idle = at is None or at.startswith("recv_multipart (zmq")  # labkit's request loop
            if busy is None and idle:
                text.append(f'Thread "{name}" (main, idle: waiting for the next request)')
                continue
            where = at
            state = f"running cell {busy}" if busy is not None else "between cells"
            text.append(f'Thread "{name}" (main, {state}):')
        elif at is None and name.startswith("labkit-"):
            service.append(name)
            continue
        else:
            text.append(f'Thread "{name}":')
        text += lines or ["    (no Python frames)"]
    if me != main_id:
        service.append(names.get(me, "labkit-heartbeat"))
    text.append(f"(labkit's own threads left out: {', '.join(sorted(service))})")
    del frames
    return "\n".join(text), where
