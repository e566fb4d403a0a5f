"""Exercise checkers for the notebooks (kernel side).

Each notebook's exercises live in a module here (`labkit.exercises.collective_checks`, ...). A
checker runs the learner's answer (often a function, run on the ranks with `lab.run`) against
a reference and returns a `Verdict`, which shows as a green "right" or a red "not yet" with
what differed. `reveal(text)` shows a solution only when the learner asks for it.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any


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
