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
        (lambda rank: rank, False, "rank 0 returned 0, expected 16"),
        (gm_sum, False, "returned 30, expected 16"),
        (gm_reduce_only, False, "rank(s) [1, 2, 3] kept the tensor they passed to dist.reduce"),
        (lambda rank: None, False, "expected one number"),
        (gm_from_world_size, False, "called no collective"),
        (gm_broadcast_last, False, "only a broadcast"),
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
        (eo_local_sync, True, "each parity summed in its own group"),
        (eo_world, False, "rank 0 returned [6.0], expected [2.0]"),
        (lambda rank: torch.tensor([float(rank)]), False, "rank 0 returned [0.0], expected [2.0]"),
        (eo_arithmetic, False, "called no collective"),
        (eo_gather_world, False, "ran on the whole world"),
        (eo_swapped_groups, False, "rank 0 returned [0.0], expected [2.0]"),
    ],
)
def test_even_odd_sums(lab, fn, ok: bool, says: str) -> None:
    _verdict(ex.check_even_odd_sums, lab, fn, ok, says)


def test_even_odd_sums_rejects_groups_made_by_their_members_only(lab, monkeypatch) -> None:
    """Groups of the same number but different members: the watchdog diagnoses it when a rank
    waits in the all_reduce, but the ranks may also hang in new_group (not an op it watches):
    then the checker's own timeout stops it. Or both groups finish: each parity's first
    new_group gets the same name, so its store keys are shared, and a rank can pair with one
    of the other parity (rank 0 with rank 3, under two busy loops) and return a wrong sum, or
    each pairs within its parity and the sums are right: the checker then sees that group 1
    has different members on even and odd ranks. A wrong verdict every way."""
    monkeypatch.setattr(labkit.exercises, "CHECK_TIMEOUT", 20.0)
    verdict = ex.check_even_odd_sums(lab, eo_own_group_only)
    assert not verdict, verdict
    hung = "the cell could not finish" in verdict.message
    crossed = re.fullmatch(r"rank \d returned \[[\d.]+\], expected \[[\d.]+\]", verdict.message)
    members = "group 1 has different members on different ranks" in verdict.message
    assert hung or crossed or members, verdict


class _Lab:
    """What the checker reads of a lab whose ranks all returned (run_on_ranks is replaced)."""

    world_size = 4

    def trace(self, **_: object) -> list:
        return []


class _Results:
    def __init__(self, values_by_rank: dict) -> None:
        self.values_by_rank = values_by_rank


@pytest.mark.parametrize(
    "members, ok, says",
    [
        # each parity made its own group 1 and both pairs met within their parity
        (
            {0: {"1": [0, 2]}, 1: {"1": [1, 3]}, 2: {"1": [0, 2]}, 3: {"1": [1, 3]}},
            False,
            "group 1 has different members on different ranks (ranks [0, 2] made it [0, 2]; "
            "ranks [1, 3] made it [1, 3])",
        ),
        # every rank made both groups: each holds only the one it is in (reference answer)
        (
            {0: {"1": [0, 2]}, 1: {"2": [1, 3]}, 2: {"1": [0, 2]}, 3: {"2": [1, 3]}},
            True,
            "all 4 ranks hold the expected tensors",
        ),
    ],
)
def test_group_members_compared_across_ranks(monkeypatch, members, ok: bool, says: str) -> None:
    """The member check alone, without the race above: right sums, as many new_group calls on
    every rank, and group names that mean different members on different ranks are wrong."""
    sums = {r: torch.tensor([float(sum(range(r % 2, 4, 2)))]) for r in range(4)}
    groups = {r: len(m) for r, m in members.items()}
    got = {r: {"value": sums[r], "groups": groups[r], "members": members[r]} for r in range(4)}
    monkeypatch.setattr(ex, "run_on_ranks", lambda lab, fn: (_Results(got), None))
    verdict = ex._run_and_compare(_Lab(), eo_reference, sums)
    assert bool(verdict) is ok, verdict
    assert says in verdict.message, verdict


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
        (lambda rank: torch.full((4,), float(rank)), False, "rank 0 returned [0.0, 0.0"),
        (lambda rank: torch.full((4,), float(rank ^ 1)), False, "called no collective"),
        (ps_both_send_first, False, "both wait to send"),
        (ps_ring_neighbour, False, "rank 0 returned [3.0, 3.0, 3.0, 3.0], expected [1.0"),
        (ps_all_gather, False, "through ['all_gather']: swap with send and recv"),
    ],
)
def test_pair_swap(lab, fn, ok: bool, says: str) -> None:
    _verdict(ex.check_pair_swap, lab, fn, ok, says)


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


def pair_members_only(rank):  # new_group skipped by ranks 1 and 3: numbered groups diverge
    t = torch.tensor([rank + 1.0])
    if rank in (0, 2):
        dist.all_reduce(t, group=dist.new_group([0, 2]))
    return t


@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (pair_reference, True, "in their own group"),
        (pair_local_sync, True, "in their own group"),
        (pair_everyone_calls, True, "in their own group"),
        (pair_async, True, "in their own group"),
        (pair_send_recv, True, "in their own group"),
        (lambda rank: torch.tensor([rank + 1.0]), False, "rank 0 returned [1.0], expected [4.0]"),
        (pair_world, False, "rank 0 returned [10.0], expected [4.0]"),
        (pair_world_masked, False, "all_reduce on ranks [0, 1, 2, 3]"),
        (pair_arithmetic, False, "called no collective"),
    ],
)
def test_pair_sum(lab, fn, ok: bool, says: str) -> None:
    _verdict(ex.check_pair_sum, lab, fn, ok, says)


def test_pair_sum_rejects_new_group_on_members_only(lab) -> None:
    try:
        _verdict(ex.check_pair_sum, lab, pair_members_only, False, "new_group calls per rank")
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
