"""The checker of the expert-parallel notebook 35 on 4 gloo ranks: right token exchanges (the
reference, asynchronous, counts by all_gather, labkit's autograd all_to_all) pass; the usual
mistakes (splits swapped, even splits, no count exchange, rows to the wrong rank, padding,
send/recv instead of all_to_all, a wrong return) are named."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from labkit.exercises import expert_parallel_checks as ep

pytestmark = pytest.mark.timeout(180)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks cannot import this module


def _verdict(verdict, ok: bool, says: str) -> None:
    assert bool(verdict) is ok, verdict
    assert says in verdict.message, verdict


def _recv_counts(send_counts):
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts)
    return recv


def reference(tokens, send_counts, rank, world_size):
    recv = _recv_counts(send_counts)
    out = tokens.new_empty((int(recv.sum()), tokens.shape[1]))
    dist.all_to_all_single(out, tokens, recv.tolist(), send_counts.tolist())
    return out


def asynchronous(tokens, send_counts, rank, world_size):  # async_op, keyword splits
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts, async_op=True).wait()
    out = torch.empty(int(recv.sum()), tokens.shape[1], device=tokens.device)
    work = dist.all_to_all_single(
        out,
        tokens,
        input_split_sizes=send_counts.tolist(),
        output_split_sizes=recv.tolist(),
        async_op=True,
    )
    work.wait()
    return out


def counts_by_all_gather(tokens, send_counts, rank, world_size):  # the whole matrix, then a column
    matrix = torch.empty(world_size * world_size, dtype=send_counts.dtype)
    dist.all_gather_single(matrix, send_counts)
    matrix = matrix.view(world_size, world_size)  # row s: what rank s sends
    recv = matrix[:, rank]
    out = torch.empty(int(recv.sum()), tokens.shape[1])
    dist.all_to_all_single(out, tokens, recv.tolist(), send_counts.tolist())
    return out


def labkit_autograd(tokens, send_counts, rank, world_size):
    from labkit.parallel.expert_parallel import all_to_all_single

    recv = _recv_counts(send_counts)
    return all_to_all_single(tokens, recv.tolist(), send_counts.tolist())


def the_start(tokens, send_counts, rank, world_size):  # the notebook's starting point
    return tokens


def swapped(tokens, send_counts, rank, world_size):
    recv = _recv_counts(send_counts)
    out = tokens.new_empty((int(recv.sum()), tokens.shape[1]))
    dist.all_to_all_single(out, tokens, send_counts.tolist(), recv.tolist())
    return out


def even_splits(tokens, send_counts, rank, world_size):
    out = torch.empty_like(tokens)
    dist.all_to_all_single(out, tokens)
    return out


def no_count_exchange(tokens, send_counts, rank, world_size):  # as if routing were symmetric
    out = torch.empty_like(tokens)
    dist.all_to_all_single(out, tokens, send_counts.tolist(), send_counts.tolist())
    return out


def off_by_one_rank(tokens, send_counts, rank, world_size):  # block d sent to rank d + 1
    matrix = torch.empty(world_size * world_size, dtype=send_counts.dtype)
    dist.all_gather_single(matrix, send_counts)
    matrix = matrix.view(world_size, world_size)  # row s: what rank s sends
    recv = matrix[:, (rank - 1) % world_size]
    out = torch.empty(int(recv.sum()), tokens.shape[1])
    dist.all_to_all_single(out, tokens, recv.tolist(), send_counts.roll(1).tolist())
    return out


def padded(tokens, send_counts, rank, world_size):  # even splits padded to the largest block
    recv = _recv_counts(send_counts)
    most = send_counts.max().clone()
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    m = int(most)
    buf = tokens.new_zeros((world_size * m, tokens.shape[1]))
    for d, block in enumerate(tokens.split(send_counts.tolist())):
        buf[d * m : d * m + len(block)] = block
    out = torch.empty_like(buf)
    dist.all_to_all_single(out, buf)
    return torch.cat([out[s * m : s * m + c] for s, c in enumerate(recv.tolist())])


def by_send_recv(tokens, send_counts, rank, world_size):
    recv = _recv_counts(send_counts).tolist()
    blocks = tokens.split(send_counts.tolist())
    out = [tokens.new_empty((c, tokens.shape[1])) for c in recv]
    ops = [dist.P2POp(dist.isend, blocks[d], d) for d in range(world_size) if d != rank]
    ops += [dist.P2POp(dist.irecv, out[s], s) for s in range(world_size) if s != rank]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    out[rank] = blocks[rank]
    return torch.cat(out)


def sorted_rows(tokens, send_counts, rank, world_size):  # right rows, grouped by place instead
    out = reference(tokens, send_counts, rank, world_size)
    return out[torch.argsort(out[:, 2], stable=True)]


@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (reference, True, "counts first"),
        (asynchronous, True, "counts first"),
        (counts_by_all_gather, True, "counts first"),
        (labkit_autograd, True, "counts first"),
        (the_start, False, "case 1, rank 0: it holds rows meant for rank(s) [1, 3]"),
        (swapped, False, "input and output split sizes are swapped"),
        (even_splits, False, "the rows were cut into equal splits"),
        (no_count_exchange, False, "a rank died"),
        (off_by_one_rank, False, "case 1, rank 0: it holds rows meant for rank(s) [1]"),
        (padded, False, "rank 0's all_to_all carried 256 bytes, its rows are 128"),
        (by_send_recv, False, "rank 0 moved the rows with ['send', 'send', 'send', 'recv'"),
        (sorted_rows, False, "the right rows in the wrong order"),
        (lambda tokens, send_counts, rank, world_size: None, False, "rank 0 returned NoneType"),
        (lambda tokens, send_counts: tokens, False, "rank 0 raised TypeError"),
    ],
)
def test_token_exchange(lab, fn, ok: bool, says: str) -> None:
    _verdict(ep.check_token_exchange(lab, fn), ok, says)


def test_token_exchange_solution(lab) -> None:
    ns = {"dist": dist, "torch": torch}
    exec(ep.solution_token_exchange().code, ns)
    _verdict(ep.check_token_exchange(lab, ns["exchange"]), True, "no byte more")


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_cases_are_uneven_and_swap_sensitive(n: int) -> None:
    circulant, irregular = ep.token_matrices(n)
    assert sum(map(sum, circulant)) % n == 0 and all(len(row) == n for row in irregular)
    cols = [sum(row[d] for row in circulant) for d in range(n)]
    assert [sum(row) for row in circulant] == cols  # swapped splits run without an abort
    if n > 2:
        assert circulant != [list(col) for col in zip(*circulant)]  # but give other rows
        assert len({x for row in circulant for x in row}) > 1
    if n > 1:
        assert [sum(row) for row in irregular] != [sum(col) for col in zip(*irregular)]
