"""`watchdog.diagnose` and `Watchdog` as pure code: each way a cell can never finish, and the
healthy waits (slow ops, stragglers, stale heartbeats) that must never be taken for one."""

from __future__ import annotations

from labkit.kernel.cell import watchdog
from labkit.kernel.cell.watchdog import CONFIRM, LONG_GRACE, Verdict, Watchdog


def diagnose(*args, **kwargs) -> str | None:
    """The verdict's text, whether certain or still to confirm."""
    verdict = watchdog.diagnose(*args, **kwargs)
    return None if verdict is None else verdict.text


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
    # ... unless a heartbeat LONG_GRACE after rank 1's reply still shows rank 0 in that recv
    late = {0: dict(_op("recv", 3, peer=1, blocked_s=6.0), received=110.0)}
    finished = {1: 110.0 - LONG_GRACE}
    assert "rank 1 finished" in diagnose(
        late, {0}, {1: "finished"}, progress=done, finished=finished
    )
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


# -- stragglers: time waiting for a finished peer counts from that peer's finish ---------------
def _at(op: dict, received: float) -> dict:
    return dict(op, received=received)


def test_waiting_long_for_a_peer_that_just_did_its_part_is_healthy():
    # rank 1 entered all_reduce at t=0; rank 0 computed 6 s, joined, finished at t=6; rank 1's
    # last heartbeat (sent just before the op completed) says "blocked 6 s": not evidence
    blocked = {1: _at(_op("all_reduce", 1, blocked_s=6.0), received=6.1)}
    done = {0: {"seq": {(0, 1): 1}}}
    assert diagnose(blocked, {1}, {0: "finished"}, progress=done, finished={0: 6.0}) is None
    # not even after a minute of waiting for the straggler
    blocked = {1: _at(_op("all_reduce", 1, blocked_s=60.0), received=60.2)}
    assert diagnose(blocked, {1}, {0: "finished"}, progress=done, finished={0: 60.0}) is None
    # nor when the kernel does not know when the peer finished
    assert diagnose(blocked, {1}, {0: "finished"}, progress=done) is None
    # still inside that op by a heartbeat LONG_GRACE after the peer's finish: certain
    blocked = {1: _at(_op("all_reduce", 1, blocked_s=65.0), received=60.0 + LONG_GRACE)}
    text = diagnose(blocked, {1}, {0: "finished"}, progress=done, finished={0: 60.0})
    assert text is not None and "rank 0 finished" in text


def test_a_root_waiting_for_a_straggler_is_healthy_though_others_finished():
    # gather to rank 0: ranks 1 and 2 sent their part and finished long ago, rank 3 computes
    group = (0, 1, 2, 3)
    blocked = {0: _at(_op("gather", 1, group=group, blocked_s=20.0), received=20.0)}
    progress = {r: {"seq": {group: 1}} for r in (0, 1, 2)}
    progress[3] = {"seq": {}}
    why_not = {1: "finished", 2: "finished"}
    finished = {1: 0.1, 2: 0.1}
    args = (blocked, {0, 3}, why_not)
    assert diagnose(*args, progress=progress, finished=finished) is None
    # once rank 3 has called the gather too (its heartbeat's progress says so), the root's
    # last heartbeat may predate that: the long grace counts again from the moment it is seen
    progress[3] = {"seq": {group: 1}}
    verdict = watchdog.diagnose(*args, progress=progress, finished=finished)
    assert verdict is not None and "rank 1 finished; rank 2 finished" in verdict.text
    assert verdict.confirm == {0, 3} and verdict.hold == LONG_GRACE
    dog = Watchdog()
    assert dog.check(verdict, 20.1, {0: 20.0, 3: 20.1}) is None
    assert dog.check(verdict, 24.0, {0: 24.0, 3: 24.0}) is None
    assert dog.check(verdict, 25.2, {0: 25.1, 3: 25.2}) == verdict.text


def test_the_long_grace_counts_from_the_last_absent_peer_to_finish():
    group = (0, 1, 2)
    blocked = {0: _at(_op("all_reduce", 1, group=group, blocked_s=9.0), received=9.0)}
    done = {r: {"seq": {group: 1}} for r in (1, 2)}
    why_not = {1: "finished", 2: "finished"}
    assert diagnose(blocked, {0}, why_not, progress=done, finished={1: 1.0, 2: 8.0}) is None
    assert diagnose(blocked, {0}, why_not, progress=done, finished={1: 1.0}) is None
    text = diagnose(blocked, {0}, why_not, progress=done, finished={1: 1.0, 2: 4.0})
    assert text is not None and "rank 1 finished; rank 2 finished" in text


def test_finished_peer_that_never_called_the_op_is_certain_at_once():
    blocked = {1: _at(_op("all_reduce", 1, blocked_s=1.5), received=3.0)}
    done = {0: {"seq": {}}}  # rank 0 finished without any collective on the group
    verdict = watchdog.diagnose(blocked, {1}, {0: "finished"}, progress=done, finished={0: 2.9})
    assert verdict is not None and not verdict.confirm
    assert "rank 0 finished" in verdict.text
    # a peer not in the cell, or one that died, has no progress: it did not do its part either
    assert diagnose(blocked, {1}, {0: "is not running this cell"}) is not None


def test_a_peer_still_computing_is_never_a_reason():
    # rank 0 is running user code (no op in its heartbeat) for a minute: waiting is healthy
    for op in (_op("all_reduce", 1, blocked_s=60.0), _op("recv", 1, peer=0, blocked_s=60.0)):
        assert diagnose({1: op}, {0, 1}, {}) is None
    blocked = {1: _op("broadcast", 1, group=(0, 1, 2), blocked_s=60.0)}
    blocked[2] = _op("broadcast", 1, group=(0, 1, 2), blocked_s=60.0)
    assert diagnose(blocked, {0, 1, 2}, {}) is None


def test_simulated_60_s_straggler_before_all_reduce():
    """Rank 0 computes 60 s before its all_reduce; heartbeats arrive late (a loaded machine)."""
    dog, done = Watchdog(), {0: {"seq": {(0, 1): 1}}}
    for step in range(int(70 / 0.25)):
        now = step * 0.25
        beat = max(0.0, now - 0.9)  # rank 1's last heartbeat is up to 0.9 s old
        if now < 60.0:  # rank 0 computes; rank 1 waits in the all_reduce
            blocked = {1: _at(_op("all_reduce", 1, blocked_s=beat), received=beat)}
            verdict = watchdog.diagnose(blocked, {0, 1}, {})
        elif now < 61.0:  # rank 0 did its part and finished; rank 1's heartbeats are stale
            blocked = {1: _at(_op("all_reduce", 1, blocked_s=min(beat, 59.9)), received=beat)}
            verdict = watchdog.diagnose(
                blocked, {1}, {0: "finished"}, progress=done, finished={0: 60.0}
            )
        else:  # rank 1 finished too
            verdict = None
        assert dog.check(verdict, now, {1: beat}) is None, now


def test_a_mismatch_needs_confirming_by_fresh_heartbeats():
    dog = Watchdog()
    mismatch = watchdog.diagnose({0: _op("all_reduce", 5), 1: _op("all_gather", 6)}, {0, 1}, {})
    assert mismatch is not None and mismatch.confirm == {0, 1}
    assert dog.check(mismatch, 10.0, {0: 9.9, 1: 9.9}) is None  # first seen
    # held long enough, but rank 1 sent nothing new: its snapshot may be stale
    assert dog.check(mismatch, 10.0 + CONFIRM, {0: 10.0 + CONFIRM, 1: 9.9}) is None
    # heartbeats since, but not CONFIRM after it was first seen: they may predate the change
    assert dog.check(mismatch, 10.0 + CONFIRM, {0: 10.5, 1: 10.6}) is None
    both = {0: 10.0 + CONFIRM, 1: 10.1 + CONFIRM}
    assert dog.check(mismatch, 10.1 + CONFIRM, both) == mismatch.text
    # fresh heartbeats, but not yet held for CONFIRM seconds
    dog = Watchdog()
    assert dog.check(mismatch, 10.0, {0: 9.9, 1: 9.9}) is None
    assert dog.check(mismatch, 10.0 + CONFIRM / 2, {0: 10.2, 1: 10.3}) is None


def test_a_stale_snapshot_is_not_a_mismatch():
    # rank 0's heartbeat is from before it left all_reduce #5; its next one is in all_gather #6
    dog = Watchdog()
    stale = watchdog.diagnose({0: _op("all_reduce", 5), 1: _op("all_gather", 6)}, {0, 1}, {})
    assert dog.check(stale, 10.0, {0: 8.0, 1: 9.9}) is None
    fresh = watchdog.diagnose({0: _op("all_gather", 6), 1: _op("all_gather", 6)}, {0, 1}, {})
    assert fresh is None and dog.check(fresh, 10.5, {0: 10.4, 1: 10.4}) is None
    # the same snapshot again later starts a new confirmation, it does not stand at once
    assert dog.check(stale, 12.0, {0: 11.9, 1: 11.9}) is None


def test_mutual_recv_is_confirmed_and_a_changed_verdict_restarts_the_wait():
    dog = Watchdog()
    both = watchdog.diagnose({0: _op("recv", 1, peer=1), 1: _op("recv", 1, peer=0)}, {0, 1}, {})
    assert both is not None and both.confirm == {0, 1}
    other = Verdict("something else", frozenset({0, 1}))
    assert dog.check(both, 1.0, {0: 0.9, 1: 0.9}) is None
    assert dog.check(other, 1.5, {0: 1.4, 1: 1.4}) is None
    assert dog.check(both, 2.0, {0: 1.9, 1: 1.9}) is None  # seen again only now
    assert dog.check(both, 1.0 + CONFIRM, {0: 1.0 + CONFIRM, 1: 1.0 + CONFIRM}) is None
    assert dog.check(both, 2.0 + CONFIRM, {0: 2.0 + CONFIRM, 1: 2.0 + CONFIRM}) == both.text


def test_a_certain_verdict_stands_at_once():
    verdict = watchdog.diagnose({0: _op("all_reduce", 1)}, {0}, {1: "raised ValueError"})
    assert verdict is not None and Watchdog().check(verdict, 0.0, {}) == verdict.text
