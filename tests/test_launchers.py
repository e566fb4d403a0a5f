"""The kernel's parts without processes: one backend/device rule for both launchers, a cell run
that reports a stuck cell instead of repairing it, and the note a user reads afterwards."""

from __future__ import annotations

import shlex
import signal
import threading
import types

import pytest

from labkit.kernel.cell import cell_run
from labkit.kernel.cell.cell_run import CellOutcome, CellRun, recovery_note
from labkit.kernel.channel.channel import Stuck
from labkit.kernel.channel.output import RankOutput
from labkit.kernel.launch.attached import choose_attached, torchrun_command
from labkit.kernel.launch.forked import ForkedRanks
from labkit.kernel.launch.launcher import RankLauncher
from labkit.kernel.launch.policy import choose


def attach(rank: int, host: str, gpus: int = 0, nccl: bool = False) -> dict:
    return {"rank": rank, "host": host, "gpus": gpus, "nccl": nccl, "cpus": 8, "world_size": 4}


def test_attached_ranks_follow_the_forked_rule_per_host() -> None:
    # 2 nodes x 2 ranks, 2 GPUs each: one GPU per rank on every node -> NCCL, as forked would
    two_by_two = {r: attach(r, f"node{r // 2}", gpus=2, nccl=True) for r in range(4)}
    c = choose_attached(4, "auto", "auto", two_by_two)
    assert (c.backend, c.device) == ("cpu:gloo,cuda:nccl", "cuda")
    assert c.reason.endswith("4 ranks attached from torchrun on node0, node1")
    assert c == choose_attached(4, "auto", "auto", two_by_two)  # a pure function
    # the same job where one node has a single GPU: too few for one each -> CPU ranks, gloo;
    # asked for CUDA, its two ranks share the GPU with gloo
    short = {**two_by_two, **{r: attach(r, "node1", gpus=1, nccl=True) for r in (2, 3)}}
    c = choose_attached(4, "auto", "auto", short)
    assert (c.backend, c.device) == ("gloo", "cpu")
    c = choose_attached(4, "auto", "cuda", short)
    assert (c.backend, c.device) == ("gloo", "cuda")
    # no GPUs anywhere: CPU and gloo; asking for NCCL there is refused with the reason
    cpu = {r: attach(r, "node0") for r in range(4)}
    assert (choose_attached(4, "auto", "auto", cpu).device) == "cpu"
    with pytest.raises(ValueError, match="one GPU per rank"):
        choose_attached(4, "nccl", "auto", cpu)


def test_ranks_per_host_decides_nccl_not_the_world_size() -> None:
    gpu4 = {"gpus": 4, "nccl": True, "cpus": 32}
    assert choose(8, "auto", "auto", gpu4, ranks_per_host=4).backend == "cpu:gloo,cuda:nccl"
    assert choose(8, "auto", "auto", gpu4).backend == "gloo"  # 8 ranks on one 4-GPU host


def test_torchrun_command_names_the_rank_entry_point() -> None:
    cmd = torchrun_command(4, "head:5555", "/k", nnodes=2)
    assert "--nnodes=2 --nproc-per-node=2" in cmd and "-m labkit.rank --connect head:5555" in cmd
    with pytest.raises(ValueError, match="not a multiple"):
        torchrun_command(3, "head:5555", "/k", nnodes=2)


def test_torchrun_command_quotes_a_key_file_path_for_the_shell() -> None:
    cmd = torchrun_command(2, "head:5555", "/home/a b/lab.key")
    assert shlex.split(cmd)[-2:] == ["--key-file", "/home/a b/lab.key"]


class FakeChannel:
    """Enough of a Channel for one cell run: `pump` raises what the test says."""

    def __init__(self, raises: BaseException):
        self.raises = raises
        self.sent: list = []
        self.status: dict = {}
        self.dead: dict = {}
        self.output = RankOutput()
        self.stacks: dict = {}
        self.asked: list = []

    def encode_for_all(self, msg):
        return [msg], []

    def settle(self, segments, answered) -> None:  # the fake encodes no shared memory
        assert segments == []

    def send(self, ranks, msg, frames=None, sent=None) -> None:
        assert frames == [msg], "a cell is encoded once for all its ranks"
        for r in ranks:  # as Channel.send: one rank after the other, each noted once sent
            self.send_one(r, msg)
            sent.append(r)

    def send_one(self, rank, msg) -> None:
        self.sent.append(([rank], msg))

    def ask_stacks(self, ranks) -> int:  # every rank answers at once
        self.asked.append(list(ranks))
        self.stacks[len(self.asked)] = {
            r: {"text": f'Thread "MainThread":\n    stack of {r}', "where": None} for r in ranks
        }
        return len(self.asked)

    def pump(self, pending, expect, **kw):
        raise self.raises

    def catch_up_streams(self, replies) -> None:
        raise AssertionError("a stuck cell has no output to wait for")


class FakeLauncher(RankLauncher):
    def __init__(self, channel):
        super().__init__(channel)
        self.calls: list[str] = []

    def start(self):
        self.calls.append("start")

    def interrupt(self, ranks, cell) -> None:
        self.calls.append(f"interrupt {ranks}")

    def kill(self) -> None:
        self.calls.append("kill")

    def stop(self) -> None:
        self.calls.append("stop")


def test_a_stuck_cell_is_reported_not_repaired() -> None:
    channel = FakeChannel(Stuck("rank 1 waits in all_reduce #3 on group [0, 1]", died=None))
    launcher = FakeLauncher(channel)
    run = CellRun(channel, launcher, 2, cell=7, targets=[0, 1], timeout=None)
    outcome = run.run({"type": "exec", "id": 7, "code": "1"})
    assert isinstance(outcome.stuck, Stuck) and "all_reduce #3" in str(outcome.stuck)
    assert launcher.calls == []  # neither killed nor restarted: the lab decides that
    msg = {"type": "exec", "id": 7, "code": "1"}
    assert channel.sent == [([0], msg), ([1], msg)]
    assert channel.asked == [[0, 1]]  # the ranks' stacks, for the message
    assert "when labkit found the cell stuck" in outcome.stacks
    assert "--- rank 0 ---\n    stack of 0\n--- rank 1 ---\n    stack of 1" in outcome.stacks


def test_stop_interrupts_through_the_launcher_and_a_second_stop_is_stuck() -> None:
    channel = FakeChannel(KeyboardInterrupt())
    launcher = FakeLauncher(channel)
    outcome = CellRun(channel, launcher, 2, cell=1, targets=[0, 1], timeout=None).run(
        {"type": "exec", "id": 1, "code": "1"}
    )
    assert launcher.calls == ["interrupt [0, 1]"]
    assert str(outcome.stuck).startswith("Stop was pressed twice; rank 0 did not stop")
    assert channel.asked == [[0, 1]] and "when Stop was pressed" in outcome.stacks  # asked once


class PressedOnce(FakeChannel):
    """Stop lands while the request is being sent to rank 1; the ranks then stop in turn."""

    def __init__(self):
        super().__init__(KeyboardInterrupt())
        self.pressed = False
        self.pumps = 0

    def send_one(self, rank, msg) -> None:
        if rank == 1 and not self.pressed:
            self.pressed = True
            raise KeyboardInterrupt
        super().send_one(rank, msg)

    def pump(self, pending, expect, replies=None, watch=None, **kw):
        self.pumps += 1
        for _ in range(3):  # three polls, a second apart: the watch re-sends Stop
            watch(set(pending))
        for r in pending:
            replies[r] = {"type": "done", "id": 1, "error": {"type": "KeyboardInterrupt"}}
        return replies

    def catch_up_streams(self, replies) -> None:
        pass


def test_stop_pressed_while_sending_still_sends_to_every_rank_then_stops_them(monkeypatch):
    ticks = iter(range(1000))  # a clock that moves a second each time it is read
    monkeypatch.setattr(cell_run, "time", types.SimpleNamespace(monotonic=lambda: next(ticks)))
    channel = PressedOnce()
    launcher = FakeLauncher(channel)
    msg = {"type": "exec", "id": 1, "code": "while True: pass"}
    outcome = CellRun(channel, launcher, 2, cell=1, targets=[0, 1], timeout=None).run(msg)
    assert channel.sent == [([0], msg), ([1], msg)]  # rank 1 got the cell despite the Stop
    assert channel.pumps == 1  # straight to stopping: the cell's own wait never began
    assert launcher.calls[0] == "interrupt [0, 1]" and len(launcher.calls) >= 2  # re-sent
    assert outcome.stuck is None and set(outcome.errors) == {0, 1}


def test_a_live_rank_that_never_took_the_request_makes_the_cell_stuck() -> None:
    channel = FakeChannel(KeyboardInterrupt())
    run = CellRun(channel, FakeLauncher(channel), 2, cell=5, targets=[0, 1], timeout=None)
    run.started = 100.0
    channel.status = {0: {"received": 100.0 + cell_run.ACK_S + 1, "taken": 4, "busy": None}}
    channel.status[1] = {"received": 100.0 + cell_run.ACK_S + 1, "taken": 5, "busy": 5}
    with pytest.raises(Stuck, match="rank 0 is alive but has not received this request"):
        run._tick({0, 1})
    channel.status[0]["taken"] = 5  # it did take it: no complaint
    run._tick({0, 1})


def test_recovery_note_names_the_dead_rank_first_and_what_was_lost() -> None:
    err = {"type": "RuntimeError", "message": "Connection closed by peer\nmore", "time": 1.0}
    outcome = CellOutcome({1: {"error": err}}, 0.0, Stuck("rank 0 died (exited with code 3)", 0))
    outcome.errors = {1: err}
    note = recovery_note(outcome, 1.25, 0.05, "")
    assert note.startswith("rank 0 died (exited with code 3)\nbecause rank 0 died, rank 1 raised")
    assert "Connection closed by peer" in note and "more" not in note
    assert "after 1.2 s" in note and "in 0.05 s: variables on the ranks were lost" in note
    stuck_attached = recovery_note(outcome, 1.0, None, "cannot restart: do X")
    assert stuck_attached == (  # attached ranks too: the death first, then what it caused
        "rank 0 died (exited with code 3)\n"
        "because rank 0 died, rank 1 raised RuntimeError: Connection closed by peer\n"
        "cannot restart: do X"
    )


def test_forked_ranks_can_restart_and_say_so() -> None:
    assert ForkedRanks.cannot_restart is None
    from labkit.kernel.launch.attached import TorchrunRanks

    assert "cannot restart" in TorchrunRanks.cannot_restart


def test_a_rank_lost_while_starting_is_a_lab_error_not_an_internal_one() -> None:
    import labkit
    from labkit.kernel.results import LabError

    class DiesAtStart(FakeLauncher):
        def start(self):
            raise Stuck("rank 1 died (killed by signal SIGKILL)", died=1)

    lab = labkit.Lab(2, device="cpu", start=False)
    try:
        lab.launcher = DiesAtStart(lab.channel)
        with pytest.raises(LabError, match="could not start: rank 1 died") as info:
            lab.start()
        assert info.value.__cause__ is None and info.value.__suppress_context__
    finally:
        lab.stop()


def test_a_call_abandoned_by_another_exception_still_stops_the_ranks() -> None:
    channel = FakeChannel(RuntimeError("a test's timeout"))
    launcher = FakeLauncher(channel)
    run = CellRun(channel, launcher, 2, cell=3, targets=[0, 1], timeout=None)
    with pytest.raises(RuntimeError, match="a test's timeout"):
        run.run({"type": "exec", "id": 3, "code": "while True: pass"})
    assert launcher.calls == ["interrupt [0, 1]"]


def test_output_sent_before_done_is_shown_even_when_it_arrives_late(tmp_path, capsys) -> None:
    from labkit.kernel.channel.channel import Channel
    from labkit.wire.codec import Codec, new_key

    channel = Channel(Codec(new_key()), str(tmp_path))
    try:
        line = {"rank": 0, "seq": 1, "name": "stdout", "text": "late line\n"}
        timer = threading.Timer(2.5, channel._post, ("stream", line))  # a starved I/O thread
        timer.start()
        channel.catch_up_streams({0: {"stream_seq": 1}})
        timer.cancel()
        assert channel.output.of(0) == "late line\n"
        assert "[rank 0] late line" in capsys.readouterr().out
    finally:
        channel.close()


@pytest.mark.timeout(30)
def test_forking_waits_as_long_as_the_start_and_says_how_many_ranks_came() -> None:
    """On a busy machine forking many ranks took over the old fixed 10 s: the wait is the
    caller's (the start's deadline), and running out says how far the server got."""
    from labkit.kernel.launch.spawn import ForkServer

    server = types.SimpleNamespace(
        cond=threading.Condition(), spawned={}, alive=lambda: True, log_path="/tmp/fs.log"
    )

    def report_slowly() -> None:  # rank 0 at once, rank 1 after 1.5 s
        for r, delay in ((0, 0.0), (1, 1.5)):
            threading.Event().wait(delay)
            with server.cond:
                server.spawned[(7, r)] = 1000 + r
                server.cond.notify_all()

    threading.Thread(target=report_slowly, daemon=True).start()
    assert ForkServer.wait_pids(server, 7, [0, 1], timeout=10.0) == {0: 1000, 1: 1001}
    with pytest.raises(RuntimeError, match=r"forked 2 of 3 ranks \(not all in 0 s\).*fs\.log"):
        ForkServer.wait_pids(server, 7, [0, 1, 2], timeout=0.2)


@pytest.mark.timeout(30)
def test_a_rank_reported_after_its_start_was_abandoned_is_killed() -> None:
    """A Stop during start-up kills the ranks reported so far; on a busy machine the server
    may fork one after that (its report came later than the 2 s waited for): it is killed as
    soon as it is reported, not left running until the lab stops."""
    from labkit.kernel.launch.spawn import ForkServer

    sent: list[tuple[list[int], int]] = []
    server = types.SimpleNamespace(
        cond=threading.Condition(), spawned={}, exited={}, ended_gens={7}, on_exit=None,
        signal=lambda pids, sig: sent.append((pids, sig)),
    )  # fmt: skip
    ForkServer._handle(server, {"type": "spawned", "gen": 8, "rank": 0, "pid": 2000})
    assert sent == []  # a rank of a live generation
    ForkServer._handle(server, {"type": "spawned", "gen": 7, "rank": 1, "pid": 1001})
    assert sent == [([1001], signal.SIGKILL)] and server.spawned[(7, 1)] == 1001
