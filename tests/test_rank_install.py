"""A rank needs only the rank install: `pip install labkit[rank]` (torch, numpy, pyzmq,
cloudpickle, cryptography), no Jupyter, plotly or scikit-learn.

- pyproject.toml: the base dependencies are exactly what a rank needs; the notebook's packages
  are the `lab` extra, which `test` (and so `dev`) include;
- a rank runs with the notebook's packages made impossible to import: a `sitecustomize` on
  PYTHONPATH puts a finder first on `sys.meta_path` that raises ImportError for them (and for
  labkit's kernel side), in torchrun's agent and in every worker it starts. `python -m
  labkit.rank --help` works, and two ranks attach to a lab, run a cell with a collective and
  give a pulled value back.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_attach import end, wait_all

import labkit

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parent.parent
RANK_DEPS = {"torch", "numpy", "pyzmq", "cloudpickle", "cryptography"}
NOTEBOOK_DEPS = {
    "ipython",
    "ipykernel",
    "ipywidgets",
    "plotly",
    "anywidget",
    "jupyterlab",
    "nbclient",
    "nbformat",
    "notebook",
    "scikit-learn",
    "tqdm",
}
BLOCKED = (
    "IPython ipykernel ipywidgets plotly anywidget jupyterlab jupyter_client jupyter_core "
    "jupyter_server notebook nbclient nbformat sklearn tqdm labkit.kernel labkit.views "
    "labkit.exercises labkit.tools"
).split()

SITECUSTOMIZE = textwrap.dedent(f"""
    import importlib.abc, sys

    BLOCKED = {BLOCKED!r}


    class NotInstalled(importlib.abc.MetaPathFinder):
        # This node has only labkit[rank]: the notebook's packages are not there.
        def find_spec(self, name, path, target=None):
            if any(name == b or name.startswith(b + ".") for b in BLOCKED):
                raise ImportError(f"No module named {{name!r}} (rank-only install)")
            return None


    sys.meta_path.insert(0, NotInstalled())
""")


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0].lower()


def test_base_dependencies_are_what_a_rank_needs():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in Python 3.11 and later")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert {_name(r) for r in project["dependencies"]} == RANK_DEPS
    assert extras["rank"] == [], "labkit[rank] must add nothing to the rank's dependencies"
    assert {_name(r) for r in extras["lab"]} == NOTEBOOK_DEPS
    assert "labkit[lab]" in extras["test"] and "labkit[test]" in extras["dev"]


@pytest.fixture
def rank_only_env(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, LABKIT_PREWARM="0")


def test_the_blocker_blocks(rank_only_env):
    # the test below could not fail if the notebook's packages were importable under it
    out = subprocess.run(
        [sys.executable, "-c", "import IPython"], env=rank_only_env, capture_output=True
    )
    assert out.returncode == 1 and b"rank-only install" in out.stderr


def test_rank_help_runs_without_the_notebook_packages(rank_only_env):
    out = subprocess.run(
        [sys.executable, "-m", "labkit.rank", "--help"],
        env=rank_only_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "--connect HOST:PORT" in out.stdout and "--key-file" in out.stdout


def test_ranks_serve_a_lab_without_the_notebook_packages(rank_only_env):
    lab = labkit.Lab.attach(2, wait=False)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
    cmd += ["-m", "labkit.rank", "--connect", lab.endpoint, "--key-file", lab.key_file]
    procs = [subprocess.Popen(cmd, env=rank_only_env, stdout=subprocess.DEVNULL)]
    try:
        lab.wait_attached(180)
        res = lab.run(
            "import sys\n"
            "t = torch.ones(2) * (rank + 1)\n"
            "dist.all_reduce(t)\n"
            "try:\n"
            "    import IPython\n"
            "    blocked = False\n"
            "except ImportError:\n"
            "    blocked = True\n"
            "(t.tolist(), blocked, sorted(m for m in sys.modules if m.startswith('labkit.k')))"
        )
        assert res.values_by_rank == {r: ([3.0, 3.0], True, []) for r in (0, 1)}
        assert {r: v.tolist() for r, v in lab.pull("t").items()} == {0: [3.0, 3.0], 1: [3.0, 3.0]}
        lab.stop()
        assert wait_all(procs, 30) == [0]
    finally:
        try:
            lab.stop()
        finally:
            end(procs)
