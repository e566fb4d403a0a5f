"""The claims of notebook 12 without Jupyter: every collective on 4 gloo ranks against the same
result computed in the test, on the world and on a subgroup, async handles, and the exercise
checkers of notebooks 10-15 telling right from wrong."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch

import labkit.exercises.collective_checks as ex

pytestmark = pytest.mark.timeout(120)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks cannot import this module
N = 4


def _pull_stack(lab, name: str) -> torch.Tensor:
    got = lab.pull(name)
    return torch.stack([got[r] for r in range(N)])


def test_rooted_collectives(lab) -> None:
    lab.run(
        "x = torch.arange(4.) + 10 * rank\n"
        "b = x.clone(); dist.broadcast(b, src=2)\n"
        "r = x.clone(); dist.reduce(r, dst=1)\n"
        "s = torch.empty(2)\n"
        "dist.scatter(s, list(torch.arange(8.).chunk(4)) if rank == 0 else None, src=0)\n"
        "bucket = [torch.empty(4) for _ in range(4)] if rank == 3 else None\n"
        "dist.gather(x, bucket, dst=3)\n"
        "g = torch.stack(bucket) if rank == 3 else None"
    )
    xs = torch.stack([torch.arange(4.0) + 10 * r for r in range(N)])
    assert torch.equal(_pull_stack(lab, "b"), xs[2].expand(N, 4))
    assert torch.equal(lab.pull("r", ranks=1)[1], xs.sum(0))
    assert torch.equal(_pull_stack(lab, "s"), torch.arange(8.0).view(4, 2))
    assert torch.equal(lab.pull("g", ranks=3)[3], xs)
    ops = [(r.op, r.peer) for r in lab.trace() if r.rank == 0]
    assert ops == [("broadcast", 2), ("reduce", 1), ("scatter", 0), ("gather", 3)]


def test_all_reduce_ops_match_torch_reductions(lab) -> None:
    lab.run(
        "x = torch.tensor([rank + 1., 4. - rank, (-1.) ** rank])\nout = {}\n"
        "for name in ['SUM', 'PRODUCT', 'MAX', 'MIN', 'AVG']:\n"
        "    t = x.clone(); dist.all_reduce(t, op=getattr(dist.ReduceOp, name)); out[name] = t"
    )
    xs = torch.stack([torch.tensor([r + 1.0, 4.0 - r, (-1.0) ** r]) for r in range(N)])
    want = {
        "SUM": xs.sum(0),
        "PRODUCT": xs.prod(0),
        "MAX": xs.amax(0),
        "MIN": xs.amin(0),
        "AVG": xs.mean(0),
    }
    for r, out in lab.pull("out").items():
        for name, w in want.items():
            assert torch.allclose(out[name], w), (r, name, out[name])
    assert [r.reduce_op for r in lab.trace() if r.rank == 2] == list(want)


def test_all_gather_reduce_scatter_all_to_all(lab) -> None:
    lab.run(
        "x = torch.full((3,), float(rank))\nparts = [torch.empty(3) for _ in range(4)]\n"
        "dist.all_gather(parts, x); ag = torch.stack(parts)\n"
        "big = torch.arange(8.) + 100 * rank\nrs = torch.empty(2)\n"
        "dist.reduce_scatter(rs, list(big.chunk(4)))\n"
        "row = torch.arange(4.) + 10 * rank\nout = [torch.empty(1) for _ in range(4)]\n"
        "dist.all_to_all(out, list(row.chunk(4))); a2a = torch.cat(out)"
    )
    xs = torch.stack([torch.full((3,), float(r)) for r in range(N)])
    assert torch.equal(_pull_stack(lab, "ag"), xs.expand(N, N, 3))
    total = sum(torch.arange(8.0) + 100 * r for r in range(N))
    assert torch.equal(_pull_stack(lab, "rs"), total.view(4, 2))
    rows = torch.stack([torch.arange(4.0) + 10 * r for r in range(N)])
    assert torch.equal(_pull_stack(lab, "a2a"), rows.T)
    recs = [r for r in lab.trace() if r.rank == 0]
    # bytes as nccl-tests counts them: all_gather the gathered buffer, reduce_scatter the input
    assert [(r.op, r.bytes) for r in recs] == [
        ("all_gather", 4 * 3 * 4),
        ("reduce_scatter", 8 * 4),
        ("all_to_all", 4 * 4),
    ]


def test_subgroup_and_async(lab) -> None:
    lab.run(
        "trio = dist.new_group([1, 2, 3])\nx = torch.arange(4.) + 10 * rank\n"
        "if rank != 0:\n    dist.all_reduce(x, group=trio)\n"
        "y = torch.ones(1 << 12) * (rank + 1)\nwork = dist.all_reduce(y, async_op=True)\n"
        "work.wait()"
    )
    xs = {r: torch.arange(4.0) + 10 * r for r in range(N)}
    got = lab.pull("x")
    assert torch.equal(got[0], xs[0])
    assert all(torch.equal(got[r], xs[1] + xs[2] + xs[3]) for r in (1, 2, 3))
    assert all(float(v[0]) == 10.0 for v in lab.pull("y").values())
    recs = lab.trace()
    assert {r.group for r in recs if not r.async_op} == {(1, 2, 3)}
    assert len([r for r in recs if r.async_op and r.op == "all_reduce" and r.end]) == N


def test_barrier_releases_no_rank_before_the_last_arrives(lab) -> None:
    lab.run("import time\ntime.sleep(0.1 * rank)\ndist.barrier()")
    recs = [r for r in lab.trace() if r.op == "barrier"]
    assert len(recs) == N
    assert all(r.end >= max(q.start for q in recs) - 0.02 for r in recs)


# ---------------------------------------------------------------- exercise checkers


def _ar_by_parts(rank, world_size):
    x = torch.arange(4.0 * world_size) + rank
    mine = torch.empty(4)
    torch.distributed.reduce_scatter(mine, list(x.chunk(world_size)))
    parts = [torch.empty(4) for _ in range(world_size)]
    torch.distributed.all_gather(parts, mine)
    return torch.cat(parts)


def _ar_shortcut(rank, world_size):
    x = torch.arange(4.0 * world_size) + rank
    torch.distributed.all_reduce(x)
    return x


def _even_odd(rank, world_size):
    groups = [torch.distributed.new_group(list(range(p, world_size, 2))) for p in (0, 1)]
    t = torch.tensor([float(rank)])
    torch.distributed.all_reduce(t, group=groups[rank % 2])
    return t


def _pair_swap(rank):
    mine, theirs = torch.full((4,), float(rank)), torch.empty(4)
    c10d = torch.distributed.distributed_c10d  # P2POp rejects labkit's traced dist.isend
    ops = [
        torch.distributed.P2POp(c10d.isend, mine, rank ^ 1),
        torch.distributed.P2POp(c10d.irecv, theirs, rank ^ 1),
    ]
    for work in torch.distributed.batch_isend_irecv(ops):
        work.wait()
    return theirs


def _pair_swap_deadlock(rank):
    mine = torch.full((4,), float(rank))
    torch.distributed.send(mine, dst=rank ^ 1)
    torch.distributed.recv(mine, src=rank ^ 1)
    return mine


def _pair_sum(rank):
    pair = torch.distributed.new_group([0, 2])
    t = torch.tensor([rank + 1.0])
    if rank in (0, 2):
        torch.distributed.all_reduce(t, group=pair)
    return t


def test_checkers_accept_references_and_reject_wrong_answers(lab) -> None:
    assert ex.check_all_reduce_by_parts(lab, _ar_by_parts)
    assert not ex.check_all_reduce_by_parts(lab, _ar_shortcut)
    assert ex.check_even_odd_sums(lab, _even_odd)
    assert not ex.check_even_odd_sums(lab, lambda rank: torch.tensor([float(rank)]))
    assert ex.check_pair_sum(lab, _pair_sum)
    assert not ex.check_pair_sum(lab, lambda rank: torch.tensor([rank + 1.0]))
    assert ex.check_pair_swap(lab, _pair_swap)
    verdict = ex.check_pair_swap(lab, _pair_swap_deadlock)  # stopped by the lab
    assert not verdict and "both wait to send" in verdict.message
    assert ex.check_pair_swap(lab, _pair_swap)  # the lab recovered


def test_pure_checkers() -> None:
    assert ex.check_owner_chunk(lambda i, p: (i + 1) % p)
    assert not ex.check_owner_chunk(lambda i, p: i)
    assert ex.check_alpha_beta(lambda a, b, n, p: 2 * (p - 1) * a + 2 * (p - 1) / p * n * b)
    assert not ex.check_alpha_beta(lambda a, b, n, p: a + n * b)
    for solution in (
        ex.solution_all_reduce_by_parts,
        ex.solution_alpha_beta,
        ex.solution_even_odd_sums,
        ex.solution_owner_chunk,
        ex.solution_pair_sum,
        ex.solution_pair_swap,
    ):
        assert "def " in repr(solution())
