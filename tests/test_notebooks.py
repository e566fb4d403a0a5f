"""Every notebook runs top to bottom in a fresh kernel; its own asserts check its numbers."""

from __future__ import annotations

import glob
import os

import pytest

from labkit.tools.cli import run_notebook

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))


def test_there_are_notebooks():
    assert any(os.path.basename(p).startswith("00_") for p in NOTEBOOKS)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[os.path.basename(p) for p in NOTEBOOKS])
def test_notebook_runs(path):
    ok, seconds, error = run_notebook(path, timeout=600)
    assert ok, f"{os.path.basename(path)} failed after {seconds:.1f} s: {error}"
