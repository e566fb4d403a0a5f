"""Pipeline schedule charts, split plans and process-group grids (kernel side, plain data).

Drawing helpers for the model-parallel notebooks; each takes plain data and returns a plotly
figure, so it is tested without ranks or a browser. Import by module path
(`from labkit.views.schedule_view import schedule_figure`).

- `schedule_figure(events)`: one row per stage, one bar per forward (F) and backward (B) of a
  micro-batch, labelled with the micro-batch; grey bars are the bubble (the stage idles).
  Events are `StageEvent`s (measured, seconds) or dicts with the same fields; `ideal_events`
  turns `make_schedule`'s unit-time steps into events, so the textbook chart and the measured
  one are drawn the same way.
- `in_flight(events)`: per stage, the most micro-batches whose forward has run and whose
  backward has not, i.e. whose activations the stage holds (GPipe: m; 1F1B: at most p).
- `stage_busy(events)`: per stage, seconds of compute (the measured per-stage time).
- `plan_figure(plans, bound)`: predicted cost per stage of each split plan side by side, with
  the lower bound max(total/p, largest layer) as a dashed line.
- `partition_figure(costs, plans)`: each plan as a row of layers (width = the layer's cost),
  coloured by the stage that holds it.
- `grid_figure(groups)`: ranks on a grid with the process groups drawn as coloured outlines.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from labkit.views._common import IDLE_COLOUR, TextFigure, title

__all__ = [
    "KIND_COLOURS",
    "STAGE_COLOURS",
    "grid_figure",
    "ideal_events",
    "in_flight",
    "partition_figure",
    "plan_figure",
    "schedule_figure",
    "stage_busy",
]

KIND_COLOURS = {"F": "#4c78a8", "B": "#f58518"}
STAGE_COLOURS = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#b279a2", "#eeca3b", "#72b7b2")

_FIELDS = ("stage", "kind", "microbatch", "start", "end")


def _event(e: Any) -> dict[str, Any]:
    """An event as a dict with stage, kind, microbatch, start, end (from a StageEvent or dict)."""
    if isinstance(e, Mapping):
        missing = [f for f in _FIELDS if f not in e]
        if missing:
            raise ValueError(f"an event needs fields {_FIELDS}, missing {missing}")
        return {f: e[f] for f in _FIELDS}
    return {f: getattr(e, f) for f in _FIELDS}


def _events(events: Iterable[Any]) -> list[dict[str, Any]]:
    out = [_event(e) for e in events]
    if not out:
        raise ValueError("events must be non-empty")
    bad = [e for e in out if e["kind"] not in KIND_COLOURS]
    if bad:
        raise ValueError(f"kind must be 'F' or 'B', got {bad[0]['kind']!r}")
    return out


def ideal_events(steps: Iterable[tuple[int, int, str, int]]) -> list[dict[str, Any]]:
    """`make_schedule`'s (time step, stage, kind, microbatch) as unit-time events."""
    return [
        {"stage": s, "kind": k, "microbatch": j, "start": float(t), "end": float(t + 1)}
        for t, s, k, j in steps
    ]


def in_flight(events: Iterable[Any]) -> dict[int, int]:
    """Per stage: the peak number of micro-batches with F done and B not yet started.

    Replays each stage's events in start order; a micro-batch enters at its F and leaves at its
    B, so this is how many micro-batches' activations the stage held at once.
    """
    by_stage: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in _events(events):
        by_stage[e["stage"]].append(e)
    peaks = {}
    for stage, mine in sorted(by_stage.items()):
        held, peak = set(), 0
        for e in sorted(mine, key=lambda e: (e["start"], e["kind"] == "F")):
            if e["kind"] == "F":
                held.add(e["microbatch"])
                peak = max(peak, len(held))
            else:
                held.discard(e["microbatch"])
        peaks[stage] = peak
    return peaks


def stage_busy(events: Iterable[Any]) -> dict[int, float]:
    """Per stage: total compute time (sum of F and B durations)."""
    busy: dict[int, float] = defaultdict(float)
    for e in _events(events):
        busy[e["stage"]] += e["end"] - e["start"]
    return dict(sorted(busy.items()))


def schedule_figure(events: Iterable[Any], title_text: str = "", unit: str = "ms") -> go.Figure:
    """The schedule chart: F and B bars per stage, labelled with the micro-batch, idle in grey.

    `unit` is "ms" for measured events (seconds in, milliseconds drawn) or "step" for
    `ideal_events` (drawn as they are).
    """
    if unit not in ("ms", "step"):
        raise ValueError(f"unit must be 'ms' or 'step', got {unit!r}")
    evs = _events(events)
    scale = 1e3 if unit == "ms" else 1.0
    t0, t1 = min(e["start"] for e in evs), max(e["end"] for e in evs)
    stages = sorted({e["stage"] for e in evs})
    traces = []
    for kind, name in (("F", "forward"), ("B", "backward")):
        mine = [e for e in evs if e["kind"] == kind]
        traces.append(
            go.Bar(
                orientation="h",
                name=name,
                y=[e["stage"] for e in mine],
                base=[(e["start"] - t0) * scale for e in mine],
                x=[(e["end"] - e["start"]) * scale for e in mine],
                width=0.8,
                text=[f"{kind}{e['microbatch']}" for e in mine],
                textposition="inside",
                insidetextanchor="middle",
                marker_color=KIND_COLOURS[kind],
                hovertemplate=f"{name} %{{text}} stage %{{y}}<br>%{{x:.3f}} {unit}<extra></extra>",
            )
        )
    ys, bases, widths = [], [], []
    for s in stages:
        cursor = t0
        for e in sorted((e for e in evs if e["stage"] == s), key=lambda e: e["start"]):
            if e["start"] > cursor:
                ys.append(s)
                bases.append((cursor - t0) * scale)
                widths.append((e["start"] - cursor) * scale)
            cursor = max(cursor, e["end"])
        if t1 > cursor:
            ys.append(s)
            bases.append((cursor - t0) * scale)
            widths.append((t1 - cursor) * scale)
    traces.append(
        go.Bar(
            orientation="h",
            name="idle (bubble)",
            y=ys,
            base=bases,
            x=widths,
            width=0.3,
            marker_color=IDLE_COLOUR,
            hovertemplate=f"idle stage %{{y}}<br>%{{x:.3f}} {unit}<extra></extra>",
        )
    )
    height = 120 + 40 * len(stages)
    fig = TextFigure(traces)
    fig.update_layout(
        barmode="overlay",
        height=height,
        margin={"l": 60, "r": 10, "t": 50, "b": 40},
        title=title(title_text or "pipeline schedule", height),
        xaxis_title="time step" if unit == "step" else "ms since the first event",
        legend={"orientation": "h", "y": -0.25, "yanchor": "top"},
    )
    fig.update_yaxes(tickvals=stages, ticktext=[f"stage {s}" for s in stages], autorange="reversed")
    return fig


def _plan_fields(plan: Any) -> tuple[str, list[float], list[int]]:
    if isinstance(plan, Mapping):
        return str(plan["method"]), list(plan["stage_costs"]), list(plan["boundaries"])
    return str(plan.method), list(plan.stage_costs), list(plan.boundaries)


def plan_figure(
    plans: Sequence[Any],
    bound: float | None = None,
    measured: Mapping[str, Sequence[float]] | None = None,
    unit: str = "ms",
) -> go.Figure:
    """Per-stage predicted cost (seconds) of each plan as grouped bars; the slowest stage of
    each plan is its bottleneck. `bound` draws the lower bound; `measured` ({method: seconds
    per stage}) adds measured times as markers."""
    if not plans:
        raise ValueError("plans must be non-empty")
    scale = 1e3 if unit == "ms" else 1.0
    fig = TextFigure()
    for i, plan in enumerate(plans):
        method, costs, _ = _plan_fields(plan)
        fig.add_trace(
            go.Bar(
                name=f"{method} (max {max(costs) * scale:.3f})",
                x=[f"stage {s}" for s in range(len(costs))],
                y=[c * scale for c in costs],
                marker_color=STAGE_COLOURS[i % len(STAGE_COLOURS)],
                offsetgroup=str(i),
            )
        )
        if measured and method in measured:
            fig.add_trace(
                go.Scatter(
                    name=f"{method} measured",
                    x=[f"stage {s}" for s in range(len(measured[method]))],
                    y=[t * scale for t in measured[method]],
                    mode="markers",
                    marker={"symbol": "diamond", "size": 10, "color": "black"},
                    offsetgroup=str(i),
                    showlegend=i == 0,
                )
            )
    if bound is not None:
        fig.add_hline(
            y=bound * scale,
            line_dash="dash",
            line_color="black",
            annotation_text=f"lower bound {bound * scale:.3f} {unit}",
            annotation_position="top left",
        )
    fig.update_layout(
        barmode="group",
        height=360,
        margin={"l": 60, "r": 10, "t": 50, "b": 40},
        title=title(f"predicted cost per stage ({unit}); the slowest stage sets the pace", 360),
        yaxis_title=unit,
    )
    return fig


def partition_figure(costs: Sequence[Any], plans: Sequence[Any], unit: str = "ms") -> go.Figure:
    """Each plan as one row of its layers (bar width = layer time), coloured by stage."""
    if not plans:
        raise ValueError("plans must be non-empty")
    times = [c["time"] if isinstance(c, Mapping) else c.time for c in costs]
    names = [c["name"] if isinstance(c, Mapping) else c.name for c in costs]
    scale = 1e3 if unit == "ms" else 1.0
    starts = [sum(times[:i]) * scale for i in range(len(times))]
    fig = TextFigure()
    methods = []
    num_stages = 0
    for plan in plans:
        method, _, bounds = _plan_fields(plan)
        methods.append(method)
        num_stages = max(num_stages, len(bounds) - 1)
        if bounds[-1] != len(times):
            raise ValueError(f"plan {method!r} covers {bounds[-1]} layers, costs have {len(times)}")
    for s in range(num_stages):
        ys, bases, widths, text = [], [], [], []
        for plan, method in zip(plans, methods):
            _, _, bounds = _plan_fields(plan)
            if s >= len(bounds) - 1:
                continue
            for i in range(bounds[s], bounds[s + 1]):
                ys.append(method)
                bases.append(starts[i])
                widths.append(times[i] * scale)
                text.append(names[i])
        fig.add_trace(
            go.Bar(
                orientation="h",
                name=f"stage {s}",
                y=ys,
                base=bases,
                x=widths,
                text=text,
                textposition="inside",
                marker={"color": STAGE_COLOURS[s % len(STAGE_COLOURS)], "line": {"width": 1}},
                hovertemplate="layer %{text}<br>%{x:.3f} " + unit + "<extra></extra>",
            )
        )
    height = 140 + 40 * len(plans)
    fig.update_layout(
        barmode="overlay",
        height=height,
        margin={"l": 80, "r": 10, "t": 50, "b": 40},
        title=title(f"which layer goes to which stage (width = layer time, {unit})", height),
        legend={"orientation": "h", "y": -0.3, "yanchor": "top"},
    )
    fig.update_yaxes(categoryorder="array", categoryarray=methods, autorange="reversed")
    return fig


def grid_figure(
    shape: tuple[int, int],
    groups: Mapping[str, Sequence[Sequence[int]]],
    axis_names: tuple[str, str] = ("replica (dp)", "stage (mp)"),
) -> go.Figure:
    """Ranks r = row * cols + col on a rows x cols grid, each group drawn as a coloured outline.

    `groups` maps a kind of group ("dp", "mp") to its groups (lists of global ranks); every
    group of one kind gets the same colour.
    """
    rows, cols = shape
    if rows < 1 or cols < 1:
        raise ValueError(f"shape must be two positive ints, got {shape}")
    fig = TextFigure()
    fig.add_trace(
        go.Scatter(
            x=[r % cols for r in range(rows * cols)],
            y=[r // cols for r in range(rows * cols)],
            mode="markers+text",
            text=[f"rank {r}" for r in range(rows * cols)],
            marker={"size": 46, "color": "#eeeeee", "line": {"width": 1, "color": "#555"}},
            showlegend=False,
            hoverinfo="text",
        )
    )
    for k, (kind, members) in enumerate(groups.items()):
        colour = STAGE_COLOURS[k % len(STAGE_COLOURS)]
        pad = 0.32 + 0.06 * k
        for i, group in enumerate(members):
            bad = [r for r in group if not 0 <= r < rows * cols]
            if bad:
                raise ValueError(f"ranks must be in [0, {rows * cols}), got {bad}")
            xs, ys = [r % cols for r in group], [r // cols for r in group]
            fig.add_trace(
                go.Scatter(
                    x=[min(xs) - pad, max(xs) + pad, max(xs) + pad, min(xs) - pad, min(xs) - pad],
                    y=[min(ys) - pad, min(ys) - pad, max(ys) + pad, max(ys) + pad, min(ys) - pad],
                    mode="lines",
                    line={"color": colour, "width": 2},
                    name=f"{kind} groups",
                    legendgroup=kind,
                    showlegend=i == 0,
                    hovertext=f"{kind} group {list(group)}",
                    hoverinfo="text",
                )
            )
    height = 160 + 110 * rows
    fig.update_layout(
        height=height,
        margin={"l": 90, "r": 10, "t": 50, "b": 40},
        title=title("ranks and their process groups", height),
        plot_bgcolor="white",
    )
    fig.update_xaxes(
        tickvals=list(range(cols)), ticktext=[f"{axis_names[1]} {c}" for c in range(cols)],
        range=[-0.8, cols - 0.2], showgrid=False, zeroline=False,
    )  # fmt: skip
    fig.update_yaxes(
        tickvals=list(range(rows)), ticktext=[f"{axis_names[0]} {r}" for r in range(rows)],
        range=[rows - 0.2, -0.8], showgrid=False, zeroline=False,
    )  # fmt: skip
    return fig
