"""A Next/Previous stepper over the steps of an algorithm, and the ring all-reduce shown in it
(kernel side; built from plain per-step records, so it is testable without ranks).

`Stepper(frames)` steps through `[(label, html), ...]`. `show_ring(steps)` takes what each rank
returned from `labkit.parallel.ring_allreduce.ring_all_reduce(..., record=True)` (`{rank:
[RingStep]}`, a flat list, or their dict forms) and draws one grid per step: a row per rank, a
column per chunk, each cell the rank's chunk after the step; the chunk a rank sent in that step
is outlined in orange, the chunk it received (added or copied into its own) is filled green."""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, is_dataclass
from typing import Any

import ipywidgets as widgets

from labkit.views._common import View

__all__ = ["Stepper", "ring_grid", "ring_steps", "show_ring"]

SENT = "outline:2px solid #d97706;outline-offset:-2px"
RECEIVED = "background:#bbf7d0"


class Stepper(View):
    """Previous / Next buttons over `frames` (`[(label, html)]`); `index` is the frame shown."""

    def __init__(self, frames: Sequence[tuple[str, str]], title: str = "") -> None:
        if not frames:
            raise ValueError("a Stepper needs at least one (label, html) frame")
        super().__init__()
        self.frames = list(frames)
        self.title = title
        self.index = 0
        self.prev_button = widgets.Button(description="◀ Previous")
        self.next_button = widgets.Button(description="Next ▶")
        self.prev_button.on_click(lambda _: self.previous())
        self.next_button.on_click(lambda _: self.next())
        self.label = widgets.HTML()
        self.body = widgets.HTML()
        head = [widgets.HTML(f"<b>{html.escape(title)}</b>")] if title else []
        controls = widgets.HBox([self.prev_button, self.next_button, self.label])
        self.children = (*head, controls, self.body)
        self.show(0)

    def show(self, index: int) -> None:
        """Show frame `index` (0-based); raises IndexError outside [0, len(frames))."""
        if not 0 <= index < len(self.frames):
            raise IndexError(f"frame must be in [0, {len(self.frames)}), got {index}")
        self.index = index
        label, body = self.frames[index]
        self.label.value = f"{index + 1}/{len(self.frames)}: <b>{html.escape(label)}</b>"
        self.body.value = body
        self.prev_button.disabled = index == 0
        self.next_button.disabled = index == len(self.frames) - 1

    def next(self) -> None:
        if self.index < len(self.frames) - 1:
            self.show(self.index + 1)

    def previous(self) -> None:
        if self.index > 0:
            self.show(self.index - 1)

    def to_html(self) -> str:
        head = f"<h4>{html.escape(self.title)}</h4>" if self.title else ""
        parts = [f"<h5>{html.escape(label)}</h5>{body}" for label, body in self.frames]
        return f"<div class='labkit-stepper'>{head}{''.join(parts)}</div>"


def _as_dict(record: Any) -> dict[str, Any]:
    if is_dataclass(record) and not isinstance(record, type):
        return asdict(record)
    if isinstance(record, Mapping):
        return dict(record)
    raise TypeError(f"a ring step record is a RingStep or a dict, got {type(record).__name__}")


def ring_steps(records: Mapping[int, Iterable[Any]] | Iterable[Any]) -> list[dict[int, dict]]:
    """Per step, {rank: record as a dict}, from `{rank: [steps]}` or a flat list of records.

    Raises ValueError when ranks recorded different numbers of steps."""
    flat = [r for rs in records.values() for r in rs] if isinstance(records, Mapping) else records
    by_step: dict[int, dict[int, dict[str, Any]]] = {}
    for rec in map(_as_dict, flat):
        by_step.setdefault(rec["step"], {})[rec["rank"]] = rec
    if not by_step:
        raise ValueError("no ring step records: run ring_all_reduce(..., record=True) first")
    steps = [by_step[k] for k in sorted(by_step)]
    ranks = set(steps[0])
    for k, step in enumerate(steps):
        if set(step) != ranks:
            raise ValueError(f"step {k} has records of ranks {sorted(step)}, not {sorted(ranks)}")
    return steps


def _fmt(values: list[float]) -> str:
    if values and all(v == values[0] for v in values):
        return f"{values[0]:g}" + (f" ×{len(values)}" if len(values) > 1 else "")
    shown = ", ".join(f"{v:g}" for v in values[:4])
    return f"[{shown}{', …' if len(values) > 4 else ''}]"


def ring_grid(step: Mapping[int, Mapping[str, Any]]) -> str:
    """HTML grid of one step: a row per rank, a column per chunk (see the module docstring)."""
    ranks = sorted(step)
    num_chunks = len(step[ranks[0]]["chunks"])
    head = "".join(f"<th style='padding:2px 8px'>chunk {c}</th>" for c in range(num_chunks))
    rows = []
    for r in ranks:
        rec = step[r]
        cells = []
        for c, values in enumerate(rec["chunks"]):
            style = "padding:2px 8px;text-align:right;font-family:monospace"
            if c == rec.get("send_chunk"):
                style += ";" + SENT
            if c == rec.get("recv_chunk"):
                style += ";" + RECEIVED
            cells.append(f"<td style='{style}'>{html.escape(_fmt(values))}</td>")
        move = ""
        if rec.get("send_chunk") is not None:
            verb = "adds" if rec["phase"] == "reduce-scatter" else "copies"
            move = (
                f"sends chunk {rec['send_chunk']} → rank {rec['send_to']}; {verb} chunk "
                f"{rec['recv_chunk']} from rank {rec['recv_from']}"
            )
        rows.append(
            f"<tr><th style='padding:2px 8px'>rank {r}</th>{''.join(cells)}"
            f"<td style='padding:2px 8px;color:#555'>{html.escape(move)}</td></tr>"
        )
    return (
        "<table class='labkit-ring' style='border-collapse:collapse'>"
        f"<thead><tr><th></th>{head}<th></th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )


def _label(step: Mapping[int, Mapping[str, Any]], total: int) -> str:
    rec = next(iter(step.values()))
    if rec["phase"] == "start":
        return "before the first step: each rank holds only its own data"
    return f"step {rec['step']} of {total} ({rec['phase']})"


def show_ring(records: Mapping[int, Iterable[Any]] | Iterable[Any], title: str = "") -> Stepper:
    """A `Stepper` over the steps of a recorded ring all-reduce (kernel side, no ranks needed)."""
    steps = ring_steps(records)
    total = len(steps) - 1
    frames = [(_label(step, total), ring_grid(step)) for step in steps]
    return Stepper(frames, title=title or f"ring all-reduce on {len(steps[0])} ranks")
