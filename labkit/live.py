"""The live status of a running cell (kernel side).

Shown once a cell has run for `SHOW_AFTER` seconds, so quick cells stay quick: one row per
rank with its state, the line it runs and the comm op it is inside ("inside all_reduce #17 on
group [0, 1] for 4.2 s"). In a notebook it is an HTML display updated in place and cleared when
the cell ends; elsewhere it stays silent. Stop is the notebook's own Stop button (kernel
interrupt), which labkit turns into SIGINT on the ranks.
"""

from __future__ import annotations

import html
from typing import Any

from labkit.results import CellState

SHOW_AFTER = 1.0
REFRESH = 0.25


def describe_state(s: CellState) -> str:
    if s.state != "running":
        return s.state
    text = "running" + (f" line {s.line}" if s.line else "")
    if s.op:
        group = ", ".join(map(str, s.op["group"]))
        text += f", inside {s.op['op']} #{s.op['seq']} on group [{group}] for {s.blocked_s:.1f} s"
    return text


def status_html(states: list[CellState], elapsed: float) -> str:
    rows = "".join(
        f"<tr><td>rank {s.rank}</td><td>{html.escape(describe_state(s))}</td></tr>" for s in states
    )
    return (
        f"<div class='lk-live'><b>running for {elapsed:.1f} s</b> — press ■ (interrupt) "
        f"to stop<table>{rows}</table></div>"
    )


def _ipython() -> Any:
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    return shell if shell is not None and hasattr(shell, "kernel") else None


class LiveStatus:
    def __init__(self, targets: list[int]):
        self.targets = targets
        self.handle: Any = None
        self.last = 0.0
        self.enabled = _ipython() is not None

    def update(self, states: list[CellState], elapsed: float) -> None:
        if not self.enabled or elapsed < SHOW_AFTER or elapsed - self.last < REFRESH:
            return
        from IPython.display import HTML, display

        self.last = elapsed
        content = HTML(status_html(states, elapsed))
        if self.handle is None:
            self.handle = display(content, display_id=True)
        else:
            self.handle.update(content)

    def close(self) -> None:
        if self.handle is not None:
            from IPython.display import HTML

            self.handle.update(HTML(""))
