"""Stop is never lost, and a rank's route cannot be taken over (2 CPU ranks, gloo).

Stop is pressed (SIGINT to the kernel's main thread) at the moments a timer cannot hit
reliably: before the ranks received the cell (the latch is sent first), between two cells, and
while a rank is inside a C++ op. Each case also runs with every CPU saturated by busy loops
(conftest's `load`), as on a shared workshop server.
"""

from __future__ import annotations

import _thread
import os
import threading
import time

import pytest

import labkit
from labkit import LabError, LabkitWarning, RemoteError
from labkit.kernel.launch.policy import threads_per_rank
from labkit.rank import side
from labkit.rank.link import CtrlLink
from labkit.wire.codec import Codec, new_key

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def lab(load):  # conftest's `load`: every test runs on a quiet CPU, then on a saturated one
    lab = labkit.Lab(2, device="cpu")
    yield lab
    lab.stop()


def press_stop_after(seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, _thread.interrupt_main)
    timer.start()
    return timer


def test_a_stop_sent_before_the_cell_arrives_stops_it_unstarted(lab):
    lab.run("kept = rank + 1")
    cell = lab.last_cell + 1
    lab.channel.send_interrupt([0, 1], cell)  # Stop that reached the ranks before the cell
    assert lab.channel.flush_side(timeout=5)
    t0 = time.monotonic()
    res = lab.run("import time\nwhile True:\n    time.sleep(0.01)")
    assert time.monotonic() - t0 < 10
    assert {r.error["type"] for r in res.values()} == {"KeyboardInterrupt"}
    assert lab.pull("kept") == {0: 1, 1: 2}  # no restart: variables kept


def test_the_stop_board_alone_stops_a_cell_not_yet_started(lab):
    """A forked rank sees a Stop at a cell's start on the lab's Stop board, before (here:
    without) the `interrupt` message on its side socket; a later cell runs as usual."""
    lab.run("kept = rank + 1")
    cell = lab.last_cell + 1
    lab.channel.stop_board.press(cell)  # the board only: no message is sent
    res = lab.run("ran = True")
    assert {r.error["type"] for r in res.values()} == {"KeyboardInterrupt"}
    assert "before this rank started the cell" in res[0].error["message"]
    assert lab.run("'ran' in globals()").values_by_rank == {0: False, 1: False}
    assert lab.pull("kept") == {0: 1, 1: 2}  # no restart


def test_a_stop_signal_after_the_user_code_ended_still_ends_the_cell(lab):
    """A Stop's SIGINT that reaches a rank's main thread after the user code ended, while the
    rank is still writing up the cell's error, is ignored there: the cell replies with its own
    error. (It used to raise KeyboardInterrupt past the reply, and the kernel waited forever: CI
    saw it when the heartbeat re-signalled a cell that Stop had kept from starting.)"""
    lab.run(
        "import signal, threading, time\n"
        "import labkit.rank.worker as _worker\n"
        "_format = _worker.format_error\n"
        "def _signalled_while_formatting(exc):\n"
        "    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)\n"
        "    time.sleep(0.05)  # the handler runs here, in the main thread\n"
        "    return _format(exc)\n"
        "_worker.format_error = _signalled_while_formatting\n"
    )
    try:
        res = lab.run("raise ValueError('its own error')", timeout=30)
        assert {r.error["type"] for r in res.values()} == {"ValueError"}
    finally:
        lab.run("_worker.format_error = _format")
    assert lab.run("rank").values_by_rank == {0: 0, 1: 1}  # no restart


def test_a_stop_for_a_finished_cell_does_not_touch_the_next_one(lab):
    lab.run("x = 1")
    lab.channel.send_interrupt([0, 1], lab.last_cell)  # too late for that cell
    assert lab.channel.flush_side(timeout=5)
    time.sleep(0.5)  # the ranks' heartbeat threads read it
    res = lab.run("import time\ntime.sleep(1.0)\nx + rank")
    assert res.values_by_rank == {0: 1, 1: 2}


def test_stop_pressed_as_the_cell_is_sent_stops_it(lab):
    lab.run("kept = 5")
    for delay in (0.0, 0.05, 0.3):  # before, while and just after the request goes out
        t0 = time.monotonic()
        res = timer = None
        try:
            timer = press_stop_after(delay)
            res = lab.run("while True:\n    pass")
        except KeyboardInterrupt:  # pressed before the call reached the ranks: nothing ran
            pass
        finally:
            if timer is not None:
                timer.cancel()
        took = time.monotonic() - t0
        assert took < 10, f"Stop after {delay} s took {took:.1f} s"
        if res is not None:
            assert {r.error["type"] for r in res.values()} == {"KeyboardInterrupt"}
        assert lab.pull("kept") == {0: 5, 1: 5}


def test_stop_says_which_rank_is_inside_a_cpp_op(lab):
    code = (
        "import time\n"
        "t = torch.zeros(1)\n"
        "if rank == 0:\n"
        "    dist.recv(t, src=1)\n"  # C++: Stop cannot reach it
        "else:\n"
        "    time.sleep(600)\n"
    )
    timer = press_stop_after(1.5)
    t0 = time.monotonic()
    try:
        with pytest.raises((LabError, RemoteError)) as info:
            lab.run(code)
    finally:
        timer.cancel()
    assert time.monotonic() - t0 < 20
    text = str(info.value)
    assert "Stop was pressed" in text and "rank 0 is inside recv" in text, text
    assert "variables on the ranks were lost" in text
    assert lab.run("rank").values_by_rank == {0: 0, 1: 1}


def _wakeups(pid: int, tid: int) -> int:
    with open(f"/proc/{pid}/task/{tid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt"))


def test_an_idle_rank_wakes_less_often_and_still_takes_stop_at_once(lab):
    """Once a rank has had no cell for DROWSY_AFTER_S, its heartbeat thread reads the side
    channel every SIDE_POLL_IDLE_S, not every SIDE_POLL_S (an idle lab costs the machine
    less). A Stop pressed as the next cell starts is still taken, and nothing is restarted."""
    lab.run("import threading\nkept = rank")
    tids = lab.run(
        "next(t.native_id for t in threading.enumerate() if t.name == 'labkit-heartbeat')"
    ).values_by_rank
    time.sleep(side.DROWSY_AFTER_S + 0.5)
    before = {r: _wakeups(lab.pids[r], tids[r]) for r in tids}
    time.sleep(2.0)
    woke = {r: _wakeups(lab.pids[r], tids[r]) - before[r] for r in tids}
    # 2 s of 50 ms polls would be 40 wake-ups; of 0.25 s polls, 8 (and a heartbeat a second)
    assert all(n <= 2.0 / side.SIDE_POLL_IDLE_S + 4 for n in woke.values()), woke
    gen, t0, timer = lab.channel.gen, time.monotonic(), press_stop_after(0.1)
    try:
        res = lab.run("while True:\n    pass")
    finally:
        timer.cancel()
    assert {r.error["type"] for r in res.values()} == {"KeyboardInterrupt"}
    assert time.monotonic() - t0 < 10
    assert lab.channel.gen == gen and lab.pull("kept") == {0: 0, 1: 1}


def _press_stop_during(op, delay: float) -> None:
    """Run `op` with Stop pressed `delay` s after it began (during it, or just after it)."""
    timer = threading.Timer(delay, _thread.interrupt_main)
    try:
        timer.start()  # a busy machine may run the press before start() returns
        op()
    except (KeyboardInterrupt, LabError, RemoteError):
        pass
    while True:  # a press that came after `op` returned is taken here, not in the next op
        try:
            timer.join()
            time.sleep(0.01)
            return
        except KeyboardInterrupt:
            pass


def test_stop_pressed_at_any_moment_never_breaks_a_ctrl_link(lab):
    """Ctrl-C may come between any two Python calls of the kernel, also in the middle of
    writing a request into a rank's link or of reading a reply (labkit.kernel.channel.direct): a
    stream that lost or repeated a byte would make the rank leave (a restart, a new
    generation) or the kernel drop the link. 1 MiB values take many reads and writes."""
    import random

    blob = os.urandom(1 << 20)
    lab.push(blob=blob)
    gen, rnd = lab.channel.gen, random.Random(7)
    ops = (lambda: lab.push(blob=blob), lambda: lab.pull("blob"), lambda: lab.run("pass"))
    for i in range(45):
        _press_stop_during(ops[i % 3], rnd.uniform(0.0, 0.006))
    assert lab.channel.gen == gen, "a rank left or was restarted: its link broke"
    assert lab.channel.ctrl.broken == 0
    assert lab.pull("blob") == {0: blob, 1: blob}
    assert lab.run("rank").values_by_rank == {0: 0, 1: 1}
    for r in (0, 1):
        with open(os.path.join(lab.log_dir, f"rank-{r}.log")) as f:
            assert "ctrl link" not in f.read()


def test_a_process_claiming_a_ranks_name_gets_nothing(lab):
    impostor = CtrlLink(lab.channel.endpoint("ctrl"))  # the kernel's ctrl socket, as a rank's
    forged = Codec(new_key()).encode({"type": "hello", "rank": 1, "gen": lab.channel.gen})
    impostor.send_multipart(forged)  # signed with another key: rejected, never unpickled
    try:
        time.sleep(0.3)
        with pytest.warns(LabkitWarning, match="rejected a message"):
            assert lab.run("rank * 3").values_by_rank == {0: 0, 1: 3}
        assert not impostor.poll(500), "the impostor received a request meant for rank 1"
        assert lab.run("rank").values_by_rank == {0: 0, 1: 1}
    finally:
        impostor.close()


def test_each_rank_gets_its_share_of_the_cores(lab):
    import os

    threads = lab.run("torch.get_num_threads()").values_by_rank
    expected = threads_per_rank(os.cpu_count(), 2) or threads[0]
    assert threads == {0: expected, 1: expected}
    assert [r["threads"] for r in lab.status_report()["ranks"]] == [expected, expected]


def test_threads_rule_and_bad_input(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads_per_rank(2, 4) == 1 and threads_per_rank(16, 4) == 4
    assert threads_per_rank(16, 4, asked=2) == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads_per_rank(16, 4) is None  # the user chose: torch reads OMP_NUM_THREADS
    with pytest.raises(ValueError, match="threads must be an int >= 1 or None, got 0"):
        labkit.Lab(2, threads=0, start=False)
