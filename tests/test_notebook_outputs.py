"""A notebook run keeps every output of a cell, also those the client reads late
(`labkit check`, the notebook tests and the course site all run notebooks through
labkit.tools.cli.execute_notebook). Runs a real kernel; no ranks."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile

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


@pytest.mark.parametrize("long_tmp", [False, True], ids=["tmp", "long tmp"])
def test_kernels_talk_over_unix_sockets_in_a_folder_removed_afterwards(tmp_path, long_tmp):
    """Over TCP, each kernel binds five ports its manager found free a moment before, so two
    kernels started together can take each other's (a GPU check running 8 notebooks at a time
    lost notebook 31 to it). The kernel's own connection info says ipc, in a folder of the
    run's own that is gone once the notebook has run. A temporary directory too long for a
    Unix socket's path (about 107 bytes) is passed over for /tmp."""
    long_dir = tmp_path / ("d" * 80)
    long_dir.mkdir()
    path = tmp_path / "where.ipynb"
    cell = (
        "import json, os\n"
        "from ipykernel.connect import get_connection_info\n"
        "info = get_connection_info(unpack=True)\n"
        "files = sorted(os.listdir(os.path.dirname(info['ip'])))\n"
        "print(json.dumps([info['transport'], info['ip'], files]))"
    )
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)]), path)
    with pytest.MonkeyPatch.context() as mp:
        if long_tmp:
            mp.setattr(tempfile, "tempdir", str(long_dir))
        expected = "/tmp" if long_tmp else tempfile.gettempdir()
        ok, _, error, _ = cli.execute_notebook(str(path), 120, str(tmp_path / "out"))
    assert ok, error
    saved = json.loads((tmp_path / "out" / "where.ipynb").read_text())
    transport, ip, files = json.loads("".join(saved["cells"][0]["outputs"][0]["text"]))
    assert transport == "ipc", (transport, ip)
    folder = os.path.dirname(ip)
    assert os.path.dirname(folder) == expected and "kernel.json" in files, (ip, files)
    assert not os.path.exists(folder), os.listdir(folder)
