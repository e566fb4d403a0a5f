"""Per-rank tensors side by side (kernel side): heatmaps, bars or summaries on one colour scale.

`show_tensors(lab, "x")` pulls `x` from every rank; `show_tensors({0: t0, 1: t1})` takes the
values directly. One panel per rank: a 2-D tensor (or an N-D one, its leading dims flattened into
rows) up to 32x32 is a heatmap, a 1-D one up to 1024 elements is a bar chart, anything larger is
a summary (shape, dtype, min/max/mean/norm) over a block-averaged heatmap. Every panel of a view
uses one colour scale (the same zmin/zmax, diverging around 0 when values change sign), so a rank
that differs stands out. `before=`/`after=` put two states side by side; `snapshots=` gives a
slider stepping through a list of states.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

from labkit.views._common import View, html_table, is_lab, title
from labkit.views.tensor_data import (
    HTML_SIDE,
    TEXT_NUMEL,
    Scale,
    TensorInfo,
    as_2d,
    downsample,
    fmt_value,
    shared_scale,
    summary_text,
    to_info,
)

__all__ = ["TensorView", "show_tensors", "tensor_panel"]


def tensor_panel(info: TensorInfo, rank: int, scale: Scale, label: str = "") -> go.Figure:
    """One rank's panel as a plotly figure."""
    heading = info.header(rank, label)
    kind = info.kind
    layout: dict[str, Any] = {
        "width": 280,
        "height": 280,
        "margin": {"l": 40, "r": 10, "t": 84, "b": 30},
    }
    if kind == "empty":
        fig = go.Figure(layout=layout)
        fig.add_annotation(text="empty tensor", showarrow=False)
    elif kind == "bars":
        a = info.array.ravel()
        text = [fmt_value(v) for v in a] if a.size <= 32 else None
        bar = go.Bar(
            x=list(range(a.size)),
            y=a,
            text=text,
            textangle=0,
            name=f"rank {rank}",
            marker={
                "color": a,
                "colorscale": scale.colorscale,
                "cmin": scale.zmin,
                "cmax": scale.zmax,
            },
        )
        fig = go.Figure(bar, layout=layout)
        lo, hi = min(scale.zmin, 0.0), max(scale.zmax, 0.0)
        pad = 0.05 * (hi - lo or 1.0)
        fig.update_yaxes(range=[lo - pad, hi + pad])
    else:
        a = as_2d(info.array) if kind == "heatmap" else downsample(as_2d(info.array))
        heat = go.Heatmap(
            z=a,
            zmin=scale.zmin,
            zmax=scale.zmax,
            colorscale=scale.colorscale,
            name=f"rank {rank}",
            showscale=False,
        )
        if kind == "heatmap" and a.size <= TEXT_NUMEL:
            heat.update(text=[[fmt_value(v) for v in row] for row in a], texttemplate="%{text}")
        fig = go.Figure(heat, layout=layout)
        fig.update_yaxes(autorange="reversed", dtick=max(1, a.shape[0] // 8))
        fig.update_xaxes(dtick=max(1, a.shape[1] // 8))
        if kind == "summary":
            heading += f"<br><sub>{summary_text(info)} (block means)</sub>"
    fig.update_layout(title=title(heading, layout["height"], below=52))
    return fig


class TensorView(View):
    """The widget `show_tensors` returns; `states` holds (label, {rank: TensorInfo})."""

    def __init__(
        self, states: list[tuple[str, dict[int, TensorInfo]]], *, slider: bool, title: str | None
    ) -> None:
        super().__init__()
        self.states = states
        self.title = title
        self.scale = shared_scale([i for _, infos in states for i in infos.values()])
        head = [widgets.HTML(f"<b>{html.escape(title)}</b>")] if title else []
        self.slider: widgets.IntSlider | None = None
        if slider:
            self._boxes = {r: widgets.Box() for r in sorted({r for _, i in states for r in i})}
            self._label = widgets.HTML()
            self.slider = widgets.IntSlider(
                min=0, max=len(states) - 1, value=0, readout=False, description="snapshot"
            )
            play = widgets.Play(min=0, max=len(states) - 1, interval=800)
            widgets.jslink((play, "value"), (self.slider, "value"))
            self.slider.observe(lambda change: self.show_step(change["new"]), names="value")
            self.show_step(0)
            controls = widgets.HBox([play, self.slider, self._label])
            panels = widgets.HBox(list(self._boxes.values()), layout=_wrap())
            self.children = (*head, controls, panels)
        else:
            columns = [self._column(label, infos) for label, infos in states]
            body = columns[0] if len(columns) == 1 else widgets.HBox(columns)
            self.children = (*head, body)

    def _column(self, label: str, infos: dict[int, TensorInfo]) -> widgets.Widget:
        panels = [self.add_figure(tensor_panel(i, r, self.scale, label)) for r, i in infos.items()]
        if not label:
            return widgets.HBox(panels, layout=_wrap())
        return widgets.VBox([widgets.HTML(f"<b>{html.escape(label)}</b>"), *panels])

    def show_step(self, index: int) -> None:
        """Show snapshot `index` (what the slider calls)."""
        label, infos = self.states[index]
        self.figures = []
        for rank, box in self._boxes.items():
            info = infos.get(rank)
            box.children = (
                [self.add_figure(tensor_panel(info, rank, self.scale, label))]
                if info is not None
                else [widgets.HTML(f"rank {rank}: no value")]
            )
        self._label.value = f"{index + 1}/{len(self.states)}: <b>{html.escape(label)}</b>"

    def to_html(self) -> str:
        parts = [f"<h4>{html.escape(self.title)}</h4>"] if self.title else []
        for label, infos in self.states:
            if label:
                parts.append(f"<h5>{html.escape(label)}</h5>")
            for rank, info in infos.items():
                parts.append(_static_table(info, rank))
        return "<div class='labkit-tensors'>" + "".join(parts) + "</div>"


def _wrap() -> widgets.Layout:
    return widgets.Layout(flex_flow="row wrap")


def _static_table(info: TensorInfo, rank: int) -> str:
    caption = info.header(rank)
    if info.kind in ("summary", "empty") or info.array.size == 0:
        body = summary_text(info) if info.array.size else "empty"
        return f"<p><b>{html.escape(caption)}</b>: {html.escape(body)}</p>"
    a = as_2d(info.array)
    shown = a[:HTML_SIDE, :HTML_SIDE]
    if shown.shape != a.shape:
        caption += f" (first {shown.shape[0]}x{shown.shape[1]})"
    headers = [""] + [str(j) for j in range(shown.shape[1])]
    rows = [[str(i)] + [fmt_value(v) for v in row] for i, row in enumerate(shown)]
    return html_table(headers, rows, caption)


def _infos(values: Mapping[int, Any], devices: Mapping[int, str]) -> dict[int, TensorInfo]:
    out = {}
    for rank in sorted(values):
        try:
            out[rank] = to_info(values[rank], devices.get(rank))
        except ValueError as err:
            raise ValueError(f"rank {rank}: {err}") from None
    return out


def show_tensors(
    lab_or_values: Any,
    name: str | None = None,
    *,
    before: Mapping[int, Any] | None = None,
    after: Mapping[int, Any] | None = None,
    snapshots: Sequence[tuple[str, Mapping[int, Any]]] | None = None,
    title: str | None = None,
) -> TensorView:
    """Show one tensor per rank (kernel side; pulls from the ranks when given a lab).

    `lab_or_values` is a lab (then `name` is pulled from every rank and the header shows each
    rank's device) or a `{rank: tensor}` dict (or None with `before`/`after`/`snapshots`). With
    `before` and/or `after`, the missing one is the current value. With `snapshots`
    (`[(label, {rank: tensor}), ...]`) a slider steps through them. All panels share one colour
    scale. Returns a `TensorView` (an ipywidgets VBox; `.figures`, `.to_html()`).

    Example: ``labkit.show_tensors(lab, "x")`` after a `%%ranks` cell that set `x`; or
    ``labkit.show_tensors(lab, "x", before=saved)`` with ``saved = lab.pull("x")`` from before.
    """
    devices: dict[int, str] = {}
    current: Mapping[int, Any] | None = lab_or_values
    if is_lab(lab_or_values):
        if not name:
            raise ValueError("show_tensors(lab, name): name of the tensor to pull is required")
        current = lab_or_values.pull(name)
        if hasattr(lab_or_values, "ranks_info"):
            devices = {int(i["rank"]): str(i["device"]) for i in lab_or_values.ranks_info()}
    if title is None and name:
        title = name
    if snapshots is not None:
        if not snapshots:
            raise ValueError("snapshots must hold at least one (label, {rank: tensor}) pair")
        states = [(str(label), _infos(v, devices)) for label, v in snapshots]
        return TensorView(states, slider=True, title=title)
    if before is not None or after is not None:
        before = before if before is not None else current
        after = after if after is not None else current
        if before is None or after is None:
            raise ValueError("before= or after= alone needs the current values (a lab or a dict)")
        states = [("before", _infos(before, devices)), ("after", _infos(after, devices))]
        return TensorView(states, slider=False, title=title)
    if not isinstance(current, Mapping) or not current:
        raise ValueError("show_tensors needs a lab and a name, or a non-empty {rank: tensor} dict")
    return TensorView([("", _infos(current, devices))], slider=False, title=title)
