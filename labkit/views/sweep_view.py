"""Collective timings against size: algbw, busbw and the alpha-beta model (kernel side).

The alpha-beta model says one call of a collective on n bytes takes t = alpha + beta·n: alpha a
fixed latency per call, beta seconds per byte (1/beta a bandwidth). For a ring all_reduce over p
ranks the model's terms are 2(p-1)·alpha_link and 2(p-1)/p·n·beta_link (docs/references.md),
so a fit of t = alpha + beta·n to all_reduce times gives alpha = 2(p-1)·alpha_link and
beta = 2(p-1)/p·beta_link. `fit_alpha_beta` is ordinary least squares on (n, t); `show_sweep`
draws the measured times and the fitted lines on log-log axes, with algbw/busbw per row and a
warning when ranks outnumber CPU cores.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

from labkit.views._common import (
    View,
    html_table,
    human_bytes,
    human_rate,
    op_colour,
    oversubscription,
    title,
    warning_html,
)
from labkit.views.bandwidth import algbw, busbw

__all__ = ["SweepView", "fit_alpha_beta", "show_sweep", "sweep_table"]


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """(alpha, beta) minimising sum (alpha + beta·n - t)^2 over the points. Pure.

    Raises ValueError with fewer than two distinct sizes or mismatched lengths."""
    if len(sizes) != len(seconds):
        raise ValueError(f"sizes and seconds differ in length: {len(sizes)} vs {len(seconds)}")
    if len(set(sizes)) < 2:
        raise ValueError("a line needs at least two distinct sizes")
    k = len(sizes)
    mean_n, mean_t = sum(sizes) / k, sum(seconds) / k
    var = sum((n - mean_n) ** 2 for n in sizes)
    cov = sum((n - mean_n) * (t - mean_t) for n, t in zip(sizes, seconds))
    beta = cov / var
    return mean_t - beta * mean_n, beta


def sweep_table(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with algbw and busbw (bytes/s, nccl-tests' factors) added."""
    out = []
    for row in rows:
        n, t, p = row["bytes"], row["seconds"], row["world_size"]
        out.append(dict(row, algbw=algbw(n, t), busbw=busbw(row["op"], n, t, p)))
    return out


class SweepView(View):
    """What `show_sweep` returns: `fits` {op: (alpha, beta)}, `rows`, `warning`, `figures`."""

    def __init__(self, rows: list[dict[str, Any]], warning: str | None) -> None:
        super().__init__()
        self.rows = sweep_table(rows)
        self.warning = warning
        self.fits: dict[str, tuple[float, float]] = {}
        fig = go.Figure()
        for op in dict.fromkeys(r["op"] for r in self.rows):
            mine = [r for r in self.rows if r["op"] == op]
            sizes = [r["bytes"] for r in mine]
            times = [r["seconds"] for r in mine]
            colour = op_colour(op)
            fig.add_scatter(x=sizes, y=times, mode="markers", name=op, marker={"color": colour})
            if len(set(sizes)) >= 2:
                alpha, beta = self.fits[op] = fit_alpha_beta(sizes, times)
                lo, hi = min(sizes), max(sizes)
                xs = [lo * (hi / lo) ** (i / 40) for i in range(41)]
                fig.add_scatter(
                    x=xs,
                    y=[max(alpha + beta * x, 1e-9) for x in xs],
                    mode="lines",
                    line={"color": colour, "dash": "dot"},
                    name=f"{op} fit: α={alpha * 1e6:.0f} µs, 1/β={human_rate(1 / beta)}"
                    if beta > 0
                    else f"{op} fit: β ≤ 0",
                )
        fig.update_layout(
            xaxis={"type": "log", "title": "bytes (S)"},
            yaxis={"type": "log", "title": "seconds per call"},
            height=460,
            autosize=True,  # no width: as wide as the output area
            title=title("collective time against size, with the alpha-beta fit", 460),
            margin={"l": 60, "r": 10, "t": 50, "b": 40},
            # flat under the axes: the fits' names are long, a legend beside the plot would
            # leave it no room in a narrow output area
            legend={"orientation": "h", "x": 0, "y": -0.18, "yanchor": "top"},
        )
        head = [widgets.HTML(warning_html(warning))] if warning else []
        self.children = (*head, self.add_figure(fig), widgets.HTML(self._table()))

    def _table(self) -> str:
        rows = [
            (
                r["op"],
                human_bytes(r["bytes"]),
                f"{r['seconds'] * 1e3:.3f}",
                human_rate(r["algbw"]),
                human_rate(r["busbw"]),
            )
            for r in self.rows
        ]
        return html_table(["op", "size", "ms", "algbw", "busbw"], rows)

    def to_html(self) -> str:
        warn = warning_html(self.warning) if self.warning else ""
        fits = "".join(
            f"<li>{html.escape(op)}: alpha {a * 1e6:.1f} µs, beta {b:.3e} s/B</li>"
            for op, (a, b) in self.fits.items()
        )
        return f"<div class='labkit-sweep'>{warn}<ul>{fits}</ul>{self._table()}</div>"


def show_sweep(
    rows: Iterable[dict[str, Any]], lab: Any = None, num_cpus: int | None = None
) -> SweepView:
    """Plot sweep rows (from `labkit.parallel.collective_sweep.sweep`) with fits (kernel side)."""
    rows = list(rows)
    if not rows:
        raise ValueError(
            "no sweep rows to show: run labkit.parallel.collective_sweep.sweep() on the ranks"
        )
    p = rows[0]["world_size"]
    warning = oversubscription(range(p), lab, num_cpus) if (lab or num_cpus) else None
    return SweepView(rows, warning)
