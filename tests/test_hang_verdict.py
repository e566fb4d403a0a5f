"""The hang verdict (labkit.kernel.inspection.hang_verdict), pure: synthetic Flight Recorder
entries with answers worked out by hand (no processes, no torch)."""

from __future__ import annotations

import pytest

from labkit.kernel.inspection.hang_verdict import TITLE, merge, verdict

pytestmark = pytest.mark.timeout(30)


def e(seq, op="all_reduce", state="completed", sizes=((4,),), dtype="Float", gid="0", **kw):
    """An entry as labkit.rank.flight_recorder gives it; `created_ns` follows seq by default."""
    group = {"0": "default_pg"}.get(gid, f"group{gid}")
    entry = {
        "seq": seq,
        "p2p": False,
        "op": op,
        "group": group,
        "group_id": gid,
        "record_id": None,
        "state": state,
        "input_sizes": [list(s) for s in sizes],
        "output_sizes": [list(s) for s in sizes],
        "dtypes": [dtype] if dtype else [],
        "duration_ms": None,
        "created_ns": seq * 1000,
        "run_ms": None,
    }
    entry.update(kw)
    return entry


def upto(n, last_state="completed", **kw):
    """all_reduce #1..#n, the last in `last_state`."""
    return [e(s, **kw) for s in range(1, n)] + [e(n, state=last_state, **kw)]


def test_ranks_that_skipped_a_collective_are_named_with_what_they_did_last():
    # ranks 0, 2 entered #7 and wait in it; ranks 1, 3 stopped after #6
    got = verdict(
        {0: upto(7, "scheduled"), 1: upto(6), 2: upto(7, "scheduled"), 3: upto(6)},
        where={1: "line 3: time.sleep(60)", 3: "line 3: time.sleep(60)"},
    )
    assert got.kind == "missing" and got.key == ("0", 7) and got.op == "all_reduce"
    assert got.missing == (1, 3) and got.entered == (0, 2)
    first = got.text.splitlines()[0]
    assert first == (
        f"{TITLE}: ranks 1, 3 never entered all_reduce #7 of group 0 (default_pg), "
        "in [[4]] float; ranks 0, 2 entered it."
    )
    assert (
        "  ranks 1, 3: last entered #6 of that group (completed); now at line 3: time" in got.text
    )


def test_a_rank_still_inside_an_earlier_collective_is_said_to_wait_there():
    # rank 1 entered #6 late and waits in it, while rank 0 finished #6 and waits in #7
    got = verdict({0: upto(7, "scheduled"), 1: upto(6, "scheduled")})
    assert got.kind == "missing" and got.key == ("0", 7) and got.missing == (1,)
    assert "rank 1: last entered #6 of that group (scheduled); waiting in all_reduce #6" in got.text


def test_a_rank_that_entered_no_collective_at_all():
    got = verdict({0: [e(1, state="scheduled")], 1: []})
    assert got.missing == (1,) and "rank 1: entered no collective of this group" in got.text


@pytest.mark.parametrize(
    "rank0,what,said",
    [
        (
            e(3, op="broadcast", state="scheduled"),
            "op",
            "different ops: broadcast in [[4]] float on rank 0; all_reduce in [[4]] float on "
            "ranks 1, 2",
        ),
        (e(3, sizes=((3,),), state="scheduled"), "shape", "different shapes: [[3]] on rank 0, "),
        (e(3, dtype="Double", state="scheduled"), "dtype", "different dtypes: double on rank 0, "),
    ],
)
def test_the_same_sequence_number_with_a_different_op_shape_or_dtype(rank0, what, said):
    others = upto(3, "scheduled")
    got = verdict({0: upto(2) + [rank0], 1: others, 2: others})
    assert got.kind == "mismatch" and got.key == ("0", 3) and got.missing == ()
    assert [m.what for m in got.mismatches] == [what]  # an op mismatch is not also a shape one
    assert got.mismatches[0].values[{"op": "all_reduce"}.get(what, "[[4]]" if what == "shape"
                                     else "float")] == (1, 2)  # fmt: skip
    assert "entered #3 of group 0 (default_pg) with " + said in got.text


@pytest.mark.parametrize("op", ["all_to_all", "all_to_all_single", "all_gather_v"])
def test_all_to_all_sizes_may_differ_by_design(op):
    # each rank's input to an uneven all_gather is its own chunk (NCCL names it all_gather_v)
    a = e(1, op=op, sizes=((2,), (2,)), state="scheduled")
    b = e(1, op=op, sizes=((1,), (3,)), state="scheduled")
    got = verdict({0: [a], 1: [b]})
    assert got.kind == "unfinished" and got.mismatches == ()
    # an even all_gather's inputs must agree
    got = verdict({0: [e(1, op="all_gather", sizes=((2,),))], 1: [e(1, op="all_gather")]})
    assert got.kind == "mismatch" and got.mismatches[0].what == "shape"


def test_a_subgroup_expects_only_its_members():
    # group 5 = ranks {1, 2}: rank 1 entered its #1, rank 2 did not; ranks 0, 3 are outsiders
    default = upto(2)
    sub = e(1, gid="5", state="scheduled", created_ns=10_000)
    groups = {
        "0": {"desc": "default_pg", "ranks": [0, 1, 2, 3]},
        "5": {"desc": "tp", "ranks": [1, 2]},
    }
    got = verdict({0: default, 1: default + [sub], 2: default, 3: default}, groups)
    assert got.kind == "missing" and got.key == ("5", 1) and got.missing == (2,)
    assert (
        got.entered == (1,) and "rank 2 never entered all_reduce #1 of group 5 (group5)" in got.text
    )
    assert "0" not in {str(r) for r in got.missing} and 3 not in got.missing


def test_a_subgroup_without_known_members_says_so():
    sub = e(1, gid="5", state="scheduled")
    got = verdict({0: [], 1: [sub]})
    assert got.kind == "unfinished" and got.key == ("5", 1)
    assert "group 5 (group5): its members are not known" in got.text


def test_the_earliest_divergence_is_named_first_across_groups():
    # group 0 diverges at #2 (entered at t=2000), group 5 at #1 (entered at t=500): group 5 first
    g0 = [e(1), e(2, state="scheduled")]
    sub = e(1, gid="5", state="scheduled", created_ns=500)
    groups = {"5": {"desc": "dp", "ranks": [0, 1]}}
    got = verdict({0: g0 + [sub], 1: [e(1)]}, groups)
    assert got.key == ("5", 1) and got.missing == (1,)


def test_a_rank_waiting_in_another_groups_collective_is_not_blamed_before_the_cause():
    # a 2 x 2 mesh: tp groups 1 = {0, 1}, 2 = {2, 3}; dp groups 3 = {0, 2}, 4 = {1, 3}. Rank 3
    # stops in its own code after tp #4; rank 2 waits in tp #5 for it, so it never enters dp #1,
    # which rank 0 entered first (t=5100, before rank 2 entered tp #5 at t=5500). The cause is
    # rank 3, not rank 2: before review the verdict said "rank 2 never entered ... group 3"
    groups = {
        "1": {"desc": "tp", "ranks": [0, 1]},
        "2": {"desc": "tp", "ranks": [2, 3]},
        "3": {"desc": "dp", "ranks": [0, 2]},
        "4": {"desc": "dp", "ranks": [1, 3]},
    }

    def tp(n, gid, last="completed"):
        return [e(s, gid=gid) for s in range(1, n)] + [e(n, gid=gid, state=last)]

    recorded = {
        0: tp(5, "1") + [e(1, gid="3", state="scheduled", created_ns=5100)],
        1: tp(5, "1") + [e(1, gid="4", state="scheduled", created_ns=5100)],
        2: tp(4, "2") + [e(5, gid="2", state="scheduled", created_ns=5500)],
        3: tp(4, "2"),
    }
    got = verdict(recorded, groups, where={3: "line 9: loss.backward()"})
    assert got.kind == "missing" and got.missing == (3,) and got.key in (("2", 5), ("4", 1))
    assert "rank 2 never entered" not in got.text
    assert "rank 3: last entered #4 of that group (completed); now at line 9" in got.text or (
        "rank 3: entered no collective of this group; now at line 9" in got.text
    )
    # rank 3 died (no answer): rank 2 is still not blamed; the group rank 3 is in is named
    del recorded[3]
    got = verdict(recorded, groups, world=[0, 1, 2, 3])
    assert got.kind == "unfinished" and 2 not in got.missing, got.text
    assert "whether rank 3 of its members entered it is not known" in got.text
    # a pipeline stage waiting in a recv never enters the dp all_reduce: the only finding,
    # it is given, with the recv the rank waits in (p2p ops are not matched)
    recv = e(1, op="recv", p2p=True, state="scheduled", gid="2", created_ns=6000)
    got = verdict({0: [e(1, gid="3", state="scheduled")], 2: [recv], 3: []}, groups)
    assert got.kind == "missing" and got.key == ("3", 1) and got.missing == (2,)
    assert "rank 2: entered no collective of this group; waiting in recv p2p #1" in got.text
    # a slow rank still inside an earlier collective of the same group is named, as before
    got = verdict({0: upto(7, "scheduled"), 1: upto(6, "scheduled")})
    assert got.kind == "missing" and got.missing == (1,)


def test_p2p_ops_have_their_own_numbers_and_are_named_when_waiting():
    send = e(1, op="send 0->1", p2p=True, state="scheduled")
    recv = e(1, op="send 1->0", p2p=True, state="scheduled")  # both send first: a deadlock
    got = verdict({0: upto(3) + [send], 1: upto(3) + [recv]})
    assert got.kind == "p2p" and got.key is None
    assert set(got.waiting) == {0, 1}
    assert "rank 0 in send 0->1 p2p #1 of group 0 (default_pg)" in got.text
    # p2p #1 is not matched against collective #1
    assert verdict({0: [e(1), send], 1: [e(1)]}).kind == "p2p"


def test_nccl_coalesced_p2p_ops_are_settled_by_their_coalesced_entry():
    # NCCL records each op of a batch_isend_irecv under the group's p2p number and never
    # retires it; the `coalesced` entry with the same number is retired when the batch is done
    # (torch's analyser pairs them the same way). Before review every such op read "waiting"
    def batch(op, state):
        parts = [e(1, op=op, p2p=True, state="scheduled", record_id=3)]
        return parts + [e(1, op="coalesced", p2p=True, state=state, record_id=4)]

    done = verdict(
        {0: upto(2) + batch("send", "completed"), 1: upto(2) + batch("recv", "completed")}
    )
    assert done.kind == "completed" and done.waiting == {}, done.text
    stuck = verdict({0: upto(2) + batch("send", "scheduled"), 1: upto(2)})
    assert stuck.kind == "p2p" and set(stuck.waiting) == {0}
    assert "rank 0 in coalesced p2p #1 of group 0 (default_pg)" in stuck.text
    # collectives: the retired `coalesced` entry stands for the ops before it
    ops = [e(3, op="_allgather_base", state="scheduled"), e(3, op="coalesced")]
    assert verdict({0: upto(2) + ops, 1: upto(2) + ops}).kind == "completed"


def test_entries_of_unnamed_groups_are_not_matched():
    # gloo under TORCH_DISTRIBUTED_DEBUG=DETAIL (torch 2.13, seen in a run): every entry has group
    # name "", the default group's, a subgroup's and the wrapper's fingerprint all_gathers alike,
    # their numbers colliding. Rank 0 is in subgroup {0, 1}, rank 2 is not: before review their
    # all_reduce #1 (default) and #1 (subgroup) were matched as "different shapes"
    def checked(seq, sizes):
        return [
            e(3, op="all_gather", gid=""),
            e(4, op="all_gather", gid=""),
            e(seq, sizes=sizes, gid=""),
        ]

    default, sub = checked(1, ((3,),)), checked(1, ((2,),))
    got = verdict({0: default + sub, 1: default + sub, 2: default})
    assert got.kind == "unknown" and got.mismatches == (), got.text
    assert "ranks 0, 1, 2: entries of no named group" in got.text
    # named groups beside them are still judged
    got = verdict({0: upto(2, "scheduled") + default, 1: upto(1) + default})
    assert got.kind == "missing" and got.key == ("0", 2) and got.missing == (1,)


def test_every_rank_completed_the_same_collectives():
    got = verdict({0: upto(5), 1: upto(5), 2: upto(5)})
    assert got.kind == "completed" and got.key is None and got.missing == ()
    assert "every rank entered and completed the same collectives (the last: all_reduce #5" in (
        got.text
    )
    assert "lab.stacks()" in got.text


def test_every_rank_inside_the_same_collective_alike():
    got = verdict({0: upto(4, "scheduled"), 1: upto(4, "started")})
    assert got.kind == "unfinished" and got.key == ("0", 4) and got.entered == (0, 1)
    assert "has not completed on ranks 0, 1" in got.text


def test_no_entries_are_said_honestly():
    off = "the Flight Recorder is off on this rank (TORCH_FR_BUFFER_SIZE is not set, or 0)"
    got = verdict({0: off, 1: off})
    assert got.kind == "unknown" and got.text.startswith(f"{TITLE}: no verdict: no rank's")
    assert f"(rank 1: no entries ({off}))" in got.text
    empty = verdict({0: [], 1: []})
    assert empty.kind == "completed" and "no rank has entered a collective yet" in empty.text
    # one rank's recorder off: the others are judged, it is not blamed, and it is named
    partial = verdict({0: upto(2, "scheduled"), 1: upto(2, "scheduled"), 2: off})
    assert partial.kind == "unfinished" and 2 not in partial.missing
    assert "ranks 0, 1 entered all_reduce #2" in partial.text and "the ranks agree" not in (
        partial.text
    )
    assert "whether rank 2 of its members entered it is not known" in partial.text
    done = verdict({0: upto(2), 1: "no answer within 1.5 s"})
    assert done.kind == "completed" and "every rank but 1 entered and completed" in done.text
    assert "(rank 2: no entries (the Flight Recorder is off" in partial.text


def test_a_wrapped_ring_is_compared_from_where_every_rank_still_has_entries():
    # rank 0's ring kept #5..#9 only; rank 1 holds #1..#8: #9 is the divergence, not #1..#4
    got = verdict({0: upto(9, "scheduled")[4:], 1: upto(8)}, wrapped={0})
    assert got.key == ("0", 9) and got.missing == (1,)
    assert "a ring wrapped; compared from #5" in got.text
    # a wrapped rank that holds nothing of a group is not blamed for it
    sub = e(1, gid="5", state="scheduled")
    groups = {"5": {"desc": "x", "ranks": [0, 1]}}
    got = verdict({0: [e(1)], 1: [e(1), sub]}, groups, wrapped={0})
    assert got.kind == "unfinished" and got.key == ("5", 1) and got.missing == ()
    assert "rank 0: no entry of it, and a wrapped ring (older entries are lost)" in got.text


def test_merge_reads_snapshots_and_unions_group_members():
    sub = e(1, gid="5", state="scheduled")
    snaps = {
        0: {"entries": [e(1)], "wrapped": False, "groups": {"0": {"desc": "default_pg",
                                                                  "ranks": [0, 1, 2]}}},
        1: {"entries": [e(1), sub], "wrapped": False,
            "groups": {"5": {"desc": "group5", "ranks": [1, 2]}}},
        2: None,  # off
        3: "dead: the process ended",
    }  # fmt: skip
    got = merge(snaps)
    # rank 2 is a member of group 5 but its recorder is off: not blamed, and said
    assert got.kind == "unfinished" and got.key == ("5", 1)
    assert "(rank 2: no entries (the Flight Recorder is off on this rank))" in got.text
    assert "(rank 3: no entries (dead: the process ended))" in got.text


def test_rank_stacks_carry_the_verdict_first():
    from labkit.kernel.inspection.stacks import RankStacks

    snap = {"entries": upto(2, "scheduled"), "wrapped": False, "groups": {}}
    stacks = RankStacks({0: "main 0", 1: "main 1"}, {0: None, 1: "line 2: x()"}, {0, 1}, {0: snap})
    # rank 1 sent none (its recorder is off): it is not blamed, and it is named
    assert stacks.verdict.kind == "unfinished" and "(rank 1: no entries (the Flight" in str(stacks)
    snap1 = {"entries": upto(1), "wrapped": False, "groups": {}}
    stacks.fr[1] = snap1
    text = str(stacks)
    assert text.startswith(f"{TITLE}: rank 1 never entered all_reduce #2"), text
    assert "now at line 2: x()" in text and text.endswith("--- rank 1 ---\nmain 1")
    assert str(RankStacks({0: "main"}, {}, {0})) == "--- rank 0 ---\nmain"  # recorder off
