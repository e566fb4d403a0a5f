"""Shared pieces of the views (kernel side): the View container, figure wrapping, HTML, units.

A view is an ipywidgets VBox whose `figures` list holds its plotly figures in display order, so
tests read the figure state without a browser. Figures are shown as plotly FigureWidgets when
`anywidget` (which plotly 7 needs for FigureWidget) is importable, otherwise as an ipywidgets
Output holding the figure's plotly JSON (JupyterLab renders it; nothing is fetched from the
network). Every view also has `to_html()`: plain HTML tables without JavaScript, which is what a
saved notebook shows once the live widgets cannot be restored; and `to_text()`, the same as plain
text (views.text), which terminal IPython and other text frontends show instead of the widget.

Shown in a notebook, a view makes two outputs: the live widget, then its static copy. JupyterLab
never falls back to a widget output's own text/html (a saved widget whose kernel is gone reads
"Error displaying widget: model not found"), so the copy is an output of its own; a CSS rule in
it hides it while the live widget right before it renders, so it shows only once that is gone
(or in a frontend without the rule's classes, where both show).
"""

from __future__ import annotations

import html
import json
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any, Protocol

import ipywidgets as widgets
import plotly.graph_objects as go

from labkit.wire.records import CommRecord, SpanRecord, from_dict

Record = CommRecord | SpanRecord
PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
LIVE_CLASS = "labkit-live-view"
# Hide the static copy while the live view in the output just before it is rendered.
STATIC_CSS = (
    f"<style>.jp-OutputArea-child:has(.{LIVE_CLASS}) + .jp-OutputArea-child "
    ".labkit-static-copy {display: none}</style>"
)


class ViewWarning(UserWarning):
    """A warning of labkit's views (turned into an error in labkit's tests)."""


class LabLike(Protocol):
    """The part of `labkit.Lab` the views use (duck-typed)."""

    world_size: int

    def pull(self, name: str, ranks: Any = None) -> dict[int, Any]: ...
    def run(self, fn_or_code: Any, ranks: Any = None) -> Any: ...
    def trace(self, cell: int | None = None) -> list[Record]: ...
    def ranks_info(self) -> list[dict[str, Any]]: ...


def is_lab(obj: object) -> bool:
    """True for a lab (anything with pull/run/trace), False for plain data."""
    return all(hasattr(obj, attr) for attr in ("pull", "run", "trace"))


def wrap_figure(fig: go.Figure) -> tuple[widgets.DOMWidget, Any]:
    """A widget showing `fig`, and the figure object to read its state from (and update)."""
    from labkit.views.figure_widget import figure_widget_class

    cls = figure_widget_class()
    if cls is not None:
        fw = cls(fig)
        return fw, fw
    out = widgets.Output()
    out.outputs = (figure_output(fig),)
    return out, fig


def figure_output(fig: go.Figure) -> dict[str, Any]:
    """A display_data output carrying the figure as plotly JSON (for an Output widget)."""
    data = json.loads(fig.to_json())
    title = fig.layout.title.text or "plotly figure"
    return {
        "output_type": "display_data",
        "data": {PLOTLY_MIME: data, "text/plain": f"<{title}>"},
        "metadata": {},
    }


def in_kernel() -> bool:
    """True inside a Jupyter kernel (widgets and figures draw), False in terminal IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return getattr(get_ipython(), "kernel", None) is not None


def figure_text(fig: go.Figure) -> str:
    """A figure in words: its title and, per trace, its kind, name and number of points."""
    lines = [f"{fig.layout.title.text or 'figure'} (plotly; it draws in a notebook)"]
    for trace in fig.data:
        points = len(trace.x) if getattr(trace, "x", None) is not None else 0
        name = f" {trace.name}" if trace.name else ""
        lines.append(f"  {trace.type}{name}: {points} point{'s' if points != 1 else ''}")
    return "\n".join(lines)


class TextFigure(go.Figure):
    """A plotly figure that terminal IPython shows as `figure_text` instead of opening a
    browser window (plotly's renderer there); in a notebook it is a plain go.Figure."""

    def _ipython_display_(self) -> None:
        if in_kernel():
            super()._ipython_display_()
        else:
            print(figure_text(self))


class StaticHTML:
    """HTML that IPython displays as is (no widget, no JavaScript)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def _repr_html_(self) -> str:
        return self.text

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # terminal IPython: the text
        from labkit.views.text import html_to_text

        p.text(html_to_text(self.text))


class View(widgets.VBox):
    """A view: a VBox of widgets plus `figures` (plotly, display order) and `to_html()`."""

    def __init__(self, children: Sequence[widgets.Widget] = (), **kwargs: Any) -> None:
        super().__init__(children=tuple(children), **kwargs)
        self.add_class(LIVE_CLASS)
        self.figures: list[Any] = []

    def add_figure(self, fig: go.Figure) -> widgets.DOMWidget:
        """Wrap `fig` as a widget, remember it in `figures`, return the widget to place."""
        widget, handle = wrap_figure(fig)
        self.figures.append(handle)
        return widget

    def to_html(self) -> str:  # overridden by each view
        return "<div class='labkit-view'></div>"

    def to_text(self) -> str:
        """The static copy as plain text (terminal IPython, consoles, a saved notebook's text)."""
        from labkit.views.text import html_to_text

        return html_to_text(self.to_html())

    def __repr__(self) -> str:  # not ipywidgets' `VBox(children=(...))`
        return self.to_text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.to_text())

    def static(self) -> StaticHTML:
        """The static HTML as a displayable object: `display(view.static())` in a cell keeps a
        readable copy in the saved notebook, which a live widget cannot give after reopening."""
        return StaticHTML(self.to_html())

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        # Saved notebooks keep the static HTML beside the widget reference.
        bundle = super()._repr_mimebundle_(**kwargs) or {}
        bundle["text/html"] = self.to_html()
        bundle["text/plain"] = self.to_text()  # what a frontend without widgets shows
        return bundle

    def static_copy_html(self) -> str:
        """The static copy as its own output: hidden while the live view renders."""
        return f"{STATIC_CSS}<div class='labkit-static-copy'>{self.to_html()}</div>"

    def _ipython_display_(self) -> None:
        from IPython.display import display

        bundle = self._repr_mimebundle_()
        live = {k: v for k, v in bundle.items() if k in (WIDGET_MIME, "text/plain")}
        display(live, raw=True)
        display({"text/html": self.static_copy_html()}, raw=True)


def html_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], caption: str = "") -> str:
    """A plain HTML table; every cell escaped."""
    cap = f"<caption>{html.escape(caption)}</caption>" if caption else ""
    # headers may wrap between words (a narrow output area), never run together (the padding)
    th = "padding:2px 8px;text-align:left;border-bottom:1px solid #ccc;vertical-align:bottom"
    head = "".join(f"<th style='{th}'>{html.escape(str(h))}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(f"<td style='padding:1px 8px'>{html.escape(str(c))}</td>" for c in row)
        + "</tr>"
        for row in rows
    )
    # cells wrap between words in a narrow output area (an ipywidgets HTML box says nowrap)
    style = "border-collapse:collapse;margin:4px 0;white-space:normal"
    # a table wider than a narrow output area even with its cells wrapped (memory per rank
    # has 8 columns) scrolls sideways in its own box instead of running past the area: the box
    # is as wide as its container (min-width) but adds no width of its own to it (width 0)
    return (
        f"<div class='labkit-scroll' style='overflow-x:auto;width:0;min-width:100%'>"
        f"<table class='labkit' style='{style}'>{cap}<thead><tr>{head}</tr></thead>"
        f"<tbody>{body}</tbody></table></div>"
    )


def warning_html(text: str) -> str:
    return f"<div class='labkit-warning' style='color:#b45309'>&#9888; {html.escape(text)}</div>"


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_rate(bytes_per_s: float) -> str:
    """Bytes per second in decimal units, as nccl-tests prints them (2.5e9 -> '2.50 GB/s')."""
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.2f} {unit}"
    return f"{bytes_per_s:.0f} B/s"


def title(text: str, height: int, below: int = 30) -> dict[str, Any]:
    """A small title `below` pixels from the top, under plotly's mode bar (which would cover it;
    on a narrow figure the bar takes two rows, so pass a larger `below`)."""
    return {
        "text": text,
        "font": {"size": 12},
        "yref": "container",
        "yanchor": "top",
        "y": 1 - below / height,
        "x": 0.02,
    }


def as_records(data: Iterable[Record | dict[str, Any]], cell: int | None = None) -> list[Record]:
    """Records from records or their dict forms, optionally only those of one cell."""
    records = [r if isinstance(r, CommRecord | SpanRecord) else from_dict(r) for r in data]
    if cell is not None:
        records = [r for r in records if r.cell == cell]
    backwards = [r for r in records if r.end < r.start]
    if backwards:
        warnings.warn(
            f"{len(backwards)} record(s) end before they start (first: rank {backwards[0].rank} "
            f"{getattr(backwards[0], 'op', getattr(backwards[0], 'name', ''))}); "
            "drawn with zero duration",
            ViewWarning,
            stacklevel=3,
        )
        records = [replace(r, end=r.start) if r.end < r.start else r for r in records]
    return records


def records_from(lab_or_records: Any, cell: int | None = None) -> tuple[list[Record], Any]:
    """(records, lab or None) from a lab (its `trace(cell)`) or plain records."""
    if is_lab(lab_or_records):
        return as_records(lab_or_records.trace(cell)), lab_or_records
    return as_records(lab_or_records, cell), None


def oversubscription(
    ranks: Iterable[int], lab: Any = None, num_cpus: int | None = None
) -> str | None:
    """A warning line when ranks outnumber CPU cores, else None.

    Cores come from `num_cpus` or from the lab's `ranks_info()` (per host: ranks on a host are
    compared with that host's `num_cpus`).
    """
    ranks = sorted(set(ranks))
    per_host: dict[str, tuple[int, int]] = {}
    if num_cpus is not None:
        per_host["this host"] = (len(ranks), num_cpus)
    elif lab is not None and hasattr(lab, "ranks_info"):
        for info in lab.ranks_info():
            host = str(info.get("host", "this host"))
            count, cpus = per_host.get(host, (0, int(info.get("num_cpus") or 0)))
            per_host[host] = (count + 1, cpus)
    notes = [
        f"{count} ranks on {cpus} CPU core{'s' if cpus != 1 else ''} ({host}): ranks outnumber "
        "cores, so they take turns and times include waiting for a core"
        for host, (count, cpus) in per_host.items()
        if cpus and count > cpus
    ]
    return "; ".join(notes) or None


_OP_COLOURS = {
    "compute": "#4c78a8",
    "all_reduce": "#e45756",
    "reduce_scatter": "#f58518",
    "all_gather": "#54a24b",
    "all_to_all": "#b279a2",
    "broadcast": "#eeca3b",
    "reduce": "#ff9da6",
    "send": "#72b7b2",
    "recv": "#9d755d",
    "barrier": "#bab0ac",
    "gather": "#8cd17d",
    "scatter": "#d4a6c8",
}
_EXTRA_COLOURS = ("#79706e", "#d37295", "#fabfd2", "#b6992d", "#499894", "#86bcb6")
IDLE_COLOUR = "rgba(190, 190, 190, 0.45)"


def op_colour(op: str) -> str:
    """A fixed colour per op (aliases share their op's colour), stable across views."""
    from labkit.views.bandwidth import canonical_op

    op = canonical_op(op)
    if op in _OP_COLOURS:
        return _OP_COLOURS[op]
    return _EXTRA_COLOURS[sum(op.encode()) % len(_EXTRA_COLOURS)]


def fixed_box(widget: widgets.Widget, width: int) -> widgets.Box:
    """`widget` (a figure with a fixed width) in a box of that width that never shrinks. Its
    flex basis is `auto` (the box's own size on either axis): a basis of `width` px, inside a
    view's column, made the box that tall, whatever the figure's height."""
    return widgets.Box([widget], layout=widgets.Layout(flex="0 0 auto", width=f"{width}px"))


def capped_box(widget: widgets.Widget, max_width: int) -> widgets.Box:
    """`widget` (a figure without a width) as wide as the output area, up to `max_width` px."""
    layout = widgets.Layout(width="100%", max_width=f"{max_width}px", flex_flow="column")
    return widgets.Box([widget], layout=layout)
