"""What comes back from the ranks, and how it shows in a notebook (kernel side).

`Results` maps rank -> `RankResult` (value, output, duration, error). A failure on one or more
ranks becomes a `RemoteError` naming the root cause: the earliest error by (offset-corrected)
time, as torch.distributed.elastic does, with that rank's traceback first. IPython renders it
through `_render_traceback_`, like ipyparallel's remote errors; every `LabError` does: IPython
shows what happened, to which rank, and what to do, without labkit's own frames or the internal
exceptions it was raised from, and `str(err)` reads the same outside IPython.

A `%%ranks` cell shows its values as `RankValues`: an HTML box per rank in a notebook, and a
`rank r: value` line per rank as text (terminal IPython, nbconvert to text, screen readers).
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any


@dataclass
class RankResult:
    """One rank's part of a `lab.run` (kernel side): the value of the cell's last expression,
    its output, its duration in seconds, and its error (None when it ran to the end).

    Example: ``r = lab.run("print(rank); rank")[1]`` gives ``r.value == 1``,
    ``r.output == "1\\n"`` and ``r.ok``."""

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
    """A warning of labkit's own, raised in the kernel (tests turn these into errors). Example:
    ``warnings.simplefilter("error", labkit.LabkitWarning)`` makes them errors in a notebook."""


RED, YELLOW, RESET = "\x1b[31m", "\x1b[33m", "\x1b[0m"


def _paint(color: str, text: str, on: bool) -> str:
    return f"{color}{text}{RESET}" if on else text


def _shell_colours() -> bool:
    """Whether IPython colours its tracebacks (`--colors=NoColor` turns that off; so for us)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is None or str(getattr(shell, "colors", "")).lower() != "nocolor"


class LabError(RuntimeError):
    """The lab could not do what was asked (bad state, dead rank, recovery happened).

    Raised in the kernel; it prints what happened and what to do, without labkit's frames.
    Example::

        try:
            lab.run("dist.all_reduce(torch.ones(1)) if rank == 0 else None", timeout=5)
        except labkit.LabError as err:
            print(err)  # the stuck collective, which rank, and that the ranks restarted
    """

    def explain(self, color: bool = False) -> list[str]:
        """The lines a user reads: `LabError: what happened`, then the rest of the message."""
        head, *rest = str(self).splitlines() or [""]
        return [f"{_paint(RED, type(self).__name__, color)}: {head}", *rest]

    def _render_traceback_(self) -> list[str]:
        # IPython calls this instead of printing the traceback: labkit's own frames, and any
        # exception this one was raised while handling, say nothing to a user
        return self.explain(color=_shell_colours())


class RemoteError(LabError):
    """One or more ranks raised; `root` is the rank whose error came first.

    Raised in the kernel for errors raised on the ranks; `errors` holds each rank's type,
    message and traceback. Example::

        try:
            lab.run("1 / (rank - 1)").raise_for_errors()
        except labkit.RemoteError as err:
            err.root, err.errors[err.root]["type"]  # (1, 'ZeroDivisionError')
    """

    def __init__(self, errors: dict[int, dict[str, Any]], note: str = ""):
        self.errors = errors
        self.root = min(errors, key=lambda r: (errors[r].get("time", 0.0), r))
        first = errors[self.root]
        others = sorted(r for r in errors if r != self.root)
        msg = f"rank {self.root} raised {first['type']}: {first['message']}"
        if others:
            msg += f" (root cause; also failed: rank {', '.join(map(str, others))})"
        self.headline = msg
        if note:
            msg += f"\n{note}"
        self.note = note
        super().__init__(msg)

    def _section(self, rank: int, color: bool) -> list[str]:
        tag = " (root cause)" if rank == self.root and len(self.errors) > 1 else ""
        lines = [_paint(RED, f"--- rank {rank}{tag} ---", color)]
        return lines + self.errors[rank]["traceback"].rstrip("\n").splitlines()

    def _body(self, color: bool, every_rank: bool) -> list[str]:
        """The headline, the root cause's traceback (every rank's with `every_rank`), the note."""
        lines = self._section(self.root, color)
        for r in sorted(r for r in self.errors if r != self.root):
            if every_rank:
                lines += self._section(r, color)
            else:
                err = self.errors[r]
                first = (err["message"].splitlines() or [""])[0]
                lines.append(f"rank {r} also raised {err['type']}: {first}")
        if self.note:
            lines += [_paint(YELLOW, line, color) for line in self.note.splitlines()]
        return lines

    def __str__(self) -> str:  # what `print(err)` and a plain Python traceback show
        return "\n".join([self.headline, *self._body(color=False, every_rank=False)])

    def explain(self, color: bool = False) -> list[str]:
        name = _paint(RED, type(self).__name__, color)
        return [f"{name}: {self.headline}", *self._body(color, every_rank=True)]


class Results(dict):
    """{rank: RankResult} for one `lab.run`; shows per-rank values and errors (kernel side).

    Example: ``res = lab.run("rank * 2")``; ``res.values_by_rank`` is ``{0: 0, 1: 2, ...}``,
    ``res.errors`` the ranks that raised, and ``res.raise_for_errors()`` raises RemoteError."""

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
        return "\n".join(
            _rank_line(r, res.display["text"] if res.display else repr(res.value), res)
            for r, res in sorted(self.items())
        )

    def _repr_html_(self) -> str:
        return values_html(self)


class RankValues:
    """What a `%%ranks` cell shows: per rank its value (or error), as HTML and as text."""

    def __init__(self, results: dict[int, RankResult]):
        self.results = results

    def __bool__(self) -> bool:  # False when no rank has anything to show
        return bool(repr(self))

    def __repr__(self) -> str:
        return values_text(self.results)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # terminal IPython's pretty printer
        p.text(repr(self))

    def _repr_html_(self) -> str:
        return values_html(self.results)


def _rank_line(rank: int, text: str, res: RankResult) -> str:
    """`rank r: value`, a multi-line value's next lines indented under its first."""
    if res.error:
        text = f"{res.error['type']}: {res.error['message']}"
    elif res.value_error:
        text += f"\n({res.value_error})"
    head = f"rank {rank}: "
    return head + text.rstrip("\n").replace("\n", "\n" + " " * len(head))


def values_text(results: dict[int, RankResult]) -> str:
    """The text twin of `values_html`: one `rank r: value` per rank that has one to show."""
    return "\n".join(
        _rank_line(r, res.display["text"] if res.display else "", res)
        for r, res in sorted(results.items())
        if res.error or res.display is not None
    )


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
    debugging: bool = False  # at a breakpoint: waiting for the user, not stuck
