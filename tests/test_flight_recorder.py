"""torch's Flight Recorder through labkit: `labkit.flight_recorder(lab)`, `%lab logs --fr`, and
the last collectives in `lab.stacks()` and in a stuck cell's message (2 CPU ranks, gloo; idle
and loaded)."""

from __future__ import annotations

import threading
import time

import pytest
from IPython.core.error import UsageError

import labkit
from labkit import LabError
from labkit.kernel.magics import LabMagics
from labkit.rank import flight_recorder as on_rank

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def lab(load):  # conftest's `load`: every test runs on a quiet CPU, then on a saturated one
    lab = labkit.Lab(2, device="cpu")
    yield lab
    lab.stop()


def _last_seq(lab):
    got = labkit.flight_recorder(lab, last=1)
    return {r: (e[-1]["seq"] if e else 0) for r, e in got.items()}


def test_each_rank_lists_its_recent_collectives_between_cells(lab, capsys):
    before = _last_seq(lab)
    lab.run("t = torch.ones(4)\nfor _ in range(3): dist.all_reduce(t)\ndist.broadcast(t, 0)")
    got = labkit.flight_recorder(lab, last=4)
    assert sorted(got) == [0, 1]
    for r, entries in got.items():
        assert [e["op"] for e in entries] == ["all_reduce"] * 3 + ["broadcast"]
        assert [e["seq"] for e in entries] == [before[r] + i for i in range(1, 5)]
        assert all(e["state"] == "completed" and e["input_sizes"] == [[4]] for e in entries)
        assert all(e["group"] == "default_pg" for e in entries)
    assert got.verdict.kind == "completed" and got.verdict.missing == ()
    text = str(got)
    assert text.startswith("Hang verdict (Flight Recorder): every rank entered and completed")
    assert "\n--- rank 0 ---\n" in text
    assert f"#{before[0] + 4} broadcast on default_pg" in text
    assert sorted(labkit.flight_recorder(lab, ranks="1", last=2)) == [1]
    with pytest.raises(ValueError, match="last must be a whole number of at least 1"):
        labkit.flight_recorder(lab, last=0)

    magics = LabMagics(shell=None)
    magics.lab("logs --fr --lines 1")
    shown = capsys.readouterr().out
    assert shown.startswith("Hang verdict (Flight Recorder): every rank entered and completed")
    assert f"(the last: broadcast #{before[1] + 4} of group 0 (default_pg)" in shown
    assert f"#{before[1] + 4} broadcast" in shown and "--- rank 1 ---" in shown
    assert shown.count("broadcast") == 3 and "all_reduce" not in shown
    with pytest.raises(UsageError, match="needs a RANK"):
        magics.lab("logs")
    with pytest.raises(UsageError, match="out of range"):
        magics.lab("logs 5 --fr")


def test_the_stacks_show_rank_0_inside_all_reduce_n_while_rank_1_never_called_it(lab, tmp_path):
    flag = str(tmp_path / "go")
    lab.run("dist.all_reduce(torch.ones(1))")  # so rank 1 has a last collective to show
    seq = _last_seq(lab)[0] + 1
    entered = f"#{seq} all_reduce on default_pg: scheduled"
    found = []

    def poll():  # from a thread while the cell runs, as a notebook user would
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not found:
            stacks = lab.stacks(timeout=10)
            if entered in stacks[0]:
                found.append(stacks)
            time.sleep(0.05)
        open(flag, "w").close()  # then rank 1 joins, and the cell ends normally

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    res = lab.run(
        "import os, time\nt = torch.ones(2)\n"
        f"if rank == 1:\n    while not os.path.exists({flag!r}):\n        time.sleep(0.02)\n"
        "dist.all_reduce(t)\nt"
    )
    thread.join()
    assert all(r.error is None for r in res.values())
    assert found, "rank 0's Flight Recorder never showed it inside the all_reduce"
    stacks = found[0]
    assert "Flight Recorder (torch), last" in stacks[1]
    assert f"#{seq - 1} " in stacks[1] and f"#{seq} " not in stacks[1]  # rank 1 never entered
    # the same, merged: printed first while the cell runs, with the line rank 1 is on
    assert stacks.verdict.kind == "missing" and stacks.verdict.key == ("0", seq)
    assert stacks.verdict.missing == (1,) and stacks.verdict.entered == (0,)
    verdict = str(stacks).split("--- rank 0 ---")[0]
    assert verdict.startswith("Hang verdict (Flight Recorder): rank 1 never entered all_reduce")
    assert "; now at line " in verdict  # its wait loop, lines 4-5 of the cell
    after = labkit.flight_recorder(lab, last=1)  # both completed it once rank 1 came
    assert all(e[-1]["seq"] == seq and e[-1]["state"] == "completed" for e in after.values())


def test_the_verdict_between_cells_names_the_rank_that_never_entered(lab, capsys):
    # so rank 1 has a last collective to name, whatever an earlier test left (restarted ranks
    # have none)
    lab.run("dist.all_reduce(torch.ones(1))")
    seq = _last_seq(lab)[0] + 1
    # rank 0 starts an all_reduce it does not wait for; rank 1 never calls it: the cell ends
    lab.run("pending = dist.all_reduce(torch.ones(5), async_op=True) if rank == 0 else None")
    try:
        got = labkit.flight_recorder(lab, last=1).verdict
        assert got.kind == "missing" and got.key == ("0", seq) and got.op == "all_reduce"
        assert got.missing == (1,) and got.entered == (0,)
        LabMagics(shell=None).lab("logs --fr --lines 1")
        assert capsys.readouterr().out.startswith(
            f"Hang verdict (Flight Recorder): rank 1 never entered all_reduce #{seq} of group 0 "
            "(default_pg), in [[5]] float; rank 0 entered it.\n"
            f"  rank 1: last entered #{seq - 1} of that group (completed)\n"
        )
    finally:  # rank 1 joins whatever happened: a pending all_reduce left behind made the next
        # test's collective a mismatch that aborted rank 1 (gloo: "8 vs 4")
        lab.run("if rank == 1:\n    dist.all_reduce(torch.ones(5))\nelse:\n    pending.wait()")
    assert labkit.flight_recorder(lab, last=1).verdict.kind == "completed"


def test_a_stuck_cell_says_which_collective_rank_0_entered(lab):
    lab.run("dist.all_reduce(torch.ones(1))")  # rank 1's last collective, as above
    seq = _last_seq(lab)[0] + 1
    with pytest.raises(LabError) as err:
        lab.run("t = torch.ones(3)\nif rank == 0:\n    dist.all_reduce(t)")
    text = str(err.value)
    assert f"rank 0 waits in all_reduce #{seq}" in text  # the watchdog's verdict
    if "no answer within" not in text:  # a saturated machine may leave the stacks out
        # every rank's recorder merged, first after the watchdog's reason: rank 1 finished
        # the cell without entering the all_reduce rank 0 waits in
        assert text.splitlines()[1] == (
            f"Hang verdict (Flight Recorder): rank 1 never entered all_reduce #{seq} of group 0 "
            "(default_pg), in [[3]] float; rank 0 entered it."
        ), text
        assert f"  rank 1: last entered #{seq - 1} of that group (completed)" in text
        assert "Flight Recorder (torch), last" in text
        assert f"#{seq} all_reduce on default_pg: scheduled, in [[3]] float" in text
    lab.run("x = 1")  # the ranks were restarted; the lab goes on


def test_entries_say_why_when_the_recorder_is_off_or_missing(monkeypatch):
    monkeypatch.setenv(on_rank.ENV, "0")
    assert "is off" in on_rank.entries() and on_rank.tail_text() == ""
    monkeypatch.setenv(on_rank.ENV, "2000")

    def missing():
        raise RuntimeError("this torch has no Flight Recorder dump")

    monkeypatch.setattr(on_rank, "_dump", missing)
    assert "could not be read: RuntimeError: this torch has no" in on_rank.entries()
    assert on_rank.tail_text().startswith("Flight Recorder (torch): the Flight Recorder could")


def test_an_entry_reads_as_one_line():
    raw = {
        "collective_seq_id": 7,
        "p2p_seq_id": 0,
        "is_p2p": False,
        "profiling_name": "gloo:all_reduce",
        "process_group": ["0", "default_pg"],
        "state": "scheduled",
        "retired": False,
        "input_sizes": [[4]],
        "output_sizes": [[4]],
        "input_dtypes": ["Float"],
    }
    line = on_rank.entry_text(on_rank._entry(raw))
    assert line == "#7 all_reduce on default_pg: scheduled, in [[4]] float"
    done = on_rank._entry(dict(raw, retired=True, duration_ms=1.5))
    assert on_rank.entry_text(done).endswith("completed, in [[4]] float, 1.500 ms")


def test_a_dump_between_cells_waits_for_gloo_to_retire_what_already_returned(monkeypatch):
    # gloo retires an entry on its own thread a moment after wait() returns: the dump the
    # kernel asks for between cells reads again until it is retired; the heartbeat's does not
    monkeypatch.setenv(on_rank.ENV, "200")
    raw = {"collective_seq_id": 4, "profiling_name": "gloo:broadcast", "state": "scheduled"}
    reads = []

    def dump():
        reads.append(1)
        return {"entries": [dict(raw, retired=len(reads) >= 3)]}

    monkeypatch.setattr(on_rank, "_dump", dump)
    assert [e["state"] for e in on_rank.entries(last=1)] == ["completed"] and len(reads) == 3
    reads.clear()
    assert "#4 broadcast on ?: scheduled" in on_rank.tail_text() and len(reads) == 1

    monkeypatch.setattr(on_rank, "_dump", lambda: {"entries": [raw]})  # open for good
    start = time.monotonic()
    assert on_rank.entries(last=1, settle=0.05)[0]["state"] == "scheduled"
    assert 0.05 <= time.monotonic() - start < 5


def _two_recorders(monkeypatch, gloo: dict, nccl: dict) -> None:
    import json
    import pickle

    monkeypatch.setenv(on_rank.ENV, "200")
    monkeypatch.setattr(
        on_rank,
        "_dumps",
        lambda: (
            lambda c, s, a: pickle.dumps(gloo),
            lambda c, a: json.dumps(gloo),
            lambda c, s, a: pickle.dumps(nccl),
            lambda c, a: json.dumps(nccl),
        ),
    )


def _fr(record_id: int, name: str, t_ns: int, seq: int, group: str = "0") -> dict:
    return {
        "record_id": record_id,
        "collective_seq_id": seq,
        "profiling_name": name,
        "time_created_ns": t_ns,
        "process_group": [group, "default_pg"],
        "input_sizes": [[4]],
        "input_dtypes": ["Float"],
        "output_sizes": [[4]],
        "output_dtypes": ["Float"],
        "retired": True,
    }


def test_a_rank_with_gloo_and_nccl_groups_reads_both_recorders(monkeypatch):
    """`cpu:gloo,cuda:nccl`: NCCL's groups keep their own recorder (dumped by
    `_dump_nccl_trace`; torch has it only where NCCL is built). DDP's buckets on CUDA are there,
    so both dumps are read, their entries merged oldest first and their groups' status kept. The
    default group has both backends: the same name in both recorders, with each backend's own
    sequence numbers, so NCCL's entries and status are kept apart ("0@nccl")."""
    gloo = {
        "entries": [_fr(0, "gloo:all_reduce", 10, 1), _fr(1, "gloo:broadcast", 30, 2)],
        "pg_status": {"0": {"last_enqueued_collective": 2}},
    }
    nccl = {
        "entries": [_fr(0, "nccl:all_reduce", 20, 1)],
        "pg_status": {"0": {"last_enqueued_collective": 1}},
    }
    _two_recorders(monkeypatch, gloo, nccl)
    names = ["gloo:all_reduce", "nccl:all_reduce", "gloo:broadcast"]
    assert [e["profiling_name"] for e in on_rank.raw_entries()] == names
    got = on_rank.entries(settle=0)
    assert [e["op"] for e in got] == ["all_reduce", "all_reduce", "broadcast"]
    # two collectives #1 of group "0", one per backend: the hang verdict must not match them
    assert [(e["group_id"], e["seq"]) for e in got] == [("0", 1), ("0@nccl", 1), ("0", 2)]
    assert on_rank.enqueued() == {
        "0": {"last_enqueued_collective": 2},
        "0@nccl": {"last_enqueued_collective": 1},
    }
    # a torch without NCCL: gloo's recorder alone, as before
    gloo_only = (*on_rank._dumps()[:2], None, None)
    monkeypatch.setattr(on_rank, "_dumps", lambda: gloo_only)
    assert [e["profiling_name"] for e in on_rank.raw_entries()] == names[::2]


def test_ddp_records_from_nccl_are_found_whatever_gloos_record_ids(monkeypatch):
    """record_id counts per recorder: a cell that ends on a gloo collective (record_id 50) must
    not hide the next cell's NCCL buckets (record_ids 1-3) from ddp_tracing.collect."""
    from labkit.rank import ddp_tracing
    from labkit.rank.trace_state import STATE

    now = time.time_ns()
    gloo = {"entries": [_fr(i, "gloo:broadcast", now - 10**9 + i, i + 1) for i in range(50)]}
    nccl: dict = {"entries": []}
    _two_recorders(monkeypatch, gloo, nccl)
    monkeypatch.setattr(ddp_tracing, "_group_ranks", lambda: {"0": (0, 1)})
    monkeypatch.setattr(on_rank, "enqueued", lambda: None)
    monkeypatch.setattr(STATE, "enabled", True)
    monkeypatch.setattr(STATE, "fr_last", {})
    monkeypatch.setattr(STATE, "records", {})
    monkeypatch.setattr(STATE, "seq", {})
    ops = []
    for cell, added in enumerate(([(0, "nccl")], [(1, "nccl"), (2, "nccl"), (3, "nccl")]), 1):
        ddp_tracing.begin()
        monkeypatch.setattr(STATE, "cell", cell)
        for rid, _ in added:
            nccl["entries"].append(_fr(rid, "nccl:all_reduce", time.time_ns(), rid + 1))
        if cell == 1:  # the cell ends on a gloo collective
            gloo["entries"].append(_fr(50, "gloo:all_gather", time.time_ns(), 51))
        ops.append([r.op for r in ddp_tracing.collect()])
    assert ops == [["all_reduce", "all_gather"], ["all_reduce"] * 3]
