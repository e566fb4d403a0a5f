"""tqdm bars on the ranks: reported, throttled, drawn one per rank (rank side in a fresh
interpreter, then 2 CPU ranks with gloo, in-process and through a real IPython kernel)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import labkit
from labkit.views.progress_view import MAX_ROWS, ProgressBars, line

pytestmark = pytest.mark.timeout(180)

LOOP = "import time\nfrom tqdm import tqdm\nfor i in tqdm(range(50)):\n    time.sleep(0.01)\n"


def _rank_side(code: str, before: str = "") -> dict:
    """Run `code` after `progress.install` in a fresh interpreter that imported torch first (as
    a rank does: torch imports tqdm), `before` before it; returns the messages sent, the stderr
    and `result`."""
    script = (
        f"import json, sys\n{before}\nimport torch\n"
        "from labkit.rank import progress\n"
        "sent = []\n"
        "progress.install(sent.append, lambda: 7)\n"
        "result = None\n"
        f"{code}\n"
        "print(json.dumps({'sent': sent, 'result': result}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    out["stderr"] = done.stderr
    return out


def test_every_way_of_making_a_bar_reports_and_draws_nothing():
    out = _rank_side(
        "import tqdm, tqdm.auto, tqdm.notebook\n"
        "from tqdm import trange\n"
        "from tqdm import tqdm as plain\n"
        "for make in (plain, tqdm.tqdm, tqdm.auto.tqdm, tqdm.notebook.tqdm):\n"
        "    for i in make(range(3), desc=make.__module__): pass\n"
        "for i in trange(4): pass\n"
        "for i in tqdm.auto.trange(5): pass\n"
        "with plain(total=6, unit='B') as bar:\n"
        "    bar.update(6); bar.set_postfix(loss=0.5)\n"
        "for i in plain(range(9), disable=True): pass\n"
    )
    final = [m for m in out["sent"] if m["closed"]]
    assert [m["n"] for m in final] == [3, 3, 3, 3, 4, 5, 6]  # a disabled bar says nothing
    assert all(m["n"] == m["total"] and m["cell"] == 7 for m in final)
    assert len({m["bar"] for m in final}) == 7  # one id per bar
    assert final[-1]["unit"] == "B" and "loss=0.5" in final[-1]["postfix"]
    assert final[0]["desc"] == "tqdm.std"
    assert "\r" not in out["stderr"] and "%|" not in out["stderr"]


def test_a_bar_reports_at_most_every_tenth_of_a_second_and_always_its_final_state():
    out = _rank_side(
        "import time\n"
        "from tqdm import tqdm\n"
        "t0 = time.monotonic()\n"
        "for i in tqdm(range(400), mininterval=0, miniters=1):\n"
        "    time.sleep(0.001)\n"
        "result = time.monotonic() - t0\n"
    )
    sent, elapsed = out["sent"], out["result"]
    assert sent[-1]["closed"] and sent[-1]["n"] == 400 and sent[-1]["total"] == 400
    assert not any(m["closed"] for m in sent[:-1])
    assert sent[0]["n"] == 0  # the bar shows as soon as it is made
    # tqdm would redraw 400 times here; one report per 0.1 s, plus the first and the final one
    assert 2 <= len(sent) <= elapsed / 0.1 + 2, (len(sent), elapsed)
    assert [m["n"] for m in sent] == sorted(m["n"] for m in sent)


def test_the_rank_side_works_without_tqdm():
    out = _rank_side(  # tqdm cannot be imported, by torch or by the user
        "try:\n    import tqdm\nexcept ImportError:\n    result = 'no tqdm'\n",
        before="sys.modules.update(dict.fromkeys(['tqdm', 'tqdm.std', 'tqdm.notebook']))",
    )
    assert out["result"] == "no tqdm" and out["sent"] == [] and out["stderr"] == ""


def _state(rank, bar, n, total=50, closed=False, leave=True):
    return dict(
        type="progress", rank=rank, bar=bar, cell=1, n=n, total=total, desc="", unit="it",
        unit_scale=False, rate=20.0, elapsed=n / 20, postfix="", leave=leave, closed=closed,
    )  # fmt: skip


def test_the_text_form_is_one_line_per_bar_and_drops_closed_bars_that_do_not_stay():
    bars = ProgressBars(mode="print")
    for n in (0, 10, 50):
        bars.update(_state(1, 1, n, closed=n == 50))
        bars.update(_state(0, 4, n))
    bars.update(_state(0, 5, 3, total=3, closed=True, leave=False))  # an inner bar: gone
    lines = bars.text().splitlines()
    assert len(lines) == 2 and lines[0].startswith("rank 0 ") and lines[1].startswith("rank 1 ")
    assert "50/50" in lines[0] and "100%" in lines[1] and "\r" not in bars.text()
    assert lines[0] == line(0, bars.bars[(0, 4)])
    for b in range(10, 10 + 2 * MAX_ROWS):  # many bars: each rank keeps its newest MAX_ROWS
        bars.update(_state(2, b, 1, total=1, closed=True))
    assert sum(1 for r, _ in bars.bars if r == 2) == MAX_ROWS


@pytest.fixture(scope="module")
def lab():
    lab = labkit.Lab(2, device="cpu")
    yield lab
    lab.stop()


def test_a_cell_with_tqdm_on_two_ranks_ends_with_each_ranks_bar_at_50_of_50(lab, capsys):
    results = lab.run(LOOP + "print('after', rank)")
    assert all(r.error is None for r in results.values())
    for r, res in results.items():
        assert res.output == f"after {r}\n"  # tqdm's own redraws never reached the output
    bars = lab.channel.output.bars
    final = {r: s for (r, _), s in bars.bars.items()}
    assert sorted(final) == [0, 1]
    assert all(s["n"] == s["total"] == 50 and s["closed"] for s in final.values())
    shown = capsys.readouterr().out
    assert "\r" not in shown
    drawn = [x for x in shown.splitlines() if "50/50" in x]  # outside a kernel: the final lines
    assert [x.split()[:2] for x in drawn] == [["rank", "0"], ["rank", "1"]]
    again = lab.run("x = 1")  # a call without bars draws none
    assert lab.channel.output.bars is None and again[0].error is None


def test_a_kernel_shows_one_widget_row_per_rank_and_the_final_lines_as_text():
    from test_kernel import Kernel

    kernel = Kernel()
    try:
        assert kernel.run("%load_ext labkit")["error"] is None
        assert kernel.run("%lab start 2 --device cpu")["error"] is None
        out, comms = _run_with_comms(kernel, "%%ranks\n" + LOOP)
        assert out["error"] is None, out
        assert "\r" not in out["stdout"] + out["stderr"] and "%|" not in out["stderr"]
        final = out["text"][-1].splitlines()  # the widget's text form, set when the cell ended
        assert [x.split()[:2] for x in final] == [["rank", "0"], ["rank", "1"]]
        assert all("50/50" in x and "100%" in x for x in final)
        bars = [s for s in comms.values() if s.get("_model_name") == "FloatProgressModel"]
        assert len(bars) == 2 and all(b["value"] == b["max"] == 50 for b in bars)
        labels = sorted(s["value"] for s in comms.values() if s.get("_model_name") == "LabelModel")
        assert "rank 0" in labels and "rank 1" in labels
    finally:
        kernel.run("%lab stop")
        kernel.close()


def _run_with_comms(kernel, code):
    """Run `code` as `Kernel.run` does, also folding every widget's state from its comm
    messages ({comm_id: state})."""
    import queue

    msg_id = kernel.kc.execute(code)
    out = {"stdout": "", "stderr": "", "text": [], "error": None}
    comms: dict[str, dict] = {}
    while True:
        try:
            msg = kernel.kc.get_iopub_msg(timeout=60)
        except queue.Empty:
            raise TimeoutError(f"no output for 60 s from: {code[:60]}") from None
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            out[content["name"]] += content["text"]
        elif kind in ("display_data", "update_display_data", "execute_result"):
            out["text"].append(content["data"].get("text/plain", ""))
        elif kind in ("comm_open", "comm_msg"):
            state = content["data"].get("state", {})
            comms.setdefault(content["comm_id"], {}).update(state)
        elif kind == "error":
            out["error"] = content
        elif kind == "status" and content["execution_state"] == "idle":
            return out, comms
