"""The scenes and views that the browser tests run in JupyterLab and screenshot for the README.

SCENES (tests/test_browser.py): a scene is a few notebook cells and the output to capture
(stacks, a stuck cell, the debugger, ...). The test runs every scene's cells in one notebook
(after SCENE_SETUP, in order) and checks that each captured output has drawn (its `plots`
plotly figures, each with its data) and says what it should (`expect`).

VIEWS (tests/test_browser_views.py): each view (timeline, tensors, comm, placement, ...) in
one notebook, checked to fit the output area at three widths with nothing in the console.

When LABKIT_SCREENSHOTS names a folder, both save each output there as `<name>.png`:

    LABKIT_SCREENSHOTS=docs/screenshots pytest tests/test_browser.py -k scenes
    LABKIT_SCREENSHOTS=docs/screenshots pytest tests/test_browser_views.py

Without the variable nothing is written, so CI never rewrites tracked files.

To show a new feature in the README: append a Scene or a view (a scene whose last cell raises
goes at the end, after every scene that does not, and sets `raises`), run the command above,
commit the PNG (keep it under 150 KB) and link it from the README.
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

# the views' pictures (timeline.png, tensors.png, comm.png, ...) come from VIEWS below, which
# tests/test_browser_views.py checks at three widths; the scenes start after WORK has run
SCENE_SETUP = (*SETUP, WORK)

SCENES = [
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


# The views, each drawn from the lab above (after WORK) or from plain data, for
# tests/test_browser_views.py: it checks that each fits the output area at the widths people
# use, and saves `<name>.png` into LABKIT_SCREENSHOTS.
VIEW_SETUP = (
    *SCENE_SETUP,
    "from labkit.parallel.pipeline_parallel import make_schedule\n"
    "from labkit.views.replicas_view import show_replicas\n"
    "from labkit.views.schedule_view import grid_figure, ideal_events, schedule_figure\n"
    "from labkit.views.stepper_view import show_ring\n"
    "from labkit.views.sweep_view import show_sweep",
)

RING = """from labkit.parallel.ring_allreduce import RingStep

steps = {
    0: [RingStep(0, "start", 0, chunks=[[1.0], [1.0]]),
        RingStep(1, "reduce-scatter", 0, 0, 1, 1, 1, 4, [[1.0], [11.0]]),
        RingStep(2, "all-gather", 0, 1, 1, 0, 1, 4, [[11.0], [11.0]])],
    1: [RingStep(0, "start", 1, chunks=[[10.0], [10.0]]),
        RingStep(1, "reduce-scatter", 1, 1, 0, 0, 0, 4, [[11.0], [10.0]]),
        RingStep(2, "all-gather", 1, 0, 0, 1, 0, 4, [[11.0], [11.0]])],
}
show_ring(steps, title="ring all-reduce on 2 ranks")"""

SWEEP = """rows = [
    {"op": op, "bytes": n, "seconds": 1e-4 + n * k * 1e-9, "world_size": 4}
    for op, k in (("all_reduce", 2.0), ("all_gather", 1.0))
    for n in (4096, 65536, 1 << 20, 1 << 22)
]
show_sweep(rows, num_cpus=2)"""

REPLICAS = """same = {"checksums": [7, 7], "max_abs_diff": 0.0, "per_param": {"0.weight": 0.0},
        "identical": True}
apart = {"checksums": [7, 9], "max_abs_diff": 0.25,
         "per_param": {"0.weight": 0.25, "0.bias": 0.0, "2.weight": 1e-3},
         "identical": False}
show_replicas({"averaged": [same, same, same], "not averaged": [same, apart, apart]})"""

WORLD = """from labkit.parallel.llama_3d import build_stage, step


def setup(mesh):  # the embedding and the output of a 2-stage model (few rows: one picture)
    stage = build_stage(mesh, hidden=32, heads=4, ffn=64, vocab=320, num_layers=0)
    step(stage, mesh, batch=1, seq=8, hidden=32, vocab=320)
    return stage, torch.optim.Adam(stage.parameters())


labkit.show_world(labkit.simulate((8, 4, 2), ("dp", "tp", "pp"), setup))"""

# (name, cells): the last cell's output is the view
VIEWS = [
    ("timeline", ("labkit.show_timeline(lab)",)),
    ("breakdown", ("labkit.show_breakdown(lab)",)),
    ("comm", ("labkit.show_comm(lab)",)),
    ("world", (WORLD,)),
    (
        "tensors",
        (
            "labkit.show_tensors({r: torch.arange(12.0).reshape(3, 4) + 12 * r for r in range(4)},"
            " title='x on 4 ranks')",
        ),
    ),
    (
        "tensor_bars",
        (
            "labkit.show_tensors({r: torch.arange(8.0) * (r + 1) - 6 for r in range(4)},"
            " title='bars: 8 values on 4 ranks')",
        ),
    ),
    ("placement", ("labkit.show_placement(lab, 'model')",)),
    (
        "schedule",
        ("schedule_figure(ideal_events(make_schedule(4, 4, '1f1b')), 'one F one B', unit='step')",),
    ),
    (
        "groups",
        (
            "grid_figure((2, 4), {'dp': [[0, 4], [1, 5], [2, 6], [3, 7]],"
            " 'tp': [[0, 1, 2, 3], [4, 5, 6, 7]]})",
        ),
    ),
    ("replicas", (REPLICAS,)),
    ("sweep", (SWEEP,)),
    ("ring", (RING,)),
    ("progress", (PROGRESS,)),
]
