"""One cell on the ranks, from sending it to its results: watch, Stop, diagnose (kernel side).

`CellRun.run()` sends the cell, waits in the channel's loop and, while it waits, shows the live
status and asks the watchdog whether the cell can still finish. Stop (Ctrl-C, the notebook's
interrupt) is never lost: pressed at any moment of the call, it interrupts the ranks through the
launcher, which latches it on the rank (a cell not started yet does not start), re-sends it
every `RESEND_S` and gives the ranks `STOP_GRACE` seconds; a second Stop gives up at once. A
rank that has not taken the cell `ACK_S` after it was sent, while its heartbeats say it is
alive, makes the cell stuck too (its request was lost). Stop and a stuck verdict also ask every
live rank for its Python stacks (labkit.kernel.inspection.stacks; Stop asks before it
interrupts, so the stacks show where each rank was), waiting at most `STUCK_WAIT_S` for them: the
outcome's `stacks` and a stopped rank's KeyboardInterrupt say where each rank was, and its
`verdict` merges every rank's Flight Recorder (which collective the ranks diverged at). A cell that
cannot finish is not repaired here: `run()` returns an outcome whose `stuck` says why, and the lab
decides what recovery means for its ranks (a restart, or a lab marked unusable for ranks it
cannot restart).
"""

from __future__ import annotations

import ast
import functools
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from labkit.kernel.cell.live import LiveStatus
from labkit.kernel.cell.watchdog import Watchdog, diagnose, op_text
from labkit.kernel.channel.channel import Channel, Stuck
from labkit.kernel.channel.sigint import armed
from labkit.kernel.inspection.debug import DebugFrontend
from labkit.kernel.inspection.stacks import STUCK_WAIT_S, collect, gather, stuck_text
from labkit.kernel.launch.launcher import RankLauncher
from labkit.kernel.results import CellState, LabkitWarning, RankResult, Results
from labkit.wire.messages import Exec, KernelToRank

STOP_GRACE = 3.0  # seconds ranks get to stop after Stop before the cell counts as stuck
RESEND_S = 0.5  # Stop is sent again this often while the ranks have not stopped
ACK_S = 15.0  # a live rank that has not taken a request this long after it was sent lost it
# the watchdog and the live status start this long into a cell: a busy rank beats every 0.25 s and
# the status shows after a second, so a quick cell skips them (they cost ~0.1 ms a turn)
WATCH_AFTER = 0.05
_COLLECTIVE = re.compile(
    r"\b(all_reduce|all_gather\w*|reduce_scatter\w*|all_to_all\w*|broadcast|barrier|reduce|"
    r"scatter|gather)\s*\("
)


def exec_message(
    code_or_function: str | Callable[..., Any], targets: list[int], world_size: int, display: bool
) -> Exec:
    """The `exec` request for code (a str) or a function; bad input raises here, once.

    Warns when code on some ranks only calls a collective on the whole group (it would wait
    for the absent ranks forever). The caller sets the cell's id.
    """
    msg = Exec(type="exec", id=0, display=display)
    if callable(code_or_function):
        import cloudpickle

        msg["fn"] = cloudpickle.dumps(code_or_function)
    elif isinstance(code_or_function, str):
        _check_syntax(code_or_function)  # a SyntaxError surfaces here, once
        msg["code"] = code_or_function
        if len(targets) < world_size and _COLLECTIVE.search(code_or_function):
            absent = sorted(set(range(world_size)) - set(targets))
            warnings.warn(
                f"this cell runs on ranks {targets} only, and it calls a collective; a "
                f"collective on the whole group waits for ranks {absent} forever "
                "(labkit will stop it). Use a group: dist.new_group(...)",
                LabkitWarning,
                stacklevel=3,
            )
    else:
        raise TypeError(
            f"run() takes code as a str or a function, got {type(code_or_function).__name__}"
        )
    return msg


@functools.lru_cache(maxsize=256)
def _check_syntax(code: str) -> None:
    """Raise the code's SyntaxError; a text that parsed is not parsed again (a loop of
    `lab.run(...)`; the ranks keep its compiled code too: labkit.rank.user_code)."""
    ast.parse(code, "<cell>")


@dataclass
class CellOutcome:
    """What happened to a cell: the replies that came, and why it is stuck, if it is."""

    replies: dict[int, dict[str, Any]]
    started: float
    stuck: Stuck | None = None
    errors: dict[int, dict[str, Any]] = field(default_factory=dict)
    stacks: str = ""  # the Python stacks of the ranks still running when it was stuck
    verdict: str = ""  # every rank's Flight Recorder merged: where the ranks diverged


class CellRun:
    """Runs one request (`exec`, `pull`, ...) with id `cell` on `targets`."""

    def __init__(
        self,
        channel: Channel,
        launcher: RankLauncher,
        world_size: int,
        cell: int,
        targets: list[int],
        timeout: float | None,
        live_owner: Any = None,
    ):
        self.channel = channel
        self.launcher = launcher
        self.world_size = world_size
        self.cell = cell
        self.targets = targets
        self.timeout = timeout
        self.live = LiveStatus(targets, lab=live_owner)
        self.watchdog = Watchdog()
        self.replies: dict[int, dict[str, Any]] = {}
        self.started = 0.0
        self._resent = 0.0
        self._asked: tuple[int, list[int], float] | None = None  # stacks asked at Stop

    def run(self, msg: KernelToRank) -> CellOutcome:
        self.channel.output.reset()
        self.started = time.monotonic()
        deadline = self.started + self.timeout if self.timeout else None
        stuck: Stuck | None = None
        frames, segments = self.channel.encode_for_all(msg)  # tensors written once for all
        try:
            try:
                with armed():  # one handler for the cell's sends and reads: no syscall each
                    pressed = self._send(msg, frames)
                    if pressed:
                        raise KeyboardInterrupt
                    self.channel.pump(
                        set(self.targets),
                        "done",
                        msg_id=self.cell,
                        deadline=deadline,
                        replies=self.replies,
                        watch=self._tick,
                        on_other=DebugFrontend(self.channel, post_mortem=msg["type"] == "debug"),
                    )
            except KeyboardInterrupt:
                self._stop()
        except Stuck as exc:
            stuck = exc
            if deadline is not None and time.monotonic() > deadline:
                stuck = Stuck(f"the cell ran past its timeout of {self.timeout} s ({exc})")
        except BaseException:  # the call is abandoned (say, a test's timeout): stop the ranks too
            running = [r for r in self.targets if r not in self.replies]
            try:
                self.launcher.interrupt(running, self.cell)
            except Exception:  # noqa: BLE001 - the original error is the one to show
                pass
            raise
        finally:
            self.channel.output.release(force=True)  # held lines are shown, whatever happened
            self.live.close()
            # each rank mapped them (and holds what it keeps): reuse or unlink them; else the
            # restart or stop sweeps them
            self.channel.settle(segments, all(r in self.replies for r in self.targets))
        outcome = CellOutcome(self.replies, self.started, stuck)
        try:
            self._add_stacks(outcome)
        except KeyboardInterrupt:  # Stop again while waiting for the stacks: go on without
            pass
        outcome.errors = {r: m["error"] for r, m in self.replies.items() if m.get("error")}
        if stuck is None:
            self.channel.catch_up_streams(self.replies)
        self.channel.output.finish()  # the tqdm bars' final state stays in the output
        return outcome

    def _add_stacks(self, outcome: CellOutcome) -> None:
        """Where the ranks were: the stacks asked at Stop, or (stuck) asked now; bounded."""
        if self._asked is not None:
            ask, ranks, at = self._asked
            stacks = gather(self.channel, ask, ranks, at + STUCK_WAIT_S, at)
            when = "when Stop was pressed"
        elif outcome.stuck is not None:
            stacks = collect(self.channel, self._alive(), STUCK_WAIT_S)
            when = "when labkit found the cell stuck"
        else:
            return
        for r, where in stacks.where.items():
            err = self.replies.get(r, {}).get("error")
            if where and err and err["type"] == "KeyboardInterrupt" and not err["message"]:
                err["message"] = f"Stop was pressed while rank {r} ran {where}"
        if outcome.stuck is not None:
            found = stacks.verdict
            outcome.verdict = found.text if found is not None else ""
            unfinished = {
                r: t for r, t in stacks.items() if r in self.targets and r not in self.replies
            }
            outcome.stacks = stuck_text(type(stacks)(unfinished, {}, stacks.answered), when)

    def _alive(self) -> list[int]:
        """Every rank of the lab still alive: those that finished the cell, or never ran it, hold
        the Flight Recorder entries that say which collective they never entered."""
        return [r for r in range(self.world_size) if r not in self.channel.dead]

    def _send(self, msg: KernelToRank, frames: list[Any]) -> bool:
        """Send the request to every target, even if Stop is pressed meanwhile (a rank takes a
        request id once, so one sent twice runs once). Returns whether Stop was pressed."""
        pressed, left = False, list(self.targets)
        while left:
            sent: list[int] = []
            try:
                self.channel.send(left, msg, frames, sent=sent)
            except KeyboardInterrupt:
                pressed = True
            left = [r for r in left if r not in sent]
        return pressed

    def _tick(self, pending: set[int]) -> None:
        """Between polls: the watchdog and the live status, and a request that never arrived."""
        if time.monotonic() - self.started < WATCH_AFTER:
            return
        for r in sorted(pending):
            st = self.channel.status.get(r, {})
            if st.get("received", 0.0) > self.started + ACK_S and st.get("taken", 0) < self.cell:
                raise Stuck(
                    f"rank {r} is alive but has not received this request {ACK_S:.0f} s after "
                    "it was sent (the message was lost, or another process took its connection)"
                )
        self._watch(pending)

    def _watch(self, pending: set[int]) -> None:
        now = time.monotonic()
        status = {r: self.channel.status.get(r, {}) for r in pending}  # one snapshot throughout
        states = self.states(pending, status)
        self.live.update(states, now - self.started)
        blocked = {
            s.rank: dict(s.op, blocked_s=s.blocked_s, received=status[s.rank].get("received"))
            for s in states
            if s.op is not None and s.state == "running"
        }
        why_not = {s.rank: s.state for s in states if s.state != "running"}
        progress = {r: m.get("progress") for r, m in self.replies.items()}
        for r, st in status.items():
            if st.get("busy") == self.cell:
                progress[r] = st.get("progress")
        finished = {r: m["received"] for r, m in self.replies.items() if "received" in m}
        verdict = diagnose(blocked, set(pending), why_not, progress=progress, finished=finished)
        beats = {r: st["received"] for r, st in status.items() if "received" in st}
        reason = self.watchdog.check(verdict, now, beats)
        if reason:
            raise Stuck(reason)
        self.launcher.watch(pending, self.started)

    def _stop(self) -> None:
        """Stop pressed: interrupt the running ranks, again every `RESEND_S` until they answer;
        ranks that do not stop within `STOP_GRACE` (or a second Stop) make the cell stuck."""
        running = [r for r in self.targets if r not in self.replies]
        alive = self._alive()  # every rank's Flight Recorder, for the hang verdict
        try:  # stacks first: the rank takes them before the Stop behind them interrupts it
            self._asked = (self.channel.ask_stacks(alive), alive, time.monotonic())
            self._interrupt(running)
            self.channel.pump(
                set(running),
                "done",
                msg_id=self.cell,
                deadline=time.monotonic() + STOP_GRACE,
                replies=self.replies,
                watch=self._stopping,
            )
        except KeyboardInterrupt:
            raise Stuck(f"Stop was pressed twice; {self._still_running(running)}") from None
        except Stuck as stuck:
            raise Stuck(
                f"Stop was pressed, and {self._still_running(running)} after "
                f"{STOP_GRACE:.0f} s ({stuck})",
                died=stuck.died,
            ) from None

    def _interrupt(self, ranks: list[int]) -> None:
        self._resent = time.monotonic()
        self.launcher.interrupt(ranks, self.cell)

    def _stopping(self, pending: set[int]) -> None:
        if time.monotonic() - self._resent >= RESEND_S:
            self._interrupt(sorted(pending))
        self._watch(pending)

    def _still_running(self, running: list[int]) -> str:
        """What the ranks that did not stop are doing: a line of the cell, or a comm op."""
        parts = []
        for s in self.states(set(running) - set(self.replies)):
            if s.state != "running":
                continue
            if s.op is not None:
                parts.append(f"rank {s.rank} is inside {op_text(s.op)} (C++: Stop cannot reach it)")
            elif s.line is not None:
                parts.append(f"rank {s.rank} still runs line {s.line} of the cell")
            else:
                parts.append(f"rank {s.rank} did not stop")
        return "; ".join(parts) or "the ranks did not answer"

    def states(
        self, pending: set[int], status: dict[int, dict[str, Any]] | None = None
    ) -> list[CellState]:
        """What each rank of the lab is doing for this cell (running, finished, died...).

        `status`: the heartbeats to read (default: the channel's latest).
        """
        status = self.channel.status if status is None else status
        states = []
        for r in range(self.world_size):
            if r in pending:
                st = status.get(r, {})
                op = st.get("op") if st.get("busy") == self.cell else None
                blocked = st["time"] - op["since"] if op else 0.0
                debugging = st.get("busy") == self.cell and st.get("debugging", False)
                states.append(CellState(r, "running", st.get("line"), op, blocked, debugging))
            elif r in self.replies:
                err = self.replies[r].get("error")
                states.append(CellState(r, f"raised {err['type']}" if err else "finished"))
            elif r in self.channel.dead:
                states.append(CellState(r, "died"))
            else:
                states.append(CellState(r, "is not running this cell"))
        return states


def results(replies: dict[int, dict[str, Any]], output: Any, offsets: dict[int, float]) -> Results:
    """{rank: RankResult} from `done` replies; error times on the kernel's clock."""
    out = Results()
    for r, m in sorted(replies.items()):
        err = m.get("error")
        if err is not None and r in offsets:
            err["time"] -= offsets[r]
        out[r] = RankResult(
            r,
            m.get("value"),
            output.of(r),
            m.get("duration", 0.0),
            err,
            m.get("display"),
            m.get("value_error"),
        )
    return out


def recovery_note(
    outcome: CellOutcome, stopped_after: float, restarted_in: float | None, cannot_restart: str
) -> str:
    """What the user reads after a stuck cell: why, and what became of the ranks."""
    assert outcome.stuck is not None
    reason, died, errors = str(outcome.stuck), outcome.stuck.died, outcome.errors
    stacks = f"\n{outcome.stacks}" if outcome.stacks else ""
    if outcome.verdict:  # first after the reason: which collective the ranks diverged at
        reason += f"\n{outcome.verdict}"
    if errors and died is not None:  # the death is the root cause; the peers' errors follow
        reason += f"\nbecause rank {died} died, " + "; ".join(
            f"rank {r} raised {e['type']}: {(e['message'].splitlines() or [''])[0][:160]}"
            for r, e in sorted(errors.items())
        )
    if restarted_in is None:  # ranks labkit cannot restart: the lab is unusable now
        return f"{reason}\n{cannot_restart}{stacks}"
    return (
        f"{reason}\nlabkit stopped the cell after {stopped_after:.1f} s and restarted the "
        f"ranks in {restarted_in:.2f} s: variables on the ranks were lost.{stacks}"
    )
