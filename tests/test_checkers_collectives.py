"""The checkers of notebooks 00 and 10-15 on 4 gloo ranks: every right answer a learner may
write (torch 2.13's `*_single` names and the deprecated ones, async and in-place variants) is
accepted, and every plausible wrong one is rejected with a message that says what is wrong."""

from __future__ import annotations

import re
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import labkit.exercises
import labkit.exercises.collective_checks as ex
from labkit.exercises.start_checks import check_global_max

pytestmark = pytest.mark.timeout(120)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks cannot import this module


def _verdict(checker, lab, fn, ok: bool, says: str) -> None:
    verdict = checker(lab, fn)
    assert bool(verdict) is ok, verdict
    assert says in verdict.message, verdict


# ---------------------------------------------------------------- 00: global max


def gm_all_reduce(rank):
    t = torch.tensor(float((rank + 1) ** 2))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def gm_async_item(rank):
    t = torch.tensor([float((rank + 1) ** 2)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True).wait()
    return t.item()


def gm_all_gather_single(rank, world_size):
    out = torch.empty(world_size)
    dist.all_gather_single(out, torch.tensor([float((rank + 1) ** 2)]))
    return out.max()


def gm_reduce_then_broadcast(rank):
    t = torch.tensor(float((rank + 1) ** 2))
    dist.reduce(t, dst=0, op=dist.ReduceOp.MAX)
    dist.broadcast(t, src=0)
    return t


def gm_object(rank, world_size):
    values = [None] * world_size
    dist.all_gather_object(values, (rank + 1) ** 2)
    return max(values)


def gm_sum(rank):
    t = torch.tensor(float((rank + 1) ** 2))
    dist.all_reduce(t)
    return t


def gm_reduce_only(rank):
    t = torch.tensor(float((rank + 1) ** 2))
    dist.reduce(t, dst=0, op=dist.ReduceOp.MAX)
    return t


def gm_from_world_size(world_size):
    return torch.tensor(float(world_size**2))


def gm_broadcast_last(rank, world_size):
    t = torch.tensor(float((rank + 1) ** 2))
    dist.broadcast(t, src=world_size - 1)
    return t


def gm_gather_last(rank, world_size):  # the last element, not the largest
    out = torch.empty(world_size)
    dist.all_gather_single(out, torch.tensor([float((rank + 1) ** 2)]))
    return out[-1]


def gm_async_no_wait(rank):
    t = torch.tensor(float((rank + 1) ** 2))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
    return t


def gm_int(rank):  # an integer tensor: MAX is exact in any dtype
    t = torch.tensor((rank + 1) ** 2)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def gm_barrier(rank):  # a barrier "to be safe" after the answer: still right
    t = torch.tensor(float((rank + 1) ** 2))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    dist.barrier()
    return t


def gm_world_size_barrier(world_size):  # a barrier moves no value: still arithmetic
    dist.barrier()
    return torch.tensor(float(world_size**2))


def gm_fails_reversed(rank, world_size):  # right as dealt; raises only when told another rank
    t = torch.tensor(float((rank + 1) ** 2))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == world_size - 1 and dist.get_rank() != rank:
        raise ValueError("the role of the last rank, played by another")
    return t


def gm_read_before_wait(rank):  # waited for, but read first: its own value, every time
    t = torch.tensor(float((rank + 1) ** 2))
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
    value = t.item()
    work.wait()
    return value


def gm_future(rank):  # the result read from the request's future
    t = torch.tensor([float((rank + 1) ** 2)])
    return dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True).get_future().wait()[0]


def gm_then(rank):  # a callback chained on the future, as a DDP communication hook is
    t = torch.tensor([float((rank + 1) ** 2)])
    fut = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True).get_future()
    fut.then(lambda f: f.value()[0].mul_(1.0)).wait()
    return t


def gm_rank0_only(rank):
    t = torch.tensor(float((rank + 1) ** 2))
    if rank == 0:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (gm_all_reduce, True, "every rank holds 16"),
        (gm_async_item, True, "every rank holds 16"),
        (gm_all_gather_single, True, "every rank holds 16"),
        (gm_reduce_then_broadcast, True, "every rank holds 16"),
        (gm_object, True, "every rank holds 16"),
        (gm_int, True, "every rank holds 16"),
        (gm_barrier, True, "every rank holds 16"),
        (gm_future, True, "every rank holds 16"),
        (gm_then, True, "every rank holds 16"),
        (gm_read_before_wait, False, "rank 0 returned 1, expected 16"),
        (gm_world_size_barrier, False, "ranks [0, 1, 2, 3] called no collective"),
        (gm_fails_reversed, False, "with the values dealt in reverse (rank r told it is rank"),
        (gm_gather_last, False, "dealt in reverse (the largest, 16, on rank 0) rank 0 returned 1"),
        (gm_async_no_wait, False, "rank 0 never waited for its all_reduce request"),
        (lambda rank: rank, False, "rank 0 returned 0, expected 16"),
        (gm_sum, False, "returned 30, expected 16"),
        (gm_reduce_only, False, "rank(s) [1, 2, 3] kept the tensor they passed to dist.reduce"),
        (lambda rank: None, False, "expected one number"),
        (gm_from_world_size, False, "called no collective"),
        (gm_broadcast_last, False, "dealt in reverse (the largest, 16, on rank 0) rank 0"),
        (gm_rank0_only, False, "the cell could not finish"),  # the lab stops it; fresh ranks
    ],
)
def test_global_max(lab, fn, ok: bool, says: str) -> None:
    _verdict(check_global_max, lab, fn, ok, says)


# ---------------------------------------------------------------- 10: even and odd sums


def eo_reference(rank, world_size, device):
    groups = [dist.new_group(list(range(p, world_size, 2))) for p in (0, 1)]
    t = torch.tensor([float(rank)], device=device)
    dist.all_reduce(t, group=groups[rank % 2])
    return t


def eo_enumeration(rank, world_size):
    mine, _ = dist.new_subgroups_by_enumeration([list(range(p, world_size, 2)) for p in (0, 1)])
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mine, async_op=True).wait()
    return t


def eo_local_sync(rank, world_size):  # each rank builds only its own group: allowed this way
    mine = dist.new_group(list(range(rank % 2, world_size, 2)), use_local_synchronization=True)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mine)
    return t


def eo_no_wait(rank, world_size):  # the result is read before the all_reduce has finished
    groups = [dist.new_group(list(range(p, world_size, 2))) for p in (0, 1)]
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=groups[rank % 2], async_op=True)
    return t


def eo_int(rank, world_size):  # an integer tensor sums exactly: right
    groups = [dist.new_group(list(range(p, world_size, 2))) for p in (0, 1)]
    t = torch.tensor([rank])
    dist.all_reduce(t, group=groups[rank % 2])
    return t


def eo_barrier(rank, world_size):  # a world barrier moves no data: still right
    groups = [dist.new_group(list(range(p, world_size, 2))) for p in (0, 1)]
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=groups[rank % 2])
    dist.barrier()
    return t


def eo_arithmetic_barrier(rank, world_size):  # a barrier is not the sum's communication
    dist.barrier()
    return torch.tensor([float(sum(range(rank % 2, world_size, 2)))])


def eo_world(rank):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t


def eo_arithmetic(rank, world_size):
    return torch.tensor([float(sum(range(rank % 2, world_size, 2)))])


def eo_gather_world(rank, world_size):
    parts = torch.empty(world_size)
    dist.all_gather_single(parts, torch.tensor([float(rank)]))
    return parts[rank % 2 :: 2].sum().reshape(1)


def eo_swapped_groups(rank, world_size):
    groups = [dist.new_group(list(range(p, world_size, 2))) for p in (0, 1)]
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=groups[1 - rank % 2])  # not a member: torch warns, t unchanged
    return t


def eo_own_group_only(rank, world_size):  # new_group called by the members only
    mine = dist.new_group(list(range(rank % 2, world_size, 2)))
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mine)
    return t


@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (eo_reference, True, "each parity summed in its own group"),
        (eo_enumeration, True, "each parity summed in its own group"),
        (eo_world, False, "rank 0 returned [6.0], expected [2.0]"),
        (lambda rank: torch.tensor([float(rank)]), False, "rank 0 returned [0.0], expected [2.0]"),
        (eo_arithmetic, False, "called no collective"),
        (eo_barrier, True, "each parity summed in its own group"),
        (eo_arithmetic_barrier, False, "rank(s) [0, 1, 2, 3] called no collective"),
        (eo_gather_world, False, "ran on the whole world"),
        (eo_swapped_groups, False, "rank 0 returned [0.0], expected [2.0]"),
        (eo_no_wait, False, "rank 0 never waited for its all_reduce request"),
        (eo_int, True, "each parity summed in its own group"),
    ],
)
def test_even_odd_sums(lab, fn, ok: bool, says: str) -> None:
    _verdict(ex.check_even_odd_sums, lab, fn, ok, says)


def test_even_odd_sums_rejects_groups_made_by_their_members_only(lab, monkeypatch) -> None:
    """Each parity makes only its own group: the two groups get the same number (its name)
    with different members. The ranks may hang in new_group or in the all_reduce (the
    watchdog or the checker's own timeout stops them), or finish: the checker then compares
    the ranks' new_group calls. Wrong either way, and the message names no group number (it
    depends on how many groups earlier cells made)."""
    monkeypatch.setattr(labkit.exercises, "CHECK_TIMEOUT", 20.0)
    try:
        verdict = ex.check_even_odd_sums(lab, eo_own_group_only)
    finally:
        lab.restart()  # the parities shared one group name: start later tests from fresh ranks
    assert not verdict, verdict
    hung = "the cell could not finish" in verdict.message
    differ = re.search(
        r"new_group calls differ between ranks: rank 0 called new_group with \[\[0, 2\]\], "
        r"rank 1 with \[\[1, 3\]\]",
        verdict.message,
    )
    assert hung or differ, verdict


def test_even_odd_sums_local_synchronization(lab) -> None:
    """Each rank makes only its own group, with use_local_synchronization=True: right, on any
    torch (2.13 does not advance the group counter for such a group; later versions may, on
    its members only, so the lab is restarted after it)."""
    try:
        _verdict(ex.check_even_odd_sums, lab, eo_local_sync, True, "in its own group")
    finally:
        lab.restart()


@pytest.mark.parametrize(
    "calls, says",
    [
        # the #35 case: a use_local_synchronization group made by its members only
        ({0: [[[0, 2], True]], 1: [], 2: [[[0, 2], True]], 3: []}, None),
        # every rank made both groups, in the same order
        ({r: [[[0, 2], False], [[1, 3], False]] for r in range(4)}, None),
        # each parity made its own group: same count, different members
        (
            {r: [[[r % 2, r % 2 + 2], False]] for r in range(4)},
            "rank 0 called new_group with [[0, 2]], rank 1 with [[1, 3]]",
        ),
        # members only, without use_local_synchronization
        ({0: [[[0, 2], False]], 1: [], 2: [[[0, 2], False]], 3: []}, "rank 1 with []"),
        # both groups, in a different order on odd ranks
        (
            {r: [[[0, 2], False], [[1, 3], False]][:: 1 if r % 2 == 0 else -1] for r in range(4)},
            "rank 1 with [[1, 3], [0, 2]]",
        ),
    ],
)
def test_group_calls_compared_across_ranks(calls, says) -> None:
    """The new_group comparison alone, on recorded calls: no ranks, no group counter."""
    verdict = ex._group_calls(calls)
    if says is None:
        assert verdict is None, verdict
    else:
        assert verdict is not None and not verdict and says in verdict.message, verdict


# ---------------------------------------------------------------- 11: pair swap


def ps_isend_irecv(rank):
    mine, theirs = torch.full((4,), float(rank)), torch.empty(4)
    for req in [dist.isend(mine, dst=rank ^ 1), dist.irecv(theirs, src=rank ^ 1)]:
        req.wait()
    return theirs


def ps_even_sends_first(rank):
    mine, theirs = torch.full((4,), float(rank)), torch.empty(4)
    if rank % 2 == 0:
        dist.send(mine, dst=rank ^ 1)
        dist.recv(theirs, src=rank ^ 1)
    else:
        dist.recv(theirs, src=rank ^ 1)
        dist.send(mine, dst=rank ^ 1)
    return theirs


def ps_batch(rank):
    mine, theirs = torch.full((4,), float(rank)), torch.empty(4)
    ops = [dist.P2POp(dist.isend, mine, rank ^ 1), dist.P2POp(dist.irecv, theirs, rank ^ 1)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return theirs


def ps_recv_async_then_send(rank):
    mine, theirs = torch.full((4,), float(rank)), torch.empty(4)
    req = dist.irecv(theirs, src=rank ^ 1)
    dist.send(mine, dst=rank ^ 1)
    req.wait()
    return theirs


def ps_then_barrier(rank):  # a barrier after the swap moves no data: still right
    theirs = ps_even_sends_first(rank)
    dist.barrier()
    return theirs


def ps_computed_barrier(rank):  # the partner's value computed, then a barrier: no swap
    dist.barrier()
    return torch.full((4,), float(rank ^ 1))


def ps_read_before_wait(rank):  # waits for both, but copies theirs before the irecv's wait
    mine, theirs = torch.full((4,), float(rank)), torch.zeros(4)
    reqs = [dist.isend(mine, dst=rank ^ 1), dist.irecv(theirs, src=rank ^ 1)]
    got = theirs.clone()
    for req in reqs:
        req.wait()
    return got


def ps_batch_read_before_wait(rank):
    mine, theirs = torch.full((4,), float(rank)), torch.zeros(4)
    ops = [dist.P2POp(dist.isend, mine, rank ^ 1), dist.P2POp(dist.irecv, theirs, rank ^ 1)]
    works = dist.batch_isend_irecv(ops)
    got = theirs.clone()
    for work in works:
        work.wait()
    return got


def ps_no_wait(rank):  # the classic race: returns theirs before irecv has filled it
    mine, theirs = torch.full((4,), float(rank)), torch.empty(4)
    dist.isend(mine, dst=rank ^ 1)
    dist.irecv(theirs, src=rank ^ 1)
    return theirs


def ps_no_wait_lucky(rank):  # a sleep makes the numbers right, not the program
    import time

    mine, theirs = torch.full((4,), float(rank)), torch.empty(4)
    dist.isend(mine, dst=rank ^ 1)
    dist.irecv(theirs, src=rank ^ 1)
    time.sleep(0.5)
    return theirs


def ps_send_not_waited(rank):  # waits for its irecv only: the isend's buffer is still in use
    mine, theirs = torch.full((4,), float(rank)), torch.empty(4)
    dist.isend(mine, dst=rank ^ 1)
    dist.irecv(theirs, src=rank ^ 1).wait()
    return theirs


def ps_batch_first_only(rank):
    mine, theirs = torch.full((4,), float(rank)), torch.empty(4)
    ops = [dist.P2POp(dist.irecv, theirs, rank ^ 1), dist.P2POp(dist.isend, mine, rank ^ 1)]
    dist.batch_isend_irecv(ops)[0].wait()
    return theirs


def ps_both_send_first(rank):
    mine = torch.full((4,), float(rank))
    dist.send(mine, dst=rank ^ 1)
    dist.recv(mine, src=rank ^ 1)
    return mine


def ps_ring_neighbour(rank, world_size):
    mine, theirs = torch.full((4,), float(rank)), torch.empty(4)
    reqs = [dist.isend(mine, (rank + 1) % world_size), dist.irecv(theirs, (rank - 1) % world_size)]
    for req in reqs:
        req.wait()
    return theirs


def ps_all_gather(rank, world_size):
    parts = [torch.empty(4) for _ in range(world_size)]
    dist.all_gather(parts, torch.full((4,), float(rank)))
    return parts[rank ^ 1]


@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (ps_isend_irecv, True, "point to point"),
        (ps_even_sends_first, True, "point to point"),
        (ps_batch, True, "point to point"),
        (ps_recv_async_then_send, True, "point to point"),
        (ps_then_barrier, True, "point to point"),
        (ps_read_before_wait, False, "rank 0 returned [0.0, 0.0, 0.0, 0.0], expected [1.0"),
        (ps_batch_read_before_wait, False, "rank 0 returned [0.0, 0.0, 0.0, 0.0], expected"),
        (ps_computed_barrier, False, "rank(s) [0, 1, 2, 3] called no collective"),
        (lambda rank: torch.full((4,), float(rank)), False, "rank 0 returned [0.0, 0.0"),
        (lambda rank: torch.full((4,), float(rank ^ 1)), False, "called no collective"),
        (ps_both_send_first, False, "both wait to send"),
        (ps_ring_neighbour, False, "rank 0 returned [3.0, 3.0, 3.0, 3.0], expected [1.0"),
        (ps_all_gather, False, "through ['all_gather']: swap with send and recv"),
    ],
)
def test_pair_swap(lab, fn, ok: bool, says: str) -> None:
    _verdict(ex.check_pair_swap, lab, fn, ok, says)


@pytest.mark.parametrize(
    "fn, says",
    [
        (ps_no_wait, "rank 0 never waited for its isend and irecv requests"),
        (ps_no_wait_lucky, "rank 0 never waited for its isend and irecv requests"),
        (ps_send_not_waited, "never waited for its isend request"),
        (ps_batch_first_only, "never waited for its isend request"),
    ],
)
def test_pair_swap_rejects_unwaited_requests(lab, fn, says: str) -> None:
    """Requests never waited for are wrong even when the numbers came out right (with a sleep,
    they nearly always do). A rank that returns with its isend pending may also leave its
    partner waiting: then the lab stops the cell. Either way wrong; the lab restarts after, so
    no pending request reaches a later test."""
    try:
        verdict = ex.check_pair_swap(lab, fn)
    finally:
        lab.restart()
    assert not verdict, verdict
    assert says in verdict.message or "could not finish" in verdict.message, verdict


# ---------------------------------------------------------------- 12: all_reduce by parts


def ar_lists(rank, world_size):
    x = torch.arange(4.0 * world_size) + rank
    mine = torch.empty(4)
    dist.reduce_scatter(mine, list(x.chunk(world_size)))
    parts = [torch.empty(4) for _ in range(world_size)]
    dist.all_gather(parts, mine)
    return torch.cat(parts)


def ar_single(rank, world_size):  # torch 2.13's names
    x = torch.arange(4.0 * world_size) + rank
    mine, out = torch.empty(4), torch.empty(4 * world_size)
    dist.reduce_scatter_single(mine, x)
    dist.all_gather_single(out, mine)
    return out


def ar_deprecated(rank, world_size):  # the old names: a FutureWarning, still right
    x = torch.arange(4.0 * world_size) + rank
    mine, out = torch.empty(4), torch.empty(4 * world_size)
    dist.reduce_scatter_tensor(mine, x)
    dist.all_gather_into_tensor(out, mine)
    return out


def ar_async(rank, world_size):
    x = torch.arange(4.0 * world_size) + rank
    mine, out = torch.empty(4), torch.empty(4 * world_size)
    dist.reduce_scatter_single(mine, x, async_op=True).wait()
    dist.all_gather_single(out, mine, async_op=True).wait()
    return out


def ar_in_place(rank, world_size):  # the gather lands in x itself; the shard is a view of it
    x = torch.arange(4.0 * world_size) + rank
    mine = x[4 * rank : 4 * rank + 4]
    dist.reduce_scatter_single(mine, x.clone())
    dist.all_gather_single(x, mine.clone())
    return x


def ar_mixed(rank, world_size):
    x = torch.arange(4.0 * world_size) + rank
    mine, out = torch.empty(4), torch.empty(4 * world_size)
    dist.reduce_scatter(mine, list(x.chunk(world_size)))
    dist.all_gather_single(out, mine)
    return out


def ar_async_no_wait(rank, world_size):
    x = torch.arange(4.0 * world_size) + rank
    mine, out = torch.empty(4), torch.empty(4 * world_size)
    dist.reduce_scatter_single(mine, x, async_op=True)
    dist.all_gather_single(out, mine, async_op=True).wait()
    return out


def ar_shortcut(rank, world_size):
    x = torch.arange(4.0 * world_size) + rank
    dist.all_reduce(x)
    return x


def ar_gather_and_add(rank, world_size):
    x = torch.arange(4.0 * world_size) + rank
    out = torch.empty(world_size * 4 * world_size)
    dist.all_gather_single(out, x)
    return out.view(world_size, -1).sum(0)


def ar_reduce_broadcast(rank, world_size):
    x = torch.arange(4.0 * world_size) + rank
    dist.reduce(x, dst=0)
    dist.broadcast(x, src=0)
    return x


def ar_scatter_only(rank, world_size):
    x = torch.arange(4.0 * world_size) + rank
    mine = torch.empty(4)
    dist.reduce_scatter_single(mine, x)
    return mine


def ar_average(rank, world_size):
    x = torch.arange(4.0 * world_size) + rank
    mine, out = torch.empty(4), torch.empty(4 * world_size)
    dist.reduce_scatter_single(mine, x, op=dist.ReduceOp.AVG)
    dist.all_gather_single(out, mine)
    return out


@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (ar_lists, True, "equals all_reduce"),
        (ar_single, True, "equals all_reduce"),
        (ar_deprecated, True, "equals all_reduce"),
        (ar_async, True, "equals all_reduce"),
        (ar_in_place, True, "equals all_reduce"),
        (ar_mixed, True, "equals all_reduce"),
        (lambda rank, world_size: torch.arange(4.0 * world_size) + rank, False, "expected [6.0"),
        (ar_shortcut, False, "it called all_reduce"),
        (ar_gather_and_add, False, "called ['all_gather'], not reduce_scatter+all_gather"),
        (ar_reduce_broadcast, False, "called ['reduce', 'broadcast']"),
        (ar_scatter_only, False, "rank 0 returned [6.0, 10.0, 14.0, 18.0], expected"),
        (ar_average, False, "rank 0 returned [1.5, 2.5"),
        (ar_async_no_wait, False, "never waited for its reduce_scatter_single request"),
    ],
)
def test_all_reduce_by_parts(lab, fn, ok: bool, says: str) -> None:
    _verdict(ex.check_all_reduce_by_parts, lab, fn, ok, says)


# ---------------------------------------------------------------- 15: a collective of two ranks


def pair_reference(rank):
    pair = dist.new_group([0, 2])
    t = torch.tensor([rank + 1.0])
    if rank in (0, 2):
        dist.all_reduce(t, group=pair)
    return t


def pair_local_sync(rank):
    t = torch.tensor([rank + 1.0])
    if rank in (0, 2):
        dist.all_reduce(t, group=dist.new_group([0, 2], use_local_synchronization=True))
    return t


def pair_everyone_calls(rank):  # non-members return at once (torch warns): still right
    pair = dist.new_group([0, 2])
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t, group=pair)
    return t


def pair_async(rank):  # (a non-member's async call returns None: no work to wait for)
    pair = dist.new_group([0, 2])
    t = torch.tensor([rank + 1.0])
    if rank in (0, 2):
        dist.all_reduce(t, group=pair, async_op=True).wait()
    return t


def pair_send_recv(rank):
    t = torch.tensor([rank + 1.0])
    if rank in (0, 2):
        other = torch.empty(1)
        reqs = [dist.isend(t, dst=2 - rank), dist.irecv(other, src=2 - rank)]
        for req in reqs:
            req.wait()
        t = t + other
    return t


def pair_then_barrier(rank):  # a world barrier after the pair's sum moves no data: right
    t = pair_reference(rank)
    dist.barrier()
    return t


def pair_world(rank):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return t


def pair_world_masked(rank):
    t = torch.tensor([rank + 1.0])
    contribution = t.clone() if rank in (0, 2) else torch.zeros(1)
    dist.all_reduce(contribution)
    return contribution if rank in (0, 2) else t


def pair_arithmetic(rank):
    return torch.tensor([4.0 if rank in (0, 2) else rank + 1.0])


def pair_async_no_wait(rank):
    pair = dist.new_group([0, 2])
    t = torch.tensor([rank + 1.0])
    if rank in (0, 2):
        dist.all_reduce(t, group=pair, async_op=True)
    return t


def pair_members_only(rank):  # new_group skipped by ranks 1 and 3: numbered groups diverge
    t = torch.tensor([rank + 1.0])
    if rank in (0, 2):
        dist.all_reduce(t, group=dist.new_group([0, 2]))
    return t


@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (pair_reference, True, "in their own group"),
        (pair_everyone_calls, True, "in their own group"),
        (pair_async, True, "in their own group"),
        (pair_send_recv, True, "in their own group"),
        (pair_then_barrier, True, "in their own group"),
        (lambda rank: torch.tensor([rank + 1.0]), False, "rank 0 returned [1.0], expected [4.0]"),
        (pair_world, False, "rank 0 returned [10.0], expected [4.0]"),
        (pair_world_masked, False, "all_reduce on ranks [0, 1, 2, 3]"),
        (pair_arithmetic, False, "called no collective"),
        (pair_async_no_wait, False, "rank 0 never waited for its all_reduce request"),
    ],
)
def test_pair_sum(lab, fn, ok: bool, says: str) -> None:
    _verdict(ex.check_pair_sum, lab, fn, ok, says)


def pair_local_sync_counted(rank):
    """pair_local_sync on a torch that advances the group counter for a hashed-name group too
    (torch 2.13 does not; later versions do, on its members only: the counts per rank then
    differ, {0: 1, 1: 0, 2: 1, 3: 0}, as in torch 2.14.1)."""
    from torch.distributed import distributed_c10d as c10d

    real = c10d._process_group_name

    def counting(ranks, use_hashed_name):
        name = real(ranks, use_hashed_name)
        if use_hashed_name:
            c10d._world.group_count += 1
        return name

    c10d._process_group_name = counting
    try:
        return pair_local_sync(rank)
    finally:
        c10d._process_group_name = real


@pytest.mark.parametrize("fn", [pair_local_sync, pair_local_sync_counted])
def test_pair_sum_local_synchronization(lab, fn) -> None:
    """new_group([0, 2], use_local_synchronization=True) called by ranks 0 and 2 only: right on
    any torch (judged from the calls, not from torch's group counter)."""
    try:
        _verdict(ex.check_pair_sum, lab, fn, True, "in their own group")
    finally:
        lab.restart()  # a torch that counts such groups on their members only: fresh ranks


def test_pair_sum_rejects_new_group_on_members_only(lab) -> None:
    try:
        _verdict(
            ex.check_pair_sum,
            lab,
            pair_members_only,
            False,
            "new_group calls differ between ranks: rank 0 called new_group with [[0, 2]], "
            "rank 1 with []",
        )
    finally:
        lab.restart()  # the ranks' group numbering diverged: later groups would mismatch


# ---------------------------------------------------------------- 13, 14: pure checkers


@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (lambda i, p: (i + 1) % p, True, "p = 2..8"),
        (lambda i, p: (i - p + 1) % p, True, "p = 2..8"),
        (lambda i, p: torch.tensor((i + 1) % p), True, "p = 2..8"),
        (lambda i, p: i, False, "fn(0, 2) = 0, but position 0 owns chunk 1"),
        (lambda i, p: (i - 1) % p, False, "but position 0 owns chunk 1"),
        (lambda i, p: i + 1, False, "fn(1, 2) = 2, but position 1 owns chunk 0"),
        (lambda i, p: 1 / 0, False, "raised ZeroDivisionError"),
    ],
)
def test_owner_chunk(fn, ok: bool, says: str) -> None:
    _verdict(lambda _lab, f: ex.check_owner_chunk(f), None, fn, ok, says)


@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (lambda a, b, n, p: 2 * (p - 1) * a + 2 * (p - 1) / p * n * b, True, "2(p-1)"),
        (lambda a, b, n, p: 2 * (p - 1) * (a + n / p * b), True, "2(p-1)"),
        (lambda a, b, n, p: torch.tensor(2 * (p - 1) * (a + n / p * b)), True, "2(p-1)"),
        (lambda a, b, n, p: a + n * b, False, "expected 0.0006061 s"),
        (lambda a, b, n, p: (p - 1) * a + 2 * (p - 1) / p * n * b, False, "= 0.0003061 s"),
        (lambda a, b, n, p: 2 * (p - 1) * a + (p - 1) / p * n * b, False, "= 0.0006031 s"),
        (lambda a, b, n, p: 2 * (p - 1) * a + 2 * (p - 1) / p * 8 * n * b, False, "expected"),
        (lambda a, b, n, p: 2 * p * a + 2 * n * b, False, "expected"),
        (lambda a, b, n: a, False, "raised TypeError"),
    ],
)
def test_alpha_beta(fn, ok: bool, says: str) -> None:
    _verdict(lambda _lab, f: ex.check_alpha_beta(f), None, fn, ok, says)


def test_solutions_are_accepted(lab) -> None:
    """Each revealed solution, run as a learner would paste it, passes its own checker."""
    names = {"torch": torch, "dist": dist}
    for solution, check in (
        (ex.solution_even_odd_sums, ex.check_even_odd_sums),
        (ex.solution_pair_swap, ex.check_pair_swap),
        (ex.solution_all_reduce_by_parts, ex.check_all_reduce_by_parts),
        (ex.solution_pair_sum, ex.check_pair_sum),
    ):
        ns = dict(names)
        exec(solution().code, ns)
        fn = next(v for k, v in ns.items() if callable(v) and k not in names)
        assert check(lab, fn), solution
    for solution, check in (
        (ex.solution_owner_chunk, ex.check_owner_chunk),
        (ex.solution_alpha_beta, ex.check_alpha_beta),
    ):
        ns = {}
        exec(solution().code, ns)
        assert check(next(v for k, v in ns.items() if callable(v))), solution
