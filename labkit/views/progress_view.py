"""The ranks' tqdm bars during one call, drawn in the notebook (kernel side).

Each rank's bars report their state (`labkit.wire.messages.Progress`, sent by
`labkit.rank.progress`); `ProgressBars` keeps the latest state of each bar and draws one row per
bar per rank, `rank r`, the bar, n/total and the rate, formatted by tqdm's own `format_meter`:

- in a kernel with ipywidgets: one widget, a row per bar (label, progress bar, text), updated
  live; its plain-text form is the same rows as lines (what a text frontend or a saved
  notebook's text shows), set when the call ends;
- in a kernel without ipywidgets: a plain-text display of one line per bar, updated in place;
- in a terminal (IPython without a kernel, a script) on a TTY: the lines redrawn in place below
  the ranks' output; elsewhere (a pipe, a log) the final lines once, when the call ends.

No `\\r` ever reaches the cell's output. A closed bar with `leave=False` disappears, as in a
terminal; each rank keeps at most `MAX_ROWS` bars (the oldest closed ones go first).
"""

from __future__ import annotations

import sys
import time
from typing import Any

MAX_ROWS = 4  # bars shown per rank
REDRAW_S = 0.1  # the fastest the bars are redrawn (the final state is always drawn)
NCOLS = 80  # width of a text line, "rank r" included


def _format(state: dict[str, Any], bar_format: str | None = None, ncols: int = NCOLS) -> str:
    """One bar as tqdm would draw it ("desc:  40%|####      | 20/50 [00:01<00:01, 19.8it/s]")."""
    try:
        from tqdm.std import tqdm
    except ImportError:  # tqdm is a dependency of labkit's `lab` extra; say it plainly without
        total = f"/{state['total']:g}" if state.get("total") else ""
        rate = f", {state['rate']:.1f}{state['unit']}/s" if state.get("rate") else ""
        desc = f"{state['desc']}: " if state.get("desc") else ""
        return f"{desc}{state['n']:g}{total} [{state['elapsed']:.1f} s{rate}]"
    return tqdm.format_meter(
        n=state["n"],
        total=state.get("total"),
        elapsed=state.get("elapsed", 0.0),
        ncols=ncols,
        prefix=state.get("desc", ""),
        unit=state.get("unit", "it"),
        unit_scale=state.get("unit_scale", False),
        rate=state.get("rate"),
        postfix=state.get("postfix") or None,
        bar_format=bar_format,
    )


def line(rank: int, state: dict[str, Any]) -> str:
    """A bar's text line: "rank 1 train:  40%|####      | 20/50 [00:01<00:01, 19.8it/s]"."""
    head = f"rank {rank} "
    return head + _format(state, ncols=NCOLS - len(head))


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


def _widgets() -> Any:
    try:
        import ipywidgets
    except ImportError:
        return None
    return ipywidgets


class ProgressBars:
    """The tqdm bars of one call; `update(msg)` for each `progress`, `finish()` at the end.

    `mode`: "widget", "display" (plain text, updated in place), "terminal" (ANSI redraw on a
    TTY) or "print" (the final lines, once); by default the best the frontend has.
    """

    def __init__(self, mode: str | None = None):
        if mode is None:
            if _in_kernel():
                mode = "widget" if _widgets() is not None else "display"
            else:
                mode = "terminal" if sys.stdout.isatty() else "print"
        self.mode = mode
        self.bars: dict[tuple[int, int], dict[str, Any]] = {}  # (rank, bar) -> latest state
        self.handle: Any = None  # the display (kernel modes)
        self.box: Any = None  # the widget
        self.rows: dict[tuple[int, int], Any] = {}  # an HBox: label, bar, text
        self.drawn = 0  # lines drawn in the terminal now
        self.last = 0.0
        self.finished = False

    # -- state -------------------------------------------------------------------------------
    def update(self, msg: dict[str, Any]) -> None:
        key = (msg["rank"], msg["bar"])
        if msg.get("closed") and not msg.get("leave", True):
            self.bars.pop(key, None)
        else:
            self.bars[key] = msg
        mine = sorted(k for k in self.bars if k[0] == key[0])
        while len(mine) > MAX_ROWS:  # the oldest closed bar goes first, else the oldest
            old = next((k for k in mine if self.bars[k].get("closed")), mine[0])
            del self.bars[old]
            mine.remove(old)
        if time.monotonic() - self.last >= REDRAW_S:
            self.draw()

    def text(self) -> str:
        """One line per bar, by rank, then by bar: what a text frontend shows."""
        return "\n".join(line(r, s) for (r, _), s in sorted(self.bars.items()))

    # -- drawing -----------------------------------------------------------------------------
    def draw(self) -> None:
        self.last = time.monotonic()
        if self.mode == "widget":
            self._draw_widget()
        elif self.mode == "display":
            self._display({"text/plain": self.text()})
        elif self.mode == "terminal":
            self.clear()
            self.redraw()

    def finish(self) -> None:
        """The call ended: draw the final state, and leave it in the output."""
        if self.finished:
            return
        self.finished = True
        if self.mode == "widget":
            self._draw_widget()
            self._display(self._bundle())  # the final lines as the widget's text form
        elif self.mode == "display":
            self._display({"text/plain": self.text()})
        elif self.mode == "terminal":
            self.clear()
            self.redraw()
            self.drawn = 0  # the last lines stay
        elif self.bars:
            print(self.text(), flush=True)

    def _display(self, bundle: dict[str, Any]) -> None:
        from IPython.display import display

        if self.handle is None:
            self.handle = display(bundle, raw=True, display_id=True)
        else:
            self.handle.update(bundle, raw=True)

    def _bundle(self) -> dict[str, Any]:
        bundle = dict(self.box._repr_mimebundle_() or {})
        bundle["text/plain"] = self.text()
        return bundle

    def _draw_widget(self) -> None:
        w = _widgets()
        if self.box is None:
            self.box = w.VBox([])
        for key, state in self.bars.items():
            if key not in self.rows:
                label = w.Label(f"rank {key[0]}", layout=w.Layout(min_width="5em"))
                bar = w.FloatProgress(min=0, max=1, layout=w.Layout(width="40%"))
                self.rows[key] = w.HBox([label, bar, w.Label()])
            label, bar, text = self.rows[key].children
            total = state.get("total") or 0
            bar.max = total or max(state["n"], 1)
            bar.value = min(state["n"], bar.max)
            if state.get("closed"):
                bar.bar_style = "success" if not total or state["n"] >= total else "danger"
            desc = state.get("desc")
            label.value = f"rank {key[0]}" + (f" {desc}" if desc else "")
            text.value = _format(state, "{n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}]")
            if state.get("postfix"):
                text.value += f" {state['postfix']}"
        for key in [k for k in self.rows if k not in self.bars]:
            del self.rows[key]
        children = tuple(self.rows[k] for k in sorted(self.rows))
        if children != self.box.children:
            self.box.children = children
        if self.handle is None:
            self._display(self._bundle())

    def clear(self) -> None:
        """Terminal: erase the bars drawn below the output (before more output is written)."""
        if self.mode == "terminal" and self.drawn:
            sys.stdout.write(f"\x1b[{self.drawn}F\x1b[J")
            sys.stdout.flush()
            self.drawn = 0

    def redraw(self) -> None:
        """Terminal: draw the bars again below the output."""
        if self.mode == "terminal" and self.bars and not self.drawn:
            text = self.text()
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
            self.drawn = text.count("\n") + 1
