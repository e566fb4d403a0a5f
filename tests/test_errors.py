"""labkit's errors read like a lab's: what happened, to which rank, and what to do, without
labkit's own frames or the internal exceptions they were raised from (kernel side)."""

from __future__ import annotations

import glob
import json
import os
import re

import pytest
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output
from test_kernel import Kernel

from labkit.kernel.results import LabError, RemoteError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ANSI = re.compile(r"\x1b\[[0-9;]*m")

pytestmark = pytest.mark.timeout(180)


def plain(lines: list[str]) -> str:
    return ANSI.sub("", "\n".join(lines))


def two_ranks_failed() -> RemoteError:
    tb = 'Traceback (most recent call last):\n  File "<cell-3>", line 2, in <module>\n'
    errors = {
        1: {"type": "ValueError", "message": "bad batch", "time": 1.0},
        3: {"type": "RuntimeError", "message": "Connection closed by peer\nmore", "time": 2.0},
    }
    errors[1]["traceback"] = tb + "    raise ValueError('bad batch')\nValueError: bad batch\n"
    errors[3]["traceback"] = tb + "    dist.all_reduce(x)\nRuntimeError: Connection closed\n"
    return RemoteError(errors, "labkit restarted the ranks: variables on the ranks were lost.")


def test_a_rank_error_reads_well_as_a_string() -> None:
    text = str(two_ranks_failed())  # what print(err) and a plain Python traceback show
    assert text.splitlines() == [
        "rank 1 raised ValueError: bad batch (root cause; also failed: rank 3)",
        "--- rank 1 (root cause) ---",
        "Traceback (most recent call last):",
        '  File "<cell-3>", line 2, in <module>',
        "    raise ValueError('bad batch')",
        "ValueError: bad batch",
        "rank 3 also raised RuntimeError: Connection closed by peer",
        "labkit restarted the ranks: variables on the ranks were lost.",
    ]


def test_a_rank_error_and_a_diagnosis_render_alike() -> None:
    remote = plain(two_ranks_failed()._render_traceback_())
    assert remote.startswith("RemoteError: rank 1 raised ValueError: bad batch (root cause;")
    assert "--- rank 3 ---" in remote and "dist.all_reduce(x)" in remote  # every rank in IPython
    assert remote.endswith("variables on the ranks were lost.")
    lab = plain(LabError("rank 0 waits in all_reduce #1\nlabkit restarted")._render_traceback_())
    assert lab == "LabError: rank 0 waits in all_reduce #1\nlabkit restarted"


def test_ipython_shows_no_internal_frames_or_chained_stuck() -> None:
    shell = InteractiveShell.instance()
    cell = (
        "from labkit.kernel.channel.channel import Stuck\n"
        "from labkit.kernel import lab as lab_module\n"
        "def diagnose():\n"
        "    try:\n"
        "        raise Stuck('internal: no reply in time')\n"
        "    except Stuck:\n"
        "        lab_module.current()  # no lab: a LabError from labkit's own frames\n"
        "diagnose()\n"
    )
    with capture_output() as shown:
        shell.run_cell(cell)
    text = ANSI.sub("", shown.stdout + shown.stderr)
    assert "LabError: no lab is running: start one with labkit.Lab(n)" in text, text
    for leak in ("labkit/kernel", "During handling", "Stuck", "Traceback"):
        assert leak not in text, (leak, text)


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    assert k.run("%load_ext labkit")["error"] is None
    assert k.run("%lab start 2 --device cpu")["error"] is None
    yield k
    k.run("%lab stop")
    k.close()


def test_a_watchdog_diagnosis_in_a_notebook_is_short(kernel) -> None:
    out = kernel.run("%%ranks 0\nx = torch.ones(1)\ndist.all_reduce(x)", timeout=120)
    error = out["error"]
    assert error["ename"] == "LabError"
    text = ANSI.sub("", "\n".join(error["traceback"]))
    assert text.startswith("LabError: rank 0 waits in all_reduce #1"), text
    assert "can never complete: rank 1 is not running this cell" in text
    assert "variables on the ranks were lost" in text
    assert "labkit/kernel" not in text and "During handling" not in text
    head, stacks = text.split("Python stacks of the ranks that had not finished", 1)
    assert len(head.splitlines()) <= 4, text
    # then rank 0's stack, short: the frames from torch's all_reduce to the cell's line
    assert "--- rank 0 ---" in stacks and "dist.all_reduce(x)" in stacks, text
    # and the Flight Recorder's last entries: the all_reduce rank 0 entered, not completed
    assert "#1 all_reduce on default_pg: scheduled" in stacks, text
    assert len(stacks.splitlines()) <= 12, text


def test_a_rank_error_in_a_notebook_shows_the_users_frames_only(kernel) -> None:
    out = kernel.run("%%ranks\nif rank == 1:\n    raise ValueError('bad batch')\nrank")
    text = ANSI.sub("", "\n".join(out["error"]["traceback"]))
    assert text.startswith("RemoteError: rank 1 raised ValueError: bad batch"), text
    assert "--- rank 1 ---" in text and "raise ValueError('bad batch')" in text
    assert "labkit/" not in text and "run_cell_magic" not in text
    assert "rank 0: 0" in out["text"]  # the rank that finished still shows its value


def test_no_notebook_cell_stops_run_all() -> None:
    """Run All (JupyterLab, VS Code) stops at the first error, whatever a cell's tags say: a
    cell that shows a failure catches it and shows it itself."""
    for path in sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb"))):
        with open(path) as f:
            cells = json.load(f)["cells"]
        for i, cell in enumerate(cells):
            tags = cell.get("metadata", {}).get("tags", [])
            assert "raises-exception" not in tags, f"{os.path.basename(path)} cell {i}"
