"""The heartbeat's `running_line` (labkit/rank/stacks.py): the line of the cell the main thread
runs, read from another thread, without walking the main thread's frame objects (that walk
crashed a rank with SIGSEGV on Python 3.11). Checked on cells whose lines are known by hand."""

from __future__ import annotations

import threading

import pytest

from labkit.rank import stacks


@pytest.fixture(autouse=True, scope="module")
def _close_the_dump_file():
    yield
    if stacks._dump is not None:  # the test process's own temporary file (a rank's dies with it)
        stacks._dump[1].close()
        stacks._dump = None


CELL = """import threading
x = 1
def inner(gate, seen):
    seen.append(running_line())  # read while the main thread waits in here
    gate.wait(10)
inner(gate, seen)
"""


def _run_cell_on_main_thread(filename: str, source: str) -> list[int | None]:
    """Runs `source` as a cell on this (the main) thread while another thread reads the line."""
    got: list[int | None] = []
    seen: list[int | None] = []  # where the cell puts what its hook returns (nothing)
    gate, asked = threading.Event(), threading.Event()

    def reader() -> None:
        asked.wait(10)
        got.append(stacks.running_line())
        gate.set()

    def running_line() -> int | None:  # the cell's hook: tell the reader to look now
        asked.set()
        return None

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        exec(
            compile(source, filename, "exec"),
            {"gate": gate, "seen": seen, "running_line": running_line},
        )
    finally:
        gate.set()
        asked.set()
        thread.join(10)
    return got


def test_the_outermost_cell_frame_gives_the_line():
    # line 6 calls inner(), which waits at line 5 of a function defined in the same cell: the
    # line people want is the cell's top-level statement, 6
    assert threading.current_thread() is threading.main_thread()
    assert _run_cell_on_main_thread("<cell-3>", CELL) == [6]


def test_no_cell_on_the_main_thread_gives_none():
    assert _run_cell_on_main_thread("/somewhere/module.py", CELL) == [None]


def test_the_dump_is_read_for_the_main_thread_only():
    dump = (
        "Thread 0x00007f0000000002 (most recent call first):\n"
        '  File "<cell-9>", line 40 in <module>\n'
        "\n"
        "Current thread 0x00007f0000000001 (most recent call first):\n"
        '  File "/x/torch/distributed/c10d.py", line 12 in all_reduce\n'
        '  File "<cell-4>", line 7 in step\n'
        '  File "<cell-4>", line 11 in <module>\n'
        '  File "/x/labkit/rank/worker.py", line 300 in execute\n'
    )
    assert stacks.cell_line(dump, 0x7F0000000001) == 11  # outermost cell frame, its thread
    assert stacks.cell_line(dump, 0x7F0000000002) == 40
    assert stacks.cell_line(dump, 0x7F0000000003) is None


def test_a_forked_child_dumps_into_a_file_of_its_own():
    import os

    assert stacks.running_line() is None  # no cell here; makes this process's file
    first = stacks._dump
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a new file, and the parent's left where it was
        try:
            stacks.running_line()
            ok = stacks._dump is not first and stacks._dump[0] == os.getpid()
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"1"
    os.close(read)
    os.waitpid(pid, 0)
    assert stacks._dump is first


def test_the_heartbeat_reads_the_stacks_only_for_a_long_cell_outside_collectives(monkeypatch):
    """faulthandler's dump of every thread crashed a rank once (python/cpython#116008: it
    reads other threads' states without locks while gloo's callbacks make and end threads),
    so the status's line comes from the traced call the main thread is in when there is one,
    is left out for a cell younger than LINE_AFTER_S, and only then is read from the dump."""
    import time

    from labkit.rank import side

    dumps: list[int] = []
    monkeypatch.setattr(stacks, "running_line", lambda: dumps.append(1) or 7)
    channel = side.SideChannel()
    channel.busy_since = time.monotonic()
    assert channel._cell_line(None) is None and dumps == []  # a short cell: no dump
    assert channel._cell_line({"op": "all_reduce", "line": 3}) == 3 and dumps == []
    channel.busy_since = time.monotonic() - side.LINE_AFTER_S
    assert channel._cell_line({"op": "all_reduce", "line": 3}) == 3 and dumps == []
    assert channel._cell_line(None) == 7 and dumps == [1]  # a long cell outside collectives
