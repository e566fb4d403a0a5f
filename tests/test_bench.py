"""The benchmark's kernel measurements run, and time what they say they time (not their speed:
speed targets live in `python -m labkit.bench`, never in timed tests)."""

from __future__ import annotations

import math
import os

import pytest

from labkit.tools.bench_kernel import kernel_cells

pytestmark = pytest.mark.timeout(240)


def test_kernel_cells_time_a_lab_run_inside_a_cell():
    out = kernel_cells(2, cells=5, pairs=3, later_s=0.1, paced=2, pause_s=0.3)
    times = ("own", "ranks", "rot_own", "rot_ranks", "bare", "echo", "magic")
    times += ("paced_own", "paced_ranks", "paced_echo_own", "paced_echo")
    times += ("inside_at_once_s", "inside_later_s")
    cpu = ("cpu_own_s", "cpu_cell_s", "cpu_ranks_s")
    assert set(out) == {*times, *cpu, "rss_growth", "echo_trips", "bare_trips", "magic_calls"}
    # every echo and bare cell, warm-up and timed, made its round trip, and the magic that does
    # nothing ran as often (a cell that failed to reach its magic would be timed as nothing);
    # the echo also ran in the paced pairs
    assert out["bare_trips"] == out["magic_calls"] == 20 + 3
    assert out["echo_trips"] == 20 + 3 + 2
    # the pause comes before a cell, never inside its timing
    assert all(out[k] < 0.3 for k in ("paced_own", "paced_ranks", "paced_echo")), out
    for key in times + cpu:
        assert math.isfinite(out[key]) and out[key] > 0, out
    # a lab.run on 2 ranks is a round trip to two processes: far more than 50 us on any machine
    # (a timer around the wrong statement, or the sleep left out of `later`, would show here)
    assert out["inside_at_once_s"] > 50e-6 and out["inside_later_s"] > 50e-6, out
    assert out["inside_later_s"] < 0.1, out  # the sleep before it is not timed
    # each rank runs Python for a cell (a timer read from the wrong process would show ~0),
    # and a cell's CPU is at most its wall time on every core
    assert 2 * 20e-6 < out["cpu_ranks_s"] < 2 * out["ranks"] * os.cpu_count(), out
    assert out["cpu_own_s"] < out["own"] * os.cpu_count(), out


@pytest.mark.timeout(120)
def test_the_trace_cost_cell_traces_every_other_op_and_restores_the_switch():
    import labkit
    from labkit.tools.bench_labkit import TRACE_COST

    def all_reduces(lab):
        ops = [r for r in lab.trace() if r.kind == "comm" and r.op == "all_reduce"]
        return [sum(r.rank == k for r in ops) for k in range(2)]

    with labkit.Lab(2, device="cpu") as lab:
        for tracing, warm_up in ((False, 0), (True, 20)):  # the 20 warm-up ops follow the switch
            lab.trace(enabled=tracing)
            lab.run(TRACE_COST.replace("{reps}", "6") + "timed(0)")
            assert all_reduces(lab) == [warm_up + 6] * 2  # 6 of the 12 timed ops traced
            lab.run("dist.all_reduce(torch.ones(1))")
            assert all_reduces(lab) == [int(tracing)] * 2  # the switch as it was before


@pytest.mark.timeout(120)
def test_the_wrapper_cost_script_runs_the_traced_call_in_one_process():
    from labkit.tools.bench_labkit import WRAPPER_COST, _fresh

    added = _fresh(WRAPPER_COST.replace("{blocks}", "3"))  # raises if the script failed
    assert math.isfinite(added) and abs(added) < 0.002  # seconds per call: microseconds


@pytest.mark.timeout(120)
def test_an_echo_group_round_trips_to_every_process_and_ends_them():
    from labkit.tools.bench_others import EchoGroup

    with EchoGroup(3) as group:
        tmp = group.tmp
        for _ in range(5):
            group.roundtrip()
        assert group.trips == 5
        # each process echoed each message once: nothing more waits once a round trip returns
        assert not group.router.poll(50)
    # each left when told (not killed), and was waited for
    assert [p.returncode for p in group.procs] == [0, 0, 0]
    assert not os.path.exists(tmp)


def test_gap_rows_and_split_read_each_cell_against_its_own_floor():
    from labkit.tools.bench_kernel import gap_rows, split_text

    # distinct figures (seconds), so a row read against the wrong floor shows
    k = dict(paced_own=0.0060, paced_ranks=0.0075, paced_echo_own=0.0061, paced_echo=0.0065)
    k.update(rot_own=0.0050, rot_ranks=0.0063, magic=0.0052, echo=0.0057, bare=0.0060)
    rows = {r[0]: r[1:] for r in gap_rows(k, 4)}
    assert rows["the same, 100 ms pause before each cell"][2] == "+1.50 ms"
    assert rows["no-op cell on 4 echo procs, paced so"][1:3] == ("6.1 ms kernel no-op", "+0.40 ms")
    assert rows["no-op %%ranks cell, in the rotation:"][2] == "+1.30 ms"
    assert rows["- cell magic that does nothing"][2] == "+0.20 ms"
    assert rows["- cell magic: echo from 4 plain procs"][2] == "+0.70 ms"
    assert rows["- cell magic: bare loop to the ranks"][2] == "+1.00 ms"
    # the split's four parts, each over the cell before it, add up to the rotation's gap
    text = split_text(k, 4)
    for part in ("gap, +1.30 ms", "any cell magic +0.20 ms", "back +0.50 ms", "signing +0.30 ms"):
        assert part in text, text
    assert "machinery +0.30 ms" in text, text


def test_the_breakdown_cost_alone_prints_its_figure(capsys):
    from labkit.tools.bench import main

    assert main(["--breakdown", "--ranks", "2"]) == 0
    line = capsys.readouterr().out
    assert "a cell of 2 ranks x 2000 records" in line and " ms of CPU" in line
