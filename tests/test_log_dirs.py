"""labkit.kernel.inspection.log_dirs: one per-user root, old labs' logs pruned, live ones kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from labkit.kernel.inspection import log_dirs


def _lab_dir(root, name, size, mtime):
    path = root / name
    path.mkdir()
    (path / "rank-0.log").write_bytes(b"x" * size)
    os.utime(path, (mtime, mtime))
    return path


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no process has it (until the pid is reused, long after)


def test_prune_keeps_the_newest_and_every_live_kernels(tmp_path):
    dead = _dead_pid()
    old = [_lab_dir(tmp_path, f"2026-pid{dead}-{i}", 10, 1000 + i) for i in range(5)]
    live = _lab_dir(tmp_path, f"2026-pid{os.getpid()}-live", 10, 1)  # oldest of all
    removed = log_dirs.prune(str(tmp_path), keep=2, keep_bytes=1 << 20)
    assert sorted(removed) == sorted(str(p) for p in old[:3])
    assert all(p.exists() for p in old[3:]) and live.exists()


def test_prune_bounds_the_bytes_kept(tmp_path):
    dead = _dead_pid()
    dirs = [_lab_dir(tmp_path, f"2026-pid{dead}-{i}", 400, 1000 + i) for i in range(4)]
    removed = log_dirs.prune(str(tmp_path), keep=10, keep_bytes=1000)
    assert removed == [str(dirs[1]), str(dirs[0])]  # the two newest fit in 1000 bytes


def test_new_log_dir_is_private_and_under_the_root(tmp_path, monkeypatch):
    monkeypatch.setenv(log_dirs.ENV, str(tmp_path / "root"))
    path = log_dirs.new_log_dir()
    assert os.path.dirname(path) == str(tmp_path / "root")
    assert f"-pid{os.getpid()}-" in os.path.basename(path)
    for p in (path, str(tmp_path / "root")):
        assert os.stat(p).st_mode & 0o077 == 0


def test_a_root_that_is_a_link_is_refused(tmp_path, monkeypatch):
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "root")
    monkeypatch.setenv(log_dirs.ENV, str(tmp_path / "root"))
    with pytest.raises(RuntimeError, match="not a directory of this user's"):
        log_dirs.new_log_dir()


def test_a_killed_kernels_fork_server_log_is_pruned_a_live_ones_kept(tmp_path, monkeypatch):
    monkeypatch.setenv(log_dirs.ENV, str(tmp_path))
    mine = log_dirs.fork_server_log()
    assert os.path.dirname(mine) == str(tmp_path) and os.path.getsize(mine) == 0
    dead = tmp_path / f"{log_dirs.FORK_SERVER_LOG}pid{_dead_pid()}-abc.log"
    dead.write_bytes(b"torch imported\n")
    log_dirs.prune(str(tmp_path))
    assert not dead.exists() and os.path.exists(mine)


def test_a_closed_fork_server_leaves_no_log(tmp_path, monkeypatch):
    from labkit.kernel.launch.spawn import ForkServer

    monkeypatch.setenv(log_dirs.ENV, str(tmp_path))
    server = ForkServer()
    assert os.path.dirname(server.log_path) == str(tmp_path)
    server.close()
    assert os.listdir(tmp_path) == []
