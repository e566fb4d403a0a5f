"""Ctrl-C held back while the kernel reads or writes a ctrl link (labkit.kernel.channel.sigint)."""

from __future__ import annotations

import _signal
import os
import signal
import threading
import time
import types

import pytest

from labkit.kernel.channel import sigint
from labkit.kernel.channel.sigint import armed, uninterrupted

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def handler_changes(monkeypatch):
    """The SIGINT handler changes labkit.kernel.channel.sigint makes, as a list of handlers set."""
    changes: list[object] = []

    def counted(signum: int, handler: object) -> object:
        changes.append(handler)
        return _signal.signal(signum, handler)

    fake = types.SimpleNamespace(
        signal=counted, getsignal=_signal.getsignal, SIG_DFL=_signal.SIG_DFL
    )
    monkeypatch.setattr(sigint, "_signal", fake)
    return changes


def press() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # Python would run the handler here, between two calls


def test_uninterrupted_holds_ctrl_c_back_until_the_block_ends():
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with uninterrupted():
            press()
            reached.append("end of block")
    assert reached == ["end of block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with uninterrupted():  # nothing pressed: nothing raised
        reached.append("quiet")
    errors = []

    def other_thread():
        try:
            with uninterrupted():  # off the main thread it changes nothing
                reached.append("thread")
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=other_thread)
    t.start()
    t.join(10)
    assert reached[-2:] == ["quiet", "thread"] and not errors


def test_a_block_inside_another_holds_until_the_outer_one_ends(handler_changes):
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with uninterrupted():
            with uninterrupted():
                press()
            reached.append("after the inner block")
    assert reached == ["after the inner block"]
    assert len(handler_changes) == 2, "the inner block set no handler of its own"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_armed_blocks_set_no_handler_and_ctrl_c_between_them_is_raised_at_once(
    handler_changes,
):
    with armed():
        for _ in range(5):  # a cell's sends and reads
            with uninterrupted():
                pass
    assert len(handler_changes) == 2, f"one handler for the whole call: {handler_changes}"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    reached = []
    with pytest.raises(KeyboardInterrupt):
        with armed():
            with uninterrupted():
                press()
                reached.append("end of block")
            reached.append("after the block")
    assert reached == ["end of block"], "held in the block, raised as it ended"

    reached.clear()
    with pytest.raises(KeyboardInterrupt):
        with armed():
            press()  # between blocks: at once, as with no labkit handler at all
            reached.append("after the press")
    assert reached == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_armed_leaves_a_handler_someone_else_set_meanwhile():
    def theirs(signum, frame):
        pass

    try:
        with armed():
            signal.signal(signal.SIGINT, theirs)
        assert signal.getsignal(signal.SIGINT) is theirs
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def test_a_cell_sets_the_handler_once_for_all_its_sends_and_reads(lab, handler_changes):
    lab.run("pass")
    handler_changes.clear()
    results = lab.run("rank")  # 4 sends, and reads of 4 replies
    assert [results[r].value for r in range(4)] == [0, 1, 2, 3]
    assert len(handler_changes) == 2, f"set once and put back once: {handler_changes}"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
