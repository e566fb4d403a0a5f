"""Two labs on one machine stay apart; forged messages are rejected before unpickling.

- a message signed with the wrong key never reaches `pickle.loads` (its payload would create
  a file if it did), on a rank, on the kernel's side socket and on an attach endpoint, and the
  rejection is logged or warned about;
- lab B's fork server cannot signal lab A's ranks; their sockets, logs and keys are private;
- nothing a lab starts listens on a non-loopback address.
"""

from __future__ import annotations

import os
import pickle
import time

import pytest
import zmq
from conftest import pid_alive

import labkit
from labkit import LabkitWarning
from labkit.wire.codec import Codec, new_key
from labkit.wire.key_file import read_key_file, write_key_file

pytestmark = pytest.mark.timeout(120)


class _Trap:
    """Unpickling this creates a file: proof that a message was (wrongly) unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def forged(path, **fields):
    msg = {"type": "exec", "id": 999, "code": "1", "gen": 1, "rank": 0, "trap": _Trap(path)}
    msg.update(fields)
    return Codec(new_key()).encode(msg)  # a valid-looking message under the wrong key


@pytest.fixture(scope="module")
def two_labs():
    a = labkit.Lab(2, device="cpu")
    b = labkit.Lab(2, device="cpu")
    yield a, b
    a.stop()
    b.stop()


def test_forged_message_to_a_rank_is_rejected_unpickled_and_logged(two_labs, tmp_path):
    a, _ = two_labs
    trap = tmp_path / "unpickled"
    route = a.channel.routes[1]  # the connection rank 1 signed in from
    a.channel.ctrl.send_multipart([route, *forged(str(trap), gen=a.channel.gen)])
    a.channel.ctrl.send_multipart([route, b"short"])  # malformed: one frame
    time.sleep(0.5)
    assert not trap.exists()
    assert a.run("rank").values_by_rank == {0: 0, 1: 1}
    with open(os.path.join(a.log_dir, "rank-1.log")) as f:
        log = f.read()
    assert log.count("rejected a message") >= 2 and "signature does not match" in log


def test_forged_message_to_the_kernel_is_rejected_and_warned(two_labs, tmp_path):
    a, _ = two_labs
    trap = tmp_path / "unpickled"
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(a.channel.endpoint("side"))
    before = a.channel.rejected
    sock.send_multipart(forged(str(trap), type="stream", gen=a.channel.gen))
    deadline = time.monotonic() + 5
    while a.channel.rejected == before and time.monotonic() < deadline:
        time.sleep(0.05)
    sock.close()
    assert a.channel.rejected == before + 1 and not trap.exists()
    with pytest.warns(LabkitWarning, match="rejected a message"):
        a.run("1")


def test_one_lab_cannot_signal_or_reach_the_other(two_labs):
    a, b = two_labs
    assert a.channel.codec.key != b.channel.codec.key
    assert a.channel.sock_dir != b.channel.sock_dir
    b.server.signal(list(a.pids.values()), 9)  # B's server only signals pids it forked
    time.sleep(0.5)
    assert all(pid_alive(p) for p in a.pids.values())
    assert a.run("rank").values_by_rank == {0: 0, 1: 1}
    ports = [lab.run("import os\nint(os.environ['MASTER_PORT'])")[0].value for lab in (a, b)]
    assert ports[0] != ports[1]


def test_private_files(two_labs):
    a, _ = two_labs
    for d in (a.channel.sock_dir, a.log_dir):
        assert os.stat(d).st_mode & 0o777 == 0o700, d
    for r in range(2):
        assert os.stat(os.path.join(a.log_dir, f"rank-{r}.log")).st_mode & 0o077 == 0


def _listening(pids):
    """(address, port) of every listening TCP socket the processes hold."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    addr, port = cols[1].split(":")
                    found.append((addr, int(port, 16)))
    return found


LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1


def test_nothing_listens_beyond_loopback(two_labs):
    a, _ = two_labs
    pids = [*a.pids.values(), a.server.proc.pid, os.getpid()]
    listening = _listening(pids)
    assert listening, "expected rank 0's store and gloo to listen (on loopback)"
    assert all(addr in LOOPBACK for addr, _ in listening), listening


def test_attach_endpoint_rejects_forgeries_and_is_loopback(tmp_path):
    lab = labkit.Lab.attach(2, wait=False)
    try:
        assert lab.channel.endpoint("ctrl").startswith("tcp://127.0.0.1:")
        assert all(addr in LOOPBACK for addr, _ in _listening([os.getpid()]))
        trap = tmp_path / "unpickled"
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(lab.channel.endpoint("ctrl"))
        sock.send_multipart(forged(str(trap), type="attach", world_size=2))
        with pytest.warns(LabkitWarning, match="rejected a message"):
            with pytest.raises(labkit.LabError, match="0 of 2 ranks attached"):
                lab.wait_attached(2)
        sock.close()
        assert not trap.exists() and lab.channel.rejected == 1
    finally:
        lab.stop()


def test_key_file_is_private(tmp_path):
    path = write_key_file(str(tmp_path / "k" / "lab.key"), b"k" * 32)
    assert os.stat(path).st_mode & 0o777 == 0o600 and read_key_file(path) == b"k" * 32
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        read_key_file(path)


def test_pickle_trap_works(tmp_path):
    # the trap would indeed fire if a forged message were unpickled
    pickle.loads(pickle.dumps(_Trap(str(tmp_path / "x")))).close()
    assert (tmp_path / "x").exists()
