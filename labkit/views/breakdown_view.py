"""Where each rank's time went in a cell, as a chart (kernel side).

`show_breakdown(lab)` draws the last cell's `labkit.views.breakdown_data.breakdown`: a stacked
horizontal bar per rank, compute (less what hid communication) / communication overlapped with
compute / communication exposed / idle, which add up to the cell's window, with the straggler
named in the title; under it the table, the same as `view.breakdown.text` in a terminal.
`show_breakdown(lab, compare=(3, 4))` puts two cells one above the other on one time axis, with
a table of their means per rank (`view.comparison`).
"""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.views._common import (
    IDLE_COLOUR,
    View,
    html_table,
    op_colour,
    oversubscription,
    records_from,
    title,
    warning_html,
)
from labkit.views.breakdown_data import (
    TEXT_HEADERS,
    Breakdown,
    Comparison,
    breakdown,
    text_row,
)
from labkit.views.breakdown_data import compare as side_by_side

__all__ = ["BreakdownView", "show_breakdown"]

# (label, colour, the part of a row it draws, in seconds)
SEGMENTS = (
    ("compute", op_colour("compute"), lambda r: r.compute - r.overlapped),
    ("comm overlapped", "#54a24b", lambda r: r.overlapped),
    ("comm exposed", op_colour("all_reduce"), lambda r: r.exposed),
    ("idle", IDLE_COLOUR, lambda r: r.idle),
)


def _bars(one: Breakdown, first: bool) -> list[go.Bar]:
    ys = [f"rank {r.rank}" for r in one.rows]
    return [
        go.Bar(
            orientation="h",
            name=label,
            y=ys,
            x=[part(r) * 1e3 for r in one.rows],
            marker_color=colour,
            legendgroup=label,
            showlegend=first,
            hovertemplate=f"%{{y}}: %{{x:.1f}} ms {label}<extra>{one.name}</extra>",
        )
        for label, colour, part in SEGMENTS
    ]


def _headline(one: Breakdown) -> str:
    s = one.straggler
    if s is None:
        return f"{one.name}: no straggler"
    return f"{one.name}: straggler rank {s.rank}, the others waited {s.waited * 1e3:.1f} ms for it"


def breakdown_figure(parts: list[Breakdown]) -> go.Figure:
    """Stacked bars per rank, one panel per breakdown (two for a comparison), in ms."""
    n = max(len(p.rows) for p in parts)
    panel = 40 + 28 * n
    height = 140 + panel * len(parts)
    fig = make_subplots(
        rows=len(parts),
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.12 if len(parts) > 1 else 0.0,
        subplot_titles=[_headline(p) for p in parts] if len(parts) > 1 else None,
    )
    for i, part in enumerate(parts):
        for bar in _bars(part, first=i == 0):
            fig.add_trace(bar, row=i + 1, col=1)
        fig.update_yaxes(autorange="reversed", row=i + 1, col=1)
    text = _headline(parts[0]) if len(parts) == 1 else f"{parts[0].name} vs {parts[1].name}"
    fig.update_layout(
        barmode="stack",
        height=height,
        autosize=True,  # no width: it follows the output area
        title=title(text, height),
        margin={"l": 70, "r": 10, "t": 60, "b": 70},
        # under the x axis's tick labels, in the bottom margin whatever the figure's height
        legend={"orientation": "h", "yref": "container", "y": 0.0, "yanchor": "bottom"},
    )
    fig.update_annotations(font_size=11)
    fig.update_xaxes(ticksuffix=" ms", row=len(parts), col=1)
    return fig


def _table(one: Breakdown) -> str:
    rows = [text_row(r) for r in one.rows]
    caption = f"{one.name}: where each rank's time went"
    note = f"<div>{one.untimed_line}</div>" if one.untimed else ""
    return html_table(TEXT_HEADERS, rows, caption) + f"<div>{one.straggler_line}</div>" + note


class BreakdownView(View):
    """The widget `show_breakdown` returns: `breakdown` (the data; for a comparison, the first
    cell's), `parts` (one or two breakdowns) and `comparison` (None for one cell)."""

    def __init__(self, parts: list[Breakdown], warning: str | None) -> None:
        super().__init__()
        self.parts = parts
        self.breakdown = parts[0]
        self.comparison: Comparison | None = side_by_side(*parts) if len(parts) == 2 else None
        self.warning = warning
        children: list[widgets.Widget] = []
        if warning:
            children.append(widgets.HTML(warning_html(warning)))
        if any(p.rows for p in parts):
            children.append(self.add_figure(breakdown_figure(parts)))
        children.append(widgets.HTML(self._tables()))
        self.children = tuple(children)

    def _tables(self) -> str:
        parts = [_table(p) if p.rows else f"<i>{p.name}: no trace records</i>" for p in self.parts]
        if self.comparison is not None:
            table = [[k, f"{a * 1e3:.1f} ms", f"{b * 1e3:.1f} ms", f"{(b - a) * 1e3:+.1f} ms"]
                     for k, a, b in self.comparison.rows]  # fmt: skip
            heads = ("mean per rank", self.parts[0].name, self.parts[1].name, "change")
            parts.append(html_table(heads, table, "side by side"))
        return "".join(parts)

    def to_html(self) -> str:
        warning = warning_html(self.warning) if self.warning else ""
        return f"<div class='labkit-breakdown'>{warning}{self._tables()}</div>"

    def to_text(self) -> str:
        """The breakdown's own text (and the comparison's), as `Breakdown.text` prints it."""
        parts = [f"! {self.warning}"] if self.warning else []
        parts += [p.text for p in self.parts]
        if self.comparison is not None:
            parts.append(self.comparison.text)
        return "\n\n".join(parts)


def _one(lab_or_records: Any, cell: int | None, label: str, ranks: set[int]) -> Breakdown:
    records, lab = records_from(lab_or_records, cell)
    if lab is not None:
        ranks = ranks | set(range(getattr(lab, "world_size", 0)))
    return breakdown(records, ranks, cell=cell, label=label)


def show_breakdown(
    lab_or_records: Any,
    cell: int | None = None,
    *,
    compare: tuple[int, int] | None = None,
    labels: tuple[str, str] = ("", ""),
    num_cpus: int | None = None,
) -> BreakdownView:
    """Each rank's compute, communication (overlapped with compute, exposed), waiting and idle
    time in a cell, and the straggler (kernel side; definitions in labkit.views.breakdown_data).

    `lab_or_records` is a lab (its `trace(cell)`) or a list of records (or their dicts; `cell`
    filters them). `compare=(a, b)` shows cells a and b side by side, named by `labels`.
    `view.breakdown.text` (or `print(view)`) is the plain-text table.

    Example: ``labkit.show_breakdown(lab)`` after a `%%ranks` cell, or
    ``labkit.show_breakdown(lab, compare=(5, 6), labels=("sync", "async"))``.
    """
    if compare is not None:
        if len(compare) != 2:
            raise ValueError(f"compare takes two cell ids, e.g. compare=(3, 4), got {compare!r}")
        parts = [
            _one(lab_or_records, c, name, set()) for c, name in zip(compare, labels, strict=True)
        ]
    else:
        parts = [_one(lab_or_records, cell, labels[0], set())]
    lab = lab_or_records if hasattr(lab_or_records, "trace") else None
    ranks = {r.rank for p in parts for r in p.rows}
    return BreakdownView(parts, oversubscription(ranks, lab, num_cpus))
