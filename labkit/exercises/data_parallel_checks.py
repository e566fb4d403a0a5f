"""Exercises of the synchronous data-parallel notebooks 20-23 (kernel side).

Each `check_*` runs the learner's function on every rank of `lab` (through `lab.run`, so the
function must only use names it imports or the kernel defines, such as `torch` and `dist`) and
compares what comes back with a single-process reference computed here. Each `solution_*`
reveals one answer. The later data-parallel notebooks have their own modules:
`checkpoint_checks` (24), `async_sgd_checks` (25), `zero_checks` (26), `multi_node_checks` (27).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from labkit.exercises import Verdict, rank_error, reveal, right, wrong

GLOBAL_BATCH = 128  # rows 0..127 of the digits: equal shards for 1, 2, 4 or 8 ranks
TOL = 1e-6


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


# ------------------------------------------------------------------ 20: average_gradients


def check_average_gradients(lab: Any, fn: Callable[[Any], None]) -> Verdict:
    """`fn(model)` runs on every rank after backward on the rank's b = 128 / W samples; it must
    leave in every p.grad the gradient of the mean loss over all 128 samples (to 1e-6)."""

    def task(rank: int, world_size: int) -> list[torch.Tensor]:
        import torch.nn.functional as F

        from labkit.parallel.data_parallel import make_mlp
        from labkit.parallel.datasets import load_digits

        X, y = load_digits()
        idx = torch.arange(GLOBAL_BATCH)[rank::world_size]
        model = make_mlp(seed=0)
        F.cross_entropy(model(X[idx]), y[idx]).backward()
        fn(model)
        return [p.grad.clone() for p in model.parameters()]

    results = lab.run(task)
    if (bad := rank_error(results)) is not None:
        return bad
    from labkit.parallel.data_parallel import make_mlp
    from labkit.parallel.datasets import load_digits

    X, y = load_digits()
    ref = make_mlp(seed=0)
    torch.nn.functional.cross_entropy(ref(X[:GLOBAL_BATCH]), y[:GLOBAL_BATCH]).backward()
    expected = [p.grad for p in ref.parameters()]
    grads = results.values_by_rank
    for r, g in sorted(grads.items()):
        diff = _max_diff(g, expected)
        if not diff < TOL:
            hint = " (summed but not divided by world_size?)" if diff > 0.1 else ""
            return wrong(f"rank {r}'s gradient differs from the whole batch's by {diff:.3g}{hint}")
    if any(not all(torch.equal(a, b) for a, b in zip(g, grads[0])) for g in grads.values()):
        return wrong("the ranks' gradients are close but not bit-identical")
    return right(f"every rank holds the whole-batch gradient (to {TOL:g}), bit-identical")


def solution_average_gradients() -> Any:
    return reveal("""
def average_gradients(model):
    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= world_size
""")


# ------------------------------------------------------------------ 21: max_replica_diff


def check_max_replica_diff(lab: Any, fn: Callable[[Any], Any]) -> Verdict:
    """`fn(model)` runs on every rank and must return, on every rank, the largest
    max_r(w) - min_r(w) over all weights w of the replicas (0.0 when they are identical)."""

    def task(rank: int, world_size: int) -> list[float]:
        from labkit.parallel.data_parallel import make_mlp, replica_report

        out = []
        for case in ("same", "one_rank_off", "all_apart"):
            model = make_mlp(seed=rank if case == "all_apart" else 0)
            if case == "one_rank_off" and rank == world_size - 1:
                with torch.no_grad():
                    model[2].bias[3] += 0.5
            got = fn(model)
            got = float(got.item() if isinstance(got, torch.Tensor) else got)
            out.extend([got, replica_report(model)["max_abs_diff"]])
        return out

    results = lab.run(task)
    if (bad := rank_error(results)) is not None:
        return bad
    cases = ("identical replicas", "one rank's bias moved by 0.5", "replicas from different seeds")
    for r, vals in sorted(results.values_by_rank.items()):
        for i, case in enumerate(cases):
            got, expected = vals[2 * i], vals[2 * i + 1]
            if abs(got - expected) > TOL:
                return wrong(f"{case}: rank {r} returned {got:.6g}, expected {expected:.6g}")
    return right("every rank measures the same spread as replica_report, in all three cases")


def solution_max_replica_diff() -> Any:
    return reveal("""
def max_replica_diff(model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return (hi - lo).max().item()
""")


# ------------------------------------------------------------------ 22: broadcast_parameters


def check_broadcast_parameters(lab: Any, fn: Callable[[Any], None]) -> Verdict:
    """`fn(model)` runs on every rank, each with differently initialised weights, and must make
    every rank's parameters bit-identical to rank 0's (what DDP does when it is built)."""

    def task(rank: int) -> list[torch.Tensor]:
        from labkit.parallel.data_parallel import make_mlp

        model = make_mlp(seed=100 + rank)
        fn(model)
        return [p.detach().clone() for p in model.parameters()]

    results = lab.run(task)
    if (bad := rank_error(results)) is not None:
        return bad
    from labkit.parallel.data_parallel import make_mlp

    expected = [p.detach() for p in make_mlp(seed=100).parameters()]
    for r, params in sorted(results.values_by_rank.items()):
        if not all(torch.equal(a, b) for a, b in zip(params, expected)):
            return wrong(f"rank {r}'s parameters are not rank 0's initial ones")
    return right("every rank now holds rank 0's weights, bit for bit")


def solution_broadcast_parameters() -> Any:
    return reveal("""
def broadcast_parameters(model):
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p, src=0)
""")


# ------------------------------------------------------------------ 23: clip by the global norm


def check_clip_global(lab: Any, fn: Callable[[list[Any], float], Any]) -> Verdict:
    """`fn(params, max_norm)` runs on every rank; rank r holds the gradients of parameter
    tensors r, r + W, ... only (a disjoint piece, as in ZeRO-2 or FSDP). Together the clipped
    pieces must equal torch.nn.utils.clip_grad_norm_ on the whole gradient in one process."""
    max_norm = 0.05

    def task(rank: int, world_size: int) -> dict[int, torch.Tensor]:
        import torch.nn.functional as F

        from labkit.parallel.data_parallel import make_mlp
        from labkit.parallel.datasets import load_digits

        X, y = load_digits()
        model = make_mlp(seed=1)
        F.cross_entropy(model(X[:GLOBAL_BATCH]), y[:GLOBAL_BATCH]).backward()
        params = list(model.parameters())
        mine = [p for i, p in enumerate(params) if i % world_size == rank]
        fn(mine, max_norm)
        return {i: p.grad.clone() for i, p in enumerate(params) if i % world_size == rank}

    results = lab.run(task)
    if (bad := rank_error(results)) is not None:
        return bad
    from labkit.parallel.data_parallel import make_mlp
    from labkit.parallel.datasets import load_digits

    X, y = load_digits()
    ref = make_mlp(seed=1)
    torch.nn.functional.cross_entropy(ref(X[:GLOBAL_BATCH]), y[:GLOBAL_BATCH]).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    expected = [p.grad for p in ref.parameters()]
    for r, pieces in sorted(results.values_by_rank.items()):
        for i, g in pieces.items():
            diff = (g - expected[i]).abs().max().item()
            if not diff < TOL:
                return wrong(
                    f"rank {r}'s piece {i} differs from one-process clipping by {diff:.3g} "
                    "(not clipped, or clipped by a local norm?)"
                )
    return right("the clipped pieces equal clip_grad_norm_ on the whole gradient")


def solution_clip_global() -> Any:
    return reveal("""
def clip_global(params, max_norm):
    grads = [p.grad for p in params if p.grad is not None]
    sq = sum((g.double().pow(2).sum() for g in grads), torch.zeros((), dtype=torch.float64))
    dist.all_reduce(sq)                       # sum over ranks of ||g_r||^2
    coef = torch.clamp(max_norm / (sq.sqrt() + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
""")
