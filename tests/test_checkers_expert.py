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


# ---------------------------------------------------------------- routing and combine (kernel)


def _route(logits, k, normalize):
    weights, chosen = logits.softmax(dim=-1).topk(k, dim=-1)
    return chosen, weights / weights.sum(dim=-1, keepdim=True) if normalize else weights


def _keep(chosen, num_experts, capacity, slot_major=True):
    keep = torch.ones_like(chosen, dtype=torch.bool)
    if capacity is None:
        return keep
    used = [0] * num_experts
    pairs = [(t, j) for t in range(len(chosen)) for j in range(chosen.shape[1])]
    for t, j in sorted(pairs, key=lambda p: (p[1], p[0])) if slot_major else pairs:
        e = int(chosen[t, j])
        keep[t, j] = used[e] < capacity
        used[e] += int(keep[t, j])
    return keep


def moe_right(x, logits, experts, k, capacity, normalize):  # by token, by slot: plain loops
    chosen, weights = _route(logits, k, normalize)
    keep = _keep(chosen, logits.shape[1], capacity)
    y = torch.zeros_like(x)
    for t in range(len(x)):
        for j in range(k):
            if keep[t, j]:
                y[t] += weights[t, j] * experts[int(chosen[t, j])](x[t])
    return y


def moe_vectorised(x, logits, experts, k, capacity, normalize):  # as labkit's MoE does it
    from labkit.parallel.expert_parallel import capacity_keep, route

    chosen, weights = route(logits, k, normalize)
    keep = capacity_keep(chosen, logits.shape[1], capacity or len(x) * k)
    y = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        token, slot = ((chosen == e) & keep).nonzero(as_tuple=True)
        if token.numel():
            y = y.index_add(0, token, weights[token, slot, None] * expert(x[token]))
    return y


def moe_never_normalised(x, logits, experts, k, capacity, normalize):
    return moe_right(x, logits, experts, k, capacity, False)


def moe_always_normalised(x, logits, experts, k, capacity, normalize):
    return moe_right(x, logits, experts, k, capacity, True)


def moe_token_order(x, logits, experts, k, capacity, normalize):
    chosen, weights = _route(logits, k, normalize)
    keep = _keep(chosen, logits.shape[1], capacity, slot_major=False)
    return torch.stack(
        [
            sum(weights[t, j] * experts[int(chosen[t, j])](x[t]) * keep[t, j] for j in range(k))
            for t in range(len(x))
        ]
    )


def moe_heaviest_kept(x, logits, experts, k, capacity, normalize):  # Megatron's "probs"
    chosen, weights = _route(logits, k, normalize)
    keep = torch.ones_like(chosen, dtype=torch.bool)
    if capacity is not None:
        for e in range(logits.shape[1]):
            w = torch.where(chosen == e, weights, torch.full_like(weights, -1.0)).flatten()
            mine = int((chosen == e).sum())
            ranked = w.argsort(descending=True)[:mine]
            keep.view(-1)[ranked[capacity:]] = False
    return torch.stack(
        [
            sum(weights[t, j] * experts[int(chosen[t, j])](x[t]) * keep[t, j] for j in range(k))
            for t in range(len(x))
        ]
    )


def moe_renormalised_after_drop(x, logits, experts, k, capacity, normalize):
    chosen, weights = _route(logits, k, normalize)
    keep = _keep(chosen, logits.shape[1], capacity)
    weights = weights * keep
    weights = weights / weights.sum(dim=1, keepdim=True).clamp_min(1e-30)
    return torch.stack(
        [
            sum(weights[t, j] * experts[int(chosen[t, j])](x[t]) for j in range(k))
            for t in range(len(x))
        ]
    )


def moe_drops_whole_token(x, logits, experts, k, capacity, normalize):  # "residual only"
    chosen, weights = _route(logits, k, normalize)
    keep = _keep(chosen, logits.shape[1], capacity)
    y = moe_right(x, logits, experts, k, None, normalize)
    return y * keep.all(dim=1, keepdim=True)


def moe_not_unsorted(x, logits, experts, k, capacity, normalize):  # the combine's missing argsort
    chosen, weights = _route(logits, k, normalize)
    keep = _keep(chosen, logits.shape[1], capacity)
    flat = chosen.flatten()
    order = torch.argsort(flat, stable=True)
    slots = torch.stack([experts[int(flat[i])](x[i // k]) for i in order.tolist()])
    slots = slots * (weights * keep).flatten()[order, None]
    return slots.view(len(x), k, -1).sum(dim=1)


@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (moe_right, True, "first choices served first"),
        (moe_vectorised, True, "first choices served first"),
        (moe_never_normalised, False, "case 1 (capacity 4, normalize=True): the top-k weights"),
        (
            moe_always_normalised,
            False,
            "case 2 (capacity 4, normalize=False): the top-k weights",
        ),
        (moe_token_order, False, "capacity filled token by token"),
        (moe_heaviest_kept, False, "kept its slots of largest weight"),
        (moe_renormalised_after_drop, False, "renormalised over the slots that survived"),
        (moe_drops_whole_token, False, "a token lost all its slots when one was dropped"),
        (moe_not_unsorted, False, "added in the order they were sorted by expert"),
        (lambda x, logits, experts, k, capacity, normalize: x, False, "case 1"),
        (lambda x, logits, experts, k, capacity, normalize: None, False, "returned NoneType"),
        (lambda x, logits, experts, k: x, False, "raised TypeError"),
    ],
)
def test_moe_forward(fn, ok: bool, says: str) -> None:
    _verdict(ep.check_moe_forward(fn), ok, says)


def test_moe_forward_solution() -> None:
    ns = {"torch": torch}
    exec(ep.solution_moe_forward().code, ns)
    _verdict(ep.check_moe_forward(ns["moe_forward"]), True, "in token order")


def test_moe_cases_tell_every_mistake_apart() -> None:
    """Every classic mistake gives other numbers than the right answer on at least one case,
    and the capped cases hold tokens with one slot of two dropped and tokens with none left."""
    cases = ep.moe_cases()
    for name in ep.moe_mistakes(cases[0]):
        if name != "right":
            assert any(
                not torch.allclose(m[name], m["right"], atol=1e-3)
                for m in map(ep.moe_mistakes, cases)
            ), name
    capped = cases[0]
    chosen, _ = _route(capped["logits"], 2, True)
    kept = _keep(chosen, 4, capped["capacity"]).sum(dim=1).tolist()
    assert 1 in kept and 0 in kept and 2 in kept, kept
