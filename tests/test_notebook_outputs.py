"""A notebook run keeps every output of a cell, also those the client reads late
(`labkit check`, the notebook tests and the course site all run notebooks through
labkit.tools.cli.execute_notebook). Runs a real kernel; no ranks."""

from __future__ import annotations

import asyncio
import json

import nbformat
import pytest
from jupyter_client.channels import AsyncZMQSocketChannel

from labkit.tools import cli

pytestmark = pytest.mark.timeout(180)


def test_outputs_read_after_the_cells_reply_are_kept(tmp_path, monkeypatch):
    """On a loaded machine the client reads a cell's reply before the burst of widget messages
    that came ahead of it: notebook 12 lost three of its views in two whole runs, and five when
    run alone beside busy loops, and passed (nbclient waits 4 s for them by default, then drops
    them with a log line). Here the client takes 0.7 s over each of the cell's 8 displays."""
    get_msg = AsyncZMQSocketChannel.get_msg

    async def slow(self, *args, **kwargs):
        msg = await get_msg(self, *args, **kwargs)
        if msg["msg_type"] == "display_data":
            await asyncio.sleep(0.7)  # the reply, on its own channel, is read meanwhile
        return msg

    monkeypatch.setattr(AsyncZMQSocketChannel, "get_msg", slow)
    path = tmp_path / "late.ipynb"
    cells = ["for i in range(8):\n    display(i)", "'after'"]
    nbformat.write(
        nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells]), path
    )
    ok, seconds, error, _ = cli.execute_notebook(str(path), 120, str(tmp_path / "out"))
    assert ok, error
    saved = json.loads((tmp_path / "out" / "late.ipynb").read_text())
    texts = [
        "".join(o["data"]["text/plain"])
        for c in saved["cells"]
        for o in c["outputs"]
        if "data" in o
    ]
    assert texts == [str(i) for i in range(8)] + ["'after'"], texts
