"""What the ranks print during one call, as the notebook shows it (kernel side).

Lines arrive from each rank's stdout and stderr (captured at the file-descriptor level on the
rank). Each line is shown with a `[rank r] ` tag, on the kernel's own stdout or stderr; a line
that arrives in pieces is tagged once, and stdout and stderr keep their own line starts.

**Order.** Ranks print at nearly the same moment and their lines reach the kernel in whatever
order the machine ran them (3, 1, 2, 0). So output is held for `HOLD` seconds from the first
line of a burst, and the burst is shown in rank order (each rank's own lines in the order it
wrote them). Lines printed within 50 ms of each other therefore read rank by rank, and a cell
that prints as it goes still shows each line within 50 ms. Held lines are shown before anything
else is: a dead rank's report, the end of the call, or a Stop.
At most `max_shown` characters per rank are shown in one call; past that a note points to
`%lab logs r`, where the rank's complete output is kept. Everything shown is also kept per rank
for `RankResult.output`.

The ranks' tqdm bars arrive in the same sequence as their output (`progress` messages, see
labkit.rank.progress) and are drawn by `labkit.views.progress_view.ProgressBars`, one per call,
made at the call's first bar; `finish()` draws their final state when the call ends.
"""

from __future__ import annotations

import re
import sys
import time
from typing import Any

MAX_SHOWN = 1 << 20  # characters shown per rank per call; the rank's log keeps everything
HOLD = 0.05  # seconds a burst of lines is held to be shown in rank order


class RankOutput:
    def __init__(self, max_shown: int = MAX_SHOWN):
        self.max_shown = max_shown
        self.reset()

    def reset(self) -> None:
        """Start a new call: nothing shown, every stream at the start of a line."""
        if getattr(self, "held", None):
            self.release(force=True)  # what an earlier call left held is shown, never dropped
        self.kept: dict[int, list[str]] = {}
        self.line_start: dict[tuple[int, str], bool] = {}
        self.shown: dict[int, int] = {}
        self.bars: Any = None  # the call's ProgressBars, from its first `progress`
        self.held: list[tuple[int, int, Any, str]] = []  # (rank, arrival, stream, tagged text)
        self.held_since: float | None = None

    def release(self, force: bool = False) -> None:
        """Show the held burst, in rank order, once it is `HOLD` old (or now, `force`)."""
        if not self.held:
            return
        if not force and time.monotonic() - self.held_since < HOLD:  # type: ignore[operator]
            return
        burst, self.held, self.held_since = sorted(self.held, key=lambda h: h[:2]), [], None
        if self.bars is not None:
            self.bars.clear()  # a terminal's bars stay below the output
        for _, _, out, text in burst:
            out.write(text)
            out.flush()
        if self.bars is not None:
            self.bars.redraw()

    def wait_ms(self, longest: int) -> int:
        """How long the waiting loop may sleep before a held burst is due."""
        if not self.held:
            return longest
        due = HOLD - (time.monotonic() - self.held_since)  # type: ignore[operator]
        return max(1, min(longest, int(due * 1000) + 1))

    def finish(self) -> None:
        """The call ended: show what is held, and leave its bars' final state in the output."""
        self.release(force=True)
        if self.bars is not None:
            self.bars.finish()

    def of(self, rank: int) -> str:
        return "".join(self.kept.get(rank, []))

    def show(self, msg: dict[str, Any]) -> None:
        """Print one `stream` message from a rank, tagged, within the per-call cap (or draw
        a `progress` message's bar)."""
        if msg.get("type") == "progress":
            self.release(force=True)  # lines written before the bar's update come first
            if self.bars is None:
                from labkit.views.progress_view import ProgressBars

                self.bars = ProgressBars()
            self.bars.update(msg)
            return
        rank, text, name = msg["rank"], msg["text"], msg["name"]
        shown = self.shown.get(rank, 0)
        self.shown[rank] = shown + len(text)
        if shown >= self.max_shown:
            return
        key = (rank, name)
        if (
            shown + len(text) > self.max_shown
        ):  # a flood: show the first part, say where the rest is
            text = text[: self.max_shown - shown]
            text += (
                f"{'' if text.endswith(chr(10)) else chr(10)}... output truncated after "
                f"{self.max_shown >> 10} KiB; the full output is in `%lab logs {rank}`\n"
            )
            self.line_start[key] = True
        self.kept.setdefault(rank, []).append(text)
        tagged = []
        for piece in re.split(r"(?<=[\n\r])", text):
            if not piece:
                continue
            if self.line_start.get(key, True):
                tagged.append(f"[rank {rank}] ")
            tagged.append(piece)
            self.line_start[key] = piece.endswith(("\n", "\r"))
        out = sys.stderr if name == "stderr" else sys.stdout
        if self.held_since is None:
            self.held_since = time.monotonic()
        self.held.append((rank, len(self.held), out, "".join(tagged)))
