"""Exercises of the context-parallel notebook 36 (kernel side, in this process).

`check_merge` tests a learner's merge of two blocks' partial attention (o, lse) against one
softmax over both blocks (computed in float64): blocks from random causal attention, with rows
that see no key in one block or in either; scores in the hundreds, where exp overflows float32
(above about 88.7) or underflows to 0 (below about -103) unless the merge stays in log space,
and blocks whose lse differ by more than 88.7, where rescaling by the wrong block's value
overflows; and outputs in bfloat16 beside a float32 lse, as FlashAttention returns them: the
merged lse must stay float32 (bfloat16 is off by up to 1 near 300) and so must the merged o,
the running accumulator of the ring.

`check_causal_mask` tests the mask of one block of a ring step from global positions: every
(rank, step) block of the contiguous and the zig-zag layouts, where a local triangle (the chunk
offset forgotten), a mask that hides the diagonal, one reversed, or one True where visible
(SDPA's attn_mask convention) differ from the right one.

`check_zigzag` tests a layout function `fn(seq_len, world_size, rank)` -> positions: every
position held once, the same visible work on every rank, and the order the ring's plan expects
(the early chunk first), by running the plan's ring in one process on the learner's positions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from labkit.exercises import Verdict, reveal, right, wrong

__all__ = [
    "check_causal_mask",
    "check_merge",
    "check_zigzag",
    "solution_causal_mask",
    "solution_merge",
    "solution_zigzag",
]

OVERFLOW = (
    "exp of an lse overflows float32 above about 88.7 (and underflows to 0 below about -103): "
    "stay in log space, subtract the larger of the two lse before exp"
)


def _softmax_blocks(s: Any, v: Any, split: int, o_dtype: Any) -> list[tuple[Any, ...]]:
    """(o_a, lse_a, o_b, lse_b, want_o, want_lse) from scores s [rows, keys] cut at `split`:
    each block's partial softmax in float32 (o in `o_dtype`), the whole one in float64."""
    import torch

    def part(s_x: Any, v_x: Any, dtype: Any) -> tuple[Any, Any]:
        lse = torch.logsumexp(s_x, -1)
        p = torch.exp(s_x - lse[:, None]).nan_to_num(0.0)
        return (p @ v_x).to(dtype), lse

    s64, v64 = s.double(), v.double()
    o_a, lse_a = part(s64[:, :split], v64[:split], o_dtype)
    o_b, lse_b = part(s64[:, split:], v64[split:], o_dtype)
    want_o, want_lse = part(s64, v64, torch.float64)
    return [(o_a, lse_a.float(), o_b, lse_b.float(), want_o, want_lse)]


def _merge_cases() -> list[tuple[str, Any, Any, Any, Any, Any, Any, float]]:
    """(what, o_a, lse_a, o_b, lse_b, want_o, want_lse, atol) cases."""
    import torch

    g = torch.Generator().manual_seed(0)
    cases = []
    for rows, keys, d, split in ((4, 6, 3, 3), (6, 10, 4, 2), (8, 16, 4, 8)):
        q, k, v = (torch.randn(n, d, generator=g) for n in (rows, keys, keys))
        q_pos = torch.randint(0, keys, (rows,), generator=g).sort().values
        q_pos[0] = 0  # row 0 sees key 0 only: nothing in block b
        s = (q @ k.T / math.sqrt(d)).masked_fill(
            torch.arange(keys)[None] > q_pos[:, None], -math.inf
        )
        for x in _softmax_blocks(s, v, split, torch.float32):
            cases.append((f"causal blocks ({rows} rows, keys cut at {split})", *x, 1e-5))
    rows, keys, split = 6, 8, 4
    v = torch.randn(keys, 3, generator=g)
    noise = torch.randn(rows, keys, generator=g)
    for what, shift_a, shift_b, dtype, atol in (
        ("scores near +200", 200.0, 200.0, torch.float32, 1e-4),
        ("scores near -200", -200.0, -200.0, torch.float32, 1e-4),
        ("block b 150 above block a", 0.0, 150.0, torch.float32, 1e-4),
        ("block a 150 above block b", 150.0, 0.0, torch.float32, 1e-4),
        ("o in bfloat16, lse in float32, scores near 300", 300.0, 302.0, torch.bfloat16, 2e-2),
    ):
        s = noise.clone()
        s[:, :split] += shift_a
        s[:, split:] += shift_b
        for x in _softmax_blocks(s, v, split, dtype):
            cases.append((what, *x, atol))
    return cases


def _describe_merge(o: Any, lse: Any, o_a: Any, lse_a: Any, o_b: Any, lse_b: Any, want: Any) -> str:
    import torch

    want_o, want_lse = want
    bad = torch.isnan(o).any(-1) | torch.isinf(o).any(-1) | torch.isnan(lse)
    if bad.any():
        masked = torch.isinf(lse_a) | torch.isinf(lse_b)
        if (bad & masked).any() and not (bad & ~masked).any():
            return (
                "it gives nan: a row with no visible key in a block has lse -inf there, and "
                "exp(-inf - -inf) is nan; such a block must weigh 0 (and a row that saw no key "
                "in either block stays o = 0, lse = -inf)"
            )
        return f"it gives nan or inf: {OVERFLOW}"
    finite = ~torch.isinf(want_lse)
    close_o = torch.allclose(o, want_o.float(), atol=1e-3, rtol=1e-3)
    close_lse = torch.allclose(lse[finite], want_lse[finite].float(), atol=1e-3, rtol=1e-5)
    if torch.allclose(o, (o_a.float() + o_b.float()) / 2, atol=1e-5):
        return "it averages the blocks; each must weigh its share of the softmax, exp(lse_x - lse)"
    if close_o and not close_lse:
        return "o is right but lse is not: lse must be log(exp(lse_a) + exp(lse_b))"
    if close_lse and not close_o:
        return "lse is right but o is not: o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b"
    if close_o and close_lse:
        return "close, but not within the tolerance: keep the weights and lse in float32"
    return "neither o nor lse is one softmax over both blocks"


def check_merge(fn: Callable[..., Any]) -> Verdict:
    """`fn(o_a, lse_a, o_b, lse_b)` -> (o, lse): two blocks' partial attention as one."""
    import torch

    for what, o_a, lse_a, o_b, lse_b, want_o, want_lse, atol in _merge_cases():
        empty = (torch.zeros_like(o_b), torch.full_like(lse_b, -math.inf))
        b_only = (o_b.double(), lse_b.double())  # after nothing: block b alone
        for first, second, want, order in (
            ((o_a, lse_a), (o_b, lse_b), (want_o, want_lse), "blocks a then b"),
            ((o_b, lse_b), (o_a, lse_a), (want_o, want_lse), "blocks b then a"),
            (empty, (o_b, lse_b), b_only, "nothing yet, then block b"),
        ):
            try:
                got = fn(first[0].clone(), first[1].clone(), second[0].clone(), second[1].clone())
                o, lse = (torch.as_tensor(t) for t in got)
            except Exception as exc:  # noqa: BLE001 - a learner's error is a verdict
                return wrong(f"{what}, {order}: raised {type(exc).__name__}: {exc}")
            if o_a.dtype == torch.bfloat16 and o.dtype not in (torch.float32, torch.float64):
                return wrong(
                    f"{what}, {order}: the merged o is {o.dtype}; keep the running output in "
                    "float32 (the ring merges n blocks, and rounding each merge to bfloat16 "
                    "adds up; torch's ring and ring-flash-attention accumulate in float32 and "
                    "round once, at the end)"
                )
            o, lse = o.float(), lse.float()
            if o.shape != want[0].shape or lse.shape != want[1].shape:
                return wrong(
                    f"{what}: returned shapes {tuple(o.shape)}, {tuple(lse.shape)}; "
                    f"expected {tuple(want[0].shape)}, {tuple(want[1].shape)}"
                )
            finite = ~torch.isinf(want[1])
            ok = (
                torch.equal(torch.isinf(lse), ~finite)
                and not torch.isnan(o).any()
                and torch.allclose(o, want[0].float(), atol=atol, rtol=1e-3)
                and torch.allclose(lse[finite], want[1][finite].float(), atol=atol, rtol=1e-5)
            )
            if not ok:
                why = _describe_merge(o, lse, *first, *second, want)
                return wrong(f"{what}, {order}: {why}")
    return right(
        "one softmax over both blocks, in either order, masked rows included, in log space "
        "(scores in the hundreds, bfloat16 outputs)"
    )


def solution_merge() -> Any:
    return reveal("""
def merge(o_a, lse_a, o_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)                      # log(exp(lse_a) + exp(lse_b)), stably
    w_a = torch.exp(lse_a - lse).nan_to_num(0.0)[:, None]    # share of block a; 0 if -inf
    w_b = torch.exp(lse_b - lse).nan_to_num(0.0)[:, None]
    return w_a * o_a.float() + w_b * o_b.float(), lse        # weights and sum in float32
""")


def _ring_blocks(seq_len: int, world_size: int) -> list[tuple[str, Any, Any]]:
    """(what, q_pos, k_pos) of every block a ring computes, both layouts."""
    from labkit.parallel.context_parallel import positions

    blocks = []
    for layout in ("contiguous", "zigzag"):
        for rank in range(world_size):
            for step in range(world_size):
                src = (rank - step) % world_size
                blocks.append(
                    (
                        f"{layout}, rank {rank}, step {step} (the block of rank {src})",
                        positions(seq_len, world_size, rank, layout),
                        positions(seq_len, world_size, src, layout),
                    )
                )
    return blocks


def check_causal_mask(fn: Callable[..., Any]) -> Verdict:
    """`fn(q_pos, k_pos)` -> bool [len(q_pos), len(k_pos)], True where the key is hidden."""
    import torch

    blocks, answers = _ring_blocks(16, 4), []
    for what, q_pos, k_pos in blocks:
        try:
            got = torch.as_tensor(fn(q_pos.clone(), k_pos.clone()))
        except Exception as exc:  # noqa: BLE001 - a learner's error is a verdict
            return wrong(f"{what}: raised {type(exc).__name__}: {exc}")
        if got.shape != (len(q_pos), len(k_pos)):
            return wrong(f"{what}: shape {tuple(got.shape)}, expected {(len(q_pos), len(k_pos))}")
        answers.append(got.bool())
    wrong_rules = (  # a classic mistake is named only if it explains every block
        (
            lambda q, k: k[None, :] >= q[:, None],
            "it hides the key at the query's own position; a query sees itself",
        ),
        (
            lambda q, k: k[None, :] < q[:, None],
            "it is reversed: it hides the earlier keys, the causal mask hides the later",
        ),
        (
            lambda q, k: k[None, :] <= q[:, None],
            "it is True where the key is visible, the convention of SDPA's boolean attn_mask; "
            "here True marks a hidden key, as masked_fill(mask, -inf) wants",
        ),
        (
            lambda q, k: torch.ones(len(q), len(k), dtype=torch.bool).triu(1),
            "it is the local "
            "triangle, right only where the block is the rank's own contiguous slice; compare "
            "global positions (k_pos > q_pos), not row numbers",
        ),
    )
    why = "hidden pairs differ from k_pos > q_pos (a key after the query is hidden)"
    for rule, text in wrong_rules:
        if all(torch.equal(got, rule(q, k)) for got, (_, q, k) in zip(answers, blocks)):
            why = text
    for got, (what, q_pos, k_pos) in zip(answers, blocks):
        if not torch.equal(got, k_pos[None, :] > q_pos[:, None]):
            return wrong(f"{what}, queries {q_pos.tolist()}, keys {k_pos.tolist()}: {why}")
    return right("every block of both layouts' rings, from global positions")


def solution_causal_mask() -> Any:
    return reveal("""
def causal_mask(q_pos, k_pos):
    return k_pos[None, :] > q_pos[:, None]   # global positions: a key after the query is hidden
""")


def check_zigzag(fn: Callable[..., Any]) -> Verdict:
    """`fn(seq_len, world_size, rank)` -> the positions rank `rank` holds, in its row order."""
    import torch

    from labkit.parallel.context_parallel import attention

    for seq_len, world_size in ((16, 2), (32, 4), (24, 3)):
        held = []
        for rank in range(world_size):
            try:
                held.append(torch.as_tensor(fn(seq_len, world_size, rank)).long().flatten())
            except Exception as exc:  # noqa: BLE001 - a learner's error is a verdict
                return wrong(f"S={seq_len}, n={world_size}, rank {rank}: raised {exc!r}")
        every = torch.cat(held).sort().values
        if not torch.equal(every, torch.arange(seq_len)):
            counts = torch.bincount(torch.cat(held).clamp(0, seq_len), minlength=seq_len + 1)
            twice = (counts[:seq_len] > 1).nonzero().flatten().tolist()
            missing = (counts[:seq_len] == 0).nonzero().flatten().tolist()
            return wrong(
                f"S={seq_len}, n={world_size}: every position must be held once; held twice "
                f"{twice[:6]}, missing {missing[:6]}"
            )
        work = [int((torch.arange(seq_len)[None] <= p[:, None]).sum()) for p in held]
        if len(set(work)) > 1:
            return wrong(
                f"S={seq_len}, n={world_size}: visible (query, key) pairs per rank {work}; "
                "zig-zag gives every rank the same: an early chunk and its mirror late one"
            )
        torch.manual_seed(0)
        q, k, v = (torch.randn(seq_len, 4, dtype=torch.float64) for _ in range(3))
        full = attention(q, k, v, causal=True)
        for rank, pos in enumerate(held):
            out = _planned_ring(q, k, v, held, rank)
            if not torch.allclose(out, full[pos], atol=1e-9):
                return wrong(
                    f"S={seq_len}, n={world_size}, rank {rank} holds {pos.tolist()}: balanced, "
                    "but the ring's plan computes the first half of a rank's rows as its early "
                    "chunk and the second half as the late one, and its output then differs "
                    "from full attention; hold chunk r, then chunk 2n-1-r"
                )
    return right("each position once, equal work, the early chunk first: the ring is exact")


def _planned_ring(q: Any, k: Any, v: Any, held: list[Any], rank: int) -> Any:
    """Rank `rank`'s rows of zig-zag ring attention in one process, computing `plan`'s pieces
    on the learner's positions."""
    import torch

    from labkit.parallel.context_parallel import block_attention, merge, plan

    n, seq_len, q_pos = len(held), q.shape[0], held[rank]
    o, lse = (
        torch.zeros(len(q_pos), v.shape[1], dtype=q.dtype),
        torch.full_like(q_pos, -math.inf, dtype=q.dtype),
    )
    for step in range(n):
        k_pos = held[(rank - step) % n]
        for qs, ks, masked in plan(seq_len, n, rank, step, "zigzag"):
            mask = (q_pos[qs], k_pos[ks]) if masked else ()
            o_b, lse_b = block_attention(q[q_pos[qs]], k[k_pos[ks]], v[k_pos[ks]], *mask)
            o[qs], lse[qs] = merge(o[qs], lse[qs], o_b, lse_b)
    return o


def solution_zigzag() -> Any:
    return reveal("""
def zigzag(seq_len, world_size, rank):
    h = seq_len // (2 * world_size)                   # 2n chunks of h positions
    early, late = rank, 2 * world_size - 1 - rank     # chunk r and its mirror
    return torch.cat([torch.arange(early * h, (early + 1) * h),
                      torch.arange(late * h, (late + 1) * h)])
""")
