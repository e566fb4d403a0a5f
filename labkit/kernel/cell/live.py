"""The live status of a running cell, and the status of the ranks (kernel side).

Shown once a cell has run for `SHOW_AFTER` seconds, so quick cells stay quick: one line per
rank with its state, e.g. "rank 1 inside all_reduce #17 on group [0, 1] for 4.2 s, line 3".
In a notebook it is an HTML display updated in place; when the cell ends it is updated to an
empty bundle, so the saved notebook keeps no stale "running for 1.2 s" (frontends draw nothing
for it). Its text is empty too, so text frontends (a console, nbconvert to text) never show a
snapshot of it; outside a kernel (terminal IPython, scripts) it stays silent.

Why no Stop button in it: while a cell runs the kernel's shell is busy, so a widget's click is
only handled after the cell ends. What reaches labkit mid-cell is the notebook's own Stop
(■, a kernel interrupt), which labkit turns into SIGINT on the ranks; the status says so. After
the cell, when ranks died, a Restart button (a real widget, which works then) replaces it.
"""

from __future__ import annotations

import html
import sys
import time
from typing import Any

from labkit.kernel.cell.watchdog import op_text
from labkit.kernel.results import CellState

SHOW_AFTER = 1.0
REFRESH = 0.25


def describe_state(s: CellState) -> str:
    """What one rank is doing: "inside all_reduce #17 on group [0, 1] for 4.2 s, line 3"."""
    if s.state != "running":
        return s.state
    line = f"line {s.line}" if s.line else ""
    if s.debugging:
        return "at a breakpoint (pdb waits for you)" + (f", {line}" if line else "")
    if not s.op:
        return "running" + (f" {line}" if line else "")
    text = f"inside {op_text(s.op)} for {s.blocked_s:.1f} s"
    return text + (f", {line}" if line else "")


def status_line(s: CellState) -> str:
    return f"rank {s.rank} {describe_state(s)}"


def status_html(states: list[CellState], elapsed: float) -> str:
    rows = "".join(f"<li>{html.escape(status_line(s))}</li>" for s in states)
    return (
        f"<div class='lk-live'><b>running for {elapsed:.1f} s</b> — press ■ (Kernel › "
        f"Interrupt) to stop every rank<ul style='margin:2px 0'>{rows}</ul></div>"
    )


def _ipython() -> Any:
    ipython = sys.modules.get("IPython")  # not imported: no kernel (and no import per cell)
    if ipython is None:
        return None
    shell = ipython.get_ipython()
    return shell if shell is not None and hasattr(shell, "kernel") else None


def restart_button(lab: Any) -> Any:
    """A Restart button (with a status label) that calls `lab.restart()` when clicked."""
    import ipywidgets as widgets

    dead = ", ".join(f"rank {r}" for r in sorted(getattr(lab, "dead", {})))
    label = widgets.HTML(f"{html.escape(dead or 'the ranks')} died: restart to go on")
    button = widgets.Button(description="Restart ranks", icon="refresh", button_style="warning")

    def on_click(_: Any) -> None:
        button.disabled = True
        label.value = "restarting..."
        try:
            lab.restart()
        except Exception as exc:  # noqa: BLE001 - shown beside the button, not lost
            label.value = html.escape(f"restart failed: {type(exc).__name__}: {exc}")
            button.disabled = False
            return
        label.value = "ranks restarted (variables on the ranks were lost)"

    button.on_click(on_click)
    return widgets.HBox([button, label])


class LiveStatus:
    """The live status of one cell: `update(states, elapsed)` while it runs, then `close()`.

    `lab` (optional) lets `close()` offer a Restart button when ranks died.
    """

    def __init__(self, targets: list[int], lab: Any = None):
        self.targets = targets
        self.lab = lab
        self.handle: Any = None
        self.last = 0.0
        self.html = ""  # what is shown now (tests read it)
        self.after: Any = None  # the widget shown after the cell, if any
        self.enabled = _ipython() is not None

    def update(self, states: list[CellState], elapsed: float) -> None:
        if not self.enabled or elapsed < SHOW_AFTER or elapsed - self.last < REFRESH:
            return
        self.last = elapsed
        self._show(status_html(states, elapsed))

    def _show(self, text: str) -> None:
        from IPython.display import display

        self.html = text
        bundle = {"text/html": text, "text/plain": ""}  # live in HTML only: text would go stale
        if self.handle is None:
            self.handle = display(bundle, raw=True, display_id=True)
        else:
            self.handle.update(bundle, raw=True)

    def close(self) -> None:
        if self.handle is not None:  # an empty bundle: nothing drawn, nothing saved but {}
            self.html = ""
            self.handle.update({}, raw=True)
        if self.enabled and self.lab is not None and getattr(self.lab, "dead", None):
            from IPython.display import display

            self.after = restart_button(self.lab)
            display(self.after)


def ranks_info(info: dict[int, dict[str, Any]], pids: dict[int, int]) -> list[dict[str, Any]]:
    """One dict per rank: rank, pid, host, device, backend, num_cpus, threads (torch's)."""
    return [
        {
            "rank": r,
            "pid": pids.get(r),
            "host": h.get("host"),
            "device": h.get("device"),
            "backend": h.get("backend"),
            "num_cpus": h.get("num_cpus"),
            "threads": h.get("threads"),
        }
        for r, h in sorted(info.items())
    ]


def status_report(lab: Any, heartbeats: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """What `%lab status` shows: the choice, and per rank its pid, device and liveness."""
    now = time.monotonic()
    rows = []
    for info in lab.ranks_info():
        r = info["rank"]
        st = heartbeats.get(r, {})
        age = now - st["received"] if "received" in st else None
        alive = r not in lab.dead and (age is None or age < 5)
        busy, debugging = st.get("busy") is not None, bool(st.get("debugging"))  # in pdb
        rows.append(dict(info, alive=alive, busy=busy, debugging=debugging, heartbeat_age_s=age))
    return {
        "running": lab.running,
        "world_size": lab.world_size,
        "backend": lab.backend,
        "choice": lab.choice.reason if lab.choice else "",
        "log_dir": lab.log_dir,
        "ranks": rows,
    }
