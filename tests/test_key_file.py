"""A dead kernel's private directory (labkit.wire.sock_dir) and its key file are removed, by its
ranks (labkit.wire.key_file) or by the next lab started on the machine; nothing else is."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

from labkit.wire import sock_dir
from labkit.wire.key_file import read_key_file, remove_orphaned_key, write_key_file

HOST = socket.gethostname()


@pytest.fixture
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: no process has this pid until the system reuses it
    return proc.pid


def _kernel_dir(tmp_path) -> str:
    folder = tmp_path / "labkit-abc123"
    folder.mkdir(mode=0o700)
    return write_key_file(str(folder / "lab.key"), b"\x01" * 32)


def test_a_dead_kernels_own_key_and_folder_go(tmp_path, dead_pid):
    key = _kernel_dir(tmp_path)
    assert read_key_file(key) == b"\x01" * 32
    assert remove_orphaned_key(key, HOST, dead_pid)
    assert not os.path.exists(os.path.dirname(key))
    assert not remove_orphaned_key(key, HOST, dead_pid)  # the node's other ranks: nothing left


def test_a_live_kernels_key_stays(tmp_path):
    key = _kernel_dir(tmp_path)  # Stop ended the torchrun job; the same command attaches again
    assert not remove_orphaned_key(key, HOST, os.getpid())
    assert os.path.exists(key)


def test_a_kernel_on_another_host_is_not_judged_here(tmp_path, dead_pid):
    key = _kernel_dir(tmp_path)
    assert not remove_orphaned_key(key, HOST + "-elsewhere", dead_pid)
    assert os.path.exists(key)


@pytest.mark.parametrize("where", ["user's folder", "user's name", "folder with more"])
def test_a_key_file_the_user_chose_is_theirs(tmp_path, dead_pid, where):
    if where == "user's folder":
        key = write_key_file(str(tmp_path / "keys" / "lab.key"), b"\x02" * 32)
    elif where == "user's name":
        (tmp_path / "labkit-abc123").mkdir()
        key = write_key_file(str(tmp_path / "labkit-abc123" / "mine.key"), b"\x02" * 32)
    else:
        key = _kernel_dir(tmp_path)
        (tmp_path / "labkit-abc123" / "notes.txt").write_text("keep")
    assert not remove_orphaned_key(key, HOST, dead_pid)
    assert os.path.exists(key)


def _lab_dir(root, name: str, owner: str | None) -> str:
    path = root / name
    path.mkdir(mode=0o700)
    (path / "ctrl").write_text("")
    if owner is not None:
        (path / sock_dir.OWNER).write_text(owner)
    return str(path)


def test_a_new_lab_removes_the_directories_of_gone_kernels_only(tmp_path, dead_pid, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    gone = _lab_dir(tmp_path, "labkit-gone", f"{HOST} {dead_pid}")
    kept = {
        "live kernel": _lab_dir(tmp_path, "labkit-live", f"{HOST} {os.getpid()}"),
        "other host": _lab_dir(tmp_path, "labkit-far", f"{HOST}-elsewhere {dead_pid}"),
        "no owner": _lab_dir(tmp_path, "labkit-logs-0", None),
        "not labkit's": _lab_dir(tmp_path, "other-gone", f"{HOST} {dead_pid}"),
        "garbled": _lab_dir(tmp_path, "labkit-odd", "?"),
    }
    (tmp_path / "labkit-link").symlink_to(gone)
    mine = sock_dir.new()  # what a channel does: sweep, then make its own
    try:
        assert not os.path.exists(gone)
        assert all(os.path.exists(p) for p in kept.values()), kept
        assert os.path.islink(tmp_path / "labkit-link")  # a link is never followed
        assert os.path.dirname(mine) == str(tmp_path)
        with open(os.path.join(mine, sock_dir.OWNER)) as f:
            assert f.read().split() == [HOST, str(os.getpid())]
        assert sock_dir.sweep() == []  # its own kernel runs
    finally:
        shutil.rmtree(mine)


def test_a_dead_kernels_key_goes_with_its_owner_note(tmp_path, dead_pid):
    key = _kernel_dir(tmp_path)
    with open(os.path.join(os.path.dirname(key), sock_dir.OWNER), "w") as f:
        f.write(f"{HOST} {dead_pid}\n")
    assert remove_orphaned_key(key, HOST, dead_pid)
    assert not os.path.exists(os.path.dirname(key))
