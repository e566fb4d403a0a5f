"""Exercises of the collectives notebooks, 10 to 15 (kernel side).

Checkers that take a function run it on every rank with `lab.run(fn)` (the function gets the
rank's namespace entries it names, e.g. `rank`, `world_size`) and compare what each rank returns
with a reference computed here. A cell the lab had to stop (a deadlock, a hang) counts as wrong,
with the lab's diagnosis as the reason; the ranks are then fresh. Right numbers are not
enough, and three things are judged before the numbers, on every rank:

- every request (isend, irecv, a batch's, async_op=True) was waited for before the function
  returned: without wait() the numbers are right or wrong by luck of timing, so an unwaited
  request is wrong even when the numbers came out right; and a received tensor read before
  its wait() reads its old values every time (the checker hands what a request received to
  the learner's tensor at wait());
- the new_group calls made without use_local_synchronization=True are the same, in the same
  order, on every rank (groups are named by a counter, so a rank that skips one, or makes a
  different one at the same point, pairs its later groups with the wrong members). This is read
  from the calls themselves, not from torch's group counter, which torch versions advance
  differently for use_local_synchronization=True groups;
- the trace shows the communication the exercise asks for (a collective on a group,
  send/recv, reduce_scatter + all_gather). A barrier moves no data: one added "to be safe"
  neither spoils a right answer nor counts as the communication a wrong one lacks.

The wrong answers each checker is tested against (tests/test_checkers_collectives.py) are
listed in its docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from labkit.exercises import (
    SYNC_ONLY,
    Verdict,
    comm_ops,
    reveal,
    right,
    run_on_ranks,
    unwaited,
    watching_factory,
    wrong,
)

P2P = {"send", "recv", "batch_isend_irecv"}  # after OP_FAMILY folded isend/irecv

__all__ = [
    "check_all_reduce_by_parts",
    "check_alpha_beta",
    "check_even_odd_sums",
    "check_owner_chunk",
    "check_pair_swap",
    "check_pair_sum",
    "solution_all_reduce_by_parts",
    "solution_alpha_beta",
    "solution_even_odd_sums",
    "solution_owner_chunk",
    "solution_pair_swap",
    "solution_pair_sum",
]


def _group_calls(groups_by_rank: dict[int, list[list[Any]]]) -> Verdict | None:
    """A wrong verdict when the ranks' new_group calls without use_local_synchronization=True
    differ (in number, members or order)."""
    numbered = {
        r: [ranks for ranks, local in calls if not local] for r, calls in groups_by_rank.items()
    }
    first = min(numbered)
    for r, calls in sorted(numbered.items()):
        if calls != numbered[first]:
            return wrong(
                f"new_group calls differ between ranks: rank {first} called new_group with "
                f"{numbered[first]}, rank {r} with {calls}. Every rank must call new_group for "
                "every group, in the same order, even for a group it is not in (or pass "
                "use_local_synchronization=True): groups are named by a counter, so otherwise "
                "later groups pair the wrong ranks"
            )
    return None


def _run_and_compare(lab: Any, fn: Callable[..., Any], expected: dict[int, Any]) -> Verdict:
    """Run fn on every rank; right when every request was waited for, every rank made the same
    numbered groups, and each rank returns a tensor equal to expected[rank]."""
    results, bad = run_on_ranks(lab, watching_factory()(fn))
    if bad is not None:
        return bad
    out = results.values_by_rank
    if (bad := unwaited({r: got["calls"] for r, got in out.items()})) is not None:
        return bad
    if (bad := _group_calls({r: got["groups"] for r, got in out.items()})) is not None:
        return bad
    for r, got in sorted(out.items()):
        want, value = expected[r], got["value"]
        if not isinstance(value, torch.Tensor):
            return wrong(f"rank {r} returned {type(value).__name__}, expected a tensor")
        if value.shape != want.shape or not torch.allclose(value.float().cpu(), want.float()):
            return wrong(f"rank {r} returned {value.tolist()}, expected {want.tolist()}")
    return right(f"all {len(expected)} ranks hold the expected tensors")


def _no_comm(lab: Any, ranks: Any) -> Verdict | None:
    """A wrong verdict when one of `ranks` called no collective and no send/recv (a barrier
    alone moves no data: it does not count)."""
    quiet = [
        r for r, ops in sorted(comm_ops(lab).items()) if r in ranks and not set(ops) - SYNC_ONLY
    ]
    if quiet:
        return wrong(
            f"right numbers, but rank(s) {quiet} called no collective and no send/recv: "
            "they computed the answer instead of receiving it"
        )
    return None


# -- 10: subgroups ----------------------------------------------------------------------------
def check_even_odd_sums(lab: Any, fn: Callable[..., Any]) -> Verdict:
    """`fn(rank, world_size)` returns `torch.tensor([float(rank)])` summed over the ranks of the
    same parity (even ranks with even ranks, odd with odd), with a collective on a group of
    one parity (not on the whole world).

    Classic wrong answers it rejects: the all_reduce left on the whole world; the answer
    computed from world_size; all_gather on the world then a sum of one parity; the other
    parity's group (a non-member's all_reduce returns at once, leaving t alone); each parity
    making only its own group without use_local_synchronization=True (a hang, or new_group
    calls that differ); an async all_reduce never waited for."""
    n = lab.world_size
    expected = {r: torch.tensor([float(sum(q for q in range(r % 2, n, 2)))]) for r in range(n)}
    verdict = _run_and_compare(lab, fn, expected)
    if not verdict or n < 3:
        return verdict
    if (quiet := _no_comm(lab, range(n))) is not None:
        return quiet
    world = tuple(range(n))
    on_world = sorted(
        {
            rec.op
            for rec in lab.trace()
            if rec.kind == "comm" and rec.group == world and rec.op not in SYNC_ONLY
        }
    )
    if on_world:
        return wrong(
            f"right numbers, but {on_world} ran on the whole world: make one group per parity "
            "and reduce within it"
        )
    return right(f"each parity summed in its own group on all {n} ranks")


def solution_even_odd_sums() -> Any:
    return reveal("""
def even_odd_sums(rank, world_size, device):
    evens = dist.new_group(list(range(0, world_size, 2)))  # every rank creates every group
    odds = dist.new_group(list(range(1, world_size, 2)))
    t = torch.tensor([float(rank)], device=device)
    dist.all_reduce(t, group=evens if rank % 2 == 0 else odds)
    return t
""")


# -- 11: point-to-point -----------------------------------------------------------------------
def check_pair_swap(lab: Any, fn: Callable[..., Any]) -> Verdict:
    """`fn(rank)` swaps `torch.full((4,), float(rank))` with its partner `rank ^ 1` and returns
    what it received, without deadlocking (the lab stops a deadlock and this says wrong).

    Classic wrong answers it rejects: both ranks send first (on gloo a deadlock at any size,
    with NCCL or MPI once the message outgrows their buffers; the lab stops it); isend/irecv
    never waited for (the tensor returned may still be empty: rejected even when a sleep made
    the numbers right); only the irecv waited for, or only the first request of a batch; the
    ring neighbour (rank + 1) instead of the partner rank ^ 1; all_gather instead of point to
    point; the answer computed without receiving. A barrier after a right swap is right."""
    n = lab.world_size
    if n % 2:
        return wrong(f"this exercise needs an even number of ranks, the lab has {n}")
    verdict = _run_and_compare(lab, fn, {r: torch.full((4,), float(r ^ 1)) for r in range(n)})
    if not verdict:
        return verdict
    if (quiet := _no_comm(lab, range(n))) is not None:
        return quiet
    other = {op for ops in comm_ops(lab).values() for op in ops} - P2P - SYNC_ONLY
    if other:
        return wrong(f"right numbers, but through {sorted(other)}: swap with send and recv")
    return right(f"every pair swapped its tensors, point to point, on all {n} ranks")


def solution_pair_swap() -> Any:
    return reveal("""
def pair_swap(rank, device):
    mine = torch.full((4,), float(rank), device=device)
    theirs = torch.empty(4, device=device)
    peer = rank ^ 1
    if rank % 2 == 0:          # even ranks send first, odd ranks receive first
        dist.send(mine, dst=peer)
        dist.recv(theirs, src=peer)
    else:
        dist.recv(theirs, src=peer)
        dist.send(mine, dst=peer)
    return theirs
# or, in any order:
#   for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer),
#                                       dist.P2POp(dist.irecv, theirs, peer)]):
#       work.wait()
""")


# -- 12: collectives --------------------------------------------------------------------------
def check_all_reduce_by_parts(lab: Any, fn: Callable[..., Any]) -> Verdict:
    """`fn(rank, world_size)` returns the all_reduce SUM of `torch.arange(4. * world_size) + rank`
    computed with reduce_scatter then all_gather, and no all_reduce.

    Classic wrong answers it rejects: all_reduce itself; all_gather of everything then a local
    sum (W times the bytes); reduce then broadcast; reduce_scatter without the all_gather (a
    quarter of the answer); ReduceOp.AVG where the sum is asked; a reduce_scatter never waited
    for before its result is gathered."""
    n = lab.world_size
    total = sum(torch.arange(4.0 * n) + r for r in range(n))
    verdict = _run_and_compare(lab, fn, {r: total for r in range(n)})
    if not verdict:
        return verdict
    for r, ops in sorted(comm_ops(lab).items()):
        if "all_reduce" in ops:
            return wrong("right numbers, but it called all_reduce: build it from the two halves")
        if not {"reduce_scatter", "all_gather"} <= set(ops):
            return wrong(f"right numbers, but rank {r} called {ops}, not reduce_scatter+all_gather")
    return right("reduce_scatter then all_gather equals all_reduce on every rank")


def solution_all_reduce_by_parts() -> Any:
    return reveal("""
def all_reduce_by_parts(rank, world_size, device):
    x = torch.arange(4. * world_size, device=device) + rank
    mine = torch.empty(4, device=device)
    dist.reduce_scatter(mine, list(x.chunk(world_size)))   # rank r: the sum of chunk r
    parts = [torch.empty(4, device=device) for _ in range(world_size)]
    dist.all_gather(parts, mine)                           # everyone: every summed chunk
    return torch.cat(parts)
""")


# -- 13: ring all-reduce ----------------------------------------------------------------------
def check_owner_chunk(fn: Callable[[int, int], int]) -> Verdict:
    """`fn(i, p)`: the chunk that ring position i holds fully reduced after the reduce-scatter
    phase (labkit's ring: position i sends chunk (i - s) mod p at step s). Pure; no ranks.

    Classic wrong answers it rejects: its own chunk i (what it starts with); (i - 1) mod p, the
    answer of a ring that sends to the left; i + 1 without the wrap-around (p = 2..8 are
    tried)."""
    from labkit.parallel.ring_allreduce import ring_schedule

    for p in range(2, 9):
        held = [[{i} for _ in range(p)] for i in range(p)]
        for _phase, plan in ring_schedule(p)[: p - 1]:
            sent = [set(held[i][plan[i][0]]) for i in range(p)]
            for i in range(p):
                held[i][plan[i][1]] |= sent[(i - 1) % p]
        for i in range(p):
            want = next(c for c in range(p) if held[i][c] == set(range(p)))
            try:
                got = fn(i, p)
            except Exception as exc:  # noqa: BLE001 - a learner's bug is a verdict
                return wrong(f"fn({i}, {p}) raised {type(exc).__name__}: {exc}")
            if got != want:
                return wrong(f"fn({i}, {p}) = {got!r}, but position {i} owns chunk {want}")
    return right("matches the schedule for p = 2..8")


def solution_owner_chunk() -> Any:
    return reveal("""
def owner_chunk(i, p):
    return (i + 1) % p   # the last chunk it received: (i - (p-2) - 1) mod p
""")


# -- 14: measuring ----------------------------------------------------------------------------
def check_alpha_beta(fn: Callable[[float, float, float, int], float]) -> Verdict:
    """`fn(alpha, beta, nbytes, p)`: the alpha-beta time of a ring all_reduce,
    2(p-1)·alpha + 2(p-1)/p·nbytes·beta (docs/references.md). Pure; no ranks.

    Classic wrong answers it rejects: one message's time alpha + n·beta; (p-1) latency steps
    instead of 2(p-1) (one phase only); (p-1)/p·n bytes (reduce-scatter alone); bits for bytes;
    2p steps of the whole buffer (a naive ring). Cases span 4 KiB to 16 MiB on 2 to 8 ranks,
    with beta 0 (latency alone) among them."""
    for alpha, beta, n, p in [(1e-4, 1e-9, 4096, 4), (5e-5, 2e-10, 2**24, 8), (1e-3, 0.0, 1, 2)]:
        want = 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta
        try:
            got = float(fn(alpha, beta, n, p))
        except Exception as exc:  # noqa: BLE001 - a learner's bug is a verdict
            return wrong(f"fn raised {type(exc).__name__}: {exc}")
        if abs(got - want) > 1e-9 * max(1.0, abs(want)) + 1e-15:
            return wrong(f"fn({alpha}, {beta}, {n}, {p}) = {got:.4g} s, expected {want:.4g} s")
    return right("2(p-1)·alpha + 2(p-1)/p·n·beta")


def solution_alpha_beta() -> Any:
    return reveal("""
def ring_time(alpha, beta, nbytes, p):
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes * beta
""")


# -- 15: when things go wrong -----------------------------------------------------------------
def check_pair_sum(lab: Any, fn: Callable[..., Any]) -> Verdict:
    """`fn(rank)` runs on every rank: ranks 0 and 2 return the sum of their
    `torch.tensor([rank + 1.])`; the other ranks return theirs unchanged.

    Classic wrong answers it rejects: all_reduce on the whole world (ranks 1 and 3 join the
    sum); the world all_reduce with zeros from ranks 1 and 3 (right numbers, wrong group);
    new_group([0, 2]) called by ranks 0 and 2 only without use_local_synchronization=True
    (later groups would pair the wrong ranks); the answer computed without communicating; an
    async all_reduce never waited for. With use_local_synchronization=True, a group made by
    its members only is right on any torch."""
    n = lab.world_size
    if n < 3:
        return wrong(f"this exercise needs at least 3 ranks, the lab has {n}")
    expected = {r: torch.tensor([4.0 if r in (0, 2) else r + 1.0]) for r in range(n)}
    verdict = _run_and_compare(lab, fn, expected)
    if not verdict:
        return verdict
    if (quiet := _no_comm(lab, (0, 2))) is not None:
        return quiet
    for rec in lab.trace():
        if rec.kind != "comm" or rec.op in P2P | SYNC_ONLY | {"isend", "irecv"}:
            continue
        if rec.group != (0, 2):
            return wrong(
                f"right numbers, but rank {rec.rank} ran {rec.op} on ranks {list(rec.group)}: "
                "a collective of ranks 0 and 2 runs on a group of just those two"
            )
    return right("ranks 0 and 2 summed in their own group; ranks 1 and 3 kept theirs")


def solution_pair_sum() -> Any:
    return reveal("""
def pair_sum(rank, device):
    pair = dist.new_group([0, 2])      # called on every rank, even those outside the group
    t = torch.tensor([rank + 1.], device=device)
    if rank in (0, 2):
        dist.all_reduce(t, group=pair)  # only the group's members wait for each other
    return t
""")
