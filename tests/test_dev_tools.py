"""The developers' tools in scripts/ that tests do not otherwise run."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(180)
def test_cell_timers_time_every_piece_of_a_cell():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "cell_timers.py"), "--ranks", "2"]
        + ["--cells", "5"],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    (warm,) = re.findall(r"^warm: +(.*)$", out.stdout, re.M)
    pieces = {name: float(us) for name, us in re.findall(r"(\w+) ([\d.]+)(?:, |$)", warm)}
    assert list(pieces) == ["decode", "encode", "stop", "output"], warm
    # each timed alone, warm: a syscall or a keyed hash at least (an empty call takes well under
    # 0.3 us), but the Stop check, a load from the lab's Stop board; all far under a
    # millisecond (a timer around the whole loop would show here)
    assert all(0.3 < us < 1000 for name, us in pieces.items() if name != "stop"), warm
    assert 0 < pieces["stop"] < 1000, warm
    kernel = re.findall(r"^kernel: (.*)$", out.stdout, re.M)
    rank = re.findall(r"^rank: +(.*)$", out.stdout, re.M)
    assert len(kernel) == len(rank) == 2  # after quiet, back to back
    for k_line, r_line in zip(kernel, rank):
        k = {name: int(us) for name, us in re.findall(r"([\w. ]+?) (\d+)(?:, |$)", k_line)}
        r = {name: int(us) for name, us in re.findall(r"([\w. ]+?) (\d+)(?:, |$)", r_line)}
        assert list(k) == [
            "first request out",
            "last request out",
            "first reply in",
            "last reply in",
            "lab.run",
        ]
        assert k["first request out"] <= k["last request out"] <= k["last reply in"] <= k["lab.run"]
        assert len(r) == 8 and r["decode"] > 0 and r["send"] > 0
        # the rank's whole turn lies inside the kernel's call, and holds its pieces
        assert r["request read to reply sent"] < k["lab.run"]
        assert r["request read to reply sent"] >= r["encode"] + r["send"]


@pytest.mark.timeout(120)
def test_wake_probe_times_both_ways_of_waking():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "wake_probe.py")]
        + ["--procs", "2", "--cells", "5", "--rounds", "2"],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = re.findall(
        r"^a socket write each (\d+) us, one eventfd write (\d+) us$", out.stdout, re.M
    )
    assert len(rows) == 2, out.stdout
    # a round trip to a process woken after 20 ms of quiet: more than the 20 ms sleep is not it
    # (the timer starts after the sleep), and a wake-up takes some microseconds at least
    assert all(1 <= int(us) < 20_000 for row in rows for us in row), rows


@pytest.mark.timeout(120)
def test_gpu_notebooks_refuses_a_machine_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the script would run the notebook")
    log = tmp_path / "errors.txt"
    nb = os.path.join(ROOT, "notebooks", "00_start.ipynb")
    script = os.path.join(ROOT, "scripts", "gpu_notebooks.py")
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, script, str(log), nb], capture_output=True, text=True, env=env, timeout=100
    )
    # the same refusal as `labkit check --device cuda`, before any kernel starts
    assert proc.returncode == 2, proc
    assert "--device cuda: torch" in proc.stdout and "sees no GPU" in proc.stdout, proc.stdout
    assert not log.exists()
