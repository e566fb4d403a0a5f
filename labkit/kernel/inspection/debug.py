"""pdb on a rank from the notebook: `lab.debug(rank)` and `breakpoint()` in a cell (kernel side).

The rank runs pdb (labkit.rank.debugger); the kernel is its terminal. Each time pdb wants a
line, the rank sends a `DebugPrompt` (pdb's output so far and its prompt); `DebugFrontend`
prints the output and reads a line with `input()`, which a notebook shows as an input box, and
sends it back as a `DebugInput`. The channel's waiting loop hands it every prompt that arrives
while a cell (or a `debug` request) runs, so the other ranks' output and the watchdog go on.

Where nobody can type (nbclient, CI: the kernel's input is not allowed; a script whose stdin is
not a terminal), the frontend sends no line and prints why: a breakpoint's session continues
the cell, a post-mortem ends. Stop at the input box ends the session: the cell (or the
`debug` request) stops with KeyboardInterrupt, as Stop does anywhere in a cell.
"""

from __future__ import annotations

import sys
from typing import Any

from labkit.kernel.results import LabError
from labkit.wire.messages import Debug, DebugInput

NO_INPUT = (NotImplementedError, EOFError, OSError)  # IPython's StdinNotImplementedError, ...


class DebugFrontend:
    """Answers the `DebugPrompt`s of one request: shows pdb's output, reads the user's line."""

    def __init__(self, channel: Any, post_mortem: bool = False):
        self.channel = channel
        self.post_mortem = post_mortem
        self.no_input: str | None = None  # why lines cannot be read here, once known

    def __call__(self, msg: dict[str, Any]) -> None:
        """The channel's `on_other`: a message that is not the reply its loop waits for."""
        if msg["type"] != "debug_prompt":
            return
        rank = msg["rank"]
        self.channel.drain_events()  # the rank's output printed before the prompt, first
        if msg["output"]:
            print(msg["output"], end="" if msg["output"].endswith("\n") else "\n", flush=True)
        line = None
        if self.no_input is None:
            try:
                line = input(f"rank {rank} {msg['prompt']}")
            except NO_INPUT as exc:
                self.no_input = f"{type(exc).__name__}: {exc}".rstrip(": ")
        if line is None:
            then = "ends the session" if self.post_mortem else "continues the cell"
            print(
                f"rank {rank} waits in pdb, but nothing can be typed here ({self.no_input}): "
                f"labkit {then}. Run the notebook in Jupyter to debug interactively.",
                file=sys.stderr,
                flush=True,
            )
        self.channel.send([rank], DebugInput(type="debug_input", id=msg["id"], line=line))


def post_mortem(lab: Any, rank: int) -> None:
    """Open pdb on the last exception a cell raised on `rank` (kernel side; pdb runs on the
    rank). Example: ``lab.debug(1)`` after a cell raised on rank 1 (as `%lab debug 1`).

    Commands are typed in the notebook's input box; pdb's answers show below the cell. The
    rank's real frames and variables are there (`p x`, `up`, `down`, `l`); `q` or `c` ends the
    session and returns the rank to serving cells. Raises LabError when the rank has raised
    nothing, ValueError for a rank the lab does not have, RemoteError (KeyboardInterrupt) when
    Stop ended the session.
    """
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise ValueError(f"debug() takes one rank number, such as 1; got {rank!r}")
    with lab._lock:
        lab._check_usable()
        if not 0 <= rank < lab.world_size:
            raise ValueError(
                f"rank {rank} out of range: this lab's ranks are 0-{lab.world_size - 1}"
            )
        res = lab._call(Debug(type="debug", id=0), [rank], None)
    res.raise_for_errors()
    if not res[rank].value:
        raise LabError(
            f"rank {rank} has no exception to debug: none of its cells raised since the ranks "
            "started. Run the failing cell again, then debug the rank that raised"
        )
