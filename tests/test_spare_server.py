"""A stopped lab's fork server is the next Lab's, when that is safe (kernel side, 2 CPU ranks).

The spare is reused only while it is clean (every rank it forked reported and exited) and the
kernel's working directory and environment are those it started with: its ranks inherit both.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

import labkit
from labkit.kernel.launch import spawn

pytestmark = pytest.mark.timeout(180)


def _fresh_spare() -> tuple[spawn.ForkServer, set[int]]:
    """A lab run and stopped: its server is the spare (any older spare closed first); the
    server and the pids of that lab's ranks."""
    spawn.close_spare()
    with labkit.Lab(2, device="cpu") as lab:
        server, pids = lab.server, set(lab.pids.values())
        assert lab.run("rank").values_by_rank == {0: 0, 1: 1}
    assert spawn._spare is server and server.alive()
    return server, pids


def test_the_next_lab_forks_from_the_stopped_labs_server():
    server, first = _fresh_spare()
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
    server, _ = _fresh_spare()
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


def test_a_killed_generation_is_forgotten_with_its_lab():
    """kill() (how a stuck start-up is recovered) marks the lab's generation ended, so a rank
    of it reported later is killed at once; the next lab numbers its generations from 1 again
    and must not inherit that mark."""
    spawn.close_spare()
    lab = labkit.Lab(2, device="cpu")
    server, gen = lab.server, lab.channel.gen
    lab.launcher.kill()
    assert gen in server.ended_gens
    lab.stop()
    assert spawn._spare is server
    with labkit.Lab(2, device="cpu") as again:
        assert again.server is server and again.channel.gen == gen
        assert again.run("rank").values_by_rank == {0: 0, 1: 1}
    spawn.close_spare()


def test_a_forked_child_of_the_kernel_leaves_the_spare_alone():
    server, _ = _fresh_spare()
    pid = os.fork()
    if pid == 0:  # what the child's atexit does
        try:
            spawn.close_spare()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert server.alive() and os.path.exists(server.log_path)
    with labkit.Lab(2, device="cpu") as lab:
        assert lab.server is server
        assert lab.run("rank").values_by_rank == {0: 0, 1: 1}
    spawn.close_spare()


def test_a_failing_exit_handler_leaves_the_servers_reader_running(capfd):
    """The reader thread hands each exit to the lab's handler; one that raises (or a handler
    cleared by a stop at that moment) must not end the thread a reused server depends on."""
    spawn.close_spare()
    with labkit.Lab(2, device="cpu") as lab:
        server, pid = lab.server, lab.pids[1]

        def broken(*_: object) -> None:
            raise RuntimeError("handler broke")

        server.on_exit = broken
        server.signal([pid], signal.SIGKILL)
        assert server.wait_exited([pid], timeout=30)
        deadline = time.monotonic() + 10
        while "handler broke" not in capfd.readouterr().err and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.reader.is_alive()
    spawn.close_spare()
