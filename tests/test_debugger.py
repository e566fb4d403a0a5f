"""pdb on a rank, typed in the notebook: `%lab debug RANK` after an error, and `breakpoint()` in a
`%%ranks` cell (2 CPU ranks, gloo), through a real IPython kernel (jupyter_client) whose input
requests the test answers as a notebook's input box would; idle and loaded.

A session's commands are answered one per input request, in order; `STOP` presses Stop (the
kernel's interrupt) at that prompt instead. The kernel runs with `allow_stdin=False` as nbclient
and CI do, for the case where nobody can type.
"""

from __future__ import annotations

import queue
import time

import pytest

pytestmark = pytest.mark.timeout(240)

STOP = object()  # press Stop at this prompt instead of answering


class Kernel:
    def __init__(self):
        from jupyter_client.manager import start_new_kernel

        self.km, self.kc = start_new_kernel(kernel_name="python3")

    def run(self, code, answers=(), allow_stdin=True, timeout=90.0, delay=0.0):
        """Execute a cell, answering its input requests with `answers` (after `delay` s each);
        its streams, rich outputs, error and the prompts it asked with."""
        msg_id = self.kc.execute(code, allow_stdin=allow_stdin)
        answers = list(answers)
        out = {"stdout": "", "stderr": "", "html": [], "error": None, "prompts": []}
        deadline = time.monotonic() + timeout
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cell did not finish in {timeout} s: {code[:60]}\n{out}")
            try:
                req = self.kc.get_stdin_msg(timeout=0.02)
                out["prompts"].append(req["content"]["prompt"])
                assert answers, f"an input request nobody expected: {out}"
                answer = answers.pop(0)
                time.sleep(delay)
                if answer is STOP:
                    self.km.interrupt_kernel()
                else:
                    self.kc.input(answer)
            except queue.Empty:
                pass
            try:
                msg = self.kc.get_iopub_msg(timeout=0.02)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out[content["name"]] += content["text"]
            elif kind in ("display_data", "update_display_data", "execute_result"):
                out["html"].append(content["data"].get("text/html", ""))
            elif kind == "error":
                out["error"] = content
            elif kind == "status" and content["execution_state"] == "idle":
                break
        while True:  # a UsageError comes in the reply only, without a traceback
            reply = self.kc.get_shell_msg(timeout=timeout)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        if reply["content"]["status"] == "error" and out["error"] is None:
            out["error"] = reply["content"]
        assert not answers, f"answers left over (the session ended early): {answers}\n{out}"
        return out

    def ok(self, code, **kw):
        out = self.run(code, **kw)
        assert out["error"] is None, out
        return out

    def close(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


@pytest.fixture(scope="module")
def kernel(load):  # conftest's `load`: every test runs on a quiet CPU, then on a saturated one
    k = Kernel()
    try:
        k.ok("%load_ext labkit")
        k.ok("%lab start 2 --device cpu")
        yield k
        k.run("%lab stop")
    finally:
        k.close()


def pids(kernel):
    return kernel.ok("print(sorted(lab.pids.values()))")["stdout"]


def values(kernel):
    """Every rank answers a cell: the lab is usable."""
    out = kernel.ok("%%ranks\nprint('value', rank * 3)")
    assert "[rank 0] value 0" in out["stdout"] and "[rank 1] value 3" in out["stdout"], out


def test_debug_says_what_is_wrong(kernel):
    kernel.ok("%lab restart")  # fresh ranks: none has raised, whatever earlier tests did
    out = kernel.run("%lab debug 0")
    assert out["error"]["ename"] == "LabError", out
    assert "rank 0 has no exception to debug" in out["error"]["evalue"]
    out = kernel.run("%lab debug 5")
    assert out["error"]["ename"] == "UsageError", out
    assert "rank 5 out of range: this lab's ranks are 0-1" in out["error"]["evalue"]
    assert "out of range" in kernel.run("lab.debug(-1)")["error"]["evalue"]


def test_post_mortem_shows_the_ranks_frames_and_returns_the_rank(kernel):
    before = pids(kernel)
    cell = "def f(v):\n    x = v * 2\n    return x / (rank - 1)\n\nw = 7 + rank\nf(w)\n"
    err = kernel.run("%%ranks\n" + cell)
    assert err["error"]["ename"] == "RemoteError" and "ZeroDivisionError" in err["error"]["evalue"]
    out = kernel.run("%lab debug 1", answers=["p x", "up", "p w", "p rank", "q"])
    assert out["error"] is None, out
    assert out["prompts"] == ["rank 1 (Pdb) "] * 5
    text = out["stdout"]
    assert "post-mortem of rank 1: ZeroDivisionError: division by zero" in text
    assert "-> return x / (rank - 1)" in text and "\n16\n" in text, text  # x = (7 + 1) * 2
    assert "-> f(w)" in text and "\n8\n" in text and "\n1\n" in text, text  # up: the cell
    assert "labkit" not in text.replace("labkit.", ""), text  # no frames of labkit's own
    values(kernel)
    out = kernel.run("lab.debug(1)", answers=["p w", STOP])  # Stop ends the session
    assert out["error"]["ename"] == "RemoteError", out
    assert "Stop was pressed while rank 1 was in the debugger" in out["error"]["evalue"], out
    values(kernel)
    assert pids(kernel) == before  # the same ranks: nothing was restarted


def test_breakpoint_on_one_rank_then_continue(kernel):
    """Rank 1 stops before an all_reduce that rank 0 waits in; the watchdog (which runs
    between prompts, answered late on purpose) must not call that stuck."""
    before = pids(kernel)
    cell = (
        "%%ranks\nx = torch.ones(2) * (rank + 1)\nif rank == 1:\n    breakpoint()\n"
        "    x = x * 10\ndist.all_reduce(x)\nx.tolist()"
    )
    out = kernel.run(cell, answers=["p x", "n", "p x", "c"], delay=1.5)
    assert out["error"] is None, out
    text = out["stdout"]
    assert "rank 1 is at breakpoint()" in text and "-> x = x * 10" in text
    assert "tensor([2., 2.])" in text and "tensor([20., 20.])" in text, text
    html = "".join(out["html"])
    assert "[21.0, 21.0]" in html and "rank 0" in html and "rank 1" in html, html
    assert "rank 1 at a breakpoint (pdb waits for you)" in html, html  # the live status
    assert "stuck" not in text + out["stderr"] + html
    out = kernel.run("%%ranks\nif rank == 1:\n    breakpoint()\nrank", answers=["q"])
    assert out["error"]["ename"] == "RemoteError", out
    assert "BdbQuit" in out["error"]["evalue"] and "q in pdb ended the cell on rank 1" in "\n".join(
        out["error"]["traceback"]
    )
    assert pids(kernel) == before
    values(kernel)


def test_stop_during_a_session_ends_it_and_the_cell(kernel):
    before = pids(kernel)
    cell = "%%ranks\nimport time\nif rank == 1:\n    breakpoint()\nelse:\n    time.sleep(600)\n"
    t0 = time.monotonic()
    out = kernel.run(cell, answers=["p rank", STOP])
    took = time.monotonic() - t0
    assert out["error"] is not None and out["error"]["ename"] == "RemoteError", out
    tb = out["error"]["evalue"] + "\n".join(out["error"]["traceback"])
    assert "rank 0" in tb and "rank 1" in tb and "KeyboardInterrupt" in tb, tb
    assert "was in the debugger" in tb, tb
    assert took < 60, took
    assert pids(kernel) == before  # Stop reached both ranks: nothing was restarted
    values(kernel)


def test_nobody_to_type_does_not_hang(kernel):
    cell = "%%ranks\nif rank == 1:\n    breakpoint()\nrank + 40"
    out = kernel.run(cell, allow_stdin=False, timeout=60)
    assert out["error"] is None, out
    assert "rank 1 waits in pdb, but nothing can be typed here" in out["stderr"], out
    assert "labkit continues the cell" in out["stderr"]
    html = "".join(out["html"])
    assert "40" in html and "41" in html, html
    kernel.run("%%ranks\n1 / (rank - 1)")
    out = kernel.run("%lab debug 1", allow_stdin=False, timeout=60)
    assert out["error"] is None, out
    assert "post-mortem of rank 1" in out["stdout"] and "ends the session" in out["stderr"]
    values(kernel)
