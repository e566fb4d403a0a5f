"""`watchdog.diagnose` as a pure function: each way a cell can never finish, and healthy waits."""

from __future__ import annotations

from labkit.kernel.watchdog import diagnose


def op(name="all_reduce", seq=1, group=(0, 1), peer=None, shape=(4,), dtype="float32", s=2.0):
    return {
        "op": name,
        "seq": seq,
        "group": list(group),
        "peer": peer,
        "shape": shape,
        "dtype": dtype,
        "line": 3,
        "blocked_s": s,
    }


def test_healthy_and_short_waits_are_left_alone() -> None:
    assert diagnose({}, {0, 1}, {}) is None
    # both ranks inside the same collective: slow, not stuck
    assert diagnose({0: op(), 1: op()}, {0, 1}, {}) is None
    # a mismatch that has not lasted the grace period yet
    assert diagnose({0: op(s=0.2), 1: op("broadcast", s=0.2)}, {0, 1}, {}) is None
    # a send and the matching recv
    send, recv = op("send", peer=1), op("recv", peer=0)
    assert diagnose({0: send, 1: recv}, {0, 1}, {}) is None


def test_collective_on_a_subset_names_the_absent_ranks() -> None:
    blocked = {0: op(group=(0, 1, 2, 3)), 2: op(group=(0, 1, 2, 3))}
    why_not = {1: "is not running this cell", 3: "is not running this cell"}
    text = diagnose(blocked, {0, 2}, why_not)
    assert text is not None
    assert text.startswith("rank 0 waits in all_reduce #1 on group [0, 1, 2, 3]")
    assert "line 3" in text and "can never complete" in text
    assert "rank 1 is not running this cell; rank 3 is not running this cell" in text


def test_peer_that_finished_or_raised() -> None:
    text = diagnose({1: op("recv", peer=0)}, {1}, {0: "finished"})
    assert text is not None and "with peer 0" in text and "rank 0 finished" in text
    text = diagnose({0: op()}, {0}, {1: "raised ZeroDivisionError"})
    assert text is not None and "rank 1 raised ZeroDivisionError" in text


def test_mismatched_op_shape_and_dtype() -> None:
    for other in (op("broadcast"), op(shape=(8,)), op(dtype="float16")):
        text = diagnose({0: op(), 1: other}, {0, 1}, {})
        assert text is not None
        head = "mismatched collectives on group [0, 1] (op, shape or dtype differs)"
        assert text.startswith(head)
        assert "rank 0 waits in all_reduce #1" in text and "rank 1 waits in" in text
    text = diagnose({0: op(), 1: op(dtype="float16")}, {0, 1}, {})
    assert text is not None and "(float16 (4,), line 3)" in text


def test_collectives_in_a_different_order() -> None:
    text = diagnose({0: op(seq=5), 1: op("all_gather", seq=6)}, {0, 1}, {})
    assert text is not None and "(order differs)" in text
    assert "all_reduce #5" in text and "all_gather #6" in text


def test_mismatch_needs_every_member_blocked() -> None:
    # rank 2 is still computing: the group may yet line up
    blocked = {0: op(group=(0, 1, 2)), 1: op("broadcast", group=(0, 1, 2))}
    assert diagnose(blocked, {0, 1, 2}, {}) is None


def test_mutual_recv_and_mutual_send() -> None:
    text = diagnose({0: op("recv", peer=1), 1: op("irecv", peer=0)}, {0, 1}, {})
    assert text is not None and text.startswith("ranks 0 and 1 both wait to recv")
    text = diagnose({0: op("send", peer=1), 1: op("send", peer=0)}, {0, 1}, {})
    assert text is not None and "both wait to send" in text


def _op(op, seq, group=(0, 1), peer=None, blocked_s=2.0):
    return {
        "op": op,
        "seq": seq,
        "group": group,
        "peer": peer,
        "blocked_s": blocked_s,
        "shape": (4,),
        "dtype": "float32",
        "line": 1,
    }


def test_finished_peer_that_already_sent_is_not_a_deadlock():
    blocked = {0: _op("recv", 3, peer=1)}
    done = {1: {"sent": {0: 3}, "received": {}, "seq": {}}}
    assert diagnose(blocked, {0}, {1: "finished"}, progress=done) is None
    # ... unless it still has not arrived after the long grace
    late = {0: _op("recv", 3, peer=1, blocked_s=6.0)}
    assert "rank 1 finished" in diagnose(late, {0}, {1: "finished"}, progress=done)
    short = {1: {"sent": {0: 2}, "received": {}, "seq": {}}}
    assert "rank 1 finished" in diagnose(blocked, {0}, {1: "finished"}, progress=short)


def test_finished_rank_that_already_left_the_barrier_is_not_absent():
    blocked = {0: _op("barrier", 7, group=(0, 1, 2))}
    progress = {1: {"seq": {(0, 1, 2): 7}}, 2: {"seq": {(0, 1, 2): 7}}}
    assert diagnose(blocked, {0}, {1: "finished", 2: "finished"}, progress=progress) is None
    progress[2] = {"seq": {(0, 1, 2): 6}}
    reason = diagnose(blocked, {0}, {1: "finished", 2: "finished"}, progress=progress)
    assert "rank 2 finished" in reason and "rank 1" not in reason.split("complete:")[1]


def test_mutual_recv_where_one_side_already_sent_is_not_reported():
    blocked = {0: _op("recv", 1, peer=1), 1: _op("recv", 1, peer=0)}
    assert "both wait to recv" in diagnose(blocked, {0, 1}, {})
    sent = {0: {"sent": {1: 1}}, 1: {"sent": {}}}
    assert diagnose(blocked, {0, 1}, {}, progress=sent) is None


def test_batches_are_left_to_stop_and_timeout():
    blocked = {0: _op("batch_isend_irecv", 1, group=(0, 1, 2))}
    assert diagnose(blocked, {0}, {1: "finished", 2: "finished"}) is None
