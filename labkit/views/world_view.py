"""A simulated world at a glance: shards, memory per rank, bytes per mesh axis (kernel side).

`show_world(world)` takes a `labkit.rank.fake_world.SimulatedWorld` (`labkit.simulate`) and
shows, for worlds of hundreds or thousands of ranks where a rank x parameter map would not fit:

- the mesh, which ranks ran `setup` (one per class) and how long it took;
- every parameter: its global shape, placements over the mesh, rank 0's local shard and the
  range of local bytes over all ranks;
- memory per rank once gradients and optimizer state exist (`SimulatedWorld.memory`), the
  ranks with the same numbers in one row;
- traffic per mesh axis (`axis_traffic`): the collectives' groups along each axis (or set of
  axes), calls and bytes (S, nccl-tests' buffer size) per rank, bytes sent per rank and per
  link under `labkit.views.comm_view`'s ring convention, and how many links carry them.

For a few ranks, `labkit.show_placement(world.placement(ranks))` draws the rank x parameter
map and `labkit.show_comm(world.traffic(ranks))` the traffic matrix.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

from labkit.views._common import View, html_table, human_bytes, title
from labkit.views.bandwidth import canonical_op
from labkit.views.comm_view import _sends

__all__ = ["WorldView", "axis_traffic", "show_world"]


def axis_traffic(world: Any, records: list[Any] | None = None) -> dict[str, dict[str, Any]]:
    """Per mesh axis (or "dp+tp" for a group spanning both; p2p by the axes between the two
    ranks): `group_size`, `groups`, and the largest over ranks of `calls`, `bytes` (sum of S)
    and `sent` per rank, `links` (src -> dst pairs that carry bytes) and `per_link` (the most
    bytes on one link)."""
    records = world.traffic() if records is None else records
    axes_of: dict[tuple[int, ...], str] = {}

    def label(ranks: tuple[int, ...]) -> str:
        if ranks not in axes_of:
            axes_of[ranks] = "+".join(world.axes_of(ranks)) or "self"
        return axes_of[ranks]

    calls: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    size: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    sent: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    links: dict[str, dict[tuple[int, int], float]] = defaultdict(lambda: defaultdict(float))
    groups: dict[str, set[tuple[int, ...]]] = defaultdict(set)
    for r in records:
        p2p = r.peer is not None and canonical_op(r.op) in ("send", "recv")
        key = label((r.rank, r.peer) if p2p else tuple(r.group))
        groups[key].add(tuple(sorted((r.rank, r.peer))) if p2p else tuple(r.group))
        calls[key][r.rank] += 1
        size[key][r.rank] += r.bytes
        for dst, nbytes in _sends(r):
            sent[key][r.rank] += nbytes
            links[key][(r.rank, dst)] += nbytes
    out = {}
    order = {n: i for i, n in enumerate(world.names)}
    for key in sorted(calls, key=lambda k: (order.get(k.split("+")[0], len(order)), k)):
        out[key] = {
            "group_size": max(len(g) for g in groups[key]),
            "groups": len(groups[key]),
            "calls": max(calls[key].values()),
            "bytes": max(size[key].values()),
            "sent": max(sent[key].values(), default=0.0),
            "links": sum(1 for v in links[key].values() if v),
            "per_link": max(links[key].values(), default=0.0),
        }
    return out


def _ranks_text(ranks: list[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3, 8' (at most 6 runs, then how many more)."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    parts = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:6]]
    if len(runs) > 6:
        parts.append(f"... ({len(ranks)} ranks)")
    return ", ".join(parts)


def _param_rows(world: Any) -> list[list[Any]]:
    rows = [r for r in world.placement() if r["kind"] == "param"]
    seen: dict[str, dict[str, Any]] = {}
    for r in rows:
        s = seen.setdefault(
            r["qualname"],
            {"row": None, "ranks": 0, "low": r["bytes"], "high": r["bytes"]},
        )
        if r["rank"] == 0 or s["row"] is None:
            s["row"] = s["row"] if s["row"] and s["row"]["rank"] == 0 else r
        s["ranks"] += 1
        s["low"], s["high"] = min(s["low"], r["bytes"]), max(s["high"], r["bytes"])
    out = []
    for name, s in seen.items():
        r = s["row"]
        spread = human_bytes(s["low"])
        if s["high"] != s["low"]:
            spread += f" - {human_bytes(s['high'])}"
        where = ", ".join(r["placements"]) if r["placements"] else "whole"
        out.append([name, r["shape"], where, r["local_shape"], spread, s["ranks"]])
    return out


def _memory_rows(memory: dict[int, dict[str, int]]) -> list[list[Any]]:
    same: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for rank, m in sorted(memory.items()):
        same[(m["params"], m["grads"], m["optimizer"], m["total"])].append(rank)
    return [
        [_ranks_text(ranks), *(f"{v:,}" for v in key)]
        for key, ranks in sorted(same.items(), key=lambda kv: kv[1][0])
    ]


def _axis_rows(traffic: dict[str, dict[str, Any]]) -> list[list[Any]]:
    return [
        [
            axis,
            t["group_size"],
            t["groups"],
            t["calls"],
            f"{t['bytes']:,}",
            f"{t['sent']:,.0f}",
            t["links"],
            f"{t['per_link']:,.0f}",
        ]
        for axis, t in traffic.items()
    ]


def memory_figure(memory: dict[int, dict[str, int]]) -> go.Figure:
    ranks = sorted(memory)
    fig = go.Figure()
    for part in ("params", "grads", "optimizer"):
        fig.add_bar(x=ranks, y=[memory[r][part] for r in ranks], name=part)
    fig.update_layout(
        barmode="stack",
        height=300,
        xaxis_title="rank",
        yaxis_title="bytes",
        title=title("memory per rank (after a step)", 300),
        margin={"t": 50, "b": 40},
    )
    return fig


class WorldView(View):
    """The widget `show_world` returns: `world`, `memory` (per rank), `traffic` (per axis)."""

    PARAM_HEADERS = ("parameter", "shape", "placements", "first shard", "bytes", "ranks")
    MEMORY_HEADERS = ("ranks", "params", "grads", "optimizer", "total")
    AXIS_HEADERS = (
        "mesh axis",
        "group size",
        "groups",
        "calls/rank",
        "bytes (S)/rank",
        "sent/rank",
        "links",
        "bytes/link",
    )

    def __init__(self, world: Any) -> None:
        super().__init__()
        self.world = world
        self.memory = world.memory()
        self.traffic = axis_traffic(world)
        self.children = (
            widgets.HTML(self._tables()),
            self.add_figure(memory_figure(self.memory)),
        )

    def summary(self) -> str:
        w = self.world
        mesh = " x ".join(f"{n}={s}" for n, s in zip(w.names, w.shape, strict=True))
        ran = len(w.ran)
        how = (
            "every rank ran setup"
            if ran == w.world_size
            else f"setup ran on {ran} representative rank(s) ({_ranks_text(w.ran)}), one per "
            f"coordinate of {'/'.join(w.vary) or 'the whole mesh'}; the others derived"
        )
        return (
            f"simulated world of {w.world_size:,} ranks, mesh {mesh}: {how}, in {w.seconds:.1f} s"
        )

    def _tables(self) -> str:
        parts = [
            f"<p>{self.summary()}</p>",
            html_table(self.PARAM_HEADERS, _param_rows(self.world), "parameters"),
            html_table(self.MEMORY_HEADERS, _memory_rows(self.memory), "memory per rank, bytes"),
        ]
        if self.traffic:
            parts.append(
                html_table(self.AXIS_HEADERS, _axis_rows(self.traffic), "traffic per mesh axis")
            )
        else:
            parts.append("<p><i>setup made no collective</i></p>")
        return "".join(parts)

    def to_html(self) -> str:
        return "<div class='labkit-world'>" + self._tables() + "</div>"


def show_world(world: Any) -> WorldView:
    """Shards, memory per rank and bytes per mesh axis of a simulated world (kernel side).

    Example: ``labkit.show_world(labkit.simulate((32, 8), ("dp", "tp"), setup))``.
    """
    return WorldView(world)
