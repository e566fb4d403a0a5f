"""Each rank's log file: where it lives and how a process's part of it begins (both sides).

A rank appends everything it prints to `log_path(log_dir, rank)` (the fork server adds what a
dying rank left unread); the kernel reads the file's tail for `%lab logs` and for the last
lines of a rank that died. A restarted rank appends to the same file, so each process starts
its part with a line that begins with `LOG_HEADER`.
"""

from __future__ import annotations

import os

LOG_HEADER = "----- labkit "  # starts the line a rank writes to its log when it starts


def log_path(log_dir: str, rank: int) -> str:
    """The log file of `rank` in a lab's log directory."""
    return os.path.join(log_dir, f"rank-{rank}.log")
