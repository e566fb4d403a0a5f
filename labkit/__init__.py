"""labkit: a Jupyter-driven lab for learning and debugging PyTorch parallelism.

Kernel side: `Lab` (start ranks, run code on them, pull and push values), the views,
`save_trace` (a trace as Chrome Trace Event JSON), `simulate` / `show_world` (a world of
hundreds of ranks played in this process on a fake process group), and the IPython extension
(`%load_ext labkit`, which also calls `prewarm()`). Rank side: `span` marks compute regions for the
timeline. Names load lazily, so a rank importing `labkit.rank.worker` never pulls in the
kernel's dependencies (IPython, ipywidgets, plotly).

Importing labkit starts nothing: no process, no thread. A fork server starts when a lab needs
one, or ahead of time through `prewarm()`.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = [
    "Lab",
    "LabError",
    "LabkitWarning",
    "RemoteError",
    "Results",
    "RankResult",
    "current",
    "span",
    "show_tensors",
    "show_placement",
    "show_timeline",
    "show_breakdown",
    "show_comm",
    "save_trace",
    "profile",
    "flight_recorder",
    "auto_split",
    "run_command",
    "simulate",
    "show_world",
    "load_ipython_extension",
    "prewarm",
    "__version__",
]

_LAZY = {
    "Lab": "labkit.kernel.lab",
    "LabkitWarning": "labkit.kernel.lab",
    "current": "labkit.kernel.lab",
    "LabError": "labkit.kernel.results",
    "RemoteError": "labkit.kernel.results",
    "Results": "labkit.kernel.results",
    "RankResult": "labkit.kernel.results",
    "span": "labkit.rank.trace",
    "show_tensors": "labkit.views",
    "show_placement": "labkit.views",
    "show_timeline": "labkit.views",
    "show_breakdown": "labkit.views",
    "show_comm": "labkit.views",
    "save_trace": "labkit.views",
    "profile": "labkit.kernel.inspection.profiling",
    "flight_recorder": "labkit.kernel.inspection.flight_recorder",
    "auto_split": "labkit.parallel.auto_split",
    "run_command": "labkit.kernel.cell.commands",
    "simulate": "labkit.rank.fake_world",
    "show_world": "labkit.views.world_view",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'labkit' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def load_ipython_extension(ipython: Any) -> None:
    """`%load_ext labkit`: add the `%lab` and `%%ranks` magics, then `prewarm()` (kernel side).

    IPython calls it; the example is the cell ``%load_ext labkit``, then ``%lab start 4``."""
    from labkit.kernel.magics import load

    load(ipython)
    prewarm()


def prewarm() -> None:
    """Start a fork server now (it imports torch), so the next `Lab(n)` only forks. Kernel side.

    `%load_ext labkit` calls it; call it yourself when you use the Python API without the
    magics. A lab that stops cleanly also keeps its server for the next `Lab`. The spare is an
    idle process with torch imported (a few hundred MB) until the kernel exits;
    LABKIT_PREWARM=0 keeps none (a benchmark measuring a cold start sets it).
    Example: ``labkit.prewarm()`` at the top of a script, then ``labkit.Lab(4)`` later.
    """
    from labkit.kernel.launch import spawn

    if spawn.keeps_spare():
        spawn.prewarm()
