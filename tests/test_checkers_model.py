"""The checkers of the model-parallel notebooks 30-34: the row-parallel linear on 4 gloo ranks
(where dense maths plus a dummy all_reduce must fail: each rank's features outside its slice
are noise of its own in the checker's second run), and the pure ones in this process."""

from __future__ import annotations

import itertools
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.exercises import model_parallel_checks as mp
from labkit.parallel.pipeline_parallel import stage_order

pytestmark = pytest.mark.timeout(120)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks cannot import this module


def _verdict(verdict, ok: bool, says: str) -> None:
    assert bool(verdict) is ok, verdict
    assert says in verdict.message, verdict


# ---------------------------------------------------------------- 32: a row-parallel linear


def _cols(rank, world_size, features=16):
    n = features // world_size
    return slice(rank * n, (rank + 1) * n)


def row_reference(x, weight, bias, rank, world_size):
    cols = _cols(rank, world_size)
    partial = x[:, cols] @ weight[:, cols].T
    dist.all_reduce(partial)
    return partial + bias


def row_async_chunks(x, weight, bias, rank, world_size):
    partial = F.linear(x.chunk(world_size, dim=1)[rank], weight.chunk(world_size, dim=1)[rank])
    dist.all_reduce(partial, async_op=True).wait()
    return partial + bias


def row_masked(x, weight, bias, rank, world_size):  # zeros elsewhere: reads its slice only
    w = torch.zeros_like(weight)
    w[:, _cols(rank, world_size)] = weight[:, _cols(rank, world_size)]
    xs = torch.zeros_like(x)
    xs[:, _cols(rank, world_size)] = x[:, _cols(rank, world_size)]
    partial = xs @ w.T
    dist.all_reduce(partial)
    return partial + bias


def row_bias_on_rank0(x, weight, bias, rank, world_size):
    cols = _cols(rank, world_size)
    out = F.linear(x[:, cols], weight[:, cols], bias if rank == 0 else None)
    dist.all_reduce(out)
    return out


def row_bias_split(x, weight, bias, rank, world_size):
    cols = _cols(rank, world_size)
    out = F.linear(x[:, cols], weight[:, cols], bias / world_size)
    dist.all_reduce(out)
    return out


def row_dense(x, weight, bias, rank, world_size):  # the notebook's starting point
    return x @ weight.T + bias


def row_dense_dummy_all_reduce(x, weight, bias, rank, world_size):
    dist.all_reduce(torch.zeros(1))
    return F.linear(x, weight, bias)


def row_dense_averaged(x, weight, bias, rank, world_size):
    out = F.linear(x, weight, bias)
    dist.all_reduce(out, op=dist.ReduceOp.AVG)
    return out


def row_bias_everywhere(x, weight, bias, rank, world_size):
    cols = _cols(rank, world_size)
    out = F.linear(x[:, cols], weight[:, cols], bias)
    dist.all_reduce(out)
    return out


def row_no_all_reduce(x, weight, bias, rank, world_size):
    cols = _cols(rank, world_size)
    return x[:, cols] @ weight[:, cols].T + bias


def row_rows_not_columns(x, weight, bias, rank, world_size):  # a column-parallel slice
    rows = _cols(rank, world_size, features=12)
    out = x @ weight[rows].T + bias[rows]
    dist.all_reduce(out)
    return out


def row_two_all_reduces(x, weight, bias, rank, world_size):
    cols = _cols(rank, world_size)
    partial = x[:, cols] @ weight[:, cols].T
    dist.all_reduce(partial)
    b = bias / world_size
    dist.all_reduce(b)
    return partial + b


def row_average(x, weight, bias, rank, world_size):
    cols = _cols(rank, world_size)
    partial = x[:, cols] @ weight[:, cols].T
    dist.all_reduce(partial, op=dist.ReduceOp.AVG)
    return partial + bias


def row_no_wait(x, weight, bias, rank, world_size):
    cols = _cols(rank, world_size)
    partial = x[:, cols] @ weight[:, cols].T
    dist.all_reduce(partial, async_op=True)
    return partial + bias


@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (row_reference, True, "computes with its slice only"),
        (row_no_wait, False, "never waited for its all_reduce request"),
        (row_async_chunks, True, "computes with its slice only"),
        (row_masked, True, "computes with its slice only"),
        (row_bias_on_rank0, True, "computes with its slice only"),
        (row_bias_split, True, "computes with its slice only"),
        (row_dense, False, "right numbers, but all_reduce calls per rank: {0: 0, 1: 0"),
        (row_dense_dummy_all_reduce, False, "right with full inputs, but it computed with the"),
        (row_dense_averaged, False, "right with full inputs, but it averaged outputs computed"),
        (row_bias_everywhere, False, "the bias counts 4 times"),
        (row_no_all_reduce, False, "the all_reduce is missing"),
        (row_rows_not_columns, False, "rank 0 returned (8, 3), expected a tensor of shape"),
        (row_two_all_reduces, False, "all_reduce calls per rank: {0: 2, 1: 2, 2: 2, 3: 2}"),
        (row_average, False, "not the sum of the ranks' shards"),
        (lambda x, weight, bias: None, False, "rank 0 raised TypeError"),
    ],
)
def test_row_parallel(lab, fn, ok: bool, says: str) -> None:
    _verdict(mp.check_row_parallel(lab, fn), ok, says)


def test_row_parallel_solution(lab) -> None:
    ns = {"dist": dist, "torch": torch}
    exec(mp.solution_row_parallel().code, ns)
    _verdict(mp.check_row_parallel(lab, ns["row_parallel"]), True, "slice only")


# ---------------------------------------------------------------- 30: groups of a 2-D grid


def grid_reference(rank, dp_size, mp_size):
    d, m = divmod(rank, mp_size)
    return [k * mp_size + m for k in range(dp_size)], [d * mp_size + k for k in range(mp_size)]


@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (grid_reference, True, "groups match"),
        (lambda r, dp, m: (range(r % m, dp * m, m), range(r - r % m, r - r % m + m)), True, "ma"),
        (lambda r, dp, m: tuple(set(g) for g in grid_reference(r, dp, m)), True, "groups match"),
        (lambda r, dp, m: grid_reference(r, dp, m)[::-1], False, "rank 0 of a 2 x 2 grid: got"),
        (
            lambda r, dp, m: grid_reference(r, m, dp),
            False,
            "rank 0 of a 2 x 3 grid: got dp=[0, 2, 4]",
        ),
        (
            lambda r, dp, m: (list(range(dp)), list(range(m))),
            False,
            "rank 0 of a 2 x 2 grid: got dp=[0, 1]",
        ),
        (lambda r, dp, m: None, False, "raised TypeError"),
    ],
)
def test_grid_groups(fn, ok: bool, says: str) -> None:
    _verdict(mp.check_grid_groups(fn), ok, says)


# ---------------------------------------------------------------- 31: the 1F1B order


def one_f_one_b_off_by_one(p, m, s):
    warmup = min(p - s, m)  # one forward too many before the first backward
    order = [("F", j) for j in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", j) for j in range(m - warmup, m)]


def one_f_one_b_warmup_reversed(p, m, s):  # the last stage warms up most: backwards
    warmup = min(s, m)
    order = [("F", j) for j in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", j) for j in range(m - warmup, m)]


def one_f_one_b_uncapped(p, m, s):  # warm-up not capped by m: forwards of missing micro-batches
    warmup = p - s - 1
    order = [("F", j) for j in range(warmup)]
    for i in range(max(m - warmup, 0)):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", j) for j in range(max(m - warmup, 0), m)]


@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (lambda p, m, s: stage_order(p, m, s, "1f1b"), True, "1F1B orders match"),
        (one_f_one_b_warmup_reversed, False, "p=2, m=2, stage 0: got [('F', 0), ('B', 0)"),
        (one_f_one_b_uncapped, False, "p=3, m=1, stage 0: got [('F', 0), ('F', 1)"),
        (lambda p, m, s: [[k.lower(), j] for k, j in stage_order(p, m, s, "1f1b")], True, "1F"),
        (lambda p, m, s: stage_order(p, m, s, "gpipe"), False, "p=1, m=2, stage 0: got"),
        (one_f_one_b_off_by_one, False, "p=1, m=2, stage 0: got [('F', 0), ('F', 1)"),
        (lambda p, m, s: [("F", j) for j in range(m)], False, "p=1, m=1, stage 0: got [('F', 0)]"),
    ],
)
def test_one_f_one_b(fn, ok: bool, says: str) -> None:
    _verdict(mp.check_one_f_one_b(fn), ok, says)


# ---------------------------------------------------------------- 33: the exact split


def split_brute_force(times, stages):
    n = len(times)
    cuts = min(
        itertools.combinations(range(1, n), stages - 1),
        key=lambda c: max(sum(times[a:b]) for a, b in zip((0, *c), (*c, n))),
    )
    return [0, *cuts, n]


def split_binary_search(times, stages):  # the smallest bottleneck a greedy fill can meet
    def fits(limit):
        bounds, total = [0], 0.0
        for i, t in enumerate(times):
            if total + t > limit:
                bounds.append(i)
                total = 0.0
            total += t
        return bounds if len(bounds) <= stages and max(times) <= limit else None

    sums = sorted(
        {sum(times[a:b]) for a in range(len(times)) for b in range(a + 1, len(times) + 1)}
    )
    bounds = next(fits(s) for s in sums if fits(s))
    i = len(times) - 1
    while len(bounds) < stages:  # split further without raising the bottleneck
        if i not in bounds:
            bounds.append(i)
        i -= 1
    return sorted(bounds) + [len(times)]


def split_equal_counts(times, stages):
    n = len(times)
    return [round(k * n / stages) for k in range(stages + 1)]


def split_greedy_average(times, stages):
    target, bounds, total = sum(times) / stages, [0], 0.0
    for i, t in enumerate(times):
        if total >= target and len(bounds) < stages:
            bounds.append(i)
            total = 0.0
        total += t
    while len(bounds) < stages:
        bounds.append(bounds[-1] + 1)
    return bounds + [len(times)]


@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (split_brute_force, True, "optimal on every test case"),
        (split_binary_search, True, "optimal on every test case"),
        (split_equal_counts, False, "times=[5.0, 1, 1, 1, 1, 1, 1, 5], stages=3"),
        (split_greedy_average, False, "your slowest stage costs"),
        (lambda times, stages: list(range(1, stages + 1)), False, "boundaries must be"),
    ],
)
def test_best_split(fn, ok: bool, says: str) -> None:
    _verdict(mp.check_best_split(fn), ok, says)


# ---------------------------------------------------------------- 34: names and what they do

RIGHT = {
    "torch.autocast": "mixed precision",
    "torch.amp.GradScaler": " Mixed Precision",
    "DistributedDataParallel": "data parallelism",
    "labkit.auto_split": "model parallelism",
    "torch.distributed.pipelining": "model parallelism",
    "ColwiseParallel": "model parallelism",
}


@pytest.mark.parametrize(
    "answers, ok, says",
    [
        (RIGHT, True, "every name in its place"),
        ({**RIGHT, "torch.autocast": "model parallelism"}, False, "torch.autocast is not model"),
        ({**RIGHT, "DistributedDataParallel": "model parallelism"}, False, "DistributedData"),
        ({**RIGHT, "ColwiseParallel": "tensor"}, False, "answer one of"),
        ({k: v for k, v in RIGHT.items() if k != "ColwiseParallel"}, False, "no answer for"),
    ],
)
def test_what_is_it(answers, ok: bool, says: str) -> None:
    _verdict(mp.check_what_is_it(answers), ok, says)


def test_pure_solutions_are_accepted() -> None:
    for name in ("grid_groups", "one_f_one_b", "best_split", "what_is_it"):
        code = getattr(mp, f"solution_{name}")().code
        if name == "what_is_it":
            assert mp.check_what_is_it(eval("{" + code + "}"))
            continue
        ns: dict = {}
        exec(code, ns)
        fn = next(v for k, v in ns.items() if callable(v) and not k.startswith("__"))
        assert getattr(mp, f"check_{name}")(fn), name
