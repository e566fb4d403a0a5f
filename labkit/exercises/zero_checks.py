"""Exercises of notebook 26, ZeRO and FSDP: bytes per rank, and a ZeRO-2 step (kernel side).

`check_zero_bytes` calls the learner's formula in the kernel (no ranks needed) and compares it
with `labkit.parallel.zero_redundancy.zero_memory` for stages 0-3. `check_zero2_step` runs the
learner's sharded SGD step on every rank of the lab and compares the weights and gradient
shards with a single-process step, on a vector whose length the world size does not divide,
with gradients that differ from rank to rank, and reads the trace for the collectives used.
The classic wrong answers it tells apart, each on inputs where it differs from the right one:

- all-reducing the whole gradient and keeping a slice (the numbers are right; every rank held
  the whole gradient, which is ZeRO-1's memory, not ZeRO-2's): the trace shows an all_reduce;
- forgetting to all-gather the updated shards: the other ranks' shards of the weights are stale;
- shard boundaries of floor(numel / N), or `tensor_split`'s uneven pieces (3, 3, 2, 2 of 10
  on 4 ranks) instead of padded shards of ceil(numel / N): elements land on the wrong rank or
  are never stepped;
- summing the gradients without dividing by the world size (N times the mean; SGD, unlike
  Adam, does not hide the scale), or dividing without reducing (the rank's own gradient / N).

`solution_zero_bytes` and `solution_zero2_step` reveal one answer each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from labkit.exercises import Verdict, comm_ops, reveal, right, run_on_ranks, wrong

LR = 0.5
TOL = 1e-6


def check_zero_bytes(fn: Callable[[int, int, int], Any]) -> Verdict:
    """`fn(num_params, world_size, stage)` must return the bytes of weights + gradients + Adam
    state each rank holds under ZeRO `stage` (0-3) with mixed precision (2 + 2 + 12 bytes per
    parameter, a sharded part divided by world_size, rounded up to whole parameters)."""
    from labkit.parallel.zero_redundancy import zero_memory

    for num_params, world_size in ((7_500_000_000, 64), (1000, 4), (1001, 8)):
        for stage in range(4):
            expected = zero_memory(num_params, world_size, stage)["total"]
            try:
                got = fn(num_params, world_size, stage)
            except Exception as exc:  # noqa: BLE001 - the learner's error is the verdict
                return wrong(f"fn({num_params}, {world_size}, {stage}) raised {exc!r}")
            if got != expected:
                return wrong(
                    f"stage {stage}, {num_params:,} parameters on {world_size} ranks: "
                    f"got {got!r}, expected {expected:,} bytes"
                )
    return right("bytes per rank match the ZeRO formulas for stages 0-3")


def solution_zero_bytes() -> Any:
    return reveal("""
def zero_bytes(num_params, world_size, stage):
    shard = -(-num_params // world_size)              # ceil
    params = 2 * (shard if stage >= 3 else num_params)
    grads = 2 * (shard if stage >= 2 else num_params)
    optimizer = 12 * (shard if stage >= 1 else num_params)
    return params + grads + optimizer
""")


def zero2_numel(world_size: int) -> int:
    """A length the world size does not divide, where floor(numel / N), ceil(numel / N) and
    `tensor_split`'s pieces all differ (10 on 4 ranks: shards of 3, 3, 3, 1)."""
    for numel in range(2 * world_size + 2, 4 * world_size + 4):
        c = -(-numel // world_size)
        if numel % world_size and (world_size - 1) * c < numel and c * (numel // c) != numel:
            return numel
    return 2 * world_size + 1


def _inputs(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    numel = zero2_numel(world_size)
    param = torch.linspace(-1.0, 1.0, numel)
    grad = torch.arange(1.0, numel + 1) * (rank + 1) + 10.0 * rank  # a different one per rank
    return param, grad


def check_zero2_step(lab: Any, fn: Callable[[Any, Any, float], Any]) -> Verdict:
    """`fn(param, grad, lr)` runs on every rank: `param` the whole flat fp32 weight vector (the
    same on every rank), `grad` this rank's own gradient, `lr` the SGD step. It must
    reduce-scatter the gradient (this rank keeps the *mean* gradient of its shard only, shards
    of ceil(numel / N) elements, the last one padded), step its shard of `param`, all-gather
    the shards back into `param` (in place), and return its gradient shard."""

    def task(rank: int, world_size: int, device: Any) -> tuple[torch.Tensor, Any]:
        param, grad = (t.to(device) for t in _inputs(rank, world_size))
        shard = fn(param, grad, LR)
        shard = shard.detach().cpu() if isinstance(shard, torch.Tensor) else shard
        return param.detach().cpu(), shard

    results, bad = run_on_ranks(lab, task)
    if bad is not None:
        return bad
    n = lab.world_size
    ops = comm_ops(lab)
    numel = zero2_numel(n)
    c = -(-numel // n)
    grads = [_inputs(r, n)[1] for r in range(n)]
    mean = torch.stack(grads).mean(0)
    expected = _inputs(0, n)[0] - LR * mean
    out = results.values_by_rank
    for r in range(n):
        if "all_reduce" in ops.get(r, []):
            return wrong(
                f"rank {r} called all_reduce: every rank then holds the whole gradient, which "
                "is ZeRO-1's memory, not ZeRO-2's; reduce-scatter it so that each rank only "
                "ever receives its own shard"
            )
        if "reduce_scatter" not in ops.get(r, []):
            return wrong(f"rank {r} never called reduce_scatter: the gradient was not reduced")
    for r, (param, shard) in sorted(out.items()):
        lo, hi = min(numel, r * c), min(numel, (r + 1) * c)
        want = mean[lo:hi]
        if not isinstance(shard, torch.Tensor) or shard.numel() not in (c, hi - lo):
            got = getattr(shard, "shape", type(shard).__name__)
            return wrong(
                f"rank {r} returned a gradient shard of {got}, expected {c} elements: shards "
                f"of ceil({numel} / {n}) = {c}, elements [{lo}, {hi}) on rank {r}"
            )
        mine = shard.reshape(-1)[: hi - lo].double()
        if not torch.allclose(mine, want.double(), rtol=TOL, atol=TOL):
            ratio = (mine.sum() / want.double().sum()).item() if hi > lo else float("nan")
            hint = f" ({ratio:.3g} x the mean" + (": summed, not divided by world_size)"
                                                  if abs(ratio - n) < 1e-3 else ")")  # fmt: skip
            return wrong(
                f"rank {r}'s gradient shard is not the mean over ranks of elements "
                f"[{lo}, {hi}){hint}; shards are ceil({numel} / {n}) = {c} elements"
            )
        if "all_gather" not in ops.get(r, []):
            return wrong(f"rank {r} never called all_gather: the updated shards stay apart")
        bad_at = (param - expected).abs() > TOL * (1 + expected.abs())
        if bool(bad_at.any()):
            where = bad_at.nonzero().flatten().tolist()
            stale = [i for i in where if i < lo or i >= hi]
            hint = (
                ": the other ranks' shards were not all-gathered"
                if stale and torch.allclose(param[lo:hi], expected[lo:hi], atol=TOL)
                else f"; rank r steps elements [r·{c}, (r+1)·{c}) (padded shards)"
            )
            return wrong(f"rank {r}'s weights after the step differ at elements {where}{hint}")
    if any(not torch.equal(p, out[0][0]) for p, _ in out.values()):
        return wrong("the ranks' weights after the step are close but not bit-identical")
    return right(
        f"{numel} weights on {n} ranks: mean gradient shards of {c}, weights stepped and "
        "gathered, with reduce_scatter and all_gather"
    )


def solution_zero2_step() -> Any:
    return reveal("""
def zero2_step(param, grad, lr):
    n, r = dist.get_world_size(), dist.get_rank()
    c = -(-param.numel() // n)                       # shard size: ceil, the last one padded
    padded = torch.zeros(n * c, dtype=grad.dtype, device=grad.device)
    padded[: grad.numel()] = grad
    shard = torch.empty(c, dtype=grad.dtype, device=grad.device)
    dist.reduce_scatter_single(shard, padded)        # sum of every rank's elements [r c, (r+1) c)
    shard /= n                                       # the mean, not the sum
    whole = torch.zeros(n * c, dtype=param.dtype, device=param.device)
    whole[: param.numel()] = param
    mine = whole[r * c : (r + 1) * c] - lr * shard   # step my shard only
    dist.all_gather_single(whole, mine)              # every rank's stepped shard
    param.copy_(whole[: param.numel()])
    return shard
""")
