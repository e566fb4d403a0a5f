"""Exercise of notebook 48 (kernel side, in this process): the vocab-parallel cross-entropy.

`check_vocab_ce(fn)` runs the learner's `fn(local_logits, target, start, all_reduce)` on P = 4
simulated ranks (threads, one each). Rank r holds the logits' columns [start, start + V/P) of a
[N, V] float32 batch; `target` holds global ids; `all_reduce(t, op)` (op "sum" or "max")
returns the reduction over the ranks, as dist.all_reduce would leave it. fn returns the
per-example loss [N], the same on every rank. Compared with F.cross_entropy(reduction="none")
on the full logits. The inputs have logits near 100 (exp overflows float32 past 88.7), targets
on every rank's slice and ids 0 and V-1 at the slices' edges, so the classic mistakes show and
are named: a softmax over the local slice only, no max subtracted (inf/nan), each rank's own
max, the target logit not masked to its rank (clamped, or the sum of every rank's column), an
offset off by one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from labkit.exercises import Verdict, reveal, right, wrong

__all__ = ["check_vocab_ce", "solution_vocab_ce"]

P, N, V = 4, 8, 32


def _run(fn: Callable[..., Any], logits: Any, target: Any) -> list[Any]:
    """fn on P threads; each rank's answer."""
    import torch

    c = V // P
    slots: list[Any] = [None] * P
    barrier = threading.Barrier(P, timeout=10)
    answers, errors = [None] * P, [None] * P

    def make(rank: int) -> Callable[..., Any]:
        def all_reduce(t: Any, op: str = "sum") -> Any:
            if op not in ("sum", "max"):
                raise ValueError(f'all_reduce op must be "sum" or "max", got {op!r}')
            slots[rank] = t.detach().clone()
            barrier.wait()
            stacked = torch.stack([slots[j] for j in range(P)])
            out = stacked.sum(0) if op == "sum" else stacked.amax(0)
            barrier.wait()
            return out

        return all_reduce

    def body(rank: int) -> None:
        try:
            local = logits[:, rank * c : (rank + 1) * c].clone()
            answers[rank] = fn(local, target.clone(), rank * c, make(rank))
        except Exception as e:  # the learner's error, shown as the verdict
            errors[rank] = e
            barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(P)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    first = next(iter(real), next((e for e in errors if e is not None), None))  # the cause first
    if first is not None:
        raise first
    return answers


def _inputs() -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(N, V, generator=g)
    logits[::2] += 100.0  # exp(100) is inf in float32
    target = torch.tensor([0, V - 1, 7, 8, 15, 16, 23, 24])  # each slice's first and last id
    return logits, target


def _mistakes(logits: Any, target: Any) -> dict[str, Any]:
    """What each classic mistake gives on these inputs, rank 0's view where ranks differ."""
    import torch

    c = V // P
    cols = [logits[:, r * c : (r + 1) * c] for r in range(P)]
    lse_local = torch.stack([torch.logsumexp(x, -1) for x in cols])  # [P, N]
    lse = torch.logsumexp(logits, -1)
    tlogit = logits.gather(-1, target[:, None]).squeeze(-1)

    def picked(shift: int, masked: bool) -> Any:
        total = torch.zeros(N)
        for r, x in enumerate(cols):
            idx = target - r * c + shift
            inside = (idx >= 0) & (idx < c)
            got = x.gather(-1, idx.clamp(0, c - 1)[:, None]).squeeze(-1)
            total += got.masked_fill(~inside, 0.0) if masked else got
        return total

    own_max = torch.stack([x.amax(-1) for x in cols])
    sum_own = sum(torch.exp(x - m[:, None]).sum(-1) for x, m in zip(cols, own_max, strict=True))
    return {
        "the softmax over this rank's slice only": lse_local[0]
        - cols[0].gather(-1, (target.clamp(0, c - 1))[:, None]).squeeze(-1),
        "each rank's own max (the sum-exps of different shifts added)": torch.log(sum_own)
        + own_max[0]
        - tlogit,
        "the target logit not masked: every rank added its clamped column": lse - picked(0, False),
        "the offset off by one": lse - picked(1, True),
        "the offset off by one (the other way)": lse - picked(-1, True),
    }


def check_vocab_ce(fn: Callable[..., Any]) -> Verdict:
    """fn(local_logits [N, V/P], target [N] global ids, start, all_reduce) -> loss [N]."""
    import torch
    import torch.nn.functional as F

    logits, target = _inputs()
    try:
        got = _run(fn, logits, target)
    except Exception as e:
        hint = ""
        if "index" in str(e).lower() or "out of bounds" in str(e).lower():
            hint = (
                " (a target id of another rank's slice indexed this slice: mask the ids "
                "outside [start, start + V/P) before gathering)"
            )
        return wrong(f"your function raised {type(e).__name__}: {e}{hint}")
    ref = F.cross_entropy(logits, target, reduction="none")
    for r in range(P):
        if not isinstance(got[r], torch.Tensor) or tuple(got[r].shape) != (N,):
            shape = list(got[r].shape) if isinstance(got[r], torch.Tensor) else type(got[r])
            return wrong(f"rank {r} returned {shape}, want a per-example loss of shape [{N}]")
    if not all(torch.isfinite(g).all() for g in got):
        return wrong(
            "inf or nan: exp of logits near 100 overflows float32 (past 88.7). Subtract the "
            'GLOBAL max first (all_reduce(local max, "max")), and add it back after the log'
        )
    for name, bad in _mistakes(logits, target).items():
        if torch.allclose(got[0], bad, atol=1e-3) and not torch.allclose(bad, ref, atol=1e-3):
            return wrong(f"rank 0's loss is {name}; compare with F.cross_entropy on all {V}")
    for r in range(P):
        err = (got[r] - ref).abs().max().item()
        if err > 1e-3:
            return wrong(
                f"rank {r}'s loss differs from F.cross_entropy on the full logits by {err:.3g}: "
                "log(sum of every rank's sum-exp) + global max - the target's logit (from the "
                "one rank whose slice holds it)"
            )
    return right("equal to F.cross_entropy on the full logits on every rank, large logits too")


def solution_vocab_ce() -> Any:
    return reveal(
        """def vocab_ce(local_logits, target, start, all_reduce):
    m = all_reduce(local_logits.amax(dim=-1), "max")  # the global max of each row
    sum_exp = all_reduce(torch.exp(local_logits - m[:, None]).sum(dim=-1), "sum")
    local = target - start
    inside = (local >= 0) & (local < local_logits.shape[-1])
    picked = local_logits.gather(-1, local.clamp(0, local_logits.shape[-1] - 1)[:, None])
    target_logit = all_reduce(picked.squeeze(-1).masked_fill(~inside, 0.0), "sum")
    return torch.log(sum_exp) + m - target_logit"""
    )
