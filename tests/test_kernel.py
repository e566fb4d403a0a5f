"""The magics through a real IPython kernel (jupyter_client), as a notebook drives them."""

from __future__ import annotations

import queue

import pytest

pytestmark = pytest.mark.timeout(180)


class Kernel:
    def __init__(self):
        from jupyter_client.manager import start_new_kernel

        self.km, self.kc = start_new_kernel(kernel_name="python3")

    def run(self, code: str, timeout: float = 60) -> dict:
        """Execute a cell; collect its streams, rich outputs, error and pager text (`x?`)."""
        msg_id = self.kc.execute(code)
        out = {"stdout": "", "stderr": "", "html": [], "text": [], "error": None, "page": ""}
        while True:
            try:
                msg = self.kc.get_iopub_msg(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no output for {timeout} s from: {code[:60]}") from None
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out[content["name"]] += content["text"]
            elif kind in ("display_data", "execute_result", "update_display_data"):
                out["html"].append(content["data"].get("text/html", ""))
                out["text"].append(content["data"].get("text/plain", ""))
            elif kind == "error":
                out["error"] = content
            elif kind == "status" and content["execution_state"] == "idle":
                break
        while True:  # help (`%lab?`) comes in the reply, as a payload for the pager
            reply = self.kc.get_shell_msg(timeout=timeout)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        if reply["content"]["status"] == "error" and out["error"] is None:
            out["error"] = reply["content"]  # a UsageError: on stderr, with no traceback
        for payload in reply["content"].get("payload", []):
            if payload.get("source") == "page":
                out["page"] += payload["data"].get("text/plain", "")
        return out

    def close(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    yield k
    k.close()


def test_magics_end_to_end(kernel):
    assert kernel.run("%load_ext labkit")["error"] is None
    started = kernel.run("%lab start 2 --device cpu")
    assert started["error"] is None, started
    assert "lab ready" in started["stdout"] and "gloo" in started["stdout"]
    assert kernel.run("print(type(lab).__name__)")["stdout"].strip() == "Lab"

    out = kernel.run("%%ranks\nx = torch.arange(3.) + rank\nprint('hello', rank)\nx")
    assert out["error"] is None, out
    assert "[rank 0] hello 0" in out["stdout"] and "[rank 1] hello 1" in out["stdout"]
    html = "".join(out["html"])
    assert "rank 1 · tensor 3 · float32 · cpu" in html and "tensor([1., 2., 3.])" in html

    sub = kernel.run("%%ranks 1\nrank * 7")
    assert "7" in "".join(sub["html"]) and "rank 0" not in "".join(sub["html"])

    quiet = kernel.run("%%ranks\ny = 1;")
    assert quiet["html"] == [] and quiet["error"] is None

    err = kernel.run("%%ranks\nif rank == 1:\n    {}['missing']\n")
    assert err["error"] is not None and err["error"]["ename"] == "RemoteError"
    tb = "\n".join(err["error"]["traceback"])
    assert "rank 1" in tb and "KeyError" in tb and "missing" in tb

    status = kernel.run("%lab status")
    assert "rank 1: pid" in "".join(status["text"])

    logs = kernel.run("%lab logs 1")
    assert "hello 1" in logs["stdout"]

    bad = kernel.run("%%ranks 0,5\n1")
    assert bad["error"]["ename"] == "UsageError" and "out of range" in bad["error"]["evalue"]
    bad = kernel.run("%lab start 2 --backend nccl")
    assert bad["error"] is not None and "one GPU per rank" in bad["error"]["evalue"]

    assert kernel.run("%lab restart")["error"] is None
    assert "NameError" in "\n".join(kernel.run("%%ranks\nx")["error"]["traceback"])
    assert kernel.run("%lab stop")["error"] is None
    assert "no lab is running" in kernel.run("%%ranks\n1")["error"]["evalue"]


def test_live_status_shows_for_slow_cells(kernel):
    kernel.run("%load_ext labkit")
    assert kernel.run("%lab start 2 --device cpu")["error"] is None
    slow = kernel.run("%%ranks\nimport time\ntime.sleep(2.0)")
    assert any("running for" in h and "rank 1" in h for h in slow["html"])
    fast = kernel.run("%%ranks\n1;")
    assert not any("running for" in h for h in fast["html"])
    kernel.run("%lab stop")
