"""Which parameter lives on which rank and device, and what each rank's memory holds (kernel).

`show_placement(lab, "model", optimizer="opt")` runs
`labkit.rank.placement_probe.describe_model` on every rank and merges the rows;
`show_placement(rows)` takes rows already gathered (a list, or `{rank: rows}`). Each parameter
is classified across ranks:

- replicated: every rank holds the whole tensor (data parallel);
- split: only some ranks hold it (a model split by layers, pipeline stages);
- sharded: a DTensor; each rank holds a slice (dim, start, stop) of the global shape.

The first figure is a rank x parameter map coloured by that class; the second a per-rank
stacked bar of parameter, gradient, optimizer-state and activation bytes beside a prediction:
numel x element size x (1 param + 1 grad + optimizer slots), e.g. fp32 Adam = 4 + 4 + 8 = 16
bytes per parameter. Notes say when ranks share one device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

from labkit.views._common import (
    View,
    capped_box,
    html_table,
    human_bytes,
    is_lab,
    title,
    warning_html,
)
from labkit.views.gpu_memory import rank_text, shared_gpu_notes
from labkit.views.placement_data import (
    LAYOUTS,
    memory_by_rank,
    merge_placement,
    shared_device_notes,
)

__all__ = ["PlacementView", "show_placement"]

_COLOURS = {"replicated": "#4c78a8", "split": "#f58518", "sharded": "#54a24b"}
MAX_ROWS = 60  # beyond this many parameters the map shows modules instead


def _label(row: Mapping[str, Any]) -> str:
    text = human_bytes(row["bytes"])
    if row.get("shard"):
        text += " " + ",".join(f"dim{d}[{a}:{b}]" for d, a, b in row["shard"])
    return text


def _depth_limited(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """Rows aggregated per module path prefix when there are too many parameters to draw."""
    names = {r["qualname"] for r in rows}
    if len(names) <= MAX_ROWS:
        return rows, "parameter"
    depth = max(n.count(".") for n in names)
    while depth > 0 and len({".".join(n.split(".")[:depth]) for n in names}) > MAX_ROWS:
        depth -= 1
    merged: dict[tuple[int, str, str], dict[str, Any]] = {}
    for r in rows:
        key = (r["rank"], ".".join(r["qualname"].split(".")[: max(depth, 1)]), r["layout"])
        m = merged.setdefault(key, {**r, "qualname": key[1], "bytes": 0, "shard": []})
        m["bytes"] += r["bytes"]
    return list(merged.values()), "module"


def placement_figure(rows: list[dict[str, Any]]) -> go.Figure:
    """Scatter of squares: x = rank, y = parameter, one trace (colour, legend) per class."""
    drawn, unit = _depth_limited([r for r in rows if r["kind"] != "activation"])
    order = list(dict.fromkeys(r["qualname"] for r in drawn))
    fig = go.Figure()
    for layout in LAYOUTS:
        mine = [r for r in drawn if r["layout"] == layout]
        if not mine:
            continue
        hover = [
            f"{r['qualname']}<br>{LAYOUTS[layout]}<br>shape {tuple(r.get('shape', ()))} local "
            f"{tuple(r.get('local_shape', ()))}<br>{r.get('dtype', '')} on {r.get('device', '')}"
            f"<br>{r['bytes']:,} bytes {' '.join(r.get('placements') or [])}"
            for r in mine
        ]
        fig.add_trace(
            go.Scatter(
                name=LAYOUTS[layout],
                x=[r["rank"] for r in mine],
                y=[r["qualname"] for r in mine],
                mode="markers+text",
                marker={"symbol": "square", "size": 16, "color": _COLOURS[layout]},
                text=[_label(r) for r in mine],
                textposition="middle right",
                hovertext=hover,
                hoverinfo="text",
            )
        )
    ranks = sorted({r["rank"] for r in rows})
    fig.update_layout(
        title=title(f"where each {unit} lives", 140 + 24 * len(order)),
        showlegend=True,
        height=140 + 24 * len(order),
        margin={"l": 10, "r": 10, "t": 50, "b": 60},
        legend={"orientation": "h", "y": -0.12, "yanchor": "top"},
    )
    fig.update_xaxes(
        tickvals=ranks, ticktext=[f"rank {r}" for r in ranks], range=[-0.5, max(ranks) + 0.9]
    )
    fig.update_yaxes(categoryorder="array", categoryarray=order, autorange="reversed")
    return fig


_PARTS = (
    ("params", "parameters", "#4c78a8"),
    ("grads", "gradients", "#e45756"),
    ("optimizer", "optimizer state", "#54a24b"),
    ("activations", "activations", "#eeca3b"),
)


def memory_figure(memory: dict[int, dict[str, Any]], devices: Mapping[int, str]) -> go.Figure:
    """Stacked bytes per rank, with the predicted total as a diamond beside each bar."""
    ranks = sorted(memory)
    x = [f"rank {r}<br>{devices.get(r, '')}" for r in ranks]
    fig = go.Figure()
    for key, name, colour in _PARTS:
        fig.add_trace(
            go.Bar(name=name, x=x, y=[memory[r][key] for r in ranks], marker_color=colour)
        )
    fig.add_trace(
        go.Scatter(
            name="predicted",
            x=x,
            y=[memory[r]["predicted"] for r in ranks],
            mode="markers",
            marker={"symbol": "diamond", "size": 14, "color": "black"},
            hovertext=[memory[r]["formula"] for r in ranks],
            hoverinfo="text",
        )
    )
    fig.update_layout(
        barmode="stack",
        # the bars add up numel x element size of each tensor, not what the allocator holds
        title=title("bytes per rank: numel x element size (bars), predicted (diamond)", 360),
        yaxis_title="bytes",
        height=360,
        margin={"l": 60, "r": 10, "t": 50, "b": 40},
    )
    return fig


class PlacementView(View):
    """The widget `show_placement` returns: `rows` (merged), `memory` per rank, `notes`;
    `gpu_memory`: each rank's CUDA memory (labkit.rank.cuda_memory; None: no GPU), when known."""

    def __init__(
        self,
        rows: list[dict[str, Any]],
        memory: dict[int, dict[str, Any]],
        notes: list[str],
        devices: Mapping[int, str],
        gpu_memory: Mapping[int, dict[str, Any] | None] | None = None,
    ) -> None:
        super().__init__()
        self.gpu_memory = dict(gpu_memory or {})
        notes = notes + shared_gpu_notes(self.gpu_memory)
        self.rows, self.memory, self.notes = rows, memory, notes
        children: list[widgets.Widget] = [widgets.HTML(warning_html(n)) for n in notes]
        ranks = len({r["rank"] for r in rows})
        # no wider than its squares need (260 + 170 px a rank), no wider than the output area
        children.append(capped_box(self.add_figure(placement_figure(rows)), 260 + 170 * ranks))
        children.append(self.add_figure(memory_figure(memory, devices)))
        children.append(widgets.HTML(self._memory_table()))
        if any(self.gpu_memory.values()):  # CPU ranks only: no table of "no GPU" rows
            children.append(widgets.HTML(self._gpu_table()))
        self.children = tuple(children)

    def _gpu_table(self) -> str:
        body = [[r, rank_text(m)] for r, m in sorted(self.gpu_memory.items())]
        return html_table(("rank", "CUDA memory now"), body, "GPU memory per rank")

    def _memory_table(self) -> str:
        headers = ("rank", *(name for _, name, _ in _PARTS), "total", "predicted", "formula")
        body = [
            [
                r,
                *(human_bytes(m[k]) for k, _, _ in _PARTS),
                human_bytes(m["total"]),
                human_bytes(m["predicted"]),
                m["formula"],
            ]
            for r, m in sorted(self.memory.items())
        ]
        return html_table(headers, body, "memory per rank")

    def to_html(self) -> str:
        parts = [warning_html(n) for n in self.notes]
        headers = (
            "rank",
            "parameter",
            "placement",
            "shape",
            "local shape",
            "dtype",
            "device",
            "bytes",
        )
        body = [
            [
                r["rank"],
                r["qualname"],
                r["layout"],
                r.get("shape"),
                r.get("local_shape"),
                r.get("dtype"),
                r.get("device"),
                r["bytes"],
            ]
            for r in self.rows
            if r["kind"] != "activation"
        ]
        parts += [html_table(headers, body, "placement"), self._memory_table()]
        if any(self.gpu_memory.values()):
            parts.append(self._gpu_table())
        return "<div class='labkit-placement'>" + "".join(parts) + "</div>"


def _dotted(expr: str, what: str) -> str:
    if not all(part.isidentifier() for part in expr.split(".")):
        raise ValueError(
            f"{what} must be a name in the ranks' namespace (like 'model'), got {expr!r}"
        )
    return expr


def _gather(lab: Any, name: str, optimizer: str | None) -> list[dict[str, Any]]:
    code = (
        "import labkit.rank.placement_probe as _lk_placement\n"
        f"_lk_placement.describe_model({_dotted(name, 'name')}, name={name!r}, "
        f"optimizer={_dotted(optimizer, 'optimizer') if optimizer else 'None'}, "
        "rank=globals().get('rank'))"
    )
    rows: list[dict[str, Any]] = []
    for rank, result in sorted(lab.run(code).items()):
        error = getattr(result, "error", None)
        if error:
            raise RuntimeError(f"rank {rank}: describe_model({name}) failed: {error}")
        rows.extend(result.value or [])
    return rows


def _gpu_memory(lab: Any) -> dict[int, dict[str, Any] | None]:
    code = "import labkit.rank.cuda_memory as _lk_cuda\n_lk_cuda.snapshot()"
    return {r: getattr(res, "value", None) for r, res in sorted(lab.run(code).items())}


def show_placement(
    lab_or_rows: Any,
    name: str = "model",
    optimizer: str | None = None,
    *,
    predicted: int | Mapping[int, int] | None = None,
) -> PlacementView:
    """Draw where every parameter lives and each rank's memory (kernel side).

    With a lab, `name` (and `optimizer`, a name too) are evaluated on every rank by
    `labkit.rank.placement_probe.describe_model`; otherwise `lab_or_rows` is a list of its rows or
    `{rank: rows}`. `predicted` overrides the formula prediction (bytes, one total or per rank).

    Example: ``labkit.show_placement(lab, "model", optimizer="opt")`` after a `%%ranks` cell
    that built `model` (and `opt`) on every rank.
    """
    info: list[dict[str, Any]] = []
    world_size = None
    gpu_memory = None
    if is_lab(lab_or_rows):
        rows = _gather(lab_or_rows, name, optimizer)
        gpu_memory = _gpu_memory(lab_or_rows)
        info = list(lab_or_rows.ranks_info()) if hasattr(lab_or_rows, "ranks_info") else []
        world_size = getattr(lab_or_rows, "world_size", None)
    elif isinstance(lab_or_rows, Mapping):
        rows = [dict(r, rank=rank) for rank, rs in lab_or_rows.items() for r in rs]
    elif isinstance(lab_or_rows, Sequence):
        rows = [dict(r) for r in lab_or_rows]
    else:
        raise ValueError(
            "show_placement needs a lab or rows from labkit.rank.placement_probe.describe_model"
        )
    if not rows:
        raise ValueError(f"no placement rows: does {name!r} hold parameters on any rank?")
    merged = merge_placement(rows, world_size)
    memory = memory_by_rank(merged, predicted)
    devices = {int(i["rank"]): str(i["device"]) for i in info} or {
        r["rank"]: r["device"] for r in merged if r.get("device")
    }
    notes = shared_device_notes(merged, info)
    return PlacementView(merged, memory, notes, devices, gpu_memory)
