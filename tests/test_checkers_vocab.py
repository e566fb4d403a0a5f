"""The checker of notebook 48's exercise (in this process, simulated ranks): the right
vocab-parallel cross-entropy passes; a softmax over the local slice only, no max subtracted
(overflow), each rank's own max, the target logit not masked, and offsets off by one are each
named."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from labkit.exercises import vocab_parallel_checks as vx


def right_ce(local_logits, target, start, all_reduce):
    m = all_reduce(local_logits.amax(dim=-1), "max")
    sum_exp = all_reduce(torch.exp(local_logits - m[:, None]).sum(dim=-1), "sum")
    local = target - start
    inside = (local >= 0) & (local < local_logits.shape[-1])
    picked = local_logits.gather(-1, local.clamp(0, local_logits.shape[-1] - 1)[:, None])
    return torch.log(sum_exp) + m - all_reduce(picked.squeeze(-1).masked_fill(~inside, 0.0))


def local_only(local_logits, target, start, all_reduce):  # softmax over the slice only
    c = local_logits.shape[-1]
    return F.cross_entropy(local_logits, (target - start).clamp(0, c - 1), reduction="none")


def no_max(local_logits, target, start, all_reduce):  # exp of raw logits overflows
    sum_exp = all_reduce(torch.exp(local_logits).sum(dim=-1), "sum")
    local = target - start
    inside = (local >= 0) & (local < local_logits.shape[-1])
    picked = local_logits.gather(-1, local.clamp(0, local_logits.shape[-1] - 1)[:, None])
    return torch.log(sum_exp) - all_reduce(picked.squeeze(-1).masked_fill(~inside, 0.0))


def own_max(local_logits, target, start, all_reduce):  # each rank shifts by its own max
    m = local_logits.amax(dim=-1)
    sum_exp = all_reduce(torch.exp(local_logits - m[:, None]).sum(dim=-1), "sum")
    local = target - start
    inside = (local >= 0) & (local < local_logits.shape[-1])
    picked = local_logits.gather(-1, local.clamp(0, local_logits.shape[-1] - 1)[:, None])
    return torch.log(sum_exp) + m - all_reduce(picked.squeeze(-1).masked_fill(~inside, 0.0))


def not_masked(local_logits, target, start, all_reduce):  # every rank adds a clamped column
    m = all_reduce(local_logits.amax(dim=-1), "max")
    sum_exp = all_reduce(torch.exp(local_logits - m[:, None]).sum(dim=-1), "sum")
    local = (target - start).clamp(0, local_logits.shape[-1] - 1)
    picked = local_logits.gather(-1, local[:, None]).squeeze(-1)
    return torch.log(sum_exp) + m - all_reduce(picked)


def not_masked_raises(local_logits, target, start, all_reduce):  # indexes out of the slice
    m = all_reduce(local_logits.amax(dim=-1), "max")
    picked = local_logits.gather(-1, (target - start)[:, None])
    return m + picked.squeeze(-1)


def off_by_one(local_logits, target, start, all_reduce):  # the offset start + 1
    m = all_reduce(local_logits.amax(dim=-1), "max")
    sum_exp = all_reduce(torch.exp(local_logits - m[:, None]).sum(dim=-1), "sum")
    local = target - start + 1
    inside = (local >= 0) & (local < local_logits.shape[-1])
    picked = local_logits.gather(-1, local.clamp(0, local_logits.shape[-1] - 1)[:, None])
    return torch.log(sum_exp) + m - all_reduce(picked.squeeze(-1).masked_fill(~inside, 0.0))


def mean_loss(local_logits, target, start, all_reduce):  # the mean, not per example
    return right_ce(local_logits, target, start, all_reduce).mean()


@pytest.mark.timeout(60)
def test_right_answers_pass():
    assert vx.check_vocab_ce(right_ce)
    ns: dict = {"torch": torch}
    exec(vx.solution_vocab_ce().code, ns)
    assert vx.check_vocab_ce(ns["vocab_ce"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("fn", "says"),
    [
        (local_only, "softmax over this rank's slice only"),
        (no_max, "inf or nan"),
        (own_max, "each rank's own max"),
        (not_masked, "not masked"),
        (not_masked_raises, "mask the ids"),
        (off_by_one, "off by one"),
        (mean_loss, "shape [8]"),
    ],
)
def test_classic_mistakes_named(fn, says):
    verdict = vx.check_vocab_ce(fn)
    assert not verdict
    assert says in verdict.message, verdict.message
