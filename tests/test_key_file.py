"""labkit.wire.key_file: a dead kernel's own key file is removed by its ranks, nothing else is."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

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
