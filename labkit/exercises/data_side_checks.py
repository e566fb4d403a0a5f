"""Exercise of the data-side notebook 43 (kernel side): a token-weighted loss across
data-parallel ranks whose sequences have uneven lengths.

`check_token_weighted(lab, fn)` runs `fn(model, inputs, targets)` on every rank: each rank holds
a bigram model (`make_token_model(0)`) and its own padded batch (targets IGNORE past a
sequence's end), and fn must leave in every p.grad the gradient of the mean loss over ALL the
ranks' real tokens, which the checker computes here in one process with F.cross_entropy on the
whole batch. Two data seeds; in both the ranks hold different numbers of tokens.

Classic wrong answers it rejects (tests/test_data_side.py), and names: the mean of per-rank
means (each rank's mean loss, gradients averaged: DDP's default); the token sum divided by the
world size only; the token count never all-reduced (a local count); the gradients never
all-reduced; padding counted as tokens; the division by W done twice or never (with the DDP
form W * S_r / N); a request never waited for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from labkit.exercises import Verdict, reveal, right, run_on_ranks, unwaited, watching_factory, wrong

__all__ = ["check_token_weighted", "solution_token_weighted"]

DATA_SEEDS = (0, 1)
TOL = 1e-6


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _grads(seqs: list[torch.Tensor], scale: float = 1.0, mean: bool = True) -> list[torch.Tensor]:
    """The gradient, in this process, of scale * (the mean, or the sum) of seqs' token losses."""
    import torch.nn.functional as F

    from labkit.parallel.data_side import make_token_model, token_batch

    model = make_token_model(0)
    inputs, targets = token_batch(seqs)
    reduction = "mean" if mean else "sum"
    loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), reduction=reduction)
    (scale * loss).backward()
    return [p.grad for p in model.parameters()]


def _diagnose(got: list[torch.Tensor], seed: int, rank: int, world_size: int) -> str:
    """What a wrong gradient is, among the classic mistakes (compared on this data)."""
    from labkit.parallel.data_side import IGNORE, rank_sequences, token_batch

    per_rank = [rank_sequences(r, world_size, seed) for r in range(world_size)]
    every = [s for seqs in per_rank for s in seqs]
    n = [int((token_batch(seqs)[1] != IGNORE).sum()) for seqs in per_rank]
    padded = sum(token_batch(seqs)[1].numel() for seqs in per_rank)
    total, w = sum(n), world_size
    want = _grads(every)
    means = [_grads(seqs) for seqs in per_rank]
    mean_of_means = [sum(gs) / w for gs in zip(*means)]

    def close(ref: list[torch.Tensor]) -> bool:  # to TOL relative to the reference's size
        size = max(1.0, max(t.abs().max().item() for t in ref))
        return _max_diff(got, ref) < TOL * size

    scaled = {
        total / w: "the token sum divided by the world size only: divide by the number of "
        "tokens of all ranks (N, all-reduced), not by W",
        float(w): f"{w} x too large: with backward on W * S_r / N the gradients are averaged "
        "(/ W, as DDP does), not summed",
        1.0 / w: f"{w} x too small: with backward on S_r / N the gradients are summed; the "
        "division by N is already in the loss (do not divide by W as well)",
        total / padded: "padding counted as tokens: count targets != IGNORE (-100)",
        float(total): "the sum of the token losses: divide it by the global token count N",
    }
    for k, why in scaled.items():
        if close([k * g for g in want]):
            return why
    if close(mean_of_means) or close([w * g for g in mean_of_means]):
        return (
            f"the mean of the per-rank means (ranks hold {n} tokens): a token on a rank with "
            "few tokens weighs more; divide each rank's token sum by the global count "
            "(all_reduce the counts first)"
        )
    if close(means[rank]):
        return (
            "it is still this rank's own mean (nothing reduced): weigh the token sum by every "
            "rank's token count, then all_reduce the gradients"
        )
    if close(_grads(per_rank[rank], 1.0 / total, mean=False)):
        return "it is this rank's part only (S_r / N): all_reduce the gradients (SUM)"
    return "not a multiple of the whole batch's gradient, nor one of the classic mistakes"


def check_token_weighted(lab: Any, fn: Callable[..., Any]) -> Verdict:
    """`fn(model, inputs, targets)` runs on every rank: forward, backward and whatever
    communication it needs, leaving in every p.grad the gradient of the mean loss over every
    rank's real tokens (targets that are not IGNORE), bit-identical on every rank."""
    watch = watching_factory()

    def task(rank: int, world_size: int, device: Any) -> list[Any]:
        from labkit.parallel.data_side import make_token_model, rank_sequences, token_batch

        out = []
        for seed in DATA_SEEDS:
            model = make_token_model(0, device=device)
            inputs, targets = token_batch(rank_sequences(rank, world_size, seed), device)
            calls = watch(fn)(model, inputs, targets)["calls"]
            grads = [None if p.grad is None else p.grad.detach().cpu() for p in model.parameters()]
            out.append((grads, calls))
        return out

    results, bad = run_on_ranks(lab, task)
    if bad is not None:
        return bad
    from labkit.parallel.data_side import rank_sequences

    w = lab.world_size
    for k, seed in enumerate(DATA_SEEDS):
        if (bad := unwaited({r: v[k][1] for r, v in results.values_by_rank.items()})) is not None:
            return bad
        want = _grads([s for r in range(w) for s in rank_sequences(r, w, seed)])
        grads = {r: v[k][0] for r, v in results.values_by_rank.items()}
        for r, g in sorted(grads.items()):
            if any(x is None or x.shape != e.shape for x, e in zip(g, want)):
                return wrong(f"data seed {seed}: rank {r} has no gradient (or a wrong shape)")
            diff = _max_diff(g, want)
            if not diff < TOL:
                why = _diagnose(g, seed, r, w)
                return wrong(
                    f"data seed {seed}: rank {r}'s gradient differs from one process on every "
                    f"rank's tokens by {diff:.3g}: {why}"
                )
        if any(not all(torch.equal(a, b) for a, b in zip(g, grads[0])) for g in grads.values()):
            return wrong(f"data seed {seed}: the ranks' gradients are close but not bit-identical")
    return right(
        f"every rank holds the gradient of the mean over all ranks' tokens (to {TOL:g}), "
        "for both data seeds"
    )


def solution_token_weighted() -> Any:
    return reveal("""
def token_weighted(model, inputs, targets):
    logits = model(inputs)
    loss_sum = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    num_tokens = (targets != -100).sum().to(loss_sum.dtype)
    dist.all_reduce(num_tokens)               # N: every rank's real tokens, before backward
    (loss_sum / num_tokens).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)               # SUM: each part is already over N
""")
