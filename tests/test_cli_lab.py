"""`labkit lab`: Jupyter's own options pass through, root works, a missing folder is named."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from labkit.tools import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _jupyter_args(argv, monkeypatch, euid=1000):
    calls = []
    monkeypatch.setattr(cli, "_exec", lambda cmd: calls.append(cmd) or 0)
    monkeypatch.setattr(cli.os, "geteuid", lambda: euid)
    assert cli.main(argv) == 0
    return calls[0][3:]  # after `python -m jupyterlab`


def test_jupyters_options_pass_through_in_order(monkeypatch):
    args = _jupyter_args(["lab", "--no-browser", "--port", "9999"], monkeypatch)
    assert args[-3:] == ["--no-browser", "--port", "9999"]
    assert "--ServerApp.ip=127.0.0.1" in args and "--allow-root" not in args
    assert _jupyter_args(["lab", "--", "--port=1"], monkeypatch)[-1] == "--port=1"


def test_root_gets_allow_root_unless_it_chose(monkeypatch, capsys):
    assert "--allow-root" in _jupyter_args(["lab"], monkeypatch, euid=0)
    assert "passing --allow-root" in capsys.readouterr().err
    chosen = _jupyter_args(["lab", "--ServerApp.allow_root=False"], monkeypatch, euid=0)
    assert "--allow-root" not in chosen


def test_another_address_comes_after_loopback_and_is_warned(monkeypatch, capsys):
    args = _jupyter_args(["lab", "--ServerApp.ip=0.0.0.0"], monkeypatch)
    assert args.index("--ServerApp.ip=0.0.0.0") > args.index("--ServerApp.ip=127.0.0.1")
    assert "SSH tunnel" in capsys.readouterr().err


def test_a_missing_notebooks_folder_is_named(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "notebooks_dir", lambda: None)
    assert cli.main(["lab"]) == 2
    assert "no notebooks folder here: pass --dir PATH" in capsys.readouterr().err
    assert cli.main(["lab", "--dir", str(tmp_path / "nope")]) == 2


def test_check_rejects_unknown_options(capsys):
    with pytest.raises(SystemExit):
        cli.main(["check", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


IN_DEV_VENV = os.path.realpath(sys.prefix) == os.path.realpath(os.path.join(ROOT, ".venv"))


NOBODY = 65534


def _others_can_run(path: str) -> bool:
    """Whether a user who owns nothing here can execute `path` (every folder on its way open)."""
    real = os.path.realpath(path)
    folders = [real]
    while os.path.dirname(folders[-1]) != folders[-1]:
        folders.append(os.path.dirname(folders[-1]))
    return all(os.stat(p).st_mode & 0o001 for p in folders)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "how,user",
    [("labkit lab", "this user"), ("scripts/dev.py lab", "this user"), ("labkit lab", "nobody")],
)
def test_the_lab_command_serves_and_ends_with_its_process(tmp_path, how, user):
    """The README's first command, for real: JupyterLab answers on loopback, as root (CI and
    containers, where Jupyter refuses to start without --allow-root) and as an ordinary user,
    and SIGTERM to the process we started ends the server (the orphan check sees none left)."""
    if how.startswith("scripts") and not IN_DEV_VENV:
        pytest.skip("dev.py sets up and uses .venv beside the repository; this is not it")
    as_user = []
    if user == "nobody":
        if os.geteuid() != 0 or not shutil.which("setpriv"):
            pytest.skip("needs root and setpriv to run as another user")
        os.chmod(tmp_path, 0o777)  # nobody's home and Jupyter's runtime folder, for this test
        as_user = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
        if not _others_can_run(sys.executable):  # e.g. a Python under /root: let it search
            as_user += ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
    port, token = _free_port(), "labkit-test-token"
    env = dict(os.environ, HOME=str(tmp_path), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"))
    head = (
        [sys.executable, "-m", "labkit"]
        if how == "labkit lab"
        else [sys.executable, os.path.join(ROOT, "scripts", "dev.py")]
    )
    proc = subprocess.Popen(
        [*as_user, *head, "lab", "--no-browser", f"--port={port}",
         f"--IdentityProvider.token={token}"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline, answered = time.monotonic() + 150, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                url = f"http://127.0.0.1:{port}/api/status?token={token}"
                with urllib.request.urlopen(url, timeout=5) as reply:
                    answered = reply.status
                    break
            except OSError:
                time.sleep(0.5)
        assert answered == 200, proc.stdout.read().decode() if proc.poll() is not None else ""
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
