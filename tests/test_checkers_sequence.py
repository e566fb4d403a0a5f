"""The checker of the sequence-parallel notebook 38, on 4 gloo ranks: right gathers of the
sequence pass (the collective's two forms), plausible wrong ones are named."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from labkit.exercises import sequence_parallel_checks as sp

pytestmark = pytest.mark.timeout(180)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks cannot import this module


def gather_movedim(x_local, rank, world_size):
    first = x_local.movedim(1, 0).contiguous()
    out = first.new_empty((world_size * first.shape[0], *first.shape[1:]))
    dist.all_gather_single(out, first)
    return out.movedim(0, 1)


def gather_list(x_local, rank, world_size):
    parts = [torch.empty_like(x_local) for _ in range(world_size)]
    dist.all_gather(parts, x_local.contiguous())
    return torch.cat(parts, dim=1)


def gather_dim0(x_local, rank, world_size):
    out = x_local.new_empty((world_size * x_local.shape[0], *x_local.shape[1:]))
    dist.all_gather_single(out, x_local.contiguous())
    return out


def gather_dim0_reshaped(x_local, rank, world_size):
    b, c, h = x_local.shape
    return gather_dim0(x_local, rank, world_size).reshape(b, c * world_size, h)


def gather_by_all_reduce(x_local, rank, world_size):
    b, c, h = x_local.shape
    padded = x_local.new_zeros((b, c * world_size, h))
    padded[:, rank * c : (rank + 1) * c] = x_local
    dist.all_reduce(padded)
    return padded


def gather_forgot(x_local, rank, world_size):
    return x_local


@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (gather_movedim, True, "after one all_gather"),
        (gather_list, True, "after one all_gather"),
        (gather_dim0, False, "rank 0: it gathered along dim 0, the batch"),
        (gather_dim0_reshaped, False, "the positions are in the wrong order"),
        (gather_by_all_reduce, False, "right tensor, but rank 0 called ['all_reduce']"),
        (gather_forgot, False, "returned shape (2, 2, 3), expected (2, 8, 3)"),
        (lambda x_local: x_local, False, "rank 0 raised TypeError"),
    ],
)
def test_gather_sequence(lab, fn, ok: bool, says: str) -> None:
    verdict = sp.check_gather_sequence(lab, fn)
    assert bool(verdict) is ok, verdict
    assert says in verdict.message, verdict


def scatter_movedim(partial, rank, world_size):
    first = partial.movedim(1, 0).contiguous()
    out = first.new_empty((first.shape[0] // world_size, *first.shape[1:]))
    dist.reduce_scatter_single(out, first)
    return out.movedim(0, 1)


def scatter_list(partial, rank, world_size):
    out = torch.empty_like(partial.chunk(world_size, dim=1)[rank]).contiguous()
    dist.reduce_scatter(out, [c.contiguous() for c in partial.chunk(world_size, dim=1)])
    return out


def scatter_by_all_reduce(partial, rank, world_size):
    total = partial.clone()
    dist.all_reduce(total)
    return total.chunk(world_size, dim=1)[rank]


def scatter_whole(partial, rank, world_size):
    total = partial.clone()
    dist.all_reduce(total)
    return total


def scatter_dim0(partial, rank, world_size):
    out = partial.new_empty((partial.shape[0] // world_size, *partial.shape[1:]))
    dist.reduce_scatter_single(out, partial.contiguous())
    return out


def scatter_mean(partial, rank, world_size):
    return scatter_movedim(partial, rank, world_size) / world_size


def scatter_avg_op(partial, rank, world_size):
    first = partial.movedim(1, 0).contiguous()
    out = first.new_empty((first.shape[0] // world_size, *first.shape[1:]))
    dist.reduce_scatter_single(out, first, op=dist.ReduceOp.AVG)
    return out.movedim(0, 1)


def scatter_no_reduce(partial, rank, world_size):
    return partial.chunk(world_size, dim=1)[rank]


@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (scatter_movedim, True, "after one reduce_scatter"),
        (scatter_list, True, "after one reduce_scatter"),
        (scatter_by_all_reduce, False, "right tensor, but rank 0 called ['all_reduce']"),
        (scatter_whole, False, "returned the whole sum, as an all_reduce does"),
        (scatter_dim0, False, "scattered along dim 0, the batch"),
        (scatter_mean, False, "it averaged"),
        (scatter_avg_op, False, "it averaged"),
        (scatter_no_reduce, False, "only this rank's own partial sum"),
    ],
)
def test_scatter_sequence(lab, fn, ok: bool, says: str) -> None:
    verdict = sp.check_scatter_sequence(lab, fn)
    assert bool(verdict) is ok, verdict
    assert says in verdict.message, verdict


def test_scatter_sequence_solution(lab) -> None:
    ns = {"dist": dist, "torch": torch}
    exec(sp.solution_scatter_sequence().code, ns)
    assert sp.check_scatter_sequence(lab, ns["scatter_sequence"])


def test_gather_sequence_solution(lab) -> None:
    ns = {"dist": dist, "torch": torch}
    exec(sp.solution_gather_sequence().code, ns)
    assert sp.check_gather_sequence(lab, ns["gather_sequence"])
