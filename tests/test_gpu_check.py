"""The GPU check's one command (scripts/gpu_check.py) tested on CPU: what it would run
(--dry-run), and a real run with --device cpu on two tiny notebooks, one that passes and one
that raises, several at a time, with one pass/fail table and the failure's traceback kept."""

from __future__ import annotations

import os
import subprocess
import sys

import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.py")


def _run(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("OUT", None)
    return subprocess.run(
        [sys.executable, SCRIPT, "--no-install", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def _notebook(path, source: str) -> str:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source)]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(nb, str(path))
    return str(path)


@pytest.mark.timeout(60)
def test_dry_run_names_every_notebook_and_runs_nothing(tmp_path):
    proc = _run("--dry-run", "--device", "cpu", "--jobs", "4", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    notebooks = sorted(
        f for f in os.listdir(os.path.join(ROOT, "notebooks")) if f.endswith(".ipynb")
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("notebook: ")]
    assert [ln.split()[-4].rsplit("/", 1)[-1] for ln in lines] == notebooks
    assert "LABKIT_DEVICE=cpu, 4 at a time, budget 480 s" in proc.stdout
    assert "pytest -m gpu tests/test_gpu.py" in proc.stdout
    assert os.listdir(tmp_path) == []  # nothing ran


@pytest.mark.timeout(300)
def test_cpu_run_prints_one_table_and_keeps_the_failure(tmp_path):
    good = _notebook(tmp_path / "good.ipynb", "print(1 + 1)")
    bad = _notebook(tmp_path / "bad.ipynb", "raise ValueError('on purpose')")
    out = tmp_path / "out"
    proc = _run("--device", "cpu", "--no-pytest", "--jobs", "2", "--out", str(out), good, bad)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # one notebook failed
    table = proc.stdout.splitlines()
    rows = {
        ln.split()[0]: ln.split()[1] for ln in table if ln.endswith((".ipynb",)) or ".ipynb " in ln
    }
    assert rows == {"good.ipynb": "pass", "bad.ipynb": "FAIL"}, proc.stdout
    assert "1 of 2 passed in" in proc.stdout
    assert "D2H ms/MiB" in proc.stdout  # the staging copies, timed on the device asked for
    assert (
        (out / "summary.txt").read_text().splitlines()[0].startswith("GPU check: LABKIT_DEVICE=cpu")
    )
    assert "on purpose" in (out / "nb_errors.txt").read_text()


@pytest.mark.timeout(60)
def test_nothing_starts_once_the_budget_is_spent(tmp_path):
    good = _notebook(tmp_path / "good.ipynb", "print(1)")
    proc = _run("--device", "cpu", "--no-pytest", "--budget", "0", "--out", str(tmp_path), good)
    assert proc.returncode == 1
    assert any(ln.startswith("good.ipynb") and "not run" in ln for ln in proc.stdout.splitlines())
