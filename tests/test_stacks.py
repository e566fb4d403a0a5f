"""Each rank's Python stacks: on demand (`lab.stacks()`, `%lab stacks`) while idle or busy, and
in the messages of a stuck cell and of Stop (2 CPU ranks, gloo; idle and loaded).

Stacks are asked from another thread while the kernel's main thread runs a cell, as a notebook
user would from a thread; a test waits for the ranks to reach a line by polling the stacks
themselves, never by sleeping a fixed time.
"""

from __future__ import annotations

import _thread
import os
import signal
import threading
import time

import pytest
from IPython.core.error import UsageError

import labkit
from labkit import LabError, LabkitWarning, RemoteError
from labkit.kernel.magics import LabMagics

pytestmark = pytest.mark.timeout(180)

WAIT_FOR = (
    "import os, time\n"
    "def wait_for(path):\n"
    "    while not os.path.exists(path):\n"
    "        time.sleep(0.02)\n"
)  # a cell's lines 1-4; line 5 on is the test's


@pytest.fixture(scope="module")
def lab(load):  # conftest's `load`: every test runs on a quiet CPU, then on a saturated one
    lab = labkit.Lab(2, device="cpu")
    yield lab
    lab.stop()


@pytest.fixture()
def flag(tmp_path, lab):
    path = str(tmp_path / "go")
    lab.push(FLAG=path)
    return path


def poll_stacks(lab, until, then, timeout=60.0):
    """In a thread: ask for the stacks until `until(stacks)`, then call `then()`; the thread
    and a list that gets the matching stacks (empty if they never matched)."""
    found = []

    def loop():
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stacks = lab.stacks(timeout=10)
            if until(stacks):
                found.append(stacks)
                break
            time.sleep(0.05)
        then()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread, found


def at(stacks, rank, text):
    return text in (stacks.where.get(rank) or "")


def test_stacks_of_an_idle_lab(lab):
    stacks = lab.stacks()
    assert sorted(stacks) == [0, 1] and stacks.answered == {0, 1}
    for r in (0, 1):
        assert 'Thread "MainThread" (main, idle: waiting for the next request)' in stacks[r]
        assert "labkit-heartbeat" in stacks[r]  # named as left out
    assert stacks.where == {0: None, 1: None}
    assert str(stacks).startswith("--- rank 0 ---\n")
    assert sorted(lab.stacks("1")) == [1]
    with pytest.raises(ValueError, match="timeout must be a number of seconds above 0"):
        lab.stacks(timeout=0)


def test_stacks_of_ranks_in_user_code_show_the_cell_line(lab, flag):
    code = WAIT_FOR + "wait_for(FLAG)\nrank * 10"

    def both_waiting(stacks):
        return all(at(stacks, r, "line 3") or at(stacks, r, "line 4") for r in (0, 1))

    thread, found = poll_stacks(lab, both_waiting, lambda: open(flag, "w").close())
    res = lab.run(code)
    thread.join()
    assert res.values_by_rank == {0: 0, 1: 10}
    assert found, "the stacks never showed both ranks waiting in the cell"
    text = found[0][1]
    cell = f"<cell-{lab.last_cell}>"
    assert f'Thread "MainThread" (main, running cell {lab.last_cell}):' in text
    # innermost frame first: wait_for, then the cell's line 5 that called it, with its source
    inner = text.index(f"wait_for ({cell}:")
    outer = text.index(f"<module> ({cell}:5)\n        wait_for(FLAG)")
    assert inner < outer, text
    assert "labkit frames" in text and "worker.py" not in text and "runpy" not in text


def test_stacks_of_a_rank_in_all_reduce_while_its_peer_sleeps(lab, flag):
    code = WAIT_FOR + "t = torch.ones(1)\nif rank == 1:\n    wait_for(FLAG)\ndist.all_reduce(t)\nt"

    def blocked(stacks):
        waiting = at(stacks, 1, "line 3") or at(stacks, 1, "line 4")
        return at(stacks, 0, "dist.all_reduce(t)") and waiting

    thread, found = poll_stacks(lab, blocked, lambda: open(flag, "w").close())
    res = lab.run(code)
    thread.join()
    assert {r: v.item() for r, v in res.values_by_rank.items()} == {0: 2.0, 1: 2.0}
    assert found, "the stacks never showed rank 0 in all_reduce while rank 1 waited"
    text = found[0][0]
    torch_frame = text.index("all_reduce (torch/distributed/distributed_c10d.py:")
    cell_frame = text.index(f"<module> (<cell-{lab.last_cell}>:8)\n        dist.all_reduce(t)")
    assert torch_frame < cell_frame, text  # the C++ wait is the innermost Python frame
    assert f"wait_for (<cell-{lab.last_cell}>:" in found[0][1]


def test_the_stuck_diagnosis_shows_the_line_of_the_hang(lab):
    before = dict(lab.pids)
    with pytest.warns(LabkitWarning, match="calls a collective"):
        with pytest.raises(LabError) as info:
            lab.run("t = torch.ones(1)\nhang = dist.all_reduce(t)", ranks=[0])
    text = str(info.value)
    assert "rank 1 is not running this cell" in text and "variables on the ranks were lost" in text
    stacks = text[text.index("Python stacks of the ranks that had not finished") :]
    assert "when labkit found the cell stuck" in stacks
    assert "--- rank 0 ---" in stacks and "--- rank 1 ---" not in stacks
    assert "all_reduce (torch/distributed/" in stacks
    assert "(<cell-" in stacks and "hang = dist.all_reduce(t)" in stacks, stacks
    assert set(before.values()).isdisjoint(lab.pids.values())  # restarted after the stacks
    assert lab.run("rank").values_by_rank == {0: 0, 1: 1}


def test_a_stop_names_the_line_each_rank_was_on(lab):
    code = "import time\nt = torch.zeros(1)\nif rank == 0:\n    dist.recv(t, src=1)\nelse:\n"
    code += "    time.sleep(600)\n"

    def there(stacks):
        return at(stacks, 0, "dist.recv(t, src=1)") and at(stacks, 1, "time.sleep(600)")

    thread, found = poll_stacks(lab, there, _thread.interrupt_main)
    t0 = time.monotonic()
    with pytest.raises((LabError, RemoteError)) as info:
        lab.run(code)
    thread.join()
    assert found and time.monotonic() - t0 < 60
    text = str(info.value)
    assert "Stop was pressed" in text and "rank 0 is inside recv" in text, text
    # rank 1 stopped: its KeyboardInterrupt says where; rank 0 could not: its stack says where
    assert "Stop was pressed while rank 1 ran line 6: time.sleep(600)" in text, text
    assert "when Stop was pressed" in text and "--- rank 0 ---" in text
    assert "recv (torch/distributed/" in text and "dist.recv(t, src=1)" in text
    assert lab.run("rank").values_by_rank == {0: 0, 1: 1}


def test_a_stop_that_ends_the_cell_says_where_each_rank_was(lab):
    lab.run("kept = rank + 7")
    code = "import time\nif rank == 0:\n    time.sleep(600)\nelse:\n    time.sleep(601)\n"

    def there(stacks):
        return at(stacks, 0, "time.sleep(600)") and at(stacks, 1, "time.sleep(601)")

    thread, found = poll_stacks(lab, there, _thread.interrupt_main)
    res = lab.run(code)
    thread.join()
    assert found
    assert res[0].error["message"] == "Stop was pressed while rank 0 ran line 3: time.sleep(600)"
    assert res[1].error["message"] == "Stop was pressed while rank 1 ran line 5: time.sleep(601)"
    with pytest.raises(RemoteError) as info:
        res.raise_for_errors()
    assert "line 5: time.sleep(601)" in str(info.value)  # the other rank's line, too
    assert lab.pull("kept") == {0: 7, 1: 8}  # no restart


def test_a_silent_rank_and_a_dead_rank_are_named(lab):
    pid = lab.pids[1]
    os.kill(pid, signal.SIGSTOP)  # a rank of this test's lab, by pid
    try:
        t0 = time.monotonic()
        stacks = lab.stacks(timeout=1.0)
        assert time.monotonic() - t0 < 5
    finally:
        os.kill(pid, signal.SIGCONT)
    assert "no answer within 1.0 s" in stacks[1] and stacks.answered == {0}
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while 1 not in lab.dead and time.monotonic() < deadline:
        time.sleep(0.05)
    stacks = lab.stacks(timeout=5.0)
    assert "dead" in stacks[1] and "SIGKILL" in stacks[1], stacks[1]
    assert "idle" in stacks[0]
    lab.restart()


def test_lab_stacks_magic(lab, capsys):
    magics = LabMagics(shell=None)
    magics.lab("stacks 1")
    out = capsys.readouterr().out
    assert out.startswith("--- rank 1 ---") and "rank 0" not in out, out
    with pytest.raises(UsageError, match="out of range|ranks"):
        magics.lab("stacks 5")
    with pytest.raises(UsageError, match="--timeout: must be a number of seconds above 0"):
        magics.lab("stacks --timeout 0")


# -- the formatting, in this process (no ranks) ----------------------------------------------
def test_snapshot_folds_labkit_frames_and_shows_cell_lines():
    from labkit.rank import stacks
    from labkit.rank.user_code import run_code

    ns = {"snapshot": stacks.snapshot}
    code = "def inner():\n    return snapshot(9)\n\nfound = inner()\n"
    run_code(code, "<cell-9>", ns)
    text, where, _fr = ns["found"]
    assert text.startswith('Thread "MainThread" (main, running cell 9):\n'), text
    inner = text.index("    inner (<cell-9>:2)\n        return snapshot(9)\n")
    outer = text.index("    <module> (<cell-9>:4)\n        found = inner()\n")
    assert inner < outer and where == "line 2: return snapshot(9)"
    # labkit's own frames: the snapshot itself (innermost), run_code (outer), folded
    assert text[:inner].rstrip().endswith("... 2 labkit frames"), text
    assert text[outer:].splitlines()[2] == "    ... 1 labkit frame", text


def test_stuck_text_keeps_the_main_thread_and_names_the_silent():
    from labkit.kernel.inspection.stacks import RankStacks, stuck_text

    main = 'Thread "MainThread" (main, running cell 3):\n    <module> (<cell-3>:2)\n        x()'
    other = 'Thread "user-thread":\n    run (worker.py:1)'
    texts = {0: f"{main}\n{other}\n(labkit's own threads left out: labkit-heartbeat)", 1: "(no"}
    text = stuck_text(RankStacks(texts, {0: "line 2: x()"}, {0}), "when Stop was pressed")
    assert text.startswith("Python stacks of the ranks that had not finished, when Stop was")
    frames = main.split("\n", 1)[1]  # the header goes: the message says which cell
    assert f"--- rank 0 ---\n{frames}\n--- rank 1 ---\n(no" in text and "user-thread" not in text
    texts = {r: f"{main}\n    ... 9 labkit frames" for r in (0, 2, 3)}
    text = stuck_text(RankStacks(texts, {}, {0, 2, 3}), "now")
    assert text.endswith(f"--- ranks 0, 2, 3 ---\n{frames}"), text  # the same stack, once
    assert stuck_text(RankStacks({}, {}, set()), "now") == ""
