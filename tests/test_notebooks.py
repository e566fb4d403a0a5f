"""Every notebook runs top to bottom in a fresh kernel; its own asserts check its numbers.

The notebooks run in a process of their own (tests/notebook_runner.py), started with the
run's first test and running beside the others, LABKIT_NOTEBOOK_JOBS (default 2) at a time:
much of a notebook's time is waiting (kernels and ranks starting, collectives waiting for their
peers), which other work fills. These tests come last and report each notebook's result.

With LABKIT_EXECUTED_DIR set (CI and `scripts/dev.py test` set it), each notebook that passes is
also saved there with its outputs and its widgets' state: the course site
(scripts/build_site.py) renders those, so the notebooks are executed once, here.
"""

from __future__ import annotations

import glob
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
WHOLE_ERROR_MAX = 6000  # characters of a failed notebook's error shown


def test_there_are_notebooks():
    assert any(os.path.basename(p).startswith("00_") for p in NOTEBOOKS)


@pytest.fixture(scope="module")
def notebook_results(notebook_batch) -> dict[str, list]:
    """Every selected notebook's execute_notebook result, path -> (ok, seconds, error, the
    whole error), from the batch conftest's `notebook_batch` started beside the other
    tests."""
    got = notebook_batch.results()  # conftest's terminal summary reports their times
    assert not got["left"], f"the notebooks left processes running (now ended):\n{got['left']}"
    return got["runs"]


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the first one waits for all of them; each cell has its own 600 s
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[os.path.basename(p) for p in NOTEBOOKS])
def test_notebook_runs(path, notebook_results):
    ok, seconds, error, whole = notebook_results[path]
    # the failed cell's source and traceback (its end, where the assert is), so a log shows why
    detail = whole if len(whole) <= WHOLE_ERROR_MAX else "...\n" + whole[-WHOLE_ERROR_MAX:]
    assert ok, f"{os.path.basename(path)} failed after {seconds:.1f} s: {error}\n{detail}"
