"""The checkers of the context-parallel notebook 36 (in this process): right answers pass, the
classic wrong ones are named: merges that leave log space (overflow at large scores), rescale
by the wrong block, drop the guard for empty blocks, or round lse or the running output to
bfloat16; causal masks that forget the chunk's offset, hide the diagonal, point the wrong way or
mark the visible keys; zig-zag layouts that overlap, do not balance, or hold the late chunk
first."""

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
        out.append((math.exp(a - m) * o_a[i].float() + math.exp(b - m) * o_b[i].float()) / s)
        lses.append(m + math.log(s))
    return torch.stack(out), torch.tensor(lses)


def merge_unguarded(o_a, lse_a, o_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_a - lse)[:, None] * o_a + torch.exp(lse_b - lse)[:, None] * o_b, lse


def merge_out_of_log_space(o_a, lse_a, o_b, lse_b):  # right while exp(lse) fits in float32
    e_a, e_b = torch.exp(lse_a), torch.exp(lse_b)
    total = e_a + e_b
    o = (e_a[:, None] * o_a + e_b[:, None] * o_b) / total.clamp_min(1e-38)[:, None]
    return o, torch.log(total)


def merge_first_block_max(o_a, lse_a, o_b, lse_b):  # rescales by block a's lse, not the max
    m = torch.where(torch.isinf(lse_a), lse_b, lse_a)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e_a, e_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = e_a + e_b
    lse = torch.where(total > 0, m + torch.log(total), torch.full_like(m, -math.inf))
    denom = torch.where(total > 0, total, torch.ones_like(total))[:, None]
    return (e_a[:, None] * o_a + e_b[:, None] * o_b) / denom, lse


def merge_in_output_dtype(o_a, lse_a, o_b, lse_b):  # lse cast to o's dtype (bfloat16)
    o, lse = merge_reference(o_a, lse_a.to(o_a.dtype), o_b, lse_b.to(o_b.dtype))
    return o, lse.float()


def merge_accumulates_in_bfloat16(o_a, lse_a, o_b, lse_b):  # right lse, o rounded each merge
    o, lse = merge_reference(o_a, lse_a, o_b, lse_b)
    return o.to(o_a.dtype), lse


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
        (merge_unguarded, False, "nothing yet, then block b: it gives nan: a row with no"),
        (merge_out_of_log_space, False, "scores near +200, blocks a then b: it gives nan or inf"),
        (merge_first_block_max, False, "block b 150 above block a, blocks a then b: it gives nan"),
        (merge_in_output_dtype, False, "o in bfloat16, lse in float32, scores near 300"),
        (merge_accumulates_in_bfloat16, False, "the merged o is torch.bfloat16; keep the"),
        (merge_average, False, "blocks a then b: it averages the blocks"),
        (merge_lse_max, False, "o is right but lse is not"),
        (merge_unnormalised, False, "lse is right but o is not"),
        (merge_keeps_first, False, "blocks a then b: neither o nor lse"),
        (lambda o_a, lse_a: o_a, False, "raised TypeError"),
        (lambda o_a, lse_a, o_b, lse_b: (o_a[:1], lse_a), False, "returned shapes (1, 3), (4,)"),
    ],
)
def test_merge(fn, ok: bool, says: str) -> None:
    verdict = cp.check_merge(fn)
    assert bool(verdict) is ok, verdict
    assert says in verdict.message, verdict


def test_merge_wrong_answers_pass_small_scores() -> None:
    # the wrong answers the large scores catch are right on the small ones: what a checker
    # with small scores only would have accepted
    cases = [c for c in cp._merge_cases() if c[0].startswith("causal")]
    for fn in (merge_out_of_log_space, merge_first_block_max):
        for _, o_a, lse_a, o_b, lse_b, want_o, want_lse, _ in cases:
            o, lse = fn(o_a, lse_a, o_b, lse_b)
            finite = ~torch.isinf(want_lse)
            assert torch.allclose(o.double(), want_o, atol=1e-5)
            assert torch.allclose(lse[finite].double(), want_lse[finite], atol=1e-5)


def test_merge_solution() -> None:
    ns = {"torch": torch}
    exec(cp.solution_merge().code, ns)
    assert cp.check_merge(ns["merge"])


def mask_right(q_pos, k_pos):
    return k_pos[None, :] > q_pos[:, None]


def mask_local_triangle(q_pos, k_pos):  # the chunk's offset forgotten
    return torch.ones(len(q_pos), len(k_pos), dtype=torch.bool).triu(1)


def mask_hides_self(q_pos, k_pos):
    return k_pos[None, :] >= q_pos[:, None]


def mask_reversed(q_pos, k_pos):
    return k_pos[None, :] < q_pos[:, None]


def mask_visible(q_pos, k_pos):  # SDPA's boolean attn_mask: True where the key takes part
    return k_pos[None, :] <= q_pos[:, None]


def mask_first_offset(q_pos, k_pos):  # one offset per block: right for contiguous slices only
    offset = int(k_pos[0] - q_pos[0])
    return torch.ones(len(q_pos), len(k_pos), dtype=torch.bool).triu(1 + offset)


@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (mask_right, True, "every block of both layouts"),
        (mask_local_triangle, False, "rank 0, step 1 (the block of rank 3), queries [0, 1, 2, 3]"),
        (mask_local_triangle, False, "it is the local triangle"),
        (mask_hides_self, False, "a query sees itself"),
        (mask_reversed, False, "it is reversed"),
        (mask_visible, False, "the convention of SDPA's boolean attn_mask"),
        (mask_first_offset, False, "contiguous, rank 0, step 1 (the block of rank 3)"),
        (mask_first_offset, False, "hidden pairs differ from k_pos > q_pos"),
        (lambda q_pos, k_pos: q_pos, False, "shape (4,), expected (4, 4)"),
    ],
)
def test_causal_mask(fn, ok: bool, says: str) -> None:
    verdict = cp.check_causal_mask(fn)
    assert bool(verdict) is ok, verdict
    assert says in verdict.message, verdict


def test_causal_mask_solution() -> None:
    ns = {"torch": torch}
    exec(cp.solution_causal_mask().code, ns)
    assert cp.check_causal_mask(ns["causal_mask"])


def _chunks(seq_len, n, chunks):
    h = seq_len // (2 * n)
    return torch.cat([torch.arange(c * h, (c + 1) * h) for c in chunks])


def zigzag_right(seq_len, n, rank):
    return _chunks(seq_len, n, [rank, 2 * n - 1 - rank])


def zigzag_late_first(seq_len, n, rank):  # balanced and complete, but the late chunk first
    return _chunks(seq_len, n, [2 * n - 1 - rank, rank])


def zigzag_shifted(seq_len, n, rank):  # chunks r and n + r: complete, not balanced
    return _chunks(seq_len, n, [rank, n + rank])


def zigzag_off_by_one(seq_len, n, rank):  # chunks r and 2n - r: overlaps and gaps
    return _chunks(seq_len, n, [rank, 2 * n - rank])


def contiguous(seq_len, n, rank):
    c = seq_len // n
    return torch.arange(rank * c, (rank + 1) * c)


@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (zigzag_right, True, "the ring is exact"),
        (zigzag_late_first, False, "balanced, but the ring's plan"),
        (zigzag_shifted, False, "visible (query, key) pairs per rank [52, 84]"),
        (zigzag_off_by_one, False, "every position must be held once; held twice"),
        (contiguous, False, "visible (query, key) pairs per rank [36, 100]"),
    ],
)
def test_zigzag(fn, ok: bool, says: str) -> None:
    verdict = cp.check_zigzag(fn)
    assert bool(verdict) is ok, verdict
    assert says in verdict.message, verdict


def test_zigzag_solution() -> None:
    ns = {"torch": torch}
    exec(cp.solution_zigzag().code, ns)
    assert cp.check_zigzag(ns["zigzag"])
