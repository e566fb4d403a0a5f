"""A rank's last output survives its death: what it wrote before a SIGKILL is in its log.

The rank's side is the real one (labkit.rank.capture, on the fork server's `output_pipe`s, with
a copy of the read ends kept here); the fork server's side is its own function,
`drain_into_log`, run here after the child died. The child writes a line without a newline
(held back from the notebook for a quiet period, the case that used to be lost) and a whole
line on stderr, says it is done, and is killed at once or after a short random delay, so the
kill lands anywhere in the reader thread's work.
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import textwrap

import pytest

from labkit.rank.fork_server import drain_into_log, output_pipe

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("load")]

CHILD = textwrap.dedent(
    """
    import os, sys, time
    from labkit.rank.capture import Capture
    r1, r2, ready = (int(a) for a in sys.argv[1:4])
    Capture(lambda name, text: None, sys.argv[4], (r1, r2), "test")
    sys.stdout.write("partial-no-newline-" + sys.argv[5])
    sys.stdout.flush()
    sys.stderr.write("stderr-line-" + sys.argv[5] + "\\n")
    sys.stderr.flush()
    os.write(ready, b"x")
    time.sleep(60)
    """
)


def _write_then_die(log: str, i: int, delay: float) -> str:
    out_r, out_w = output_pipe()
    err_r, err_w = output_pipe()
    ready_r, ready_w = os.pipe()
    for fd in (out_r, err_r):
        os.set_blocking(fd, False)  # as the fork server's copies are
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(out_r), str(err_r), str(ready_w), log, str(i)],
        stdout=out_w,
        stderr=err_w,
        pass_fds=(out_r, err_r, ready_w),
    )
    for fd in (out_w, err_w, ready_w):
        os.close(fd)
    try:
        ready, _, _ = select.select([ready_r], [], [], 60)
        assert ready, "the child never said it had written"
        if delay:
            select.select([], [], [], delay)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
        os.close(ready_r)
    drain_into_log([out_r, err_r], log)
    with open(log, "rb") as f:
        return f.read().decode()


def test_output_written_before_sigkill_is_in_the_log_every_time(tmp_path):
    rng = random.Random(0)
    lost = []
    for i in range(50):
        log = str(tmp_path / f"rank-{i}.log")
        delay = 0.0 if i % 2 == 0 else rng.uniform(0, 0.06)  # around the 50 ms quiet period
        text = _write_then_die(log, i, delay)
        if f"partial-no-newline-{i}" not in text or f"stderr-line-{i}" not in text:
            lost.append((i, delay, text))
    assert not lost, f"{len(lost)} of 50 lost output; first: {lost[0]}"
