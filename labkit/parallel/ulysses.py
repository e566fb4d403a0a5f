"""Ulysses (all-to-all) sequence parallelism, and ring attention's backward (runs on ranks; the
formulas also in one process).

Ulysses. Each of P ranks holds S/P positions of q, k and v for all H heads: [S/P, H, d]. One
all_to_all per tensor trades positions for heads: rank r sends its positions of head group j
(heads [jH/P, (j+1)H/P)) to rank j and receives every rank's positions of its own group, so
it ends with [S, H/P, d], the whole sequence for H/P heads. Attention is per head, so it runs
locally, unchanged (here F.scaled_dot_product_attention). A second all_to_all trades back:
[S, H/P, d] -> [S/P, H, d]. all_to_all_single sends chunk j of dim 0 to rank j and puts what
rank j sent at chunk j, so the send buffer is [P, S/P, H/P, d] (head group first: the heads
are split, then moved in front) and the received one [P, S/P, H/P, d] is source-rank first,
which is sequence order: reshape to [S, H/P, d] as it is. The way back is the mirror.
all_to_all's backward is an all_to_all of the gradient with the same splits (it transposes
the (rank, chunk) grid; so does its backward), hence `_AllToAll`.

Bytes per rank: an all_to_all keeps 1/P of its tensor and sends (P-1)/P of it, so with KV
heads H_kv (grouped-query attention) the forward sends
    (P-1)/P * S/P * d * (H + 2 H_kv + H) * b
(q, k, v out, the output back), which falls as 1/P; ring attention sends its K and V round
(P-1) steps, (P-1) * S/P * 2 H_kv d * b, about constant in P. Ulysses' limit: the heads must
divide by P, and the KV heads too; with fewer KV heads than ranks they must be replicated
first (more bytes), and P can never exceed H.

Ring attention's backward (contiguous layout, one head [S/n, d]). With the forward's output
o and log-sum-exp lse (per query row), for a K/V block b:
    p = exp(q k_b^T / sqrt(d) - lse)          (the forward's softmax, masked entries 0)
    dv_b = p^T do,   dp = do v_b^T,   ds = p * (dp - rowsum(do * o)),
    dq += ds k_b / sqrt(d),   dk_b = ds^T q / sqrt(d).
dq stays on the rank (its queries). dk_b and dv_b belong to the rank that owns block b, and
every rank adds to them: so the accumulators travel round the ring with the block they belong
to, each rank adding its share; after n steps one last hop brings each home. Bytes per rank:
(n-1) K/V blocks and n dK/dV blocks, (2n-1) * S/n * (d_k + d_v) * b.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.parallel.context_parallel import positions, ring_attention

__all__ = [
    "RingAttention",
    "heads_to_seq",
    "replicate_kv",
    "ring_attention_backward",
    "ring_backward_bytes",
    "seq_to_heads",
    "ulysses_attention",
    "ulysses_bytes",
]

Group = dist.ProcessGroup | None


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 (P equal chunks), differentiable: its backward is the same
    exchange of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        x = x.contiguous()  # all_to_all_single reads and writes memory in order: no strides
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous()  # often a transposed view: empty_like would keep its strides
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def seq_to_heads(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """[S/P, H, d] (this rank's positions, all heads) -> [S, H/P, d] (every position, this
    rank's head group). Every rank of the group must call it."""
    p = dist.get_world_size(group)
    s_local, heads, d = x.shape
    if heads % p:
        raise ValueError(f"Ulysses needs the heads ({heads}) to divide by the ranks ({p})")
    send = x.reshape(s_local, p, heads // p, d).transpose(0, 1)  # [P, S/P, H/P, d]: group first
    return _AllToAll.apply(send.contiguous(), group).reshape(p * s_local, heads // p, d)


def heads_to_seq(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """[S, H/P, d] (every position, this rank's heads) -> [S/P, H, d]: the mirror of
    `seq_to_heads`. Every rank of the group must call it."""
    p = dist.get_world_size(group)
    seq, heads_local, d = x.shape
    got = _AllToAll.apply(x.reshape(p, seq // p, heads_local, d).contiguous(), group)
    return got.transpose(0, 1).reshape(seq // p, p * heads_local, d)  # [S/P, P*H/P, d]


def replicate_kv(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """[S/P, H_kv, d] with its KV heads repeated (each in place, as GQA pairs them) until their
    number divides by `world_size`: lcm(H_kv, P) heads."""
    kv_heads = x.shape[1]
    return x.repeat_interleave(math.lcm(kv_heads, world_size) // kv_heads, dim=1)


def ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, group: Group = None
) -> torch.Tensor:
    """This rank's rows [S/P, H, d] of attention over the whole sequence, by Ulysses.

    q: [S/P, H, d]; k, v: [S/P, H_kv, d] (H_kv < H: grouped-query attention, H_kv dividing H),
    at positions [rank*S/P, (rank+1)*S/P). H and H_kv must divide by P (see `replicate_kv`).
    Every rank of the group must call it (four all_to_all_single each)."""
    p = dist.get_world_size(group)
    if q.shape[1] % p or k.shape[1] % p:
        raise ValueError(
            f"Ulysses splits heads over the {p} ranks: query heads {q.shape[1]} and KV heads "
            f"{k.shape[1]} must both divide by {p} (replicate the KV heads, replicate_kv, or "
            "use ring attention, which splits the sequence)"
        )
    qh, kh, vh = (seq_to_heads(t, group).transpose(0, 1) for t in (q, k, v))  # [H/P, S, d]
    out = F.scaled_dot_product_attention(
        qh, kh, vh, is_causal=causal, enable_gqa=kh.shape[0] != qh.shape[0]
    )
    return heads_to_seq(out.transpose(0, 1), group)


def ulysses_bytes(
    seq_len: int, world_size: int, heads: int, kv_heads: int, head_dim: int, element_size: int
) -> int:
    """Bytes one rank sends in one Ulysses forward: (P-1)/P of q, k, v and the output."""
    p = world_size
    return (p - 1) * (seq_len // p // p) * head_dim * (2 * heads + 2 * kv_heads) * element_size


def ring_attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    causal: bool = True,
    group: Group = None,
    last_hop: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of this rank's rows of ring attention (contiguous layout, [S/n, d] each),
    from the forward's `out` and `lse` (`ring_attention`): the K/V blocks go round the ring
    with their dK/dV accumulators, which one last hop brings home. Every rank must call it."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    seq_len, scale = q.shape[0] * n, 1 / math.sqrt(q.shape[-1])
    acc = torch.promote_types(q.dtype, torch.float32)
    q32, do32 = q.to(acc), dout.to(acc)
    delta = (do32 * out.to(acc)).sum(-1)  # rowsum(do * o) = sum_j p_ij dp_ij
    q_pos = positions(seq_len, n, rank, "contiguous")
    dq = torch.zeros_like(q32)
    kv = torch.cat([k, v], dim=-1).contiguous()
    dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)  # block (rank - step)'s gradient
    nxt = dist.get_global_rank(group, (rank + 1) % n) if group is not None else (rank + 1) % n
    prv = dist.get_global_rank(group, (rank - 1) % n) if group is not None else (rank - 1) % n
    for step in range(n):
        blk_k, blk_v = (t.to(acc) for t in kv.split([k.shape[-1], v.shape[-1]], dim=-1))
        s = q32 @ blk_k.T * scale
        if causal:
            k_pos = positions(seq_len, n, (rank - step) % n, "contiguous")
            s = s.masked_fill(k_pos[None, :].to(s.device) > q_pos[:, None].to(s.device), -math.inf)
        p = torch.exp(s - lse.to(acc)[:, None])  # exp(-inf) = 0 where masked
        ds = p * (do32 @ blk_v.T - delta[:, None])
        dq += ds @ blk_k * scale
        dkv += torch.cat([ds.T @ q32 * scale, p.T @ do32], dim=-1)
        # K/V go on while a rank still needs the next block; dK/dV go on every step: after
        # the n-th, the accumulator a rank holds is its next rank's, complete
        ops, incoming = [], torch.empty_like(dkv)
        if step < n - 1:
            next_kv = torch.empty_like(kv)
            ops += [dist.isend(kv, nxt, group=group), dist.irecv(next_kv, prv, group=group)]
        if step == n - 1 and not last_hop:
            break
        ops += [  # tag 1: gloo matches by tag; NCCL ignores tags and keeps the order
            dist.isend(dkv, nxt, group=group, tag=1),
            dist.irecv(incoming, prv, group=group, tag=1),
        ]
        for w in ops:
            w.wait()
        if step < n - 1:
            kv = next_kv
        dkv = incoming
    dk, dv = dkv.split([k.shape[-1], v.shape[-1]], dim=-1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def ring_backward_bytes(
    seq_len: int, world_size: int, d_k: int, d_v: int, element_size: int
) -> int:
    """Bytes one rank sends in ring attention's backward: n-1 K/V blocks, n dK/dV blocks."""
    return (2 * world_size - 1) * (seq_len // world_size) * (d_k + d_v) * element_size


class RingAttention(torch.autograd.Function):
    """Ring attention (contiguous layout) with its ring backward: `RingAttention.apply(q, k, v,
    causal, group)` on [S/n, d] tensors. Every rank must call forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal=True, group=None):  # type: ignore[override]
        res = ring_attention(q, k, v, "contiguous", causal, group)
        ctx.save_for_backward(q, k, v, res.out, res.lse)
        ctx.causal, ctx.group = causal, group
        return res.out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_attention_backward(q, k, v, out, lse, dout, ctx.causal, ctx.group)
        return dq, dk, dv, None, None
