"""Reading the end of a rank's log file (kernel side).

Every rank appends all it prints to its log file (`labkit.wire.logfile`), and a restarted rank
appends to the same file after a `LOG_HEADER` line. Two readers share `read_tail`: `%lab logs`
shows the end of the whole file, earlier processes included, and the report of a rank that died
shows what its latest process printed last, without the frames of labkit's own code.
"""

from __future__ import annotations

import os
import re

from labkit.wire.logfile import LOG_HEADER, log_path

TAIL_BYTES = 8 << 20  # a rank that floods its output leaves a huge log: read only its end

# lines of a crash report that say nothing to a learner (labkit's and Python's own frames)
LABKIT_RANK_FILES = r"worker|fork_server|user_code|process_group|script|torchrun_entry"
NOISE = re.compile(
    rf"labkit[/\\]rank[/\\]({LABKIT_RANK_FILES})\.py|<frozen runpy>|^Extension modules:"
)


def read_tail(
    log_dir: str,
    rank: int,
    lines: int,
    *,
    every_process: bool = False,
    drop_noise: bool = False,
    max_bytes: int = TAIL_BYTES,
) -> str:
    """The last `lines` lines of `rank`'s log, without trailing blank space (kernel side).

    By default only what the rank's latest process wrote (after its `LOG_HEADER` line); with
    `every_process`, the end of the whole file, header lines of earlier processes included.
    `drop_noise` leaves out lines of labkit's own frames (`NOISE`). Reads at most the last
    `max_bytes` of the file. "" when the rank has no log yet or it cannot be read.
    """
    path = log_path(log_dir, rank)
    try:
        with open(path, "rb") as f:
            start = max(0, os.fstat(f.fileno()).st_size - max_bytes)
            f.seek(max(0, start - 1))  # one byte early, to see whether `start` begins a line
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    if start > 0:  # drop the (part of a) line before the first line break
        text = text[text.find("\n") + 1 :] if "\n" in text else ""
    if not every_process:  # keep what follows the latest header line, if it was read
        at = text.rfind("\n" + LOG_HEADER) + 1
        if at > 0 or text.startswith(LOG_HEADER):
            end = text.find("\n", at)
            text = text[end + 1 :] if end >= 0 else ""
    kept = text.splitlines(True)
    if drop_noise:
        kept = [line for line in kept if not NOISE.search(line)]
    while kept and not kept[-1].strip():  # trailing blank lines are not among the last lines
        kept.pop()
    return "".join(kept[-lines:] if lines > 0 else []).rstrip()
