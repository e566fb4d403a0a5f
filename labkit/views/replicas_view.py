"""Replica consistency: are the data-parallel replicas still the same model? (kernel side)

Built from plain `labkit.parallel.data_parallel.replica_report` dicts, which every rank computes
the same: checksums (one CRC-32 of all weights per rank), max_abs_diff (largest max_r(w) -
min_r(w) over all weights), per_param (the same per parameter) and identical. Equal checksums on
every rank and a spread of exactly 0 mean bit-identical replicas; anything else means they
drifted.

    show_replicas(report)                         one moment: a row per rank, a bar per parameter
    show_replicas({"no average": [r1, r2, ...]})  drift over steps, one line per run

A report in a history may carry a "step" key (else its position, from 1, is its step).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

from labkit.views._common import View, html_table, title

__all__ = ["ReplicaView", "drift_summary", "replica_rows", "show_replicas"]

Report = Mapping[str, Any]


def _check(report: Report) -> None:
    missing = {"checksums", "max_abs_diff", "identical"} - set(report)
    if missing:
        raise ValueError(
            f"a replica report needs keys checksums, max_abs_diff and identical "
            f"(from labkit.parallel.data_parallel.replica_report); missing {sorted(missing)}"
        )


def replica_rows(report: Report) -> list[dict[str, Any]]:
    """One row per rank: rank, checksum (hex) and whether it equals rank 0's."""
    _check(report)
    sums = list(report["checksums"])
    return [
        {"rank": r, "checksum": f"{c:08x}", "same_as_rank_0": c == sums[0]}
        for r, c in enumerate(sums)
    ]


def _steps(history: Sequence[Report]) -> list[int]:
    return [int(rep.get("step", i + 1)) for i, rep in enumerate(history)]


def drift_summary(histories: Mapping[str, Sequence[Report]]) -> list[dict[str, Any]]:
    """Per run: final identical, final max_abs_diff, distinct checksums at the end, and the
    first step at which the replicas were no longer bit-identical (None if never)."""
    rows = []
    for label, history in histories.items():
        if not history:
            raise ValueError(f"history {label!r} holds no reports")
        for rep in history:
            _check(rep)
        steps = _steps(history)
        first = next((s for s, rep in zip(steps, history) if not rep["identical"]), None)
        last = history[-1]
        rows.append(
            {
                "run": label,
                "identical": bool(last["identical"]),
                "max_abs_diff": float(last["max_abs_diff"]),
                "distinct_checksums": len(set(last["checksums"])),
                "first_drift_step": first,
            }
        )
    return rows


def _report_figure(report: Report) -> go.Figure:
    per_param = dict(report.get("per_param", {}))
    fig = go.Figure(
        go.Bar(
            x=list(per_param),
            y=list(per_param.values()),
            marker_color=["#1a7f37" if v == 0 else "#cf222e" for v in per_param.values()],
            hovertemplate="%{x}: max spread %{y:.3g}<extra></extra>",
        )
    )
    height = 260
    fig.update_layout(
        height=height,
        margin={"l": 60, "r": 20, "t": 50, "b": 60},
        title=title("max over weights of (max over ranks - min over ranks), per parameter", height),
        yaxis_title="spread",
    )
    return fig


def _drift_figure(histories: Mapping[str, Sequence[Report]]) -> go.Figure:
    fig = go.Figure()
    for label, history in histories.items():
        diffs = [float(rep["max_abs_diff"]) for rep in history]
        # a log axis cannot show 0 (bit-identical): those points sit on the floor, marked
        floor = 1e-12
        fig.add_trace(
            go.Scatter(
                x=_steps(history),
                y=[max(d, floor) for d in diffs],
                name=label,
                mode="lines+markers",
                customdata=[["identical" if d == 0 else f"{d:.3g}"] for d in diffs],
                hovertemplate=f"{label} · step %{{x}}: %{{customdata[0]}}<extra></extra>",
            )
        )
    height = 320
    fig.update_layout(
        height=height,
        margin={"l": 60, "r": 20, "t": 50, "b": 40},
        title=title("drift between replicas (max |w_r - w_s|; 1e-12 = bit-identical)", height),
        xaxis_title="step",
        yaxis={"type": "log", "title": "max spread"},
    )
    return fig


def _rank_table(report: Report) -> str:
    rows = [
        [r["rank"], r["checksum"], "yes" if r["same_as_rank_0"] else "NO"]
        for r in replica_rows(report)
    ]
    verdict = (
        "replicas bit-identical"
        if report["identical"]
        else f"replicas differ: max spread {float(report['max_abs_diff']):.3g}"
    )
    return html_table(("rank", "weights CRC-32", "same as rank 0"), rows, verdict)


def _summary_table(rows: list[dict[str, Any]]) -> str:
    body = [
        [
            r["run"],
            "yes" if r["identical"] else "NO",
            f"{r['max_abs_diff']:.3g}",
            r["distinct_checksums"],
            "never" if r["first_drift_step"] is None else r["first_drift_step"],
        ]
        for r in rows
    ]
    headers = ("run", "identical at the end", "max spread", "distinct checksums", "drifts from")
    return html_table(headers, body, "replica consistency per run")


class ReplicaView(View):
    """What `show_replicas` returns: `rows` (per rank or per run) and `figures` (plotly)."""

    def __init__(self, data: Report | Mapping[str, Sequence[Report]]) -> None:
        super().__init__()
        if "checksums" in data:
            self.mode = "report"
            self.rows = replica_rows(data)
            self.table = _rank_table(data)
            fig = _report_figure(data) if data.get("per_param") else None
        else:
            self.mode = "drift"
            self.rows = drift_summary(data)
            self.table = _summary_table(self.rows)
            fig = _drift_figure(data)
        children: list[widgets.Widget] = [widgets.HTML(self.table)]
        if fig is not None:
            children.append(self.add_figure(fig))
        self.children = tuple(children)

    def to_html(self) -> str:
        return f"<div class='labkit-replicas'>{self.table}</div>"


def show_replicas(data: Report | Mapping[str, Sequence[Report]]) -> ReplicaView:
    """Replica consistency from `replica_report` dicts (kernel side; see the module docstring).

    `data` is one report (a row per rank: checksum and whether it matches rank 0; a bar per
    parameter: how far the ranks disagree) or {run label: [report per step]} (a drift curve per
    run and a table: identical at the end, spread, distinct checksums, first step of drift).
    """
    if not isinstance(data, Mapping) or not data:
        raise ValueError("show_replicas takes a replica_report dict or {label: [reports]}")
    return ReplicaView(data)
