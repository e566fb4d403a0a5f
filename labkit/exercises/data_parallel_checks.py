"""Exercises of the synchronous data-parallel notebooks 20-23 (kernel side).

Each `check_*` runs the learner's function on every rank of `lab` (through `lab.run`, so the
function must only use names it imports or the kernel defines, such as `torch` and `dist`) and
compares what comes back with a single-process reference computed here. Each `solution_*`
reveals one answer. The later data-parallel notebooks have their own modules:
`checkpoint_checks` (24), `async_sgd_checks` (25), `zero_checks` (26), `multi_node_checks` (27).

Every checker here also rejects a request (async_op=True) the function never waited for: the
numbers are then right or wrong by luck of timing. The classic wrong answers each one rejects
(tested in tests/test_checkers_data.py) are listed in its docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from labkit.exercises import Verdict, reveal, right, run_on_ranks, unwaited, watching_factory, wrong

GLOBAL_BATCH = 128  # rows 0..127 of the digits: equal shards for 1, 2, 4 or 8 ranks
TOL = 1e-6
MAX_NORMS = (0.05, 1000.0)  # below the test gradient's norm (clips), above it (does not)


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


# ------------------------------------------------------------------ 20: average_gradients


def check_average_gradients(lab: Any, fn: Callable[[Any], None]) -> Verdict:
    """`fn(model)` runs on every rank after backward on the rank's b = 128 / W samples; it must
    leave in every p.grad the gradient of the mean loss over all 128 samples (to 1e-6). It runs
    twice: with a float32 model and with a float64 one, where `p.grad.float()` or
    `p.grad.to(torch.float32)` is a copy (on GPUs `.cpu()` is one too), so an all_reduce of it
    leaves p.grad as it was.

    Classic wrong answers it rejects: all_reduce then no division (W x the mean); the division
    without the all_reduce; dividing twice (ReduceOp.AVG, then / W); `g = g / W`, which only
    rebinds a name; reducing a converted copy; an async all_reduce never waited for; averaging
    the weights instead of the gradients; leaving some parameters out."""
    watch = watching_factory()

    def task(rank: int, world_size: int, device: Any) -> list[Any]:
        import torch.nn.functional as F

        from labkit.parallel.data_parallel import make_mlp
        from labkit.parallel.datasets import load_digits

        out = []
        for dtype in (torch.float32, torch.float64):
            X, y = (t.to(device) for t in load_digits())
            idx = torch.arange(GLOBAL_BATCH)[rank::world_size]
            model = make_mlp(seed=0, device=device).to(dtype)
            F.cross_entropy(model(X[idx].to(dtype)), y[idx]).backward()
            calls = watch(fn)(model)["calls"]
            out.append(([p.grad.cpu() for p in model.parameters()], calls))
        return out  # compared on the kernel's CPU

    results, bad = run_on_ranks(lab, task)
    if bad is not None:
        return bad
    from labkit.parallel.data_parallel import make_mlp
    from labkit.parallel.datasets import load_digits

    X, y = load_digits()
    n = lab.world_size
    for k, dtype in enumerate((torch.float32, torch.float64)):
        if (bad := unwaited({r: v[k][1] for r, v in results.values_by_rank.items()})) is not None:
            return bad

        def grads_of(idx: torch.Tensor, dtype: torch.dtype = dtype) -> list[torch.Tensor]:
            ref = make_mlp(seed=0).to(dtype)
            torch.nn.functional.cross_entropy(ref(X[idx].to(dtype)), y[idx]).backward()
            return [p.grad for p in ref.parameters()]

        expected = grads_of(torch.arange(GLOBAL_BATCH))
        grads = {r: v[k][0] for r, v in results.values_by_rank.items()}
        where = "" if dtype == torch.float32 else "right for float32 gradients, but for float64 "
        for r, g in sorted(grads.items()):
            if not all(torch.is_tensor(x) and x.shape == e.shape for x, e in zip(g, expected)):
                return wrong(f"{where}rank {r}: some p.grad is missing or has the wrong shape")
            if any(x.dtype != e.dtype for x, e in zip(g, expected)):
                return wrong(f"{where}rank {r}: p.grad changed dtype; leave it {dtype}")
            diff = _max_diff(g, expected)
            if not diff < TOL:
                own = grads_of(torch.arange(GLOBAL_BATCH)[r::n])
                hint = ""
                if _max_diff(g, [n * e for e in expected]) < TOL * n:
                    hint = (
                        f": it is {n} x the mean (summed, not divided by world_size; "
                        "`g = g / n` only rebinds a name: divide in place, g /= n)"
                    )
                elif _max_diff(g, [e / n for e in expected]) < TOL:
                    hint = f": it is the mean / {n} (divided twice)"
                elif _max_diff(g, own) < TOL:
                    hint = ": it is still this rank's own gradient (not reduced)"
                    if where:
                        hint += (
                            "; p.grad.float() and .to(dtype) are copies when the dtype "
                            "differs (on GPUs .cpu() is one too): all_reduce p.grad itself"
                        )
                elif _max_diff(g, [e / n for e in own]) < TOL:
                    hint = ": it is this rank's gradient / world_size (divided, never summed)"
                return wrong(
                    f"{where}rank {r}'s gradient differs from the whole batch's by {diff:.3g}{hint}"
                )
        if any(not all(torch.equal(a, b) for a, b in zip(g, grads[0])) for g in grads.values()):
            return wrong(f"{where}the ranks' gradients are close but not bit-identical")
    return right(
        f"every rank holds the whole-batch gradient (to {TOL:g}), bit-identical, "
        "in float32 and float64"
    )


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
    max_r(w) - min_r(w) over all weights w of the replicas (0.0 when they are identical). Three
    cases: identical replicas, one rank's bias moved (on the last rank), all from different
    seeds.

    Classic wrong answers it rejects: no communication (every rank reports 0); the max over
    ranks minus its own weights (0 on the rank that moved); the answer on rank 0 only (gather);
    the largest weight instead of the largest spread; an async reduction never waited for."""

    watch = watching_factory()

    def task(rank: int, world_size: int, device: Any) -> dict[str, Any]:
        from labkit.parallel.data_parallel import make_mlp, replica_report

        out, calls = [], []
        for case in ("same", "one_rank_off", "all_apart"):
            model = make_mlp(seed=rank if case == "all_apart" else 0, device=device)
            if case == "one_rank_off" and rank == world_size - 1:
                with torch.no_grad():
                    model[2].bias[3] += 0.5
            seen = watch(fn)(model)
            got, calls = seen["value"], calls + seen["calls"]
            got = float(got.item() if isinstance(got, torch.Tensor) else got)
            out.extend([got, replica_report(model)["max_abs_diff"]])
        return {"values": out, "calls": calls}

    results, bad = run_on_ranks(lab, task)
    if bad is not None:
        return bad
    if (bad := unwaited({r: v["calls"] for r, v in results.values_by_rank.items()})) is not None:
        return bad
    cases = ("identical replicas", "one rank's bias moved by 0.5", "replicas from different seeds")
    for i, case in enumerate(cases):  # the simplest case that fails is named
        for r, out in sorted(results.values_by_rank.items()):
            got, expected = out["values"][2 * i], out["values"][2 * i + 1]
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


def _model_with_buffers_factory() -> Callable[[int, Any], Any]:
    """The function building the exercise's model, made here so that it is pickled by value
    (a rank does not import this kernel-side module)."""

    def model_with_buffers(seed: int, device: Any = None) -> Any:
        """make_mlp(seed) followed by a BatchNorm1d whose affine weights, running statistics
        and num_batches_tracked (an int64 buffer) all differ with the seed (rank and kernel)."""
        from labkit.parallel.data_parallel import make_mlp

        model = make_mlp(seed=seed)
        g = torch.Generator().manual_seed(seed)
        norm = torch.nn.BatchNorm1d(10)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(10, generator=g))
            norm.bias.copy_(0.1 * torch.randn(10, generator=g))
            norm.running_mean.copy_(torch.randn(10, generator=g))
            norm.running_var.copy_(torch.rand(10, generator=g) + 0.5)
            norm.num_batches_tracked.fill_(seed)
        model.append(norm)
        return model.to(device)

    return model_with_buffers


def check_broadcast_parameters(lab: Any, fn: Callable[[Any], None]) -> Verdict:
    """`fn(model)` runs on every rank, each with different weights and different BatchNorm
    running statistics (buffers, one of them int64), and must make every rank's parameters and
    buffers bit-identical to rank 0's: what DDP does when it is built (it broadcasts both, and
    by default the buffers again before every forward: forward_sync_buffers=True, torch
    2.13's name for the deprecated broadcast_buffers).

    Classic wrong answers it rejects: parameters only (the running statistics stay each
    rank's own, and the replicas normalise differently); averaging instead of broadcasting;
    the wrong source rank; broadcasting copies (`p.detach().clone()`, `p.float()`) that
    nothing writes back; weights without biases; an async broadcast never waited for."""
    build = _model_with_buffers_factory()
    watch = watching_factory()

    def task(rank: int, device: Any) -> dict[str, Any]:
        model = build(100 + rank, device)
        calls = watch(fn)(model)["calls"]
        return {
            "params": [p.detach().cpu() for p in model.parameters()],
            "buffers": {k: b.detach().cpu() for k, b in model.named_buffers()},
            "calls": calls,
        }

    results, bad = run_on_ranks(lab, task)
    if bad is not None:
        return bad
    outs = results.values_by_rank
    if (bad := unwaited({r: out["calls"] for r, out in outs.items()})) is not None:
        return bad
    initial = [build(100 + k) for k in range(lab.world_size)]
    for r, out in sorted(outs.items()):
        params = out["params"]
        same = [
            k
            for k, m in enumerate(initial)
            if all(torch.equal(a, b) for a, b in zip(params, m.parameters()))
        ]
        if same == [r] and r != 0:
            return wrong(f"rank {r} still holds its own initial weights")
        if same and same != [0]:
            return wrong(f"rank {r} holds rank {same[0]}'s initial weights: broadcast from rank 0")
        if not same:
            return wrong(
                f"rank {r}'s parameters are not rank 0's initial ones (a mix, or averaged?)"
            )
        theirs = dict(initial[0].named_buffers())
        differ = [k for k, b in out["buffers"].items() if not torch.equal(b, theirs[k])]
        if differ:
            return wrong(
                f"rank {r} holds rank 0's parameters, but not its buffers {differ}: broadcast "
                "the buffers too (model.buffers(); DDP does when it is built), or the replicas "
                "normalise with different statistics"
            )
    return right("every rank now holds rank 0's parameters and buffers, bit for bit")


def solution_broadcast_parameters() -> Any:
    return reveal("""
def broadcast_parameters(model):
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:   # buffers: BatchNorm's statistics
            dist.broadcast(t, src=0)
""")


# ------------------------------------------------------------------ 23: clip by the global norm


def check_clip_global(lab: Any, fn: Callable[[list[Any], float], Any]) -> Verdict:
    """`fn(params, max_norm)` runs on every rank; rank r holds the gradients of parameter
    tensors r, r + W, ... only (a disjoint piece, as in ZeRO-2 or FSDP). Together the clipped
    pieces must equal torch.nn.utils.clip_grad_norm_ on the whole gradient in one process.
    It runs twice: with max_norm 0.05 (below the gradient's norm: it clips) and 1000 (above
    it: the gradients must stay as they are).

    Classic wrong answers it rejects: clip_grad_norm_ on the local piece (a local norm); the
    coefficient not capped at 1 (scales up small gradients); the ranks' norms summed instead
    of their squares; the mean of the squares (ReduceOp.AVG) instead of their sum; the sum of
    squares without the square root; an async all_reduce never waited for."""

    watch = watching_factory()

    def task(rank: int, world_size: int, device: Any) -> list[Any]:
        import torch.nn.functional as F

        from labkit.parallel.data_parallel import make_mlp
        from labkit.parallel.datasets import load_digits

        X, y = (t.to(device) for t in load_digits())
        out, calls = [], []
        for max_norm in MAX_NORMS:
            model = make_mlp(seed=1, device=device)
            F.cross_entropy(model(X[:GLOBAL_BATCH]), y[:GLOBAL_BATCH]).backward()
            params = list(model.parameters())
            mine = [p for i, p in enumerate(params) if i % world_size == rank]
            calls += watch(fn)(mine, max_norm)["calls"]
            out.append({i: p.grad.cpu() for i, p in enumerate(params) if i % world_size == rank})
        return [*out, calls]

    results, bad = run_on_ranks(lab, task)
    if bad is not None:
        return bad
    if (bad := unwaited({r: v[-1] for r, v in results.values_by_rank.items()})) is not None:
        return bad
    from labkit.parallel.data_parallel import make_mlp
    from labkit.parallel.datasets import load_digits

    X, y = load_digits()
    for k, max_norm in enumerate(MAX_NORMS):
        ref = make_mlp(seed=1)
        torch.nn.functional.cross_entropy(ref(X[:GLOBAL_BATCH]), y[:GLOBAL_BATCH]).backward()
        norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm))
        expected = [p.grad for p in ref.parameters()]
        for r, out in sorted(results.values_by_rank.items()):
            for i, g in out[k].items():
                diff = (g - expected[i]).abs().max().item()
                if not diff < TOL:
                    why = (
                        "not clipped, or by a local norm?"
                        if norm > max_norm
                        else (
                            "the norm is below max_norm: nothing may change, the coefficient "
                            "is capped at 1"
                        )
                    )
                    return wrong(
                        f"max_norm={max_norm:g} (the gradient's norm is {norm:.3g}): rank {r}'s "
                        f"piece {i} differs from one-process clipping by {diff:.3g} ({why})"
                    )
    return right(
        "the clipped pieces equal clip_grad_norm_ on the whole gradient, with and without clipping"
    )


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
