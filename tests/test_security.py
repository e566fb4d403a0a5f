"""Two labs on one machine stay apart; forged messages are rejected before unpickling.

- a message signed with the wrong key never reaches `pickle.loads` (its payload would create
  a file if it did), on a rank, on the kernel's side socket and on an attach endpoint, and the
  rejection is logged or warned about;
- lab B's fork server cannot signal lab A's ranks; their sockets, logs and keys are private;
- nothing a lab starts listens on a non-loopback address;
- over the network (`Lab.attach`): a replayed message, a host not in `allow`, a rank attaching
  twice or with another world size are rejected and warned of; waiting shows how many ranks
  arrived and gives up naming the missing ones; a rank says what is wrong with its key file.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time

import pytest
import zmq
from conftest import pid_alive

import labkit
from labkit import LabkitWarning
from labkit.wire.codec import AuthenticationError, Codec, new_key
from labkit.wire.key_file import read_key_file, write_key_file
from labkit.wire.messages import Attach

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


# -- over the network: replays, hosts, and who may attach ---------------------------------------


def test_a_replayed_message_is_rejected_before_unpickling(tmp_path):
    key = new_key()
    sender, receiver = Codec(key), Codec(key)
    first = sender.encode({"type": "ping", "id": 1})
    second = sender.encode({"type": "ping", "id": 2})
    assert receiver.decode(second)["id"] == 2  # out of order (ctrl and side) is fine...
    assert receiver.decode(first)["id"] == 1
    trap = tmp_path / "unpickled"
    captured = sender.encode({"type": "exec", "trap": _Trap(str(trap))})
    receiver.decode(captured)
    trap.unlink()
    for frames in (first, second, captured):  # ...a message seen before is not
        with pytest.raises(AuthenticationError, match="replayed message"):
            receiver.decode(frames)
    assert not trap.exists()
    assert Codec(key).decode(first)["id"] == 1  # another receiver has its own memory


def _attach_frames(codec, rank=0, world_size=2):
    return codec.encode(
        Attach(
            type="attach",
            rank=rank,
            gen=1,
            world_size=world_size,
            host="fakehost",
            pid=4242,
            gpus=0,
            nccl=False,
            cpus=1,
        )  # fmt: skip
    )


def _dealer(lab):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(lab.channel.endpoint("ctrl"))
    return sock


def _answer(sock, key, timeout_ms=5000):
    assert sock.poll(timeout_ms), "the lab did not answer"
    return Codec(key).decode(sock.recv_multipart())


def test_attach_shows_progress_rejects_a_replay_and_names_the_missing_ranks(capsys):
    lab = labkit.Lab.attach(2, wait=False)
    sock = _dealer(lab)
    try:
        key = lab.channel.codec.key
        frames = _attach_frames(Codec(key), rank=0)
        sock.send_multipart(frames)
        sock.send_multipart(frames)  # the same signed bytes again: a replay
        with pytest.warns(LabkitWarning, match="replayed message"):
            with pytest.raises(labkit.LabError) as err:
                lab.wait_attached(3)
        text = str(err.value)
        assert "only 1 of 2 ranks attached (fakehost: 1) in 3 s (missing: rank 1)" in text
        assert "torchrun --nnodes=1 --nproc-per-node=2" in text and "1 message(s)" in text
        assert "labkit: 1 of 2 ranks attached (fakehost: 1)" in capsys.readouterr().out
        answer = _answer(sock, key)  # the rank that came is sent away, not left waiting
        assert answer["type"] == "refused" and "gave up" in answer["why"]
    finally:
        sock.close()
        lab.stop()


def test_a_rank_attaching_twice_is_turned_away():
    lab = labkit.Lab.attach(2, wait=False)
    first, second = _dealer(lab), _dealer(lab)
    try:
        key = lab.channel.codec.key
        first.send_multipart(_attach_frames(Codec(key), rank=0))
        time.sleep(0.3)
        second.send_multipart(_attach_frames(Codec(key), rank=0))
        with pytest.warns(LabkitWarning, match="turned away rank 0 from fakehost"):
            with pytest.raises(labkit.LabError, match="only 1 of 2"):
                lab.wait_attached(3)
        answer = _answer(second, key)
        assert answer["type"] == "refused" and "attached already" in answer["why"]
    finally:
        first.close()
        second.close()
        lab.stop()


def test_a_world_size_that_does_not_match_fails_at_once():
    lab = labkit.Lab.attach(2, wait=False)
    sock = _dealer(lab)
    try:
        key = lab.channel.codec.key
        sock.send_multipart(_attach_frames(Codec(key), rank=3, world_size=4))
        t0 = time.monotonic()
        with pytest.raises(labkit.LabError, match=r"WORLD_SIZE=4 \(rank 3 on fakehost\).*wants 2"):
            lab.wait_attached(60)
        assert time.monotonic() - t0 < 20, "it waited for the timeout instead"
        assert _answer(sock, key)["type"] == "refused"
    finally:
        sock.close()
        lab.stop()


def test_a_connection_from_a_host_not_allowed_is_rejected_and_warned(tmp_path):
    lab = labkit.Lab.attach(2, wait=False, allow=["10.213.0.0/24"])
    sock = _dealer(lab)  # from 127.0.0.1
    try:
        trap = tmp_path / "unpickled"
        sock.send_multipart(forged(str(trap), type="attach", world_size=2))
        sock.send_multipart(_attach_frames(Codec(lab.channel.codec.key)))  # even with the key
        with pytest.warns(LabkitWarning, match=r"from 127\.0\.0\.1, not one of the hosts"):
            with pytest.raises(labkit.LabError, match="0 of 2 ranks attached"):
                lab.wait_attached(3)
        assert lab.channel.rejected == 2 and not trap.exists()
    finally:
        sock.close()
        lab.stop()


def test_allow_takes_addresses_networks_and_names():
    from labkit.kernel.channel.admission import parse_allow

    nets = parse_allow(["10.1.2.3", "10.213.0.0/24", "localhost"])
    assert [str(n) for n in nets[:2]] == ["10.1.2.3/32", "10.213.0.0/24"]
    assert any(n.network_address.is_loopback for n in nets[2:])
    with pytest.raises(ValueError, match="neither an address, a network"):
        parse_allow(["no-such-host.invalid"])


@pytest.mark.parametrize("case", ["missing", "world-readable", "not a key"])
def test_a_rank_says_what_is_wrong_with_its_key_file(tmp_path, case):
    path = tmp_path / "lab.key"
    if case != "missing":
        path.write_text("zz\n" if case == "not a key" else "ab" * 32 + "\n")
        path.chmod(0o644 if case == "world-readable" else 0o600)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="1", LABKIT_PREWARM="0")  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "labkit.rank", "--connect", "127.0.0.1:1", "--key-file", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    expected = {
        "missing": "not found on this node",
        "world-readable": "readable by others (mode 0o644); run chmod 600",
        "not a key": "does not hold a lab key",
    }[case]
    assert out.returncode == 1 and expected in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
