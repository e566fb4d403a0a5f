"""Exercises of the model-parallel notebooks 30-34 (kernel side).

Each checker compares a learner's answer with labkit's reference implementation and returns a
`Verdict`; `solution_*()` shows an answer on request. Checkers that need ranks take the lab and
run the answer there with `lab.run`.

Classic wrong answers each rejects (tests/test_checkers_model.py):
- grid_groups (30): dp and mp groups swapped; the grid read transposed (r = mp_rank * dp_size
  + dp_rank), which only square grids hide (2x3 and 3x2 grids are tried); groups of the first
  replica for every rank.
- one_f_one_b (31): GPipe's order (every forward first); one warm-up forward too many
  (p - s) or the warm-up counted from the wrong end (s instead of p - s - 1); the warm-up not
  capped by the number of micro-batches (p > m is tried).
- row_parallel (32): the bias added on every rank before the sum; the all_reduce missing;
  dense maths with a dummy all_reduce, or dense outputs averaged (each rank's features
  outside its slice are its own noise in the second run, so only an answer that reads its
  slice alone passes); a column slice instead of a row slice; two all_reduces; an AVG
  instead of a SUM; an async all_reduce never waited for.
- best_split (33): equal layer counts; greedy filling to the average; boundaries not
  starting at 0 or not increasing.
- what_is_it (34): each name in the wrong family; a category outside the three; the stub
  answers nothing, so all six must be chosen.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from labkit.exercises import (
    Verdict,
    comm_ops,
    reveal,
    right,
    run_on_ranks,
    unwaited,
    watching_factory,
    wrong,
)
from labkit.parallel.auto_split import LayerCost, partition_optimal
from labkit.parallel.pipeline_parallel import stage_order

__all__ = [
    "CATEGORIES",
    "check_best_split",
    "check_grid_groups",
    "check_one_f_one_b",
    "check_row_parallel",
    "check_what_is_it",
    "solution_best_split",
    "solution_grid_groups",
    "solution_one_f_one_b",
    "solution_row_parallel",
    "solution_what_is_it",
]


def _raised(exc: BaseException) -> Verdict:
    return wrong(f"raised {type(exc).__name__}: {exc}")


# ------------------------------------------------------------------ 30: groups of a 2-D grid


def check_grid_groups(fn: Callable[[int, int, int], Any]) -> Verdict:
    """`fn(rank, dp_size, mp_size)` -> (dp_ranks, mp_ranks): the global ranks of the two groups
    `rank` belongs to when r = dp_rank * mp_size + mp_rank (replicas hold consecutive ranks)."""
    for dp, mp in ((2, 2), (2, 3), (3, 2), (1, 4), (4, 1)):
        for rank in range(dp * mp):
            d, m = divmod(rank, mp)
            want = ([k * mp + m for k in range(dp)], [d * mp + k for k in range(mp)])
            try:
                got = fn(rank, dp, mp)
                got = (sorted(got[0]), sorted(got[1]))
            except Exception as exc:  # noqa: BLE001 - a learner's error is a verdict
                return _raised(exc)
            if got != want:
                return wrong(
                    f"rank {rank} of a {dp} x {mp} grid: got dp={got[0]}, mp={got[1]}; "
                    f"expected dp={want[0]}, mp={want[1]}"
                )
    return right("groups match on 2x2, 2x3, 3x2, 1x4 and 4x1 grids")


def solution_grid_groups() -> Any:
    return reveal("""
def grid_groups_of(rank, dp_size, mp_size):
    dp_rank, mp_rank = divmod(rank, mp_size)
    dp_ranks = [d * mp_size + mp_rank for d in range(dp_size)]   # same stage, every replica
    mp_ranks = [dp_rank * mp_size + m for m in range(mp_size)]   # one replica, every stage
    return dp_ranks, mp_ranks
""")


# ------------------------------------------------------------------ 31: the 1F1B order


def check_one_f_one_b(fn: Callable[[int, int, int], Any]) -> Verdict:
    """`fn(num_stages, num_microbatches, stage)` -> the 1F1B order of that stage, as a list of
    ("F" | "B", microbatch)."""
    for p in range(1, 5):
        for m in range(1, 7):
            for s in range(p):
                want = stage_order(p, m, s, "1f1b")
                try:
                    got = [(str(k).upper(), int(j)) for k, j in fn(p, m, s)]
                except Exception as exc:  # noqa: BLE001
                    return _raised(exc)
                if got != want:
                    return wrong(f"p={p}, m={m}, stage {s}: got {got}, expected {want}")
    return right("1F1B orders match for p <= 4 and m <= 6")


def solution_one_f_one_b() -> Any:
    return reveal("""
def one_f_one_b(num_stages, num_microbatches, stage):
    warmup = min(num_stages - stage - 1, num_microbatches)
    order = [("F", j) for j in range(warmup)]
    for i in range(num_microbatches - warmup):          # steady state: one F, one B
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", j) for j in range(num_microbatches - warmup, num_microbatches)]
""")


# ------------------------------------------------------------------ 32: a row-parallel linear


def _row_inputs_factory() -> Callable[[int, int, bool], tuple[Any, Any, Any]]:
    """The function giving x, weight, bias to a rank, made here so that it is pickled by value
    (a rank does not import this kernel-side module)."""

    def _row_inputs(rank: int, world_size: int, poisoned: bool) -> tuple[Any, Any, Any]:
        """x [8, 16], weight [12, 16], bias [12] as rank `rank` gets them (runs on a rank and in
        the kernel). Poisoned: the input features outside the rank's shard, in x and in the
        weight's columns, are replaced by noise of that rank's own, as if they were not there."""
        import torch

        g = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(*s, generator=g) for s in ((8, 16), (12, 16), (12,)))
        if poisoned:
            n = 16 // world_size
            mine = slice(rank * n, (rank + 1) * n)
            noise = torch.Generator().manual_seed(1000 + rank)
            x2, w2 = (
                x + torch.randn(8, 16, generator=noise),
                w + torch.randn(12, 16, generator=noise),
            )
            x2[:, mine], w2[:, mine] = x[:, mine], w[:, mine]
            x, w = x2, w2
        return x, w, b

    return _row_inputs


def _row_diagnosis(inputs: Any, got: Any, rank: int, world_size: int, poisoned: bool) -> str:
    """What a wrong output most likely came from (kernel side)."""
    import torch
    import torch.nn.functional as F

    x, w, b = inputs(rank, world_size, poisoned=False)
    n = 16 // world_size
    mine = slice(rank * n, (rank + 1) * n)
    dense = [F.linear(*inputs(r, world_size, poisoned)) for r in range(world_size)]
    guesses = {
        "it added the bias on every rank before the sum, so the bias counts "
        f"{world_size} times": F.linear(x, w) + world_size * b,
        "it holds only its own part X_i A_i (+ bias): the all_reduce is missing": x[:, mine]
        @ w[:, mine].T,
        "it computed with the whole weight; the features outside this rank's shard are not "
        "this rank's to use": dense[rank],
        "it all-reduced outputs computed with the whole weight; the features outside a "
        "rank's shard are not its to use": sum(dense),
        "it averaged outputs computed with the whole weight; the features outside a "
        "rank's shard are not its to use": sum(dense) / world_size,
    }
    for why, value in guesses.items():
        for candidate in (value, value + b):
            if torch.allclose(got, candidate, atol=1e-4):
                return why
    return "its output is not the sum of the ranks' shards X_i A_i plus the bias"


def check_row_parallel(lab: Any, fn: Callable[..., Any]) -> Verdict:
    """`fn(x, weight, bias, rank, world_size)` runs on every rank with the full x [8, 16] and
    the dense weight [12, 16]; it must compute with its slice of the input features only and
    return the full output F.linear(x, weight, bias), using exactly one all_reduce.

    Run twice: once with the same x and weight everywhere (the numbers and the all_reduce
    count), once with the features outside each rank's slice, in x and the weight, replaced by
    that rank's own noise: only an answer that really uses its slice alone still gets the dense
    result there (dense maths plus an all_reduce does not)."""
    import torch
    import torch.nn.functional as F

    n = lab.world_size
    if 16 % n:
        return wrong(
            f"this exercise splits 16 features evenly: it needs 1, 2, 4, 8 or 16 ranks, "
            f"the lab has {n}"
        )
    inputs = _row_inputs_factory()
    x, w, b = inputs(0, n, poisoned=False)
    want = F.linear(x, w, b)
    watch = watching_factory()
    for poisoned in (False, True):

        def task(rank: int, world_size: int, poisoned: bool = poisoned) -> Any:
            return watch(fn)(*inputs(rank, world_size, poisoned), rank, world_size)

        results, bad = run_on_ranks(lab, task, display=False)
        if bad is not None:
            return bad
        seen = results.values_by_rank
        if (bad := unwaited({r: v["calls"] for r, v in seen.items()})) is not None:
            return bad
        for r, out in sorted((r, v["value"]) for r, v in seen.items()):
            if not isinstance(out, torch.Tensor) or out.shape != want.shape:
                what = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                return wrong(f"rank {r} returned {what}, expected a tensor of shape (8, 12)")
            err = float((out.float().cpu() - want).abs().max())
            if err > 1e-5:
                why = _row_diagnosis(inputs, out.float().cpu(), r, n, poisoned)
                if poisoned:
                    return wrong(f"rank {r}: right with full inputs, but {why}")
                return wrong(f"rank {r}: {err:.3g} away from the dense layer; {why}")
        counts = {r: ops.count("all_reduce") for r, ops in comm_ops(lab).items()}
        if any(c != 1 for c in counts.values()):
            return wrong(
                f"right numbers, but all_reduce calls per rank: {counts}; a row-parallel "
                "layer needs exactly 1"
            )
    return right("every rank computes with its slice only; one all_reduce gives the dense layer")


def solution_row_parallel() -> Any:
    return reveal("""
def row_parallel(x, weight, bias, rank, world_size):
    n = weight.shape[1] // world_size                  # input features per rank
    cols = slice(rank * n, (rank + 1) * n)
    partial = x[:, cols] @ weight[:, cols].T           # X_i A_i
    dist.all_reduce(partial)                           # sum_i X_i A_i
    return partial + bias                              # the bias once, after the sum
""")


# ------------------------------------------------------------------ 33: the exact split


def _cases() -> list[list[float]]:
    rng = random.Random(0)
    cases = [[1.0] * 8, [5.0, 1, 1, 1, 1, 1, 1, 5], [1, 2, 3, 4, 5, 6, 7, 8.0]]
    cases += [[rng.uniform(0.1, 3.0) for _ in range(rng.randint(4, 12))] for _ in range(20)]
    return cases


def check_best_split(fn: Callable[[list[float], int], Any]) -> Verdict:
    """`fn(times, stages)` -> boundaries [0, b_1, ..., len(times)] whose slowest stage is as
    small as any contiguous split can make it."""
    for times in _cases():
        for p in range(1, min(len(times), 4) + 1):
            costs = [LayerCost(i, str(i), t) for i, t in enumerate(times)]
            best = partition_optimal(costs, p).bottleneck
            try:
                bounds = [int(b) for b in fn(list(times), p)]
            except Exception as exc:  # noqa: BLE001
                return _raised(exc)
            ok = len(bounds) == p + 1 and bounds[0] == 0 and bounds[-1] == len(times)
            if not ok or any(a >= b for a, b in zip(bounds, bounds[1:])):
                return wrong(
                    f"times={times}, stages={p}: boundaries must be {p + 1} increasing ints "
                    f"from 0 to {len(times)}, got {bounds}"
                )
            got = max(sum(times[a:b]) for a, b in zip(bounds, bounds[1:]))
            if got > best + 1e-9:
                return wrong(
                    f"times={[round(t, 2) for t in times]}, stages={p}: your slowest stage "
                    f"costs {got:.4f}, the optimum is {best:.4f}"
                )
    return right("optimal on every test case")


def solution_best_split() -> Any:
    return reveal("""
def best_split(times, stages):
    n, prefix = len(times), [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]   # best[k][j]: k stages, j layers
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    bounds = [n]
    for k in range(stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]
""")


# ------------------------------------------------------------------ 34: names and what they do

CATEGORIES = ("mixed precision", "data parallelism", "model parallelism")
_WHAT = {
    "torch.autocast": "mixed precision",
    "torch.amp.GradScaler": "mixed precision",
    "DistributedDataParallel": "data parallelism",
    "labkit.auto_split": "model parallelism",
    "torch.distributed.pipelining": "model parallelism",
    "ColwiseParallel": "model parallelism",
}


def check_what_is_it(answers: dict[str, str]) -> Verdict:
    """`answers` maps each name in the exercise to one of CATEGORIES."""
    missing = sorted(set(_WHAT) - set(answers))
    if missing:
        return wrong(f"no answer for {missing}")
    for name, want in _WHAT.items():
        got = str(answers[name]).strip().lower()
        if got not in CATEGORIES:
            return wrong(f"{name}: answer one of {CATEGORIES}, got {answers[name]!r}")
        if got != want:
            return wrong(f"{name} is not {got}")
    return right("every name in its place")


def solution_what_is_it() -> Any:
    return reveal("\n".join(f"{k!r}: {v!r}," for k, v in _WHAT.items()))
