"""The core on 4 CPU ranks with gloo: dispatch, namespaces, output, values, pull/push, errors."""

import os
import sys
import threading
import time

import pytest
import torch

import labkit
from labkit import LabError, RemoteError
from labkit.wire import framed

pytestmark = pytest.mark.timeout(120)


def test_namespace_and_torchrun_env(lab):
    res = lab.run(
        "import os\n"
        "(rank, world_size, local_rank, str(device), dist.get_rank(), dist.get_world_size(),\n"
        " os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['LOCAL_RANK'],\n"
        " os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']) > 0, nn.Linear, F.relu)"
    )
    for r, result in res.items():
        v = result.value
        assert v[:9] == (r, 4, r, "cpu", r, 4, str(r), "4", str(r))
        assert v[9] == "127.0.0.1" and v[10]
        assert v[11] is torch.nn.Linear


def test_torch_is_kept_out_of_the_collector(lab):
    # a full collection that walks torch's objects took ~100 ms, in whichever cell it fell
    frozen = lab.run("import gc\ngc.get_freeze_count()")
    assert all(r.value > 50_000 for r in frozen.values()), frozen


def test_state_persists_and_collective(lab):
    lab.run("x = torch.arange(4.) + rank * 10")
    res = lab.run("dist.all_reduce(x)\nx")
    expected = sum(torch.arange(4.0) + r * 10 for r in range(4))
    for r in range(4):
        assert torch.equal(res[r].value, expected)
        assert res[r].display["tensor"]["shape"] == (4,)
        assert res[r].display["tensor"]["device"] == "cpu"
        assert "float32" in res[r].display["tensor"]["dtype"]


@pytest.mark.parametrize("spec,expected", [("0,2", [0, 2]), ("1-3", [1, 2, 3]), ([3], [3])])
def test_subsets(lab, spec, expected):
    res = lab.run("rank * 100", ranks=spec)
    assert sorted(res) == expected
    assert all(res[r].value == r * 100 for r in expected)


def test_function_gets_namespace_by_parameter_name(lab):
    def step(rank, world_size):
        t = torch.tensor([float(rank)])
        torch.distributed.all_reduce(t)
        return t.item(), world_size

    assert lab.run(step).values_by_rank == {r: (6.0, 4) for r in range(4)}


def test_output_is_tagged_and_fd_level(lab, capfd):
    res = lab.run(
        "import os, subprocess\n"
        "print('py', rank)\n"
        "os.write(1, f'fd {rank}\\n'.encode())\n"
        "os.write(2, f'err {rank}\\n'.encode())\n"
        "subprocess.run(['echo', f'child {rank}'])\n"
        "import sys; sys.stdout.write('partial')"
    )
    out, err = capfd.readouterr()
    for r in range(4):
        for line in (f"[rank {r}] py {r}", f"[rank {r}] fd {r}", f"[rank {r}] child {r}"):
            assert line in out
        assert f"[rank {r}] err {r}" in err
        assert f"[rank {r}] partial" in out
        assert res[r].output.count("\n") >= 3
    # never interleaved mid-line: every line starts with a rank tag
    assert all(line.startswith("[rank ") for line in out.splitlines() if line)


class _Clock:
    """A stdout that remembers when each piece arrived."""

    def __init__(self):
        self.writes = []

    def write(self, text):
        self.writes.append((time.monotonic(), text))

    def flush(self):
        pass


def test_output_streams_while_cell_runs(lab, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(sys, "stdout", clock)
    t0 = time.monotonic()
    lab.run("import time\nprint('early', flush=True)\ntime.sleep(1.5)\nprint('late')", ranks=0)
    early = [t for t, text in clock.writes if "early" in text]
    assert early and early[0] - t0 < 1.0, clock.writes


def test_large_pull_and_push(lab):
    lab.run("big = torch.full((4, 1024, 1024), float(rank))")  # 16 MB per rank
    got = lab.pull("big")
    assert sorted(got) == [0, 1, 2, 3]
    for r, t in got.items():
        assert t.shape == (4, 1024, 1024) and t.device.type == "cpu"
        assert float(t[0, 0, 0]) == r and float(t.sum()) == r * t.numel()
    payload = torch.randn(1024, 1024)
    lab.push(w=payload, lr=0.25)
    sums = lab.run("(w.sum().item(), lr)").values_by_rank
    assert all(abs(v[0] - payload.sum().item()) < 1e-2 and v[1] == 0.25 for v in sums.values())
    assert lab.pull("big.shape", ranks=1) == {1: torch.Size([4, 1024, 1024])}


def test_a_push_over_the_message_limit_says_so_and_sends_nothing(lab, monkeypatch):
    monkeypatch.setattr(framed, "MAX_MESSAGE", 1 << 20)  # the kernel checks before it sends
    lab.push(t=torch.ones(1 << 20))  # 4 MiB of tensor goes through shared memory: allowed
    with pytest.raises(ValueError, match=r"this push is 2 MiB once pickled, over the 1 MiB"):
        lab.push(blob=b"x" * (2 << 20), ranks=[0, 1])
    assert lab.run("'blob' in globals(), float(t.sum())").values_by_rank == {
        r: (False, float(1 << 20)) for r in range(4)
    }


def test_a_value_limit_counts_only_what_travels_in_the_message(lab):
    shm_dir = lab.channel.shm_dir

    def busy():  # segments not free for reuse: mapped by the kernel, or lost
        return {n for n in os.listdir(shm_dir) if not n.endswith(".free")}

    lab.run("import labkit.rank.worker as w\nold, w.MAX_VALUE_BYTES = w.MAX_VALUE_BYTES, 1 << 20")
    try:
        big = lab.run("torch.ones(1 << 20)", ranks=0)  # 4 MiB, through /dev/shm: not counted
        assert big[0].value_error is None and float(big[0].value.sum()) == 1 << 20
        mapped = busy()
        res = lab.run("(torch.ones(1 << 20), b'x' * (2 << 20))", ranks=0)
        assert res[0].value is None and res[0].value_error.endswith(
            "ValueError: it is 2 MiB once pickled, over the 1 MiB limit (tensors that go "
            "through shared memory do not count)"
        )
        assert busy() == mapped  # the segment written for the tensor is free again
        files = len(os.listdir(shm_dir))
        again = lab.run("torch.full((1 << 20,), 2.0)", ranks=0)  # and it is reused
        assert float(again[0].value[0]) == 2.0 and len(os.listdir(shm_dir)) == files
    finally:
        lab.run("w.MAX_VALUE_BYTES = old")


def test_pull_missing_name_names_the_rank(lab):
    lab.run("only_on_one = 1", ranks=1)
    with pytest.raises(RemoteError, match="NameError") as info:
        lab.pull("only_on_one")
    assert info.value.root in (0, 2, 3) and 1 not in info.value.errors


def test_error_names_rank_and_root_cause(lab):
    res = lab.run(
        "import time\n"
        "if rank == 2:\n"
        "    1 / 0\n"
        "time.sleep(0.3)\n"
        "if rank == 3:\n"
        "    raise ValueError('later')\n"
    )
    assert res[2].error["type"] == "ZeroDivisionError" and res[3].error["type"] == "ValueError"
    assert res[0].ok and res[1].ok
    with pytest.raises(RemoteError) as info:
        res.raise_for_errors()
    assert info.value.root == 2
    assert "rank 2 raised ZeroDivisionError" in str(info.value)
    text = "\n".join(info.value._render_traceback_())
    assert "rank 2 (root cause)" in text and "<cell-" in text and "1 / 0" in text
    assert "worker.py" not in text and "user_code.py" not in text  # labkit's own frames


def test_syntax_error_is_local_and_lab_stays_usable(lab):
    for _ in range(2):  # the kernel keeps texts that parsed, never one that did not
        with pytest.raises(SyntaxError):
            lab.run("def broken(:\n  pass")
    assert lab.run("rank").values_by_rank == {0: 0, 1: 1, 2: 2, 3: 3}


def test_a_text_run_again_is_not_compiled_again_and_keeps_its_lines(lab):
    code = "n = globals().get('n', 0) + 1\nif n == 3:\n    raise ValueError('third run')\nn * 10"
    assert lab.run(code).values_by_rank == {0: 10, 1: 10, 2: 10, 3: 10}
    assert lab.run(code).values_by_rank == {0: 20, 1: 20, 2: 20, 3: 20}  # its last expression
    kept = (
        "from labkit.rank import user_code\n"
        "sum(c.startswith('n = globals()') for c in user_code._COMPILED)"
    )
    assert lab.run(kept).values_by_rank == {0: 1, 1: 1, 2: 1, 3: 1}
    lab.run("import linecache\nlinecache.clearcache()")
    res = lab.run(code)
    assert {r: res[r].error["type"] for r in res} == {
        0: "ValueError",
        1: "ValueError",
        2: "ValueError",
        3: "ValueError",
    }
    assert "raise ValueError('third run')" in res[1].error["traceback"]  # the line, shown


def test_a_rank_keeps_the_code_of_its_latest_texts_only(monkeypatch):
    from labkit.rank import user_code

    monkeypatch.setattr(user_code, "KEEP_COMPILED", 3)
    monkeypatch.setattr(user_code, "_COMPILED", {})
    ns: dict = {}
    for i in range(5):
        assert user_code.run_code(f"x = {i}\nx + 1", f"<cell-{i}>", ns) == i + 1
    assert list(user_code._COMPILED) == ["x = 2\nx + 1", "x = 3\nx + 1", "x = 4\nx + 1"]


def test_unpicklable_value_is_shown_not_lost(lab):
    res = lab.run("import threading\nthreading.Lock()", ranks=0)
    assert res[0].ok and res[0].value is None
    assert "could not be sent" in res[0].value_error
    assert "lock" in res[0].display["text"]
    lab.run("lk = threading.Lock()", ranks=0)
    with pytest.raises(LabError, match="could not be sent"):
        lab.pull("lk", ranks=0)


def test_classes_defined_on_ranks_come_back(lab):
    res = lab.run("class P:\n    def __init__(self, v): self.v = v\nP(rank)")
    assert res[3].value.v == 3


@pytest.mark.usefixtures("load")
def test_interrupt_stops_busy_ranks_and_keeps_state(lab):
    lab.run("kept = rank + 1")
    timer = threading.Timer(1.0, lambda: __import__("_thread").interrupt_main())
    timer.start()
    t0 = time.monotonic()
    res = lab.run("while True:\n    pass")
    assert time.monotonic() - t0 < 5
    assert all(r.error["type"] == "KeyboardInterrupt" for r in res.values())
    assert lab.run("kept").values_by_rank == {0: 1, 1: 2, 2: 3, 3: 4}


def test_trace_records_collectives(lab):
    lab.run("t = torch.ones(1000)\ndist.all_reduce(t)\ndist.broadcast(t, src=1)\ndist.barrier()")
    recs = lab.trace()
    for r in range(4):
        ops = [(x.op, x.seq, x.bytes) for x in recs if x.rank == r]
        assert [o for o, _, _ in ops] == ["all_reduce", "broadcast", "barrier"]
        assert ops[0][2] == 4000 and ops[1][2] == 4000
        assert all(x.end >= x.start for x in recs)
    assert {x.peer for x in recs if x.op == "broadcast"} == {1}


def test_status_report(lab):
    report = lab.status_report()
    assert report["world_size"] == 4 and report["backend"] == "gloo"
    assert [r["rank"] for r in report["ranks"]] == [0, 1, 2, 3]
    assert all(r["alive"] for r in report["ranks"])
    assert os.path.isdir(report["log_dir"])


def test_current_is_the_last_started(lab):
    assert labkit.current() is lab


def test_function_sees_rank_names_it_did_not_import(lab):
    namespace = {}
    exec(  # a function whose module (like a notebook without these imports) lacks dist/torch
        "def f():\n    t = torch.ones(1)\n    dist.all_reduce(t)\n    return t.item(), str(device)",
        namespace,
    )
    assert lab.run(namespace["f"]).values_by_rank == {r: (4.0, "cpu") for r in range(4)}
