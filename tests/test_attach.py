"""Ranks started by torchrun attach to a lab: two torchrun "nodes" on loopback, 1 rank each.

Checks that cells, output, values, pull/push, tracing, Stop and logs work as with forked
ranks; that restart says clearly why it cannot; that `stop()` ends the torchrun job; and that
attached ranks leave when the notebook's kernel dies.
"""

from __future__ import annotations

import _thread
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from processes import alive, key, subtree
from processes import end as end_processes

import labkit
from labkit import LabError

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("load")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_torchrun(endpoint: str, key_file: str, nnodes: int = 2) -> list[subprocess.Popen]:
    """One torchrun agent per "node", all on this machine (static rendezvous on loopback)."""
    port = _free_port()
    procs = []
    for node in range(nnodes):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nnodes}",
            f"--node-rank={node}",
            "--nproc-per-node=1",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            "-m",
            "labkit.rank",
            "--connect",
            endpoint,
            "--key-file",
            key_file,
        ]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    return procs


def wait_all(procs, timeout):
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    return codes


def end(procs):
    """End the torchrun agents we started and every process below them, by pid.

    torchrun starts each worker in a session of its own, so signalling the agents' process
    group would miss the workers: they are found in /proc before the agents are told to stop,
    and whatever of them is left after 10 s is killed by pid.
    """
    agents = {k for k in (key(p.pid) for p in procs if p.poll() is None) if k}
    tree = subtree(agents)
    for p in procs:  # our own children, by their Popen handles
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while tree and time.monotonic() < deadline:
        tree = {k for k in tree | subtree(agents) if alive(k)}  # workers started meanwhile
        time.sleep(0.1)
    end_processes(tree)
    for p in procs:
        p.wait()
        if p.stderr:
            p.stderr.close()


@pytest.fixture(scope="module")
def attached():
    lab = labkit.Lab.attach(2, wait=False)
    procs = start_torchrun(lab.endpoint, lab.key_file)
    try:
        lab.wait_attached(180)
        yield lab, procs
    finally:
        try:
            lab.stop()
        finally:  # even if stop() failed or hung until a timeout: the job must not outlive us
            end(procs)


def test_attach_prints_the_command_and_keeps_the_key_private(attached):
    lab, _ = attached
    assert lab.endpoint.startswith("127.0.0.1:")
    assert "-m labkit.rank --connect 127.0.0.1:" in lab.command
    assert "--nproc-per-node=2" in lab.command and lab.key_file in lab.command
    assert os.stat(lab.key_file).st_mode & 0o777 == 0o600
    assert "attached from torchrun" in lab.choice.reason and lab.world_size == 2


def test_cells_values_and_collectives(attached, capsys):
    lab, _ = attached
    res = lab.run("print('hello', rank)\nt = torch.ones(3) * (rank + 1)\ndist.all_reduce(t)\nt")
    assert all(res[r].value.tolist() == [3.0, 3.0, 3.0] for r in (0, 1))
    out = capsys.readouterr().out
    assert "[rank 0] hello 0" in out and "[rank 1] hello 1" in out
    env = lab.run("import os\n(os.environ['RANK'], os.environ['WORLD_SIZE'], str(device))")
    assert env.values_by_rank == {0: ("0", "2", "cpu"), 1: ("1", "2", "cpu")}
    lab.push(lr=0.5)
    assert lab.pull("lr * 2") == {0: 1.0, 1: 1.0}
    assert lab.run("rank * 10", ranks=1).values_by_rank == {1: 10}


def test_tracing_and_logs(attached):
    lab, _ = attached
    lab.run("x = torch.ones(100)\ndist.all_reduce(x)\nprint('logged line', rank)")
    recs = lab.trace()
    assert sorted((r.rank, r.op) for r in recs) == [(0, "all_reduce"), (1, "all_reduce")]
    from labkit.kernel.magics import read_log

    assert "logged line 1" in read_log(lab.log_dir, 1, lab.world_size, 50)


def test_stop_reaches_attached_ranks(attached):
    lab, _ = attached
    lab.run("kept = 7")
    timer = threading.Timer(0.8, _thread.interrupt_main)
    timer.start()
    t0 = time.monotonic()
    res = lab.run("while True:\n    pass")
    timer.cancel()
    assert time.monotonic() - t0 < 15
    assert {r.error["type"] for r in res.values()} == {"KeyboardInterrupt"}
    assert lab.pull("kept") == {0: 7, 1: 7}


def test_a_rank_that_comes_late_is_turned_away(attached):
    import zmq

    from labkit import LabkitWarning
    from labkit.wire.codec import Codec
    from labkit.wire.messages import Attach

    lab, _ = attached
    key = lab.channel.codec.key
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(lab.channel.endpoint("ctrl"))
    try:
        late = Attach(type="attach", rank=0, gen=1, world_size=2, host="latehost", pid=1,
                      gpus=0, nccl=False, cpus=1)  # fmt: skip
        sock.send_multipart(Codec(key).encode(late))
        # the kernel reads the late message when a call reads its channel; on a busy machine
        # it can arrive after the first call (connecting alone took more than 0.3 s), so
        # calls go on until the warning comes, each still answered by the right ranks
        with pytest.warns(
            LabkitWarning, match="turned away rank 0 from latehost.*came late"
        ) as seen:
            deadline = time.monotonic() + 60
            while True:
                assert lab.run("rank").values_by_rank == {0: 0, 1: 1}  # rank 0 keeps its route
                if any("came late" in str(w.message) for w in seen) or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        assert sock.poll(5000), "the late rank got no answer"
        assert Codec(key).decode(sock.recv_multipart())["type"] == "refused"
    finally:
        sock.close()


def test_restart_is_refused_with_the_reason(attached):
    lab, _ = attached
    with pytest.raises(
        LabError, match="started by torchrun.*restart the torchrun job|torchrun job"
    ):
        lab.restart()
    assert lab.run("rank").values_by_rank == {0: 0, 1: 1}


def test_stop_ends_the_torchrun_job():
    lab = labkit.Lab.attach(2, wait=False)
    procs = start_torchrun(lab.endpoint, lab.key_file)
    try:
        lab.wait_attached(180)
        lab.stop()
        assert wait_all(procs, 30) == [0, 0]
    finally:
        try:
            lab.stop()
        finally:
            end(procs)


def test_stop_ends_the_torchrun_job_when_a_cell_was_abandoned():
    # the ranks spin in user code and cannot read `exit`: the dropped link must end them
    lab = labkit.Lab.attach(2, wait=False)
    procs = start_torchrun(lab.endpoint, lab.key_file)
    try:
        lab.wait_attached(180)
        with pytest.raises(LabError, match="timeout"):
            lab.run("while True:\n    pass", timeout=2)
        lab.stop()
        assert None not in wait_all(procs, 30), "torchrun's ranks outlived the stopped lab"
    finally:
        try:
            lab.stop()
        finally:
            end(procs)


KERNEL = textwrap.dedent("""
    import labkit, sys
    lab = labkit.Lab.attach(2, wait=False)
    print("EP", lab.endpoint, lab.key_file, flush=True)
    lab.wait_attached(180)
    print("ready", flush=True)
    lab.run("print('spinning', flush=True)\\nwhile True:\\n    pass")
""")


def test_attached_ranks_leave_when_the_kernel_dies():
    # mid-cell: the ranks' main threads spin in user code when the kernel goes
    kernel = subprocess.Popen(
        [sys.executable, "-u", "-c", KERNEL],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    procs = []
    try:
        line = ""
        while not line.startswith("EP "):
            line = kernel.stdout.readline()
            assert line, "the kernel ended early"
        endpoint, key_file = line.split()[1:]
        procs = start_torchrun(endpoint, key_file)
        while line.strip() != "ready":  # after "labkit: k of 2 ranks attached" lines
            line = kernel.stdout.readline()
            assert line, "the kernel ended early"
        while "spinning" not in line:
            line = kernel.stdout.readline()
            assert line, "the kernel ended early"
        kernel.kill()
        kernel.wait()
        codes = wait_all(procs, 40)
        assert None not in codes, "torchrun's ranks outlived the kernel"
        # the key file the dead kernel made in its private directory: removed by its ranks
        assert os.path.basename(os.path.dirname(key_file)).startswith("labkit-"), key_file
        assert not os.path.exists(os.path.dirname(key_file)), "the dead kernel's key was left"
    finally:
        if kernel.poll() is None:
            kernel.kill()
            kernel.wait()
        kernel.stdout.close()
        kernel.stdin.close()
        end(procs)
