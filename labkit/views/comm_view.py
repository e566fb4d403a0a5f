"""Who sent how many bytes to whom, and how fast each op ran (kernel side).

`show_comm(lab)` reads `lab.trace()`; `show_comm(records)` takes a saved trace.

Traffic matrix, bytes[src][dst]. Every record counts only what its own rank sends, so a call is
never counted twice. S is the record's `bytes`, taken as nccl-tests' buffer size (for
all_gather / reduce_scatter the whole gathered / unsplit buffer); n is the group size and the
ring is the group's rank order (each rank sends to the next, the last to the first):

- send/isend: S to `peer`; recv/irecv: nothing (counted at the sender);
- all_reduce (ring: reduce_scatter + all_gather): 2(n-1)/n * S to the next rank;
- reduce_scatter, all_gather (ring): (n-1)/n * S to the next rank;
- all_to_all: S/n to every other rank;
- broadcast (pipelined ring from the root): S to the next rank, except the root's predecessor;
- reduce (ring towards the root): S to the next rank, except the root itself;
- gather: S to the root; scatter: S/n from the root to every other rank; barrier: nothing.

These are the bytes a ring algorithm moves; gloo or NCCL may pick trees or halving-doubling,
which move the same total per rank for all_reduce but along other pairs.

Per-op table: a collective call is the records with the same (op, group, seq); its time is the
slowest rank's duration and its size the largest S. algbw = sum(S) / sum(time);
busbw = sum(S x factor) / sum(time) with nccl-tests' factors (`busbw_factor`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

from labkit.views._common import (
    View,
    html_table,
    human_bytes,
    human_rate,
    op_colour,
    records_from,
    title,
)
from labkit.views.bandwidth import busbw_factor, canonical_op
from labkit.wire.records import CommRecord

__all__ = ["CommView", "op_summary", "show_comm", "traffic_matrix"]

_P2P = {"send", "recv"}


def _sends(r: CommRecord) -> list[tuple[int, float]]:
    """(destination, bytes) this record's rank sends under the ring convention above."""
    op, group, s = canonical_op(r.op), list(r.group), float(r.bytes)
    if op == "send" and r.peer is not None:
        return [(r.peer, s)]
    if r.rank not in group or len(group) < 2:
        return []
    n, i = len(group), group.index(r.rank)
    nxt, root = group[(i + 1) % n], r.peer if r.peer is not None else group[0]
    if op == "all_reduce":
        return [(nxt, 2 * (n - 1) / n * s)]
    if op in ("reduce_scatter", "all_gather"):
        return [(nxt, (n - 1) / n * s)]
    if op == "all_to_all":
        return [(q, s / n) for q in group if q != r.rank]
    if op == "broadcast":
        return [(nxt, s)] if nxt != root else []
    if op == "reduce":
        return [(nxt, s)] if r.rank != root else []
    if op == "gather":
        return [(root, s)] if r.rank != root else []
    if op == "scatter":
        return [(q, s / n) for q in group if q != root] if r.rank == root else []
    return []


def traffic_matrix(records: list[Any], world_size: int | None = None) -> list[list[float]]:
    """bytes[src][dst] sent between ranks (see the module docstring for the convention)."""
    comms = [r for r in records if isinstance(r, CommRecord)]
    ranks = {r.rank for r in comms} | {q for r in comms for q in r.group}
    ranks |= {r.peer for r in comms if r.peer is not None}
    size = max(world_size or 0, max(ranks, default=-1) + 1)
    matrix = [[0.0] * size for _ in range(size)]
    for r in comms:
        for dst, nbytes in _sends(r):
            matrix[r.rank][dst] += nbytes
    return matrix


def op_summary(records: list[Any]) -> list[dict[str, Any]]:
    """Per op: calls, bytes (sum of S), seconds (sum of call times), algbw and busbw (B/s)."""
    calls: dict[tuple, list[CommRecord]] = defaultdict(list)
    for r in records:
        if isinstance(r, CommRecord):
            p2p = canonical_op(r.op) in _P2P
            calls[(r.op, r.group, r.seq, r.rank if p2p else None)].append(r)
    rows: dict[str, dict[str, Any]] = {}
    for (op, group, _, _), recs in calls.items():
        size = max(x.bytes for x in recs)
        seconds = max(x.duration for x in recs)
        row = rows.setdefault(op, {"op": op, "calls": 0, "bytes": 0, "seconds": 0.0, "_bus": 0.0})
        row["calls"] += 1
        row["bytes"] += size
        row["seconds"] += seconds
        row["_bus"] += size * busbw_factor(op, max(len(group), 1))
    out = []
    for row in sorted(rows.values(), key=lambda x: x["op"]):
        bus, seconds = row.pop("_bus"), row["seconds"]
        row["algbw"] = row["bytes"] / seconds if seconds > 0 else 0.0
        row["busbw"] = bus / seconds if seconds > 0 else 0.0
        out.append(row)
    return out


def matrix_figure(matrix: list[list[float]]) -> go.Figure:
    n = len(matrix)
    labels = [f"rank {r}" for r in range(n)]
    fig = go.Figure(
        go.Heatmap(
            z=matrix,
            x=labels,
            y=labels,
            colorscale="Blues",
            zmin=0,
            text=[[human_bytes(v) if v else "" for v in row] for row in matrix],
            texttemplate="%{text}",
            hovertemplate="%{y} to %{x}: %{z:,.0f} bytes<extra></extra>",
        )
    )
    fig.update_layout(
        title=title("bytes sent (row: from, column: to)", 160 + 60 * n),
        width=200 + 70 * n,
        height=160 + 60 * n,
        margin={"l": 60, "r": 10, "t": 60, "b": 40},
    )
    fig.update_yaxes(autorange="reversed")
    return fig


def ops_figure(ops: list[dict[str, Any]]) -> go.Figure:
    names = [o["op"] for o in ops]
    fig = go.Figure(
        [
            go.Bar(
                name="busbw",
                x=names,
                y=[o["busbw"] / 1e9 for o in ops],
                marker_color=[op_colour(o["op"]) for o in ops],
            ),
            go.Bar(
                name="algbw",
                x=names,
                y=[o["algbw"] / 1e9 for o in ops],
                marker_color="rgba(120,120,120,0.5)",
            ),
        ]
    )
    fig.update_layout(
        barmode="group",
        title=title("bandwidth per op (GB/s)", 320),
        yaxis_title="GB/s",
        height=320,
        margin={"l": 60, "r": 10, "t": 40, "b": 40},
    )
    return fig


def _op_rows(ops: list[dict[str, Any]]) -> list[list[Any]]:
    return [
        [
            o["op"],
            o["calls"],
            human_bytes(o["bytes"]),
            f"{o['seconds'] * 1e3:.3f} ms",
            human_rate(o["algbw"]),
            human_rate(o["busbw"]),
        ]
        for o in ops
    ]


class CommView(View):
    """The widget `show_comm` returns: `matrix` (bytes[src][dst]) and `ops` (op_summary)."""

    OP_HEADERS = ("op", "calls", "bytes", "time", "algbw", "busbw")

    def __init__(self, matrix: list[list[float]], ops: list[dict[str, Any]]) -> None:
        super().__init__()
        self.matrix, self.ops = matrix, ops
        if not ops:
            self.children = (widgets.HTML("<i>no collective or point-to-point calls traced</i>"),)
            return
        table = widgets.HTML(html_table(self.OP_HEADERS, _op_rows(ops), "per op"))
        self.children = (
            widgets.HBox(
                [self.add_figure(matrix_figure(matrix)), self.add_figure(ops_figure(ops))]
            ),
            table,
        )

    def to_html(self) -> str:
        n = len(self.matrix)
        headers = ["from \\ to", *(f"rank {r}" for r in range(n))]
        body = [[f"rank {r}", *(f"{v:,.0f}" for v in row)] for r, row in enumerate(self.matrix)]
        parts = [
            html_table(headers, body, "bytes sent"),
            html_table(self.OP_HEADERS, _op_rows(self.ops), "per op"),
        ]
        return "<div class='labkit-comm'>" + "".join(parts) + "</div>"


def show_comm(lab_or_records: Any, cell: int | None = None) -> CommView:
    """Traffic matrix and per-op bandwidth of a trace (kernel side; convention in module doc).

    `lab_or_records` is a lab (its last cell's trace, or `cell`'s) or a list of records.
    Example: ``labkit.show_comm(lab)`` after a `%%ranks` cell that ran collectives.
    """
    records, lab = records_from(lab_or_records, cell)
    world_size = getattr(lab, "world_size", None) if lab is not None else None
    return CommView(traffic_matrix(records, world_size), op_summary(records))
