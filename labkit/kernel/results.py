"""What comes back from the ranks, and how it shows in a notebook (kernel side).

`Results` maps rank -> `RankResult` (value, output, duration, error). A failure on one or more
ranks becomes a `RemoteError` naming the root cause: the earliest error by (offset-corrected)
time, as torch.distributed.elastic does, with that rank's traceback first. IPython renders it
through `_render_traceback_`, like ipyparallel's remote errors.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any


@dataclass
class RankResult:
    rank: int
    value: Any = None
    output: str = ""
    duration: float = 0.0
    error: dict[str, Any] | None = None  # type, message, traceback, time
    display: dict[str, Any] | None = None  # what the rank said about its value (repr, tensor)
    value_error: str | None = None  # why the value did not come back, if it did not

    @property
    def ok(self) -> bool:
        return self.error is None


class LabkitWarning(UserWarning):
    """A warning of labkit's own (tests turn these into errors)."""


class LabError(RuntimeError):
    """The lab could not do what was asked (bad state, dead rank, recovery happened)."""


class RemoteError(LabError):
    """One or more ranks raised; `root` is the rank whose error came first."""

    def __init__(self, errors: dict[int, dict[str, Any]], note: str = ""):
        self.errors = errors
        self.root = min(errors, key=lambda r: (errors[r].get("time", 0.0), r))
        first = errors[self.root]
        others = sorted(r for r in errors if r != self.root)
        msg = f"rank {self.root} raised {first['type']}: {first['message']}"
        if others:
            msg += f" (root cause; also failed: rank {', '.join(map(str, others))})"
        if note:
            msg += f"\n{note}"
        self.note = note
        super().__init__(msg)

    def _render_traceback_(self) -> list[str]:
        lines = []
        for r in [self.root] + sorted(r for r in self.errors if r != self.root):
            err = self.errors[r]
            tag = " (root cause)" if r == self.root and len(self.errors) > 1 else ""
            lines.append(f"\x1b[31m--- rank {r}{tag} ---\x1b[0m")
            lines.extend(err["traceback"].rstrip("\n").splitlines())
        if self.note:
            lines.append(f"\x1b[33m{self.note}\x1b[0m")
        return lines


class Results(dict):
    """{rank: RankResult} for one `lab.run`; shows per-rank values and errors."""

    @property
    def values_by_rank(self) -> dict[int, Any]:
        return {r: res.value for r, res in self.items()}

    @property
    def errors(self) -> dict[int, dict[str, Any]]:
        return {r: res.error for r, res in self.items() if res.error is not None}

    def raise_for_errors(self, note: str = "") -> None:
        if self.errors:
            raise RemoteError(self.errors, note)

    def __repr__(self) -> str:
        parts = []
        for r, res in sorted(self.items()):
            if res.error:
                parts.append(f"[rank {r}] {res.error['type']}: {res.error['message']}")
            elif res.display:
                parts.append(f"[rank {r}] {res.display['text']}")
            else:
                parts.append(f"[rank {r}] {res.value!r}")
        return "\n".join(parts)

    def _repr_html_(self) -> str:
        return values_html(self)


def _header(rank: int, info: dict[str, Any] | None) -> str:
    if info and "tensor" in info:
        t = info["tensor"]
        shape = "×".join(map(str, t["shape"])) or "scalar"
        grad = " · requires_grad" if t.get("requires_grad") else ""
        return (
            f"rank {rank} · tensor {shape} · {t['dtype'].removeprefix('torch.')} · "
            f"{t['device']}{grad}"
        )
    return f"rank {rank}" + (f" · {info['type']}" if info else "")


def values_html(results: dict[int, RankResult]) -> str:
    """One box per rank with its value's header (shape, dtype, device for tensors) and repr."""
    cells = []
    for r, res in sorted(results.items()):
        if res.error:
            body = html.escape(f"{res.error['type']}: {res.error['message']}")
            cells.append(f"<div class='lk-rank lk-err'><b>rank {r}</b><pre>{body}</pre></div>")
            continue
        if res.display is None:
            continue
        note = f"<i>{html.escape(res.value_error)}</i>" if res.value_error else ""
        cells.append(
            f"<div class='lk-rank'><b>{html.escape(_header(r, res.display))}</b>"
            f"<pre style='margin:2px 0'>{html.escape(res.display['text'])}</pre>{note}</div>"
        )
    if not cells:
        return ""
    style = (
        "<style>.lk-rank{border:1px solid #ccc;border-radius:4px;padding:4px 8px;"
        "margin:2px 0}.lk-err{border-color:#d33}</style>"
    )
    return style + "".join(cells)


@dataclass
class CellState:
    """The kernel's view of one rank while a cell runs (what the live status shows)."""

    rank: int
    state: str = "running"  # running, finished, raised, not in cell, dead
    line: int | None = None
    op: dict[str, Any] | None = None
    blocked_s: float = 0.0
