"""Large tensors through shared memory (labkit.wire.shm): what arrives is what was sent, and
nothing is left in /dev/shm after a stop, a rank killed mid-pull, or a kernel killed by -9."""

from __future__ import annotations

import gc
import glob
import os
import stat
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import pid_alive

import labkit
from labkit import LabError
from labkit.wire import shm
from labkit.wire.codec import AuthenticationError, Codec, new_key

pytestmark = pytest.mark.timeout(180)

MAKE = """
torch.manual_seed(rank)
big = torch.randn(4, 256, 1024)
bf = torch.randn(1024, 1024).to(torch.bfloat16)
nc = torch.randn(1024, 2048).t()
rg = torch.randn(512, 1024, requires_grad=True)
param = torch.nn.Parameter(torch.randn(512, 1024))
small = torch.arange(10.0)
"""


def expected(rank: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(rank)
    big = torch.randn(4, 256, 1024)
    bf = torch.randn(1024, 1024).to(torch.bfloat16)
    nc = torch.randn(1024, 2048).t()
    rg = torch.randn(512, 1024, requires_grad=True)
    param = torch.nn.Parameter(torch.randn(512, 1024))
    return {"big": big, "bf": bf, "nc": nc, "rg": rg, "param": param, "small": torch.arange(10.0)}


def same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert type(got) is type(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.requires_grad == want.requires_grad
    assert torch.equal(got.detach(), want.detach())


def test_codec_sends_only_the_segment_path_and_the_receiver_unlinks_it():
    directory = shm.new_dir()
    try:
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        codec = Codec(new_key(), directory)
        t = torch.randn(1024, 1024).to(torch.bfloat16).t()  # non-contiguous bf16, 2 MiB
        frames = codec.encode({"type": "done", "value": t})
        assert len(frames) == 2, "the tensor's bytes went as a frame, not through /dev/shm"
        (name,) = os.listdir(directory)
        assert stat.S_IMODE(os.stat(os.path.join(directory, name)).st_mode) == 0o600
        got = codec.decode(frames)["value"]
        assert os.listdir(directory) == []
        same(got, t.contiguous())
        got.add_(1)  # the receiver's tensor is its own (copy-on-write mapping)
        # a message to several receivers, and a small tensor, go through the socket
        assert len(codec.encode({"v": t}, shared=False)) == 3
        assert len(codec.encode({"v": torch.zeros(16)})) == 3
        assert os.listdir(directory) == []
        # a message to several receivers: they map without unlinking, the sender releases
        kept: list[str] = []
        frames = codec.encode({"v": t}, kept=kept)
        receivers = [Codec(codec.key, directory) for _ in range(2)]  # each rank has its own
        first, second = (rx.decode(frames)["v"] for rx in receivers)
        assert os.listdir(directory) == [os.path.basename(kept[0])]
        shm.release(kept)
        assert os.listdir(directory) == []
        first.mul_(2)
        same(second, t.contiguous())
        # a segment that cannot be written (/dev/shm full, say): the bytes go as a frame
        broken = Codec(codec.key, os.path.join(directory, "missing"))
        frames = broken.encode({"v": t})
        assert len(frames) == 3
        same(codec.decode(frames)["v"], t.contiguous())
        # a forged message naming a segment is rejected before anything is unpickled
        forged = Codec(new_key(), directory).encode({"v": torch.zeros(1 << 18)})
        with pytest.raises(AuthenticationError):
            codec.decode(forged)
        assert len(os.listdir(directory)) == 1  # left for the lab's sweep
        shm.sweep(directory)
        assert os.listdir(directory) == []
    finally:
        shm.remove(directory)
    assert not os.path.exists(directory)


def test_a_rank_reuses_a_segment_only_once_the_kernel_freed_what_it_mapped():
    directory = shm.new_dir()
    try:
        key = new_key()
        rank, kernel = Codec(key, directory, recycle=True), Codec(key, directory)
        a = torch.randn(1 << 19)  # 2 MiB
        first = kernel.decode(rank.encode({"v": a}))["v"]
        view = first[: 1 << 10]  # a view keeps the mapping too
        (path,) = (os.path.join(directory, n) for n in os.listdir(directory))
        second = kernel.decode(rank.encode({"v": a * 2}))["v"]
        assert len(os.listdir(directory)) == 2, "a segment the kernel still maps was reused"
        del first
        gc.collect()
        third = kernel.decode(rank.encode({"v": a * 3}))["v"]
        assert len(os.listdir(directory)) == 3, "a segment under a live view was reused"
        assert torch.equal(view, a[: 1 << 10]) and torch.equal(second, a * 2)
        del view
        gc.collect()
        assert os.path.exists(path + shm.FREE)  # given back: the rank may write it again
        second.add_(1)  # the kernel's writes stay its own (copy-on-write)
        fourth = kernel.decode(rank.encode({"v": a * 4}))["v"]
        assert sorted(os.listdir(directory)) == sorted(
            os.path.basename(p) for p in rank.pool.owned
        ), "a freed segment was not reused"
        assert torch.equal(fourth, a * 4) and torch.equal(third, a * 3)
        assert torch.equal(second, a * 2 + 1)
        # a bigger tensor grows a free segment; past the pool's limit segments are unlinked
        del second, third, fourth
        gc.collect()
        rank.pool.limit = 8 << 20
        big = torch.arange(1 << 20, dtype=torch.float64)  # 8 MiB
        got = kernel.decode(rank.encode({"v": big, "w": big + 1}))
        assert torch.equal(got["v"], big) and torch.equal(got["w"], big + 1)
        assert rank.pool.used() <= 8 << 20
        del got
        gc.collect()
        assert all(n.endswith(shm.FREE) for n in os.listdir(directory))
        kept = kernel.decode(rank.encode({"v": a * 5}))["v"]
    finally:
        shm.remove(directory)
    assert not os.path.exists(directory)
    assert torch.equal(kept, a * 5)  # the mapping outlives the lab's directory (a stop)
    del kept
    gc.collect()  # giving back a segment whose directory is gone is quiet


def test_the_kernel_reuses_a_pushed_segment_only_once_every_rank_let_go():
    directory = shm.new_dir()
    key = new_key()
    kernel = Codec(key, directory)
    kernel.shared = shm.Shared()
    ranks = [Codec(key, directory, recycle=True) for _ in range(2)]
    a = torch.randn(1 << 19)  # 2 MiB

    def push(value: torch.Tensor) -> tuple[list[torch.Tensor], str]:
        kept: list[str] = []
        frames = kernel.encode({"v": value}, kept=kept)
        assert len(frames) == 2 and len(kept) == 1, "the tensor did not go through /dev/shm"
        return [rank.decode(frames)["v"] for rank in ranks], kept[0]

    try:
        first, path = push(a)
        second, unanswered = push(a * 2)
        assert unanswered != path, "a segment was written again before every rank answered"
        kernel.shared.settle([path, unanswered], answered=True)
        assert os.stat(path).st_nlink == 3  # the kernel's name and each rank's hold
        third, p3 = push(a * 3)
        assert p3 not in (path, unanswered), "a segment the ranks still map was written again"
        kernel.shared.settle([p3], answered=True)
        view = first[1][:16]  # rank 1 keeps a view of its first tensor
        del first
        gc.collect()
        assert os.stat(path).st_nlink == 2
        fourth, p4 = push(a * 4)
        assert p4 != path, "a segment under a rank's live view was written again"
        kernel.shared.settle([p4], answered=True)
        assert torch.equal(view, a[:16])
        del view
        gc.collect()
        assert os.stat(path).st_nlink == 1
        fifth, p5 = push(a * 5)
        assert p5 == path, "a segment no rank holds was not reused"
        for got, want in ((second, a * 2), (third, a * 3), (fourth, a * 4), (fifth, a * 5)):
            assert all(torch.equal(t, want) for t in got)
        fifth[0].add_(1)  # a rank's writes stay its own (copy-on-write)
        assert torch.equal(fifth[1], a * 5)
        # a message some rank never answered: its segment is left for the restart's sweep
        kernel.shared.settle([p5], answered=False)
        assert path not in kernel.shared.owned and os.path.exists(path)
        # pooled segments stay within the pool's limit; the rest are unlinked when settled
        kernel.shared.limit = kernel.shared.used()
        extra, p6 = push(a * 6)
        assert p6 not in kernel.shared.owned
        kernel.shared.settle([p6], answered=True)
        assert not os.path.exists(p6) and all(torch.equal(t, a * 6) for t in extra)
    finally:
        shm.remove(directory)
        kernel.shared.clear()
    assert kernel.shared.owned == {} and not os.path.exists(directory)
    del second, third, fourth, fifth, extra
    gc.collect()  # dropping a hold whose directory is gone is quiet


def test_a_child_a_rank_forks_holds_the_segments_it_inherited():
    directory = shm.new_dir()
    key = new_key()
    kernel = Codec(key, directory)
    kernel.shared = shm.Shared()
    rank = Codec(key, directory, recycle=True)
    a = torch.randn(1 << 19)
    kept: list[str] = []
    got = rank.decode(kernel.encode({"v": a}, kept=kept))["v"]
    kernel.shared.settle(kept, answered=True)
    (path,) = kept
    want = a.numpy().tobytes()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a DataLoader worker, say: it reads its inherited tensor after the parent let go
        code = 1
        try:
            os.close(w)
            os.read(r, 1)
            code = 0 if got.numpy().tobytes() == want else 3  # numpy: no torch thread pool
            del got
            gc.collect()  # its own hold goes with its mapping
        finally:
            os._exit(code)
    try:
        os.close(r)
        del got
        gc.collect()
        assert os.stat(path).st_nlink == 2, "the forked child holds no link of its own"
        again: list[str] = []
        kernel.encode({"v": a * 2}, kept=again)
        assert again != kept, "a segment a forked child still maps was written again"
        kernel.shared.settle(again, answered=True)
        os.write(w, b"x")
        _, status = os.waitpid(pid, 0)
        pid = 0
        assert os.waitstatus_to_exitcode(status) == 0, "the child's tensor changed under it"
        assert os.stat(path).st_nlink == 1
    finally:
        os.close(w)  # a child still waiting reads end-of-file and ends
        if pid:
            os.waitpid(pid, 0)
        shm.remove(directory)
        kernel.shared.clear()


def test_a_segment_outside_a_lab_directory_is_refused(tmp_path):
    outside = tmp_path / "x"
    outside.write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="not a labkit shared-memory segment"):
        shm.read(str(outside), 64)
    assert outside.exists()


def test_pull_and_push_keep_dtype_values_and_flags_and_leave_nothing():
    lab = labkit.Lab(2, device="cpu")
    directory = lab.channel.shm_dir
    try:
        assert directory is not None and os.path.isdir(directory)
        lab.run(MAKE)
        for name in ("big", "bf", "nc", "rg", "param", "small"):
            got = lab.pull(name)
            for r in (0, 1):
                same(got[r], expected(r)[name].contiguous())
        del got
        gc.collect()
        # what the ranks sent is kept for reuse (given back once the kernel freed it), bounded
        left = os.listdir(directory)
        assert all(name.endswith(shm.FREE) for name in left), left
        held = sum(os.path.getsize(os.path.join(directory, name)) for name in left)
        assert 0 < held <= 2 * shm.POOL_BYTES
        want = expected(5)
        lab.push(a=want["bf"].t().requires_grad_(), b=want["param"], c=want["big"])
        seeded = MAKE.replace("manual_seed(rank)", "manual_seed(5)")
        reference = f"ref = {{'torch': torch}}\nexec({seeded!r}, ref)\n"
        checks = lab.run(
            reference + "\n(a.dtype, a.requires_grad, torch.equal(a.detach(), ref['bf'].t()),"
            " type(b).__name__, b.requires_grad, torch.equal(b.detach(), ref['param'].detach()),"
            " torch.equal(c, ref['big']))"
        ).values_by_rank
        for r in (0, 1):
            assert checks[r] == (torch.bfloat16, True, True, "Parameter", True, True, True)
        # one file for both ranks; a rank's writes stay its own
        lab.run("a.data.mul_(rank + 2)")
        assert lab.pull("float(a.float().sum() / (rank + 2))")[1] == pytest.approx(
            want["bf"].float().sum().item(), rel=1e-2
        )
        # pushed segments are reused once no rank maps them, never while one does
        lab.run("kept = c")
        for k in range(2, 8):
            lab.push(c=want["big"] * k)
        checks = lab.run(
            reference + "torch.equal(kept, ref['big']), torch.equal(c, 7 * ref['big'])"
        )
        assert checks.values_by_rank == {0: (True, True), 1: (True, True)}
        pool = lab.channel.codec.shared
        assert pool is not None and pool.used() <= shm.POOL_BYTES and not pool.busy
        pooled = {os.path.basename(p) for p in pool.owned}
        holds = {n for n in os.listdir(directory) if shm.HOLD in n}
        assert set(os.listdir(directory)) == set(left) | pooled | holds, "a pushed segment was left"
        assert {n.split(shm.HOLD)[0] for n in holds} <= pooled
        assert len(holds) == 2 * 4, "each rank holds the 4 tensors it keeps (a, b, kept and c)"
        assert len(pooled) <= 6, "pushes of the same size did not reuse the segments"
    finally:
        lab.stop()
    assert not os.path.exists(directory)


KILL_MID_PULL = """
import os, signal

class DieAfterTheTensor:
    # pickled after the big tensor: the rank dies once that tensor's segment is written
    def __reduce__(self):
        if os.listdir(shm_dir):
            os.kill(os.getpid(), signal.SIGKILL)
        return (int, ())

value = [torch.randn(1024, 1024), DieAfterTheTensor()]
"""


def test_a_rank_killed_mid_pull_leaves_no_segment():
    lab = labkit.Lab(2, device="cpu")
    directory = lab.channel.shm_dir
    try:
        lab.push(shm_dir=directory)
        lab.run(KILL_MID_PULL)
        with pytest.raises(LabError, match="rank 1 died"):
            lab.pull("value", ranks=[1])
        assert os.listdir(directory) == []  # the restart swept what the dead rank wrote
        assert lab.pull("torch.ones(1024, 1024)")[0].sum().item() == 1024 * 1024
    finally:
        lab.stop()
    assert not os.path.exists(directory)


def test_a_kernel_killed_with_segments_in_flight_leaves_nothing():
    code = textwrap.dedent("""
        import labkit
        from labkit.wire import shm
        lab = labkit.Lab(2, device="cpu")
        lab.push(shm_dir=lab.channel.shm_dir)
        lab.run("from labkit.wire import shm; shm.write(shm_dir, memoryview(bytes(1 << 20)))")
        print("READY", lab.channel.shm_dir, lab.server.proc.pid, *lab.pids.values(), flush=True)
        lab.run("import time; time.sleep(60)")
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    line = ""
    while not line.startswith("READY"):
        line = proc.stdout.readline()
        assert line, "the kernel ended early"
    directory, *pids = line.split()[1:]
    pids = [int(p) for p in pids]
    assert len(os.listdir(directory)) == 2  # one segment per rank, never received
    proc.kill()
    proc.wait()
    proc.stdout.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (
        os.path.exists(directory) or any(pid_alive(p) for p in pids)
    ):
        time.sleep(0.05)
    assert not os.path.exists(directory), "the lab's /dev/shm directory outlived its kernel"
    assert not any(pid_alive(p) for p in pids), "the fork server or a rank outlived its kernel"


def test_a_lab_refused_at_construction_leaves_no_directory():
    before = set(glob.glob(os.path.join(shm.ROOT, shm.PREFIX + "*")))
    with pytest.raises(ValueError, match="threads"):
        labkit.Lab(2, threads=0, start=False)
    assert set(glob.glob(os.path.join(shm.ROOT, shm.PREFIX + "*"))) <= before
