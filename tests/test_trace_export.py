"""save_trace: a trace as Chrome Trace Event JSON (Perfetto, chrome://tracing, HTA).

Hand-made records check the structure, units (microseconds), tracks, args and flow pairing
without processes; one test exports a real 2-rank gloo lab's cell and reloads the file. Every
file written is checked against the rules a viewer needs (`check_viewer_rules`).
"""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict

import pytest
import torch
from test_views_fakes import FakeLab

import labkit
from labkit.kernel.inspection.profiling import last_profile, profile_start, profiler_events
from labkit.kernel.magics import LabMagics
from labkit.rank.profiling import PROFILE_NAME, ProfiledCell
from labkit.views.trace_export import chrome_trace, flow_pairs, save_trace, trace_events
from labkit.wire.records import CommRecord, SpanRecord, to_dict

pytestmark = pytest.mark.filterwarnings("error::labkit.views.ViewWarning")
T0 = 1000.0  # kernel clock, seconds


def check_viewer_rules(doc: dict) -> list[dict]:
    """What Perfetto and chrome://tracing need of a file; returns its events.

    Every event has ph, ts, pid, tid; "X" has name and dur >= 0; slices of a track nest or are
    disjoint; each flow id has one "s" and then one "f" (bound to its enclosing slice with
    bp "e"), each inside an "X" slice of its own track.
    """
    events = doc["traceEvents"]
    assert isinstance(events, list) and events
    slices = defaultdict(list)
    for e in events:
        for key in ("ph", "ts", "pid", "tid"):
            assert key in e, f"{key} missing in {e}"
        assert isinstance(e["ts"], int | float) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["name"] and e["dur"] >= 0, e
            slices[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
        else:
            assert e["ph"] in ("M", "s", "f"), e
    for track in slices.values():
        open_ends: list[float] = []
        for start, end in sorted(track, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1], f"slices overlap on a track: {track}"
            open_ends.append(end)
    flows = defaultdict(list)
    for e in events:
        if e["ph"] in ("s", "f"):
            flows[e["id"]].append(e)
            inside = [a <= e["ts"] <= b for a, b in slices[(e["pid"], e["tid"])]]
            assert any(inside), f"flow event outside any slice of its track: {e}"
    for fid, pair in flows.items():
        assert [e["ph"] for e in pair] == ["s", "f"], f"flow {fid} does not pair up: {pair}"
        start, finish = pair
        assert finish.get("bp") == "e" and start["cat"] == finish["cat"]
        assert start["name"] == finish["name"]
    return events


def _records() -> list:
    g = (0, 1, 2)
    return [
        SpanRecord(rank=0, name="forward", start=T0, end=T0 + 0.010, cell=3),
        CommRecord(rank=0, op="all_reduce", seq=5, group=g, bytes=4096, dtype="float32",
                   shape=(1024,), start=T0 + 0.004, end=T0 + 0.009, cell=3, line=4,
                   filename="<cell>", reduce_op="SUM"),
        CommRecord(rank=1, op="all_reduce", seq=5, group=g, bytes=4096, start=T0 + 0.006,
                   end=T0 + 0.009, cell=3),
        CommRecord(rank=2, op="all_reduce", seq=5, group=g, bytes=4096, start=T0 + 0.008,
                   end=T0 + 0.0091, cell=3),
        # rank 0's 2nd send to rank 2 is rank 2's 2nd receive from rank 0
        CommRecord(rank=0, op="isend", seq=2, group=g, peer=2, bytes=64, start=T0 + 0.011,
                   end=T0 + 0.014, cell=3, async_op=True),
        CommRecord(rank=2, op="recv", seq=2, group=g, peer=0, bytes=64, start=T0 + 0.012,
                   end=T0 + 0.013, cell=3),
        # a send whose receive is not in the trace: no arrow
        CommRecord(rank=1, op="send", seq=1, group=g, peer=2, bytes=64, start=T0 + 0.011,
                   end=T0 + 0.012, cell=3),
    ]  # fmt: skip


def _by(events: list, ph: str, **match) -> list:
    return [e for e in events if e["ph"] == ph and all(e.get(k) == v for k, v in match.items())]


def test_slices_in_microseconds_since_the_first_record_with_args() -> None:
    events = check_viewer_rules(chrome_trace(_records()))
    fwd = _by(events, "X", name="forward")[0]
    assert (fwd["pid"], fwd["tid"], fwd["ts"], fwd["dur"], fwd["cat"]) == (0, 0, 0, 10000, "span")
    ar = _by(events, "X", name="all_reduce", pid=0)[0]
    assert ar["ts"] == pytest.approx(4000) and ar["dur"] == pytest.approx(5000)
    assert ar["tid"] == 0  # nested in the span, on the same track
    assert ar["cat"] == "collective"
    assert ar["args"] == {
        "op": "all_reduce", "bytes": 4096, "group": [0, 1, 2], "seq": 5, "dtype": "float32",
        "shape": [1024], "reduce_op": "SUM", "async_op": False, "cell": 3, "line": 4,
        "file": "<cell>",
    }  # fmt: skip
    send = _by(events, "X", name="isend")[0]
    assert send["cat"] == "p2p" and send["args"]["peer"] == 2 and send["args"]["async_op"]
    assert not _by(events, "X", cat="device")  # no device time on CPU


def test_one_named_process_per_rank_and_named_tracks() -> None:
    events = chrome_trace(_records())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in _by(events, "M", name="process_name")}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    order = {e["pid"]: e["args"]["sort_index"] for e in _by(events, "M", name="process_sort_index")}
    assert order == {0: 0, 1: 1, 2: 2}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in _by(events, "M", name="thread_name")
    }
    assert threads[(0, 0)] == "host"


def test_a_collective_flows_from_its_last_caller_to_every_other_rank() -> None:
    events = check_viewer_rules(chrome_trace(_records()))
    starts = {e["id"]: e for e in _by(events, "s", cat="collective")}
    ends = {e["id"]: e for e in _by(events, "f", cat="collective")}
    assert starts.keys() == ends.keys() and len(starts) == 2
    assert {s["pid"] for s in starts.values()} == {2}  # rank 2 called last: the others waited
    assert sorted(ends[i]["pid"] for i in starts) == [0, 1]
    for i, s in starts.items():
        assert s["pid"] != ends[i]["pid"] and s["name"] == "all_reduce"
        assert s["ts"] == 8000.001  # when rank 2 called: it let the others' calls return
    assert sorted(ends[i]["ts"] for i in starts) == [8999.999, 8999.999]


def test_a_send_flows_to_the_receive_that_took_it() -> None:
    events = check_viewer_rules(chrome_trace(_records()))
    (s,) = _by(events, "s", cat="p2p")
    (f,) = _by(events, "f", cat="p2p")
    assert (s["pid"], f["pid"], s["id"]) == (0, 2, f["id"])
    # from the send's start (11 ms) to the receive's end (13 ms), a nanosecond inside each
    assert (s["ts"], f["ts"]) == (11000.001, 12999.999)
    pairs = flow_pairs([r for r in _records() if isinstance(r, CommRecord)])
    assert [(c, a.rank, b.rank) for c, a, b in pairs if c == "p2p"] == [("p2p", 0, 2)]


def test_overlapping_calls_go_to_further_tracks_and_device_time_to_its_own() -> None:
    g = (0, 1)
    records = [
        CommRecord(rank=0, op="irecv", seq=1, group=g, peer=1, start=T0, end=T0 + 0.003),
        CommRecord(rank=0, op="irecv", seq=2, group=g, peer=1, start=T0 + 0.001, end=T0 + 0.004),
        CommRecord(rank=0, op="all_reduce", seq=1, group=g, start=T0 + 0.002, end=T0 + 0.0025,
                   device_time=0.0004),
    ]  # fmt: skip
    events = check_viewer_rules(chrome_trace(records))
    tids = [e["tid"] for e in _by(events, "X") if e["cat"] != "device"]
    assert tids == [0, 1, 2]  # neither nests in the other: calls nest only in spans
    (dev,) = _by(events, "X", cat="device")
    assert dev["tid"] >= 1000 and dev["dur"] == pytest.approx(400) and dev["ts"] == 2000
    assert dev["args"]["device_us"] == pytest.approx(400)
    threads = {e["tid"]: e["args"]["name"] for e in _by(events, "M", name="thread_name")}
    assert threads[dev["tid"]] == "device (CUDA events)"


def test_save_trace_writes_a_file_that_reloads(tmp_path) -> None:
    path = save_trace([to_dict(r) for r in _records()], tmp_path / "t.json")
    assert path == str(tmp_path / "t.json")
    doc = json.loads((tmp_path / "t.json").read_text())
    check_viewer_rules(doc)
    assert doc["otherData"]["t0_unix_s"] == T0 and doc["otherData"]["world_size"] == 3
    assert "distributedInfo" not in doc  # the combined file holds every rank
    save_trace(_records(), tmp_path / "t.json.gz", cell=3)
    with gzip.open(tmp_path / "t.json.gz", "rt") as fh:
        assert json.load(fh)["traceEvents"] == doc["traceEvents"]


def test_per_rank_files_carry_distributed_info_and_one_origin(tmp_path) -> None:
    lab = FakeLab(3, records=_records())
    lab.backend = "gloo"
    paths = save_trace(lab, tmp_path, per_rank=True)
    assert paths == [str(tmp_path / f"rank{r}.json") for r in range(3)]
    docs = [json.loads(open(p).read()) for p in paths]
    for rank, doc in enumerate(docs):
        # HTA 0.5 reads a file's rank from its text with this pattern, the first match
        text = open(paths[rank]).read()
        assert re.search(r'"rank":\s+(\d+)', text).group(1) == str(rank)
        events = check_viewer_rules(doc)
        info = doc["distributedInfo"]
        assert (info["rank"], info["world_size"], info["backend"]) == (rank, 3, "gloo")
        assert info["pg_config"][0]["ranks"] == [0, 1, 2] and info["pg_count"] == 1
        assert {e["pid"] for e in events} == {rank}
        assert not [e for e in events if e["ph"] in ("s", "f")]
    # each file keeps the common origin: rank 1's all_reduce starts 6 ms after rank 0's span
    (ar,) = _by(docs[1]["traceEvents"], "X", name="all_reduce")
    assert ar["ts"] == pytest.approx(6000)
    paths = save_trace(_records(), str(tmp_path / "r{rank}.json"), per_rank=True)
    assert (
        paths[2].endswith("r2.json") and json.load(open(paths[2]))["distributedInfo"]["rank"] == 2
    )


def test_bad_input_gets_a_clear_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="nothing to save: the last cell left no trace records"):
        save_trace(FakeLab(2), tmp_path / "t.json")
    with pytest.raises(ValueError, match="nothing to save: no trace records of cell 9"):
        save_trace(_records(), tmp_path / "t.json", cell=9)
    with pytest.raises(ValueError, match="nothing to save"):
        save_trace([], tmp_path / "t.json")
    with pytest.raises(TypeError, match="takes a lab or a list of trace records"):
        save_trace("trace.json", tmp_path / "t.json")
    with pytest.raises(TypeError, match="trace record 1 is a int"):
        save_trace([_records()[0], 5], tmp_path / "t.json")
    with pytest.raises(ValueError, match="dict is not a CommRecord"):
        save_trace([{"rank": 0, "op": "send"}], tmp_path / "t.json")
    with pytest.raises(FileNotFoundError, match="the folder .*nowhere.* does not exist"):
        save_trace(_records(), tmp_path / "nowhere" / "t.json")
    with pytest.raises(ValueError, match=r"needs an existing folder .* or a path with \{rank\}"):
        save_trace(_records(), tmp_path / "t.json", per_rank=True)
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_a_collective_of_another_cell_is_not_joined() -> None:
    a, b = _records()[1:3]  # rank 0 and rank 1's all_reduce #5
    assert len(flow_pairs([a, b])) == 1
    b.cell = 4  # the same group and seq after a restart: another collective
    assert flow_pairs([a, b]) == []


def test_profile_keeps_each_ranks_events_shifted_by_its_clock_offset() -> None:
    class Lab:  # what profile() uses of a lab
        offsets = {0: 0.0, 1: 0.25}  # rank 1's clock runs 0.25 s ahead of the kernel's

        def ranks(self, spec):
            return [0, 1]

        def run(self, fn, ranks, timeout):
            assert isinstance(fn, ProfiledCell) and fn.code == "x = 1" and ranks == [0, 1]
            return "results"

        def pull(self, name, ranks):
            assert name == PROFILE_NAME
            return {r: {"cell": 7, "base_s": T0 + 0.25 * r, "events": [{"ts": 5}]} for r in ranks}

    lab = Lab()
    assert labkit.profile(lab, "x = 1") == "results"
    cell, by_rank = last_profile(lab)
    assert cell == 7 and by_rank[0]["origin"] == T0 and by_rank[1]["origin"] == T0
    assert last_profile(Lab()) is None and last_profile([]) is None


def test_labkit_exports_save_trace() -> None:
    assert labkit.save_trace is save_trace and "save_trace" in labkit.__all__
    assert trace_events([]) == []


@pytest.fixture(scope="module")
def lab():
    lab = labkit.Lab(2, device="cpu")
    yield lab
    lab.stop()


@pytest.mark.timeout(180)
def test_a_real_cell_exports_with_flows_across_ranks(lab, tmp_path) -> None:
    lab.run(
        """
import labkit
x = torch.ones(1000)
with labkit.span("compute"):
    x = x * 2
dist.all_reduce(x)
if rank == 0:
    dist.send(x, dst=1)
else:
    dist.recv(x, src=0)
dist.barrier()
"""
    ).raise_for_errors()
    path = save_trace(lab, tmp_path / "lab.json")
    paths = save_trace(lab, tmp_path, per_rank=True)
    records = lab.trace()
    doc = json.load(open(path))
    events = check_viewer_rules(doc)
    assert doc["otherData"]["backend"] == "gloo" and doc["otherData"]["world_size"] == 2
    ops = sorted((e["pid"], e["name"]) for e in _by(events, "X") if e["cat"] != "span")
    assert ops == [(0, "all_reduce"), (0, "barrier"), (0, "send"),
                   (1, "all_reduce"), (1, "barrier"), (1, "recv")]  # fmt: skip
    assert sorted(e["pid"] for e in _by(events, "X", name="compute")) == [0, 1]
    # the slices are the records, shifted to the first record's start
    t0 = min(r.start for r in records)
    for rec in records:
        name = getattr(rec, "op", getattr(rec, "name", None))
        (e,) = _by(events, "X", name=name, pid=rec.rank)
        assert e["ts"] == pytest.approx((rec.start - t0) * 1e6, abs=0.01)
        assert e["dur"] == pytest.approx((rec.end - rec.start) * 1e6, abs=0.01)
    flows = defaultdict(dict)
    for e in events:
        if e["ph"] in ("s", "f"):
            flows[e["id"]][e["ph"]] = e
    kinds = sorted((p["s"]["cat"], p["s"]["name"]) for p in flows.values())
    assert kinds == [
        ("collective", "all_reduce"),
        ("collective", "barrier"),
        ("p2p", "send -> recv"),
    ]
    for pair in flows.values():
        assert pair["s"]["pid"] != pair["f"]["pid"]  # each arrow joins two ranks
    p2p = next(p for p in flows.values() if p["s"]["cat"] == "p2p")
    assert (p2p["s"]["pid"], p2p["f"]["pid"]) == (0, 1)
    for rank, p in enumerate(paths):
        one = json.load(open(p))
        check_viewer_rules(one)
        assert one["distributedInfo"]["rank"] == rank
        assert one["distributedInfo"]["backend"] == "gloo"


def test_holistic_trace_analysis_reads_the_per_rank_files(tmp_path) -> None:
    """HTA (in the test extra, not a labkit dependency) loads each rank's file by its rank."""
    hta = pytest.importorskip("hta.trace_analysis", reason="HolisticTraceAnalysis not installed")
    save_trace(_records(), tmp_path, per_rank=True)
    analyzer = hta.TraceAnalysis(trace_dir=str(tmp_path))
    assert sorted(analyzer.t.get_all_traces()) == [0, 1, 2]
    table = analyzer.t.symbol_table.get_sym_table()
    for rank, ops in ((0, {"forward", "all_reduce", "isend"}), (2, {"all_reduce", "recv"})):
        df = analyzer.t.get_trace(rank)
        assert {table[i] for i in df["name"].unique()} == ops


def test_profiler_events_go_under_their_rank_on_tracks_of_their_own() -> None:
    torch_events = [  # what a rank keeps: the profiler's trace, ts in us since its base time
        {"ph": "M", "name": "process_name", "pid": 77, "tid": 0, "ts": 0,
         "args": {"name": "python"}},
        {"ph": "M", "name": "thread_name", "pid": 77, "tid": 78, "ts": 0,
         "args": {"name": "thread 78 (python)"}},
        {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "pid": 77, "tid": 78, "ts": 2000.125,
         "dur": 150.5, "args": {"External id": 3}},
        # a child that ends 2 ns after its parent (the profiler does that): cut at its end
        {"ph": "X", "name": "aten::empty", "cat": "cpu_op", "pid": 77, "tid": 78,
         "ts": 2100.0, "dur": 50.627},
        {"ph": "X", "name": "gloo", "cat": "cpu_op", "pid": 77, "tid": 90, "ts": 3000, "dur": 10},
        {"ph": "s", "name": "ac2g", "pid": 77, "tid": 78, "ts": 2000, "id": 1},
        {"ph": "i", "name": "mark", "pid": 77, "tid": 78, "ts": 2000, "s": "t"},
    ]  # fmt: skip
    profile = {1: {"origin": T0, "events": torch_events}}
    events = profiler_events(profile, T0 + 0.001)
    assert profile_start(profile) == pytest.approx(T0 + 0.002000125)
    check_viewer_rules({"traceEvents": events})
    threads = {e["tid"]: e["args"]["name"] for e in _by(events, "M", name="thread_name")}
    assert threads == {
        2000: "torch.profiler: thread 78 (python)",
        2001: "torch.profiler: thread 90",
    }
    mm, empty, gloo = _by(events, "X")
    assert (mm["pid"], mm["tid"], mm["ts"], mm["dur"], mm["cat"]) == (
        1,
        2000,
        1000.125,
        150.5,
        "cpu_op",
    )
    assert mm["args"] == {"External id": 3} and (gloo["tid"], gloo["ts"]) == (2001, 2000)
    assert (empty["ts"], empty["dur"]) == (1100, 50.625)
    assert not [e for e in events if e["ph"] not in ("M", "X")]  # its flows and instants left out


@pytest.mark.timeout(300)
def test_a_profiled_cell_has_each_ranks_operators_inside_labkits_calls(
    lab, tmp_path, cpu_load
) -> None:
    """On a machine whose every CPU is busy: the clocks still agree."""
    with pytest.raises(TypeError, match="takes a cell's code as a string"):
        labkit.profile(lab, lambda: None)
    code = """
y = torch.mm(torch.ones(32, 32), torch.ones(32, 32))
x = torch.ones(4096)
dist.all_reduce(x)
x.sum();
"""
    LabMagics(shell=None).ranks("--profile", code)  # as `%%ranks --profile` (the first is slow)
    assert sorted((r.rank, r.op) for r in lab.trace()) == [(0, "all_reduce"), (1, "all_reduce")]
    assert all(torch.equal(x, torch.full((4096,), 2.0)) for x in lab.pull("x").values())
    doc = json.load(open(save_trace(lab, tmp_path / "p.json")))
    events = check_viewer_rules(doc)
    for rank in (0, 1):
        (ar,) = _by(events, "X", name="all_reduce", pid=rank, cat="collective")
        mm = _by(events, "X", name="aten::mm", pid=rank)
        c10d = [e for e in _by(events, "X", pid=rank) if e["name"].startswith("c10d::allreduce")]
        assert mm and mm[0]["tid"] >= 2000 and c10d and c10d[0]["tid"] >= 2000
        # one clock: the profiler's all_reduce op lies inside labkit's record of the call
        slack = 1000  # us: the profiler converts its clock to Unix time (a unit slip is 1e3x)
        assert ar["ts"] - slack <= c10d[0]["ts"]
        assert c10d[0]["ts"] + c10d[0]["dur"] <= ar["ts"] + ar["dur"] + slack
        assert mm[0]["ts"] + mm[0]["dur"] <= ar["ts"] + slack  # the matmul came first
    one = json.load(open(save_trace(lab, tmp_path, per_rank=True)[1]))
    check_viewer_rules(one)
    assert _by(one["traceEvents"], "X", name="aten::mm", pid=1)
    # another cell is not the profiled one: its export has no operators
    lab.run("dist.barrier()").raise_for_errors()
    doc = json.load(open(save_trace(lab, tmp_path / "q.json")))
    assert not [e for e in doc["traceEvents"] if e.get("tid", 0) >= 2000]
    # a profiled cell that raises: its error comes back, its operators up to the error are saved
    results = labkit.profile(lab, "z = torch.arange(6.).sum()\nraise ValueError('boom')")
    with pytest.raises(labkit.RemoteError, match="ValueError: boom") as err:
        results.raise_for_errors()
    assert "profiling.py" not in str(err.value)  # labkit's own frames are left out
    assert lab.trace() == []  # no record: the export is the profile alone
    doc = json.load(open(save_trace(lab, tmp_path / "e.json")))
    check_viewer_rules(doc)
    assert {e["pid"] for e in _by(doc["traceEvents"], "X", name="aten::arange")} == {0, 1}
