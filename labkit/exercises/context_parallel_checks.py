"""Exercises of the context-parallel notebook 36 (kernel side).

`check_merge` tests a learner's merge of two blocks' partial attention (o, lse) against one
softmax over both blocks, in this process: random blocks, causal masks that leave some rows
with no visible key in one block, and rows that have seen no key in either.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from labkit.exercises import Verdict, reveal, right, wrong

__all__ = ["check_merge", "solution_merge"]


def _cases() -> list[tuple[Any, ...]]:
    """(q, k, v, q_pos, k_pos, split) cases: the keys cut at `split` into blocks a and b."""
    import torch

    g = torch.Generator().manual_seed(0)
    cases = []
    for rows, keys, d, split in ((4, 6, 3, 3), (6, 10, 4, 2), (5, 9, 2, 7), (8, 16, 4, 8)):
        q, k, v = (torch.randn(n, d, generator=g) for n in (rows, keys, keys))
        q_pos = torch.randint(0, keys, (rows,), generator=g).sort().values
        q_pos[0] = 0  # row 0 sees key 0 only: nothing in block b
        cases.append((q, k, v, q_pos, torch.arange(keys), split))
    return cases


def _describe(o: Any, lse: Any, want_o: Any, want_lse: Any, o_a: Any, o_b: Any) -> str:
    import torch

    if torch.isnan(o).any() or torch.isnan(lse).any():
        return (
            "it gives nan: a row with no visible key in a block has lse -inf there, and "
            "exp(-inf - -inf) is nan; such a block must weigh 0 (and a row that saw no key "
            "in either block stays o = 0, lse = -inf)"
        )
    if torch.allclose(o, (o_a + o_b) / 2, atol=1e-5):
        return "it averages the blocks; each must weigh its share of the softmax, exp(lse_x - lse)"
    if torch.allclose(o, want_o, atol=1e-5):
        return "o is right but lse is not: lse must be log(exp(lse_a) + exp(lse_b))"
    if torch.allclose(lse, want_lse, atol=1e-5):
        return "lse is right but o is not: o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b"
    return "neither o nor lse is one softmax over both blocks"


def check_merge(fn: Callable[..., Any]) -> Verdict:
    """`fn(o_a, lse_a, o_b, lse_b)` -> (o, lse): two blocks' partial attention as one."""
    import torch

    from labkit.parallel.context_parallel import block_attention

    for i, (q, k, v, qp, kp, split) in enumerate(_cases()):
        want_o, want_lse = block_attention(q, k, v, qp, kp)
        o_a, lse_a = block_attention(q, k[:split], v[:split], qp, kp[:split])
        o_b, lse_b = block_attention(q, k[split:], v[split:], qp, kp[split:])
        empty = (torch.zeros_like(o_a), torch.full_like(lse_a, -math.inf))
        for first, second, what in (
            ((o_a, lse_a), (o_b, lse_b), "blocks a then b"),
            ((o_b, lse_b), (o_a, lse_a), "blocks b then a"),
            (empty, (o_b, lse_b), "nothing yet, then block b"),
        ):
            want = (
                block_attention(q, k[split:], v[split:], qp, kp[split:])
                if first is empty
                else (want_o, want_lse)
            )
            try:
                got = fn(first[0].clone(), first[1].clone(), second[0].clone(), second[1].clone())
                o, lse = (torch.as_tensor(t, dtype=torch.float32) for t in got)
            except Exception as exc:  # noqa: BLE001 - a learner's error is a verdict
                return wrong(f"raised {type(exc).__name__}: {exc}")
            if o.shape != want[0].shape or lse.shape != want[1].shape:
                return wrong(
                    f"case {i + 1}: returned shapes {tuple(o.shape)}, {tuple(lse.shape)}; "
                    f"expected {tuple(want[0].shape)}, {tuple(want[1].shape)}"
                )
            same_inf = torch.equal(torch.isinf(lse), torch.isinf(want[1]))
            finite = ~torch.isinf(want[1])
            ok = (
                same_inf
                and not torch.isnan(o).any()
                and torch.allclose(o, want[0], atol=1e-5)
                and torch.allclose(lse[finite], want[1][finite], atol=1e-5)
            )
            if not ok:
                why = _describe(o, lse, want[0], want[1], first[0], second[0])
                return wrong(f"case {i + 1}, {what}: {why}")
    return right("one softmax over both blocks, in either order, masked rows included")


def solution_merge() -> Any:
    return reveal("""
def merge(o_a, lse_a, o_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)                      # log(exp(lse_a) + exp(lse_b))
    w_a = torch.exp(lse_a - lse).nan_to_num(0.0)[:, None]    # share of block a; 0 if -inf
    w_b = torch.exp(lse_b - lse).nan_to_num(0.0)[:, None]
    return w_a * o_a + w_b * o_b, lse
""")
