"""scripts/dev.py's choice of torch: a pinned default, and never a torch over one a user has.

The commands dev.py would run are recorded instead of run (no venv, no pip): which venv it
makes, and which torch it installs, for each case LABKIT_TORCH and the outer Python allow.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def dev(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("labkit_dev", f"{ROOT}/scripts/dev.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    venv = tmp_path / ".venv"
    monkeypatch.setattr(module, "VENV", str(venv))
    monkeypatch.setattr(module, "PY", str(venv / "bin" / "python"))
    monkeypatch.delenv("LABKIT_TORCH", raising=False)
    monkeypatch.delenv("LABKIT_TORCH_INDEX", raising=False)
    module.ran = []
    module.torches = {}  # python -> its torch version (None: no torch)

    def sh(*cmd, **kw):
        module.ran.append(list(cmd))
        if cmd[1:3] == ("-m", "venv"):  # the venv exists from now on
            (venv / "bin").mkdir(parents=True)
            (venv / "bin" / "python").touch()
            if "--system-site-packages" in cmd:  # the venv sees the outer Python's torch
                module.torches[module.PY] = module.torches.get(sys.executable)

    monkeypatch.setattr(module, "sh", sh)
    monkeypatch.setattr(module, "torch_version", lambda py: module.torches.get(py))
    return module


def _installs(dev) -> list[list[str]]:
    return [c[c.index("install") + 1 :] for c in dev.ran if "install" in c]


def test_the_pinned_torch_without_one(dev) -> None:
    dev.ensure_env()
    assert dev.ran[0] == [sys.executable, "-m", "venv", dev.VENV]
    assert _installs(dev)[0][-1] == "torch==2.13.0" == dev.PINNED
    assert _installs(dev)[1][-1].endswith("[dev]")


def test_the_outer_torch_is_used_not_replaced(dev, capsys) -> None:
    dev.torches[sys.executable] = "2.11.0+cu130"
    dev.ensure_env()
    assert dev.ran[0] == [sys.executable, "-m", "venv", "--system-site-packages", dev.VENV]
    assert [c[-1] for c in _installs(dev)] == [f"{dev.ROOT}[dev]"]  # no torch installed
    assert "using the torch 2.11.0+cu130" in capsys.readouterr().out


@pytest.mark.parametrize("wanted", ["torch==2.11.0", "pinned"])
def test_labkit_torch_installs_the_one_asked_for(dev, monkeypatch, wanted) -> None:
    dev.torches[sys.executable] = "2.12.0"
    monkeypatch.setenv("LABKIT_TORCH", wanted)
    monkeypatch.setenv("LABKIT_TORCH_INDEX", "https://download.pytorch.org/whl/cpu")
    dev.ensure_env()
    assert dev.ran[0] == [sys.executable, "-m", "venv", dev.VENV]
    torch_install = _installs(dev)[0]
    assert torch_install[-1] == (dev.PINNED if wanted == "pinned" else wanted)
    assert "--extra-index-url" in torch_install


def test_a_venv_keeps_its_torch(dev, monkeypatch, capsys) -> None:
    os.makedirs(os.path.dirname(dev.PY))
    open(dev.PY, "w").close()
    dev.torches[dev.PY] = "2.13.0+cpu"
    monkeypatch.setenv("LABKIT_TORCH", "torch==2.14.1")
    dev.ensure_env()
    assert not any(c[-1].startswith("torch") for c in _installs(dev))
    assert ".venv keeps its torch 2.13.0+cpu" in capsys.readouterr().out


def test_the_range_is_pyprojects_and_torch_compats() -> None:
    """dev.py's oldest torch is pyproject's lower bound; both ends are torch_compat.TESTED."""
    import tomllib

    from labkit.rank import torch_compat

    spec = importlib.util.spec_from_file_location("labkit_dev2", f"{ROOT}/scripts/dev.py")
    dev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dev)
    with open(f"{ROOT}/pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    oldest, newest = dev.RANGE["oldest"], dev.RANGE["newest"]
    assert f"torch>={oldest.removesuffix('.0')}" in deps
    assert (oldest.removesuffix(".0"), newest) == torch_compat.TESTED
    for test in dev.RANGE_TESTS:
        assert os.path.exists(os.path.join(ROOT, test.split("::")[0])), test


def test_range_installs_torch_alone_then_its_libraries_only_if_needed(dev, monkeypatch) -> None:
    """ensure_torch: kept when .torch/VERSION has it; else torch alone (--no-deps: a CPU build
    imports with .venv's packages), then its dependencies only when it does not import."""
    where = os.path.join(dev.ROOT, ".torch", "2.11.0")
    answers = iter(["2.11.0"])
    monkeypatch.setattr(dev, "torch_at", lambda w: next(answers))
    assert dev.ensure_torch("2.11.0") == where and dev.ran == []
    monkeypatch.setattr(dev.shutil, "rmtree", lambda *a, **k: None)
    for imports, installs in ((True, 1), (False, 2)):
        dev.ran.clear()
        answers = iter([None, "2.11.0" if imports else None])
        dev.ensure_torch("2.11.0")
        assert len(dev.ran) == installs and all("--target" in c for c in dev.ran)
        assert "--no-deps" in dev.ran[0] and dev.ran[-1][-1] == "torch==2.11.0"


def test_range_runs_each_end_on_its_torch_without_saving_its_notebooks(
    dev, monkeypatch, capsys
) -> None:
    """run_range: each end's subset with that end's torch first on PYTHONPATH, its executed
    notebooks not saved where the course site reads the whole suite's (the pinned torch's), a
    line per end with its exit status, and the worst status returned."""
    monkeypatch.setenv("LABKIT_EXECUTED_DIR", "/somewhere/executed")
    monkeypatch.setattr(dev, "ensure_torch", lambda version: f"/t/{version}")
    calls = []

    def call(cmd, env):
        calls.append((cmd, env))
        return 1 if env["PYTHONPATH"].startswith("/t/2.14") else 0

    monkeypatch.setattr(dev.subprocess, "call", call)
    assert dev.run_range(["-q"]) == 1
    assert [env["PYTHONPATH"].split(os.pathsep)[0] for _, env in calls] == [
        f"/t/{dev.RANGE['oldest']}",
        f"/t/{dev.RANGE['newest']}",
    ]
    for cmd, env in calls:
        assert cmd[-1] == "-q" and cmd[3 : 3 + len(dev.RANGE_TESTS)] == dev.RANGE_TESTS
        assert "LABKIT_EXECUTED_DIR" not in env
    out = capsys.readouterr().out
    assert f"torch {dev.RANGE['oldest']} (oldest) exit 0" in out
    assert f"torch {dev.RANGE['newest']} (newest) exit 1" in out
    calls.clear()
    assert dev.run_range(["newest"]) == 1 and len(calls) == 1
