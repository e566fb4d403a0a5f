"""A stopped lab's fork server is the next Lab's, when that is safe (kernel side, 2 CPU ranks).

The spare is reused only while it is clean (every rank it forked reported and exited) and the
kernel's working directory and environment are those it started with: its ranks inherit both.
"""

from __future__ import annotations

import os

import pytest

import labkit
from labkit.kernel.launch import spawn

pytestmark = pytest.mark.timeout(180)


def _fresh_spare() -> spawn.ForkServer:
    """A lab run and stopped: its server is the spare (any older spare closed first)."""
    spawn.close_spare()
    with labkit.Lab(2, device="cpu") as lab:
        server = lab.server
        assert lab.run("rank").values_by_rank == {0: 0, 1: 1}
    assert spawn._spare is server and server.alive()
    return server


def test_the_next_lab_forks_from_the_stopped_labs_server():
    server = _fresh_spare()
    first = {*server.exited}  # the first lab's ranks, exited
    with labkit.Lab(2, device="cpu") as lab:
        assert lab.server is server and spawn._spare is None
        # the new lab's ranks, not the old lab's (same generation numbers: forgotten at the stop)
        assert not first & set(lab.pids.values())
        assert all(os.path.exists(f"/proc/{p}") for p in lab.pids.values())
        assert lab.run("rank").values_by_rank == {0: 0, 1: 1}
        lab.restart()  # a restart forks from it too
        assert lab.run("rank * 10").values_by_rank == {0: 0, 1: 10}
    assert spawn._spare is server
    spawn.close_spare()
    assert not server.alive() and not os.path.exists(server.log_path)


def test_a_changed_environment_or_directory_starts_a_new_server(monkeypatch, tmp_path):
    server = _fresh_spare()
    monkeypatch.setenv("LABKIT_TEST_SPARE", "seen")
    with labkit.Lab(2, device="cpu") as lab:
        assert lab.server is not server and not server.alive()  # the stale one is closed
        got = lab.run("import os\nos.environ.get('LABKIT_TEST_SPARE')").values_by_rank
        assert got == {0: "seen", 1: "seen"}
    server = spawn._spare
    monkeypatch.chdir(tmp_path)
    with labkit.Lab(2, device="cpu") as lab:
        assert lab.server is not server
        got = lab.run("import os\nos.getcwd()").values_by_rank
        assert got == {0: str(tmp_path), 1: str(tmp_path)}
    spawn.close_spare()


def test_a_server_with_a_rank_not_accounted_for_is_closed_not_kept():
    spawn.close_spare()
    with labkit.Lab(2, device="cpu") as lab:
        server = lab.server
        assert not server.reset()  # its ranks run: nothing is forgotten
        assert set(server.spawned.values()) == set(lab.pids.values())
        with server.cond:
            server.asked += 1  # a fork asked for and never reported
    assert spawn._spare is None and not server.alive()


def test_a_forked_child_of_the_kernel_leaves_the_spare_alone():
    server = _fresh_spare()
    pid = os.fork()
    if pid == 0:  # what a child's atexit would do
        try:
            spawn.close_spare()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert server.alive()
    with labkit.Lab(2, device="cpu") as lab:
        assert lab.server is server
        assert lab.run("rank").values_by_rank == {0: 0, 1: 1}
    spawn.close_spare()
