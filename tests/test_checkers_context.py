"""The checker of the context-parallel notebook 36 (in this process): right merges of two
blocks' partial attention pass, plausible wrong ones are named."""

from __future__ import annotations

import math

import pytest
import torch

from labkit.exercises import context_parallel_checks as cp


def merge_reference(o_a, lse_a, o_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).nan_to_num(0.0)[:, None]
    w_b = torch.exp(lse_b - lse).nan_to_num(0.0)[:, None]
    return w_a * o_a + w_b * o_b, lse


def merge_max_trick(o_a, lse_a, o_b, lse_b):  # FlashAttention's running max, guarded
    m = torch.maximum(lse_a, lse_b)
    safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e_a, e_b = torch.exp(lse_a - safe), torch.exp(lse_b - safe)
    total = e_a + e_b
    lse = torch.where(total > 0, safe + torch.log(total), torch.full_like(m, -math.inf))
    denom = torch.where(total > 0, total, torch.ones_like(total))[:, None]
    return (e_a[:, None] * o_a + e_b[:, None] * o_b) / denom, lse


def merge_by_rows(o_a, lse_a, o_b, lse_b):  # python loop, numbers as floats
    out, lses = [], []
    for i in range(len(lse_a)):
        a, b = float(lse_a[i]), float(lse_b[i])
        if a == b == -math.inf:
            out.append(torch.zeros_like(o_a[i]))
            lses.append(-math.inf)
            continue
        m = max(a, b)
        s = math.exp(a - m) + math.exp(b - m)
        out.append((math.exp(a - m) * o_a[i] + math.exp(b - m) * o_b[i]) / s)
        lses.append(m + math.log(s))
    return torch.stack(out), torch.tensor(lses)


def merge_unguarded(o_a, lse_a, o_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_a - lse)[:, None] * o_a + torch.exp(lse_b - lse)[:, None] * o_b, lse


def merge_average(o_a, lse_a, o_b, lse_b):
    return (o_a + o_b) / 2, torch.logaddexp(lse_a, lse_b)


def merge_lse_max(o_a, lse_a, o_b, lse_b):
    o, _ = merge_reference(o_a, lse_a, o_b, lse_b)
    return o, torch.maximum(lse_a, lse_b)


def merge_unnormalised(o_a, lse_a, o_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_a)[:, None] * o_a + torch.exp(lse_b)[:, None] * o_b, lse


def merge_keeps_first(o_a, lse_a, o_b, lse_b):
    return o_a, lse_a


@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (merge_reference, True, "one softmax over both blocks"),
        (merge_max_trick, True, "one softmax over both blocks"),
        (merge_by_rows, True, "one softmax over both blocks"),
        (merge_unguarded, False, "case 1, nothing yet, then block b: it gives nan"),
        (merge_average, False, "case 1, blocks a then b: it averages the blocks"),
        (merge_lse_max, False, "o is right but lse is not"),
        (merge_unnormalised, False, "lse is right but o is not"),
        (merge_keeps_first, False, "case 1, blocks a then b: neither o nor lse"),
        (lambda o_a, lse_a: o_a, False, "raised TypeError"),
        (lambda o_a, lse_a, o_b, lse_b: (o_a[:1], lse_a), False, "returned shapes (1, 3), (4,)"),
    ],
)
def test_merge(fn, ok: bool, says: str) -> None:
    verdict = cp.check_merge(fn)
    assert bool(verdict) is ok, verdict
    assert says in verdict.message, verdict


def test_merge_solution() -> None:
    ns = {"torch": torch}
    exec(cp.solution_merge().code, ns)
    assert cp.check_merge(ns["merge"])
