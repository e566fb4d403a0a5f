"""Exercise of notebook 47 (kernel side, in this process): Ulysses' two all_to_all layouts.

`check_ulysses(seq_to_heads, heads_to_seq)` runs the learner's functions on P = 4 simulated
ranks (threads, one each) with an `all_to_all(t)` that behaves as dist.all_to_all_single on
dim 0: t is [P, ...], chunk j goes to rank j, and the answer's chunk j is what rank j sent.
Inputs are coded: element (s, h, e) holds 1000 s + 10 h + e, so a wrong answer can be read
back: the heads a rank received (scattering along the sequence, or a reshape that cuts memory
by positions, gives it heads of other ranks), the order of the positions (a transpose too many
after receiving), the order of the heads on the way back (merging source rank and heads in the
wrong order), and whether the way back called all_to_all at all. A non-contiguous send (a
transposed view) is refused, as all_to_all_single reads memory in order. Then causal attention
through both functions against full attention in one process (float64).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from labkit.exercises import Verdict, reveal, right, wrong

__all__ = ["check_ulysses", "solution_ulysses"]

P, S, H, D = 4, 16, 8, 2


def _run(fn: Callable[..., Any], inputs: list[Any]) -> tuple[list[Any], list[int]]:
    """fn(x, P, all_to_all) on P threads; (answers, all_to_all calls per rank)."""
    import torch

    slots: list[Any] = [None] * P
    barrier = threading.Barrier(P, timeout=10)
    calls, answers, errors = [0] * P, [None] * P, [None] * P

    def make(rank: int) -> Callable[[Any], Any]:
        def all_to_all(t: Any) -> Any:
            calls[rank] += 1
            if t.shape[0] != P:
                raise ValueError(
                    f"all_to_all wants dim 0 of size {P} (chunk j goes to rank j), got a "
                    f"tensor of shape {list(t.shape)}"
                )
            if not t.is_contiguous():  # dist.all_to_all_single reads memory in order
                raise ValueError(
                    "all_to_all got a non-contiguous tensor (a transposed view?): "
                    "all_to_all_single sends memory in order, so gloo would scramble it "
                    "silently and NCCL refuses it; call .contiguous() first"
                )
            slots[rank] = t.clone()
            barrier.wait()
            out = torch.stack([slots[j][rank] for j in range(P)])
            barrier.wait()
            return out

        return all_to_all

    def body(rank: int) -> None:
        try:
            answers[rank] = fn(inputs[rank], P, make(rank))
        except Exception as e:  # the learner's error, shown as the verdict
            errors[rank] = e
            barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(P)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return answers, calls


def _coded() -> Any:
    import torch

    s, h, e = torch.meshgrid(torch.arange(S), torch.arange(H), torch.arange(D), indexing="ij")
    return (1000 * s + 10 * h + e).double()


def _describe(got: Any, want: Any, shape_hint: str) -> str:
    if tuple(got.shape) != tuple(want.shape):
        return f"shape {list(got.shape)}, want {list(want.shape)} ({shape_hint})"
    pos, head = (got // 1000).long(), (got % 1000 // 10).long()
    want_pos, want_head = (want // 1000).long(), (want % 1000 // 10).long()
    if set(head.flatten().tolist()) != set(want_head.flatten().tolist()):
        return (
            f"it holds heads {sorted(set(head.flatten().tolist()))}, want "
            f"{sorted(set(want_head.flatten().tolist()))}"
        )
    if set(pos.flatten().tolist()) != set(want_pos.flatten().tolist()):
        return "it holds the right heads of the wrong positions"
    if not (pos == want_pos).all():
        return f"positions out of order: {pos[:, 0, 0].tolist()}"
    return f"heads out of order: {head[0, :, 0].tolist()}, want {want_head[0, :, 0].tolist()}"


def check_ulysses(seq_to_heads: Callable[..., Any], heads_to_seq: Callable[..., Any]) -> Verdict:
    """seq_to_heads(x [S/P, H, d], P, all_to_all) -> [S, H/P, d]; heads_to_seq(x [S, H/P, d],
    P, all_to_all) -> [S/P, H, d], on 4 simulated ranks."""
    import torch
    import torch.nn.functional as F

    full, c, hp = _coded(), S // P, H // P
    try:
        got, calls = _run(seq_to_heads, [full[r * c : (r + 1) * c] for r in range(P)])
    except Exception as e:
        return wrong(f"seq_to_heads raised {type(e).__name__}: {e}")
    if calls[0] == 0:
        return wrong("seq_to_heads called no all_to_all: the heads must travel to their ranks")
    for r in range(P):
        want = full[:, r * hp : (r + 1) * hp]
        if tuple(got[r].shape) != tuple(want.shape) or not torch.equal(got[r], want):
            what = _describe(got[r], want, "every position, this rank's H/P heads")
            hint = (
                "each rank must receive its own head group for every position: split the heads "
                "(x.reshape(S/P, P, H/P, d)), bring the group to the front (transpose(0, 1)), "
                "then all_to_all; cutting along the sequence, or reshaping straight to "
                "[P, ...] (which cuts the memory by positions), sends other ranks' heads"
            )
            if "positions out of order" in what:
                hint = (
                    "what arrives is [source rank, its positions, H/P, d]: rank j's positions "
                    "come j-th, which is sequence order; reshape it as it is, no transpose"
                )
            return wrong(f"seq_to_heads, rank {r}: {what}. {hint}")
    try:
        back, calls = _run(heads_to_seq, [full[:, r * hp : (r + 1) * hp] for r in range(P)])
    except Exception as e:
        return wrong(f"heads_to_seq raised {type(e).__name__}: {e}")
    if calls[0] == 0:
        return wrong(
            "heads_to_seq called no all_to_all (the second all_to_all forgotten): a reshape "
            "cannot bring back the positions of other ranks; this rank must end with its own "
            "positions for all heads"
        )
    for r in range(P):
        want = full[r * c : (r + 1) * c]
        if tuple(back[r].shape) != tuple(want.shape) or not torch.equal(back[r], want):
            what = _describe(back[r], want, "this rank's positions, all heads")
            return wrong(
                f"heads_to_seq, rank {r}: {what}. Send position chunk j to rank j "
                "(x.reshape(P, S/P, H/P, d)); what arrives is [head group, S/P, H/P, d]: "
                "transpose(0, 1) before merging the group with the heads"
            )
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(S, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    heads = [_run(seq_to_heads, [t[r * c : (r + 1) * c] for r in range(P)])[0] for t in (q, k, v)]
    outs = [
        F.scaled_dot_product_attention(
            *(x[r].transpose(0, 1) for x in heads), is_causal=True
        ).transpose(0, 1)
        for r in range(P)
    ]
    ours = torch.cat(_run(heads_to_seq, outs)[0])
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    ).transpose(0, 1)
    if not torch.allclose(ours, ref, atol=1e-10):
        return wrong("the layouts pass, yet attention through them differs from full attention")
    return right("both all_to_all layouts right; causal attention through them equals full")


def solution_ulysses() -> Any:
    return reveal(
        """def seq_to_heads(x, P, all_to_all):
    s, h, d = x.shape  # [S/P, H, d]
    send = x.reshape(s, P, h // P, d).transpose(0, 1)  # [P, S/P, H/P, d]: head group first
    return all_to_all(send.contiguous()).reshape(P * s, h // P, d)  # rank j's positions j-th


def heads_to_seq(x, P, all_to_all):
    s, h, d = x.shape  # [S, H/P, d]
    got = all_to_all(x.reshape(P, s // P, h, d).contiguous())  # [group, S/P, H/P, d]
    return got.transpose(0, 1).reshape(s // P, P * h, d)"""
    )
