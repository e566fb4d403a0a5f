"""Every notebook runs top to bottom in a fresh kernel; its own asserts check its numbers.

The notebooks run `JOBS` at a time (LABKIT_NOTEBOOK_JOBS, default 2): much of a notebook's time
is waiting (kernels and ranks starting, collectives waiting for their peers), which a second
notebook fills. They all run while the module's fixture is set up, so the processes they start
belong to the fixture (the orphan check in conftest.py looks at them when it is torn down);
each test then reports its own notebook's result and time.

With LABKIT_EXECUTED_DIR set (CI and `scripts/dev.py docs` set it), each notebook that passes is
also saved there with its outputs and its widgets' state: the course site (docs/conf.py) renders
those, so the notebooks are executed once, here.
"""

from __future__ import annotations

import glob
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from labkit.tools.cli import run_notebook

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
JOBS = max(1, int(os.environ.get("LABKIT_NOTEBOOK_JOBS", "2")))
SAVE_DIR = os.environ.get("LABKIT_EXECUTED_DIR") or None


def test_there_are_notebooks():
    assert any(os.path.basename(p).startswith("00_") for p in NOTEBOOKS)


@pytest.fixture(scope="module")
def notebook_results(request: pytest.FixtureRequest) -> dict[str, tuple[bool, float, str]]:
    """Run every selected notebook, JOBS at a time, longest first; path -> run_notebook's."""
    chosen = [
        item.callspec.params["path"]
        for item in request.session.items
        if item.originalname == "test_notebook_runs" and hasattr(item, "callspec")
    ]
    # the slowest notebooks first, so the last one to start is a short one
    chosen.sort(key=lambda p: -os.path.getsize(p))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(JOBS) as pool:
        results = dict(zip(chosen, pool.map(lambda p: run_notebook(p, 600, SAVE_DIR), chosen)))
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        busy = sum(r[1] for r in results.values())
        reporter.write_line(
            f"\nnotebooks: {len(results)} in {time.perf_counter() - t0:.0f} s wall, {JOBS} at a "
            f"time ({busy:.0f} s of notebook time)"
        )
    return results


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the first one waits for all of them; each cell has its own 600 s
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[os.path.basename(p) for p in NOTEBOOKS])
def test_notebook_runs(path, notebook_results):
    ok, seconds, error = notebook_results[path]
    assert ok, f"{os.path.basename(path)} failed after {seconds:.1f} s: {error}"
