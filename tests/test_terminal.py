"""labkit in terminal IPython: the magics, a collective, the ranks' stacks and every view read
as plain text (2 CPU ranks, gloo).

`ipython` runs as a subprocess and reads its cells from stdin, as a user typing them would (a
blank line ends a `%%ranks` cell). What it prints must read well in a terminal: no widget
repr (`VBox(children=...)`), no `<IPython.core.display... object>`, no HTML, no escape codes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CELLS = [
    "%load_ext labkit",
    "%lab start 2 --device cpu",
    "%%ranks\n"
    "torch.manual_seed(0)\n"
    "model = nn.Linear(4, 2)\n"
    "x = (torch.arange(6.).reshape(2, 3) + 10 * rank)\n"
    "dist.all_reduce(x)\n"
    "print('sum', x.sum().item())\n"
    "x\n",
    "%lab status",
    "%lab stacks",
    "import labkit",
    "labkit.show_tensors(lab, 'x')",
    "labkit.show_timeline(lab)",
    "labkit.show_breakdown(lab)",
    "labkit.show_comm(lab)",
    "labkit.show_placement(lab, 'model')",
    "labkit.show_timeline(lab).static()",
    "from labkit.views.schedule_view import ideal_events, schedule_figure",
    "schedule_figure(ideal_events([(0, 0, 'F', 0), (1, 0, 'F', 1)]), 'GPipe', unit='step')",
    "lab.pull('x')",
    "%%ranks 1\nrank * 100\n",
    "%%ranks\nif rank == 1:\n    raise ValueError('bad batch on rank 1')\n",
    "%%ranks\nif rank == 0:\n    dist.all_reduce(torch.ones(1))  # rank 1 never joins\n",
    "%lab stop",
    "print('END OF SCRIPT')",
]


@pytest.mark.timeout(180)
def test_terminal_ipython_shows_readable_text(tmp_path) -> None:
    ipython = os.path.join(os.path.dirname(sys.executable), "ipython")
    if not os.path.exists(ipython):
        pytest.skip(f"{ipython} is missing (the lab extra installs IPython)")
    script = "\n\n".join(c.rstrip("\n") + "\n" for c in CELLS) + "\nexit\n"
    env = dict(
        os.environ,
        IPYTHONDIR=str(tmp_path / "ipython"),  # no user profile, no startup files
        PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
        TERM="xterm-256color",  # a real terminal's: labkit must not colour text on its own
    )
    proc = subprocess.run(
        [ipython, "--no-banner", "--colors=NoColor", "--no-confirm-exit"],
        input=script,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=150,
    )
    out = proc.stdout + proc.stderr
    assert "END OF SCRIPT" in out, out  # every cell ran, in order
    # the collective ran on both ranks: (0+...+5) + (10+...+15) = 90
    assert "[rank 0] sum 90.0" in out and "[rank 1] sum 90.0" in out, out
    assert re.search(r"rank 0: pid \d+ cpu .*alive", out), out  # %lab status
    assert out.count("--- rank 0") >= 1 and "--- rank 1" in out, out  # %lab stacks
    assert "idle" in out, out
    assert "rank 1: 100" in out, out  # %%ranks 1 shows its value per rank
    assert "ValueError" in out and "bad batch on rank 1" in out and "rank 1" in out, out
    assert "can never complete" in out and "<module> (<cell-" in out, out  # stuck, with stacks
    # the views as text: their tables, one line per row
    assert re.search(r"rank 0 .*float32", out), out  # show_tensors: each rank's tensor
    assert "time per rank" in out and "all_reduce" in out, out  # show_timeline
    assert re.search(r"rank +compute +comm +overlapped", out), out  # show_breakdown's table
    assert "straggler: " in out, out
    assert "bytes sent" in out and "from \\ to" in out, out  # show_comm
    assert "weight" in out and "bias" in out, out  # show_placement
    # a bare plotly figure (the pipeline schedules): words, not a browser window
    assert "GPipe (plotly; it draws in a notebook)\n  bar forward: 2 points" in out, out
    for bad in ("VBox(", "HBox(", "children=", "<IPython.", "Output(", "FigureWidget"):
        assert bad not in out, f"{bad!r} in the terminal's output:\n{out}"
    assert not re.search(r"</?(div|table|tr|td|b|style|span|pre)\b", out), out  # no HTML
    assert "\x1b" not in out, out  # no escape codes
    assert proc.returncode == 0, out
