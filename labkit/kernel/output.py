"""What the ranks print during one call, as the notebook shows it (kernel side).

Lines arrive from each rank's stdout and stderr (captured at the file-descriptor level on the
rank). Each line is shown live with a `[rank r] ` tag, on the kernel's own stdout or stderr; a
line that arrives in pieces is tagged once, and stdout and stderr keep their own line starts.
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
from typing import Any

MAX_SHOWN = 1 << 20  # characters shown per rank per call; the rank's log keeps everything


class RankOutput:
    def __init__(self, max_shown: int = MAX_SHOWN):
        self.max_shown = max_shown
        self.reset()

    def reset(self) -> None:
        """Start a new call: nothing shown, every stream at the start of a line."""
        self.kept: dict[int, list[str]] = {}
        self.line_start: dict[tuple[int, str], bool] = {}
        self.shown: dict[int, int] = {}
        self.bars: Any = None  # the call's ProgressBars, from its first `progress`

    def finish(self) -> None:
        """The call ended: leave its bars' final state in the output."""
        if self.bars is not None:
            self.bars.finish()

    def of(self, rank: int) -> str:
        return "".join(self.kept.get(rank, []))

    def show(self, msg: dict[str, Any]) -> None:
        """Print one `stream` message from a rank, tagged, within the per-call cap (or draw
        a `progress` message's bar)."""
        if msg.get("type") == "progress":
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
        if self.bars is not None:
            self.bars.clear()  # a terminal's bars stay below the output
        out.write("".join(tagged))
        out.flush()
        if self.bars is not None:
            self.bars.redraw()
