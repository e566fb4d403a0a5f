"""The live status line and the Restart button, tested through their state (no browser)."""

from __future__ import annotations

from labkit.kernel.cell import live
from labkit.kernel.results import CellState


def blocked(rank: int = 1) -> CellState:
    op = {"op": "all_reduce", "seq": 17, "group": [0, 1], "peer": None}
    return CellState(rank, "running", 3, op, 4.2)


def test_status_line_reads_like_a_sentence() -> None:
    assert (
        live.status_line(blocked())
        == "rank 1 inside all_reduce #17 on group [0, 1] for 4.2 s, line 3"
    )
    recv = CellState(0, "running", None, {"op": "recv", "seq": 2, "group": [0, 1], "peer": 1}, 1.0)
    assert live.status_line(recv) == "rank 0 inside recv #2 on group [0, 1] with peer 1 for 1.0 s"
    assert live.status_line(CellState(2, "running", 7)) == "rank 2 running line 7"
    assert live.status_line(CellState(3, "raised ValueError")) == "rank 3 raised ValueError"


def test_status_html_says_how_to_stop_and_escapes() -> None:
    page = live.status_html([blocked(), CellState(0, "raised <X>")], 2.5)
    assert "running for 2.5 s" in page and "press ■" in page and "Interrupt" in page
    assert "raised &lt;X&gt;" in page and "<X>" not in page


def test_live_status_waits_a_second_then_updates_in_place(monkeypatch) -> None:
    shown: list[str] = []
    status = live.LiveStatus([0, 1])
    status.enabled = True
    monkeypatch.setattr(status, "_show", shown.append)
    status.update([blocked()], 0.5)
    assert shown == []  # quick cells stay quiet
    status.update([blocked()], 1.2)
    status.update([blocked()], 1.3)  # within REFRESH of the last one: skipped
    status.update([blocked()], 1.6)
    assert len(shown) == 2 and "rank 1 inside all_reduce #17" in shown[-1]


def test_outside_a_kernel_it_stays_silent() -> None:
    status = live.LiveStatus([0])
    assert not status.enabled
    status.update([blocked()], 5.0)
    status.close()
    assert status.html == "" and status.after is None


class FakeLab:
    def __init__(self, fail: bool = False) -> None:
        self.dead = {1: -9}
        self.fail = fail
        self.restarts = 0

    def restart(self) -> None:
        self.restarts += 1
        if self.fail:
            raise RuntimeError("no fork server")
        self.dead = {}


def test_restart_button_restarts_the_lab() -> None:
    lab = FakeLab()
    box = live.restart_button(lab)
    button, label = box.children
    assert "rank 1 died" in label.value
    button.click()
    assert lab.restarts == 1 and "restarted" in label.value and button.disabled


def test_restart_button_shows_a_failure_and_stays_usable() -> None:
    lab = FakeLab(fail=True)
    button, label = live.restart_button(lab).children
    button.click()
    assert "restart failed: RuntimeError: no fork server" in label.value
    assert not button.disabled
