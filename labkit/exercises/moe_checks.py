"""Exercise of notebook 45 (mixture of experts, continued; kernel side): the load-balancing loss
of the whole batch, computed on data-parallel ranks.

`check_global_aux_loss` runs a learner's `global_aux_loss(logits, k)` on every rank, each with
its own router logits, and wants on every rank E * sum_i f_i P_i of all the ranks' tokens
together: f_i = slots routed to expert i by the hard top-k / (T * k), P_i the mean softmax
probability, T the tokens of all ranks. The cases are made so that the classic mistakes give
other numbers: every rank prefers another expert (so each rank's own loss is high while the
batch is balanced), and in the second case the ranks hold different numbers of tokens (so a
mean of per-rank means is not the mean). Named mistakes: per-rank losses averaged, only this
rank's tokens, soft probabilities for f, f from the top-1 choice only, the num_experts factor
forgotten, f per token instead of per slot (Hugging Face's Mixtral scale, k times larger), the
ranks' P (or f) averaged with equal weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from labkit.exercises import Verdict, reveal, right, run_on_ranks, wrong

__all__ = ["aux_cases", "aux_mistakes", "check_global_aux_loss", "solution_global_aux_loss"]

NUM_EXPERTS, K = 4, 2


def aux_cases(n: int) -> list[list[Any]]:
    """Per case, each rank's router logits [T_r, 4] (kernel side, seeded): rank r leans to
    expert r % 4; case 1 with 12 tokens on every rank, case 2 with 6 + 5r tokens on rank r."""
    import torch

    cases = []
    for case, tokens in enumerate(([12] * n, [6 + 5 * r for r in range(n)])):
        g = torch.Generator().manual_seed(45 + case)
        per_rank = []
        for r, t in enumerate(tokens):
            z = torch.randn(t, NUM_EXPERTS, generator=g)
            z[:, r % NUM_EXPERTS] += 1.5 + 0.5 * r  # each rank its own favourite, unevenly
            per_rank.append(z)
        cases.append(per_rank)
    return cases


def _stats(z: Any, k: int, top: int | None = None) -> tuple[Any, Any, Any]:
    """(slot counts [E] from the hard top-k, probability sums [E], tokens) of one set of logits."""
    import torch

    p = z.softmax(dim=-1)
    chosen = p.topk(top or k, dim=-1).indices
    return (
        torch.bincount(chosen.flatten(), minlength=z.shape[-1]).double(),
        p.double().sum(0),
        len(z),
    )


def _loss(counts: Any, prob_sums: Any, tokens: int, k: int) -> float:
    num = len(counts)
    return float(num * ((counts / (tokens * k)) * (prob_sums / tokens)).sum())


def aux_mistakes(per_rank: list[Any], k: int = K) -> dict[str, list[float]]:
    """Per rank, the right answer ("right") and each classic mistake's value (kernel side)."""
    import torch

    n, num = len(per_rank), per_rank[0].shape[-1]
    stats = [_stats(z, k) for z in per_rank]
    counts = sum(s[0] for s in stats)
    sums = sum(s[1] for s in stats)
    tokens = sum(s[2] for s in stats)
    top1 = sum(_stats(z, k, top=1)[0] for z in per_rank)
    good = _loss(counts, sums, tokens, k)
    local = [_loss(*s, k) for s in stats]
    mean_p = sum(s[1] / s[2] for s in stats) / n  # each rank's mean, equally weighted
    mean_f = sum(s[0] / (s[2] * k) for s in stats) / n
    p_all = torch.cat(per_rank).softmax(dim=-1).double()

    def every(value: float) -> list[float]:
        return [value] * n

    return {
        "right": every(good),
        "per-rank averaged": every(sum(local) / n),
        "this rank only": local,
        "soft f": every(float(num * (p_all.mean(0) ** 2).sum())),
        "top-1 f": every(_loss(top1 * k, sums, tokens, k)),
        "no num_experts": every(good / num),
        "f per token": every(good * k),
        "rank means": every(float(num * ((counts / (tokens * k)) * mean_p).sum())),
        "rank means of f": every(float(num * (mean_f * (sums / tokens)).sum())),
    }


_WHY = {
    "per-rank averaged": (
        "each rank computed the loss of its own tokens and the ranks averaged those: f and P "
        "are statistics of the whole batch, and E * sum f_i P_i is a product of two means, so "
        "the mean of per-rank losses is another number when the ranks route differently; "
        "all_reduce the counts, the probability sums and the token count first"
    ),
    "this rank only": (
        "every rank returned the loss of its own tokens: the ranks disagree; f and P come from "
        "all the ranks' tokens (all_reduce the counts, probability sums and token count)"
    ),
    "soft f": (
        "f was the mean probability (soft): f_i is the share of slots the hard top-k sends to "
        "expert i, a count with no gradient; with soft f the loss is E * sum P_i^2"
    ),
    "top-1 f": (
        "f counted only each token's first choice (GShard's top-2 gate counts that way, another "
        "loss): this exercise's f counts every one of the k slots, divided by T * k"
    ),
    "no num_experts": (
        "the factor num_experts is missing: E * sum_i f_i P_i is 1 at perfect balance"
    ),
    "f per token": (
        "f was divided by the number of tokens, not of slots (T * k): that is k times the loss "
        "(Hugging Face's Mixtral scale, k at perfect balance); this exercise's loss is 1 there"
    ),
    "rank means": (
        "P was the mean of the ranks' means: ranks with fewer tokens weighed as much as ranks "
        "with more; sum the probabilities and the tokens over the ranks, then divide"
    ),
    "rank means of f": (
        "f was the mean of the ranks' fractions: ranks with fewer tokens weighed as much as "
        "ranks with more; sum the counts over the ranks, then divide by all the slots"
    ),
}


def _close(got: dict[int, float], values: list[float]) -> bool:
    return all(abs(got[r] - v) <= 1e-4 * max(1.0, abs(v)) for r, v in enumerate(values))


def check_global_aux_loss(lab: Any, fn: Callable[..., Any]) -> Verdict:
    """`fn(logits, k)` runs on every rank with that rank's router logits [T_r, E] and returns
    (a number or a one-element tensor) the whole batch's load-balancing loss
    E * sum_i f_i * P_i, f_i = slots the hard top-k routes to expert i / (T * k), P_i = the
    mean softmax probability of expert i, over the tokens of all ranks: the same on every rank."""
    import torch

    for case, per_rank in enumerate(aux_cases(lab.world_size)):
        what = f"case {case + 1} (tokens per rank {[len(z) for z in per_rank]})"

        def task(rank: int, world_size: int, device: Any, per_rank: list = per_rank) -> Any:
            out = fn(per_rank[rank].to(device), K)
            if isinstance(out, torch.Tensor):
                return out.detach().double().cpu() if out.numel() == 1 else tuple(out.shape)
            return out

        results, bad = run_on_ranks(lab, task, display=False)
        if bad is not None:
            return bad
        got = dict(sorted(results.values_by_rank.items()))
        for r, value in got.items():
            if not isinstance(value, (int, float, torch.Tensor)):
                return wrong(f"{what}: rank {r} returned {value!r}, expected one number")
        got = {r: float(v) for r, v in got.items()}
        answers = aux_mistakes(per_rank)
        want = answers.pop("right")
        if _close(got, want):
            continue
        for name, values in answers.items():
            if _close(got, values):
                return wrong(f"{what}: {_WHY[name]}")
        r = max(got, key=lambda r: abs(got[r] - want[r]))
        return wrong(f"{what}: rank {r} returned {got[r]:.6g}, the batch's loss is {want[r]:.6g}")
    return right(
        "counts, probability sums and tokens summed over the ranks, then E * sum f_i P_i: the "
        "whole batch's loss on every rank"
    )


def solution_global_aux_loss() -> Any:
    return reveal("""
def global_aux_loss(logits, k):
    num_experts = logits.shape[-1]
    probs = logits.softmax(dim=-1)
    chosen = probs.topk(k, dim=-1).indices                 # hard top-k: a count, no gradient
    stats = torch.cat([
        torch.bincount(chosen.flatten(), minlength=num_experts).to(probs.dtype),  # slots
        probs.sum(dim=0),                                                        # sum of p
        probs.new_tensor([len(logits)]),                                         # tokens
    ])
    dist.all_reduce(stats)                                 # the whole batch's sums
    counts, prob_sums, tokens = stats[:num_experts], stats[num_experts:-1], stats[-1]
    f = counts / (tokens * k)
    P = prob_sums / tokens
    return num_experts * (f * P).sum()
""")
