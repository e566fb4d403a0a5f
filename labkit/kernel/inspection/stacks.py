"""Every rank's Python stacks: on demand, and when a cell is stuck or stopped (kernel side).

The kernel sends `ask_stacks` on the side socket; each rank's heartbeat thread answers with
every thread's stack (labkit.rank.stacks), so a rank answers while its main thread runs user
code or waits in a C++ collective. Waits are bounded: a rank that does not answer in time is
named as such, a dead rank says it is dead. Nothing here takes the lab's lock or touches the
ctrl socket, so `lab.stacks()` may be called from another thread while a cell runs.

`RankStacks` is {rank: text}; it prints (and shows in a notebook) as one section per rank.
When torch's Flight Recorder is on (labkit turns it on), each rank's text ends with the last
collectives it entered, and a stuck cell's message shows them under each rank's stack; every
rank's entries also come whole (`RankStacks.fr`), merged into a hang verdict (`.verdict`,
labkit.kernel.inspection.hang_verdict) that the printed stacks and a stuck cell's message
start with.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterable
from typing import Any

from labkit.kernel.inspection.hang_verdict import HangVerdict, merge
from labkit.kernel.results import LabError
from labkit.rank.flight_recorder import HEADER as FLIGHT_RECORDER

STACKS_TIMEOUT = 5.0  # seconds `lab.stacks()` waits for the ranks by default
STUCK_WAIT_S = 1.5  # seconds a stuck or stopped cell waits for the stacks before going on
SHORT_FR = 2  # Flight Recorder entries per rank in a stuck cell's message (lab.stacks(): 4)


class RankStacks(dict):
    """{rank: text} of each rank's Python stacks (main thread first, innermost frame first),
    or why a rank has none. `where[rank]`: the cell line its main thread was on, if any;
    `answered`: the ranks that did answer."""

    def __init__(
        self,
        texts: dict[int, str],
        where: dict[int, str | None],
        answered: set[int],
        fr: dict[int, Any] | None = None,
    ):
        super().__init__(sorted(texts.items()))
        self.where = where
        self.answered = answered
        self.fr = fr or {}  # rank -> its Flight Recorder (FrSnapshot), where it is on

    @property
    def verdict(self) -> HangVerdict | None:
        """Every rank's Flight Recorder merged (labkit.kernel.inspection.hang_verdict), or None
        when no rank sent its entries (the recorder is off)."""
        if not self.fr:
            return None
        snaps: dict[int, Any] = {}
        for r, text in self.items():
            if r in self.fr:
                snaps[r] = self.fr[r]
            elif r in self.answered:
                snaps[r] = None  # the rank's recorder is off
            else:  # dead, or silent: say which, without its stacks' wording
                snaps[r] = text.strip("()").split(";")[0]
        return merge(snaps, where=self.where, world=list(self))

    def __str__(self) -> str:
        # the verdict while a cell runs (between cells no rank can hang: %lab logs --fr has it)
        found = self.verdict if any(self.where.values()) else None
        head = f"{found.text}\n" if found is not None else ""
        return head + "\n".join(f"--- rank {r} ---\n{text}" for r, text in self.items())

    __repr__ = __str__

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython shows it as plain text
        p.text(str(self))


def main_thread(text: str) -> str:
    """The main thread's part of a rank's stacks text (what a stuck cell's message shows)."""
    lines = text.splitlines()
    end = next((i for i, line in enumerate(lines[1:], 1) if not line.startswith(" ")), len(lines))
    return "\n".join(lines[:end])


def _dead_text(code: int) -> str:
    how = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    return f"(dead: the process ended, {how}; no stacks)"


def gather(
    channel: Any, ask: int, ranks: Iterable[int], deadline: float, asked_at: float
) -> RankStacks:
    """Wait (until `deadline`, monotonic) for the answers to the request `ask` of `ranks`."""
    ranks = sorted(set(ranks))
    got = channel.stacks.get(ask, {})
    while time.monotonic() < deadline and any(
        r not in got and r not in channel.dead for r in ranks
    ):
        time.sleep(0.01)
    channel.stacks.pop(ask, None)
    texts, where, fr = {}, {}, {}
    for r in ranks:
        if r in got:
            texts[r], where[r] = got[r]["text"], got[r]["where"]
            if got[r].get("fr") is not None:  # None: the rank's recorder is off
                fr[r] = got[r]["fr"]
        elif r in channel.dead:
            texts[r] = _dead_text(channel.dead[r])
        else:
            texts[r] = (
                f"(no answer within {deadline - asked_at:.1f} s: the rank's heartbeat thread "
                "did not run; a C extension may hold the GIL, or the machine is overloaded)"
            )
    return RankStacks(texts, where, set(got) & set(ranks), fr)


def collect(channel: Any, ranks: Iterable[int], timeout: float) -> RankStacks:
    """Ask `ranks` for their stacks and wait at most `timeout` seconds for the answers."""
    ranks = sorted(set(ranks))
    asked_at = time.monotonic()
    ask = channel.ask_stacks([r for r in ranks if r not in channel.dead])
    return gather(channel, ask, ranks, asked_at + timeout, asked_at)


def lab_stacks(lab: Any, ranks: Any, timeout: float) -> RankStacks:
    """`lab.stacks()`: bad input and a lab without ranks raise a clear error."""
    if not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds above 0, got {timeout!r}")
    if lab.closed or not lab.running:
        raise LabError("the lab's ranks are not running, so they have no stacks to show")
    return collect(lab.channel, lab.ranks(ranks), timeout)


def flight_recorder_part(text: str) -> str:
    """The Flight Recorder's lines at the end of a rank's stacks text (labkit.rank.stacks),
    or "" when the rank sent none (the recorder is off)."""
    at = text.find("\n" + FLIGHT_RECORDER)
    return text[at + 1 :] if at >= 0 else ""


def _short_main(text: str) -> str:
    """A message's form of a rank's stacks: its main thread's frames only, without the header
    and the request loop's frames every cell starts from (`... 9 labkit frames`, last), then
    the last collectives torch's Flight Recorder saw the rank enter, if it is on."""
    lines = main_thread(text).splitlines()[1:]
    if lines and lines[-1].lstrip().startswith("... ") and lines[-1].endswith("labkit frames"):
        lines.pop()
    recorded = flight_recorder_part(text).splitlines()
    main = "\n".join(lines) or "    (idle: no cell running)"
    if not recorded:
        return main
    head, *entries = recorded
    if not entries:  # why there are none: nothing recorded yet, or the dump failed
        return f"{main}\n  {head}"
    return "\n".join([main, f"  {FLIGHT_RECORDER}, last entries:", *entries[-SHORT_FR:]])


def stuck_text(stacks: RankStacks, when: str) -> str:
    """What a stuck or stopped cell's message ends with: each rank's main-thread stack, taken
    `when` ("when Stop was pressed"); ranks with the same stack share one section."""
    if not stacks:
        return ""
    same: dict[str, list[int]] = {}
    for r, text in stacks.items():
        same.setdefault(_short_main(text) if r in stacks.answered else text, []).append(r)
    parts = [
        f"--- rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} ---\n{text}"
        for text, ranks in same.items()
    ]
    return (
        f"Python stacks of the ranks that had not finished, {when} "
        "(innermost frame first; every thread: lab.stacks()):\n" + "\n".join(parts)
    )
