"""The scenes that tests/test_browser.py runs in JupyterLab and screenshots for the README.

A scene is a few notebook cells and the output to capture. The test runs every scene's cells
in one notebook (after SETUP, in order) and checks that each captured output has drawn (its
`plots` plotly figures, each with its data) and says what it should (`expect`). When
LABKIT_SCREENSHOTS names a folder, it saves each output there as `<name>.png`:

    LABKIT_SCREENSHOTS=docs/screenshots pytest tests/test_browser.py -k scenes

Without the variable nothing is written, so CI never rewrites tracked files.

To show a new feature in the README: append a Scene (a scene whose last cell raises goes at the
end, after every scene that does not, and sets `raises`), run the command above, commit the PNG
(keep it under 150 KB) and link it from the README.
"""

from __future__ import annotations

from dataclasses import dataclass

SETUP = (
    "import torch\n\nimport labkit\n\nlab = labkit.Lab(2)",
    "%load_ext labkit",
)


@dataclass(frozen=True)
class Scene:
    name: str  # the screenshot's file name, without .png
    cells: tuple[str, ...]  # code cells run in order; the last one's output is captured
    expect: str = ""  # text the captured output shows once it is drawn
    plots: int = 0  # plotly figures in the captured output: each must have drawn its data
    whole_cell: bool = False  # capture the last cell's input with its output
    raises: bool = False  # the last cell ends in an error (tagged raises-exception)
    answers: tuple[str, ...] = ()  # typed, in order, into the input boxes the last cell opens


WORK = """%%ranks
import labkit

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).to(device)
for step in range(3):
    with labkit.span("forward"):
        loss = model(torch.randn(256, 64, device=device)).pow(2).mean()
    with labkit.span("backward"):
        loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
x = (torch.arange(12.0).reshape(3, 4) + 12 * rank).to(device)  # each rank its own
total = x.clone()
dist.all_reduce(total)"""

PROGRESS = """%%ranks
import time
from tqdm.auto import tqdm

for batch in tqdm(range(40 + 20 * rank), desc="train"):
    time.sleep(0.01)"""

FAILS_ON_RANK_1 = (
    'lab.run("def f(v):\\n    x = v * 2\\n    return x / (rank - 1)\\n\\nw = 7 + rank\\nf(w)");'
)

SCENES = [
    Scene("timeline", (WORK, "labkit.show_timeline(lab)"), plots=1),
    Scene("tensors", ("labkit.show_tensors(lab, 'x')",), plots=2),
    Scene("comm", ("labkit.show_comm(lab)",), plots=2),
    Scene("stacks", ("%lab stacks",), expect="--- rank 1 ---", whole_cell=True),
    Scene("progress", (PROGRESS,), expect="60/60", whole_cell=True),
    Scene("flight_recorder", ("%lab logs --fr --lines 4",), expect="all_reduce", whole_cell=True),
    Scene(
        "debugger",
        (FAILS_ON_RANK_1, "%lab debug 1"),
        expect="-> return x / (rank - 1)",
        whole_cell=True,
        answers=("p x", "up", "p w", "q"),
    ),
    Scene(
        "stuck",
        (
            "%%ranks\n"
            "x = torch.ones(4, device=device)\n"
            "if rank == 0:\n"
            "    dist.all_reduce(x)  # rank 1 never joins: rank 0 waits forever",
        ),
        expect="can never complete",
        whole_cell=True,
        raises=True,
    ),
]
