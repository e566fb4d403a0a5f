"""ruff keeps code and notebooks clean (the dev extra installs it; CI runs it here)."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ruff() -> list[str]:
    exe = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    if exe is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    return [exe]


@pytest.mark.timeout(120)
def test_ruff_check():
    out = subprocess.run(
        [*_ruff(), "check", "labkit", "tests", "scripts", "notebooks"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.timeout(120)
def test_ruff_format():
    out = subprocess.run(
        [*_ruff(), "format", "--check", "labkit", "tests", "scripts"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
