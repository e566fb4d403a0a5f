"""What a `%%ranks` cell leaves as text (terminal IPython, nbconvert, screen readers), and that
the live status leaves nothing stale in a saved notebook (kernel side; one run needs ranks)."""

from __future__ import annotations

import json

import pytest
from IPython.core.formatters import DisplayFormatter

from labkit.kernel.results import RankResult, RankValues, Results


def tensor_result(rank: int, text: str) -> RankResult:
    info = {"text": text, "tensor": {"shape": [2], "dtype": "torch.float32", "device": "cpu"}}
    return RankResult(rank, display=info)


def test_rank_values_carry_text_beside_html() -> None:
    values = RankValues(
        {
            0: tensor_result(0, "tensor([1., 2.])"),
            1: tensor_result(1, "tensor([[1., 2.],\n        [3., 4.]])"),
            2: RankResult(2),  # no value to show
            3: RankResult(3, error={"type": "ValueError", "message": "bad <input>"}),
        }
    )
    data, _ = DisplayFormatter().format(values)
    assert data["text/plain"] == (
        "rank 0: tensor([1., 2.])\n"
        "rank 1: tensor([[1., 2.],\n"
        "                [3., 4.]])\n"  # a multi-line value stays aligned under its first line
        "rank 3: ValueError: bad <input>"
    )
    assert "rank 0 · tensor 2 · float32 · cpu" in data["text/html"]
    assert "bad &lt;input&gt;" in data["text/html"]
    assert not RankValues({0: RankResult(0)})  # nothing to show: the magic shows nothing


def test_results_read_as_text_too() -> None:
    res = Results({0: RankResult(0, value=3), 1: RankResult(1, value_error="not picklable")})
    res[1].display = {"text": "<lock>"}
    assert repr(res) == "rank 0: 3\nrank 1: <lock>\n        (not picklable)"


@pytest.mark.timeout(300)
def test_a_saved_notebook_keeps_values_as_text_and_no_live_status(tmp_path) -> None:
    import nbformat
    from nbclient import NotebookClient

    cells = [
        "import labkit\nlab = labkit.Lab(2, device='cpu')\n%load_ext labkit",
        "%%ranks\nimport time\ntime.sleep(2.0)  # long enough for the live status\n"
        "torch.tensor([1., 2.]) * rank",
        "lab.stop()",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, timeout=240, kernel_name="python3").execute()
    saved = json.loads(nbformat.writes(nb))
    outputs = saved["cells"][1]["outputs"]
    assert "running for" not in json.dumps(saved)  # the live status was there, and is gone
    assert {"output_type": "display_data", "data": {}, "metadata": {}} in outputs
    plain = [
        "".join(o["data"]["text/plain"]) for o in outputs if o.get("data", {}).get("text/plain")
    ]
    assert plain == ["rank 0: tensor([0., 0.])\nrank 1: tensor([1., 2.])"]
