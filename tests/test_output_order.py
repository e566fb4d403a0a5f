"""labkit.kernel.channel.output: a burst of lines is shown in rank order, nothing held is lost."""

from __future__ import annotations

import time

from labkit.kernel.channel import output
from labkit.kernel.channel.output import RankOutput


def _line(rank: int, text: str, name: str = "stdout") -> dict:
    return {"type": "stream", "rank": rank, "text": text, "name": name}


def test_a_burst_is_shown_in_rank_order_each_ranks_lines_in_order(capsys):
    out = RankOutput()
    for rank, text in [(3, "a\n"), (1, "b\n"), (3, "c\n"), (2, "d\n"), (0, "e\n")]:
        out.show(_line(rank, text))
    assert capsys.readouterr().out == ""  # held
    out.finish()
    assert capsys.readouterr().out == (
        "[rank 0] e\n[rank 1] b\n[rank 2] d\n[rank 3] a\n[rank 3] c\n"
    )
    assert out.of(3) == "a\nc\n"


def test_held_lines_come_out_once_due_and_the_wait_is_shortened(capsys, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(output.time, "monotonic", lambda: now[0])
    out = RankOutput()
    assert out.wait_ms(100) == 100
    out.show(_line(1, "x\n"))
    assert 1 <= out.wait_ms(100) <= output.HOLD * 1000 + 1
    now[0] += output.HOLD / 2
    out.release()
    assert capsys.readouterr().out == ""
    now[0] += output.HOLD
    out.release()
    assert capsys.readouterr().out == "[rank 1] x\n"


def test_a_partial_line_and_stderr_keep_their_own_tags(capsys):
    out = RankOutput()
    out.show(_line(1, "par"))
    out.show(_line(0, "boom\n", "stderr"))
    out.show(_line(1, "tial\n"))
    out.reset()  # a new call shows what the last one left held
    captured = capsys.readouterr()
    assert captured.out == "[rank 1] partial\n" and captured.err == "[rank 0] boom\n"


def test_live_output_is_not_held_longer_than_the_hold(capsys):
    out = RankOutput()
    out.show(_line(0, "tick\n"))
    time.sleep(output.HOLD + 0.01)
    out.release()
    assert capsys.readouterr().out == "[rank 0] tick\n"
