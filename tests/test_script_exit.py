"""`exit_with(main)`: a torchrun script's exit without interpreter shutdown (runs the scripts as
plain processes; on a lab the rank goes on: tests/test_torchrun_code.py runs
examples/ddp_digits.py there)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

HEAD = """\
import atexit, sys
from labkit.parallel.script_exit import exit_with

atexit.register(lambda: print("the interpreter shut down", flush=True))
print("out before the end")  # a pipe is block-buffered: exit_with must flush it
"""


def run(body: str) -> subprocess.CompletedProcess:
    source = HEAD + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", source], capture_output=True, text=True, timeout=90
    )


@pytest.mark.parametrize(
    "body,status,stderr",
    [
        ("def main():\n    return 0\n", 0, ""),
        ("def main():\n    pass\n", 0, ""),
        ("def main():\n    return 3\n", 3, ""),
        ("def main():\n    sys.exit(2)\n", 2, ""),
        ("def main():\n    sys.exit('bad input')\n", 1, "bad input\n"),
        ("def main():\n    raise ValueError('boom')\n", 1, "ValueError: boom\n"),
    ],
)
def test_exit_with_ends_with_mains_status_without_interpreter_shutdown(body, status, stderr):
    proc = run(body + "exit_with(main)\n")
    assert proc.returncode == status, proc.stderr
    assert proc.stdout == "out before the end\n", "not flushed, or atexit handlers ran"
    assert proc.stderr.endswith(stderr)
    if "raise" in body:
        assert proc.stderr.startswith("Traceback (most recent call last):")


def test_on_a_labs_rank_it_raises_system_exit_instead():
    # a lab's rank has labkit.rank.worker loaded; the script's exit is then the rank's to take
    proc = run(
        "import labkit.rank.worker\n"
        "def main():\n    return 4\n"
        "try:\n    exit_with(main)\n"
        "except SystemExit as exc:\n    print('SystemExit', exc.code)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "out before the end\nSystemExit 4\nthe interpreter shut down\n"
