"""Exercise checkers for the notebooks (kernel side).

Each notebook's exercises live in a module here (`labkit.exercises.collective_checks`, ...). A
checker runs the learner's answer (often a function, run on the ranks with `lab.run`) against
a reference and returns a `Verdict`, which shows as a green "right" or a red "not yet" with
what differed. `reveal(text)` shows a solution only when the learner asks for it.

`run_on_ranks` runs an answer on every rank and turns a raised error or a cell the lab had to
stop (a deadlock, a hang) into a "not yet"; `comm_ops` reads which collectives each rank called,
for checkers that ask for a given collective and not only for the right numbers.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from labkit.kernel.results import LabError

CHECK_TIMEOUT = 120.0  # seconds an answer may run on the ranks before it counts as hanging

# names the tracer records for one collective, folded to the exercise's word for it: torch 2.13
# deprecates all_gather_into_tensor / reduce_scatter_tensor (a FutureWarning) for *_single, and
# the functional collectives are recorded under the old names
OP_FAMILY = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "isend": "send",
    "irecv": "recv",
}


@dataclass
class Verdict:
    ok: bool
    message: str

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        return f"{'right' if self.ok else 'not yet'}: {self.message}"

    def _repr_html_(self) -> str:
        color, word = ("#1a7f37", "✔ right") if self.ok else ("#cf222e", "✘ not yet")
        return (
            f"<div style='border-left:4px solid {color};padding:2px 8px'>"
            f"<b style='color:{color}'>{word}</b> — {html.escape(self.message)}</div>"
        )


@dataclass
class Solution:
    code: str

    def __repr__(self) -> str:
        return self.code

    def _repr_html_(self) -> str:
        code = html.escape(self.code)
        return f"<details open><summary>solution</summary><pre>{code}</pre></details>"


def right(message: str = "matches the reference") -> Verdict:
    return Verdict(True, message)


def wrong(message: str) -> Verdict:
    return Verdict(False, message)


def reveal(code: str) -> Solution:
    """A solution, shown only when a learner evaluates it."""
    return Solution(code.strip("\n"))


def rank_error(results: Any) -> Verdict | None:
    """The lowest rank's error in `results` (from `lab.run`) as a verdict; None when none raised."""
    if results.errors:
        r = min(results.errors)
        err = results.errors[r]
        return wrong(f"rank {r} raised {err['type']}: {err['message']}")
    return None


def run_on_ranks(lab: Any, fn: Any, *, display: bool = True) -> tuple[Any, Verdict | None]:
    """Run `fn` on every rank with `lab.run` (kernel side; tracing is switched on first, so
    `comm_ops` can read what it called). Returns (results, None), or (None, a wrong verdict)
    when a rank raised or the lab had to stop the cell: the watchdog's diagnosis, or a run
    past CHECK_TIMEOUT (a hang the watchdog cannot prove, e.g. ranks that disagree on which
    groups they create); the ranks are then fresh."""
    timeout = min(t for t in (lab.timeout, CHECK_TIMEOUT) if t)
    try:
        lab.trace(enabled=True)
        results = lab.run(fn, timeout=timeout, display=display)
    except LabError as err:
        return None, wrong(f"the cell could not finish: {str(err).splitlines()[0]}")
    return results, rank_error(results)


def comm_ops(lab: Any) -> dict[int, list[str]]:
    """{rank: the collectives and p2p ops it called in the last cell, in order}, with names
    folded by OP_FAMILY (kernel side; reads `lab.trace()`)."""
    ops: dict[int, list[str]] = {r: [] for r in range(lab.world_size)}
    for rec in lab.trace():
        if getattr(rec, "kind", "") == "comm":
            ops.setdefault(rec.rank, []).append(OP_FAMILY.get(rec.op, rec.op))
    return ops


# ops after which a rank holds something the others sent it
_DELIVERING = {
    "broadcast",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "scatter",
    "recv",
    "batch_isend_irecv",
}


def reduce_leftovers(lab: Any) -> Verdict | None:
    """A wrong verdict when a rank called `reduce` as a non-destination and received nothing
    after it, in the last cell (kernel side). After reduce only the destination's tensor is
    defined; gloo leaves partial results on the other ranks (rank r holds the reduction of
    ranks r..n-1 on 4 CPU ranks), which for MAX can even be the right number."""
    pending: dict[int, bool] = {}
    for rec in lab.trace():  # sorted by start time
        if getattr(rec, "kind", "") != "comm":
            continue
        op = OP_FAMILY.get(rec.op, rec.op)
        if op == "reduce" and rec.peer != rec.rank:
            pending[rec.rank] = True
        elif op in _DELIVERING:
            pending[rec.rank] = False
    ranks = sorted(r for r, left in pending.items() if left)
    if not ranks:
        return None
    return wrong(
        f"rank(s) {ranks} kept the tensor they passed to dist.reduce as non-destinations: "
        "after reduce only the destination holds the result (gloo happens to leave partial "
        "results elsewhere, NCCL does not); all_reduce, or reduce then broadcast"
    )
