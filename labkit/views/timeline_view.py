"""Per-rank timeline of compute spans and collectives (kernel side).

`show_timeline(lab)` draws `lab.trace()`; `show_timeline(records)` draws a saved trace. Each rank
is one row of a Gantt chart: compute spans (`labkit.span`) as wide blue bars, every
`torch.distributed` call as a narrower bar coloured by op, and idle gaps as grey bars. Hovering a
call shows op, seq, bytes, duration and bandwidth. Below it a table gives each rank's compute,
communication and idle time over the common window [earliest start, latest end] of all ranks,
and a folded table lists every call (rank, op, seq, bytes, duration):

    comm    = length of the union of the rank's comm intervals
    compute = length of the union of its spans, less the time also inside a comm call
    idle    = window - length of the union of everything it did

(`timeline_summary`, in labkit.views.breakdown_data; `show_breakdown` splits the same time
further: communication hidden under compute or exposed, waiting, and the straggler.)

On CUDA a call's record also carries `device_time` (CUDA events around it on the current
stream; None on CPU). Those calls get a second, thinner track under their rank, "rank r
device", with a bar of the device time: CUDA events measure a duration, not a clock time, so
the bar starts where the host call started (the kernel may run later than it is issued). The
table then adds each rank's summed device time beside its host communication time.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

from labkit.views._common import (
    IDLE_COLOUR,
    Record,
    View,
    html_table,
    op_colour,
    oversubscription,
    records_from,
    title,
    warning_html,
)
from labkit.views.bandwidth import algbw, busbw_factor
from labkit.views.breakdown_data import timeline_summary
from labkit.views.intervals import gaps, union
from labkit.wire.records import CommRecord, SpanRecord

__all__ = ["TimelineView", "device_times", "show_timeline", "timeline_summary"]


def _comm_trace(op: str, recs: list[CommRecord], t0: float) -> go.Bar:
    custom = []
    for r in recs:
        bw = algbw(r.bytes, r.duration)
        n = max(len(r.group), 1)
        custom.append([r.seq, r.bytes, r.duration * 1e3, bw / 1e9, bw * busbw_factor(op, n) / 1e9])
    return go.Bar(
        orientation="h",
        name=op,
        y=[r.rank for r in recs],
        base=[(r.start - t0) * 1e3 for r in recs],
        x=[r.duration * 1e3 for r in recs],
        width=0.5,
        marker_color=op_colour(op),
        customdata=custom,
        hovertemplate=(
            f"<b>{op}</b> #%{{customdata[0]}} rank %{{y}}<br>%{{customdata[1]:,}} bytes"
            "<br>%{customdata[2]:.3f} ms<br>algbw %{customdata[3]:.3f} GB/s"
            "<br>busbw %{customdata[4]:.3f} GB/s<extra></extra>"
        ),
    )


def _span_trace(spans: list[SpanRecord], t0: float) -> go.Bar:
    return go.Bar(
        orientation="h",
        name="compute",
        y=[s.rank for s in spans],
        base=[(s.start - t0) * 1e3 for s in spans],
        x=[s.duration * 1e3 for s in spans],
        width=0.8,
        text=[s.name for s in spans],
        textposition="inside",
        marker_color=op_colour("compute"),
        customdata=[[s.name, s.duration * 1e3] for s in spans],
        hovertemplate="<b>%{customdata[0]}</b> rank %{y}<br>%{customdata[1]:.3f} ms<extra></extra>",
    )


DEVICE_OFFSET = 0.42  # the device track sits just under its rank's row
DEVICE_COLOUR = "#8c564b"


def _device_trace(recs: list[CommRecord], t0: float) -> go.Bar:
    """Device time of calls measured with CUDA events, one bar each on the rank's device track."""
    return go.Bar(
        orientation="h",
        name="device time",
        y=[r.rank + DEVICE_OFFSET for r in recs],
        base=[(r.start - t0) * 1e3 for r in recs],
        x=[(r.device_time or 0.0) * 1e3 for r in recs],
        width=0.2,
        marker_color=DEVICE_COLOUR,
        customdata=[[r.op, r.seq, r.rank, (r.device_time or 0.0) * 1e3, r.duration * 1e3]
                    for r in recs],
        hovertemplate=(
            "<b>%{customdata[0]}</b> #%{customdata[1]} rank %{customdata[2]}, on the device"
            "<br>device %{customdata[3]:.3f} ms (host %{customdata[4]:.3f} ms)"
            "<br>drawn from the host call's start<extra></extra>"
        ),
    )  # fmt: skip


def device_times(records: list[Record]) -> dict[int, float]:
    """Per rank that has any: the summed `device_time` (seconds) of its calls."""
    out: dict[int, float] = {}
    for r in records:
        if isinstance(r, CommRecord) and r.device_time is not None:
            out[r.rank] = out.get(r.rank, 0.0) + r.device_time
    return out


def _idle_trace(records: list[Record], t0: float) -> go.Bar:
    window = (t0, max(r.end for r in records))
    ys, bases, widths = [], [], []
    for rank in sorted({r.rank for r in records}):
        busy = union((r.start, r.end) for r in records if r.rank == rank)
        for a, b in gaps(busy, window):
            ys.append(rank)
            bases.append((a - t0) * 1e3)
            widths.append((b - a) * 1e3)
    return go.Bar(
        orientation="h",
        name="idle",
        y=ys,
        base=bases,
        x=widths,
        width=0.3,
        marker_color=IDLE_COLOUR,
        hovertemplate="idle rank %{y}<br>%{x:.3f} ms<extra></extra>",
    )


def timeline_figure(records: list[Record]) -> go.Figure:
    """The Gantt chart: one trace for compute, one per op, one for idle gaps."""
    t0 = min(r.start for r in records)
    spans = [r for r in records if isinstance(r, SpanRecord)]
    comms = [r for r in records if isinstance(r, CommRecord)]
    traces = [_span_trace(spans, t0)] if spans else []
    for op in sorted({r.op for r in comms}):
        traces.append(_comm_trace(op, [r for r in comms if r.op == op], t0))
    traces.append(_idle_trace(records, t0))
    timed = [r for r in comms if r.device_time is not None]
    if timed:
        traces.append(_device_trace(timed, t0))
    ranks = sorted({r.rank for r in records})
    ticks = [(float(r), f"rank {r}") for r in ranks]
    ticks += [(r + DEVICE_OFFSET, f"rank {r} device") for r in sorted({r.rank for r in timed})]
    ticks.sort()
    fig = go.Figure(traces)
    fig.update_layout(
        barmode="overlay",
        height=120 + 50 * len(ranks),
        margin={"l": 60, "r": 10, "t": 50, "b": 40},
        title=title("timeline (ms since the first record)", 120 + 50 * len(ranks)),
        xaxis_ticksuffix=" ms",
        legend={"orientation": "h", "y": -0.2, "yanchor": "top"},
    )
    fig.update_yaxes(
        tickvals=[t for t, _ in ticks], ticktext=[s for _, s in ticks], autorange="reversed"
    )
    return fig


def _summary_rows(
    summary: dict[int, dict[str, float]], device: dict[int, float] | None = None
) -> list[list[str]]:
    rows = [
        [str(rank)]
        + [f"{row[k] * 1e3:.3f} ms ({row[k + '_pct']:.0f}%)" for k in ("compute", "comm", "idle")]
        for rank, row in summary.items()
    ]
    if device:  # a column only where some call was timed on a GPU
        for row, rank in zip(rows, summary, strict=True):
            row.append(f"{device[rank] * 1e3:.3f} ms" if rank in device else "-")
    return rows


CALL_HEADERS = ("rank", "op", "seq", "bytes", "duration")
MAX_CALL_ROWS = 500  # rows the widget's calls table shows (the text copy has them all)


def _call_rows(records: list[Record]) -> list[list[Any]]:
    """One row per collective or point-to-point call, in the trace's order."""
    return [
        [r.rank, r.op, r.seq, r.bytes, f"{r.duration * 1e3:.3f} ms"]
        for r in records
        if isinstance(r, CommRecord)
    ]


class TimelineView(View):
    """The widget `show_timeline` returns; `summary` holds `timeline_summary(records)`."""

    HEADERS = ("rank", "compute", "communication", "idle")

    def __init__(self, records: list[Record], warning: str | None) -> None:
        super().__init__()
        self.records = records
        self.warning = warning
        self.summary = timeline_summary(records)
        self.device = device_times(records)
        self.headers = self.HEADERS + (("communication on the device",) if self.device else ())
        children: list[widgets.Widget] = []
        if warning:
            children.append(widgets.HTML(warning_html(warning)))
        if records:
            children.append(self.add_figure(timeline_figure(records)))
            rows = _summary_rows(self.summary, self.device)
            table = html_table(self.headers, rows, "time per rank")
            children.append(widgets.HTML(table))
            calls = _call_rows(records)
            if calls:  # every call, as in the text copy; folded, as it can be long
                shown = html_table(CALL_HEADERS, calls[:MAX_CALL_ROWS], "calls")
                if len(calls) > MAX_CALL_ROWS:
                    shown += f"<i>the first {MAX_CALL_ROWS} of {len(calls)} calls</i>"
                self.calls = widgets.Accordion(children=[widgets.HTML(shown)])
                self.calls.set_title(0, f"calls ({len(calls)})")
                self.calls.selected_index = None
                children.append(self.calls)
        else:
            children.append(widgets.HTML("<i>no trace records</i>"))
        self.children = tuple(children)

    def to_html(self) -> str:
        parts = [warning_html(self.warning)] if self.warning else []
        rows = _summary_rows(self.summary, self.device)
        parts.append(html_table(self.headers, rows, "time per rank"))
        calls = _call_rows(self.records)
        if calls:
            parts.append(html_table(CALL_HEADERS, calls, "calls"))
        return "<div class='labkit-timeline'>" + "".join(parts) + "</div>"


def show_timeline(
    lab_or_records: Any, cell: int | None = None, *, num_cpus: int | None = None
) -> TimelineView:
    """Per-rank Gantt chart of a trace plus a compute/comm/idle table (kernel side).

    `lab_or_records` is a lab (its `trace(cell)` is drawn) or a list of CommRecord/SpanRecord
    (or their dicts; `cell` filters them). A warning line says when ranks outnumber CPU cores
    (`num_cpus`, or the lab's `ranks_info()`).

    Example: ``labkit.show_timeline(lab)`` after a `%%ranks` cell; ``with labkit.span("fwd"):``
    in the cell marks its compute, and ``show_timeline(lab, cell=3)`` draws an earlier cell.
    """
    records, lab = records_from(lab_or_records, cell)
    ranks = {r.rank for r in records}
    if lab is not None:
        ranks |= set(range(getattr(lab, "world_size", 0)))
    warning = oversubscription(ranks, lab, num_cpus)
    return TimelineView(records, warning)
