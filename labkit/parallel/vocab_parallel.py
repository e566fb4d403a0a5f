"""Vocab-parallel embedding and cross-entropy, grouped-query attention under tensor parallelism,
and an all-gather + matmul decomposed so communication overlaps compute (runs on ranks; the
formulas also in one process).

Vocab-parallel embedding. Rank r of P holds rows [r V/P, (r+1) V/P) of the [V, D] table. A
token id outside that range is looked up at row 0 of the slice and its row zeroed; an
all_reduce (sum) then gives every rank the full [N, D] output: exactly one rank contributed
each row. Backward: the output's gradient is the same on every rank, so the reduction's
backward is the identity (Megatron's "reduce from the model-parallel region"); each rank's
weight gradient lands on its own rows only. Bytes: one all_reduce of N * D * b.

Vocab-parallel cross-entropy. The logits [N, V] are split on the vocab dim: rank r holds
[N, V/P]. loss_i = log sum_j exp(z_ij - m_i) + m_i - z_i,t_i with m_i the GLOBAL max: all_reduce
MAX of the local maxima, all_reduce SUM of the local sum-exps, all_reduce SUM of the target
logit (only the rank whose range holds t_i contributes it). Three all_reduces of N numbers
instead of an all-gather of N * V logits. The gradient softmax - onehot is local.

GQA under TP. H query heads, H_kv KV heads, each KV head shared by H / H_kv query heads. TP
splits the query heads: rank r gets H/P consecutive heads, all of which belong to one KV group
when P >= H_kv (rank r's KV head is r * H_kv // P: replicated P / H_kv times), or H_kv / P
whole groups when P <= H_kv.

Overlap. y = all_gather(x) @ W: the gathered x is P chunks; pass them round a ring with
isend/irecv and multiply the chunk in hand while the next one travels.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = [
    "VocabParallelEmbedding",
    "gqa_kv_heads",
    "gqa_tp_attention",
    "overlapped_all_gather_matmul",
    "reduce_sum",
    "vocab_parallel_cross_entropy",
    "vocab_range",
]

Group = dist.ProcessGroup | None


def vocab_range(vocab: int, rank: int, world: int) -> tuple[int, int]:
    """Rank's rows [start, end) of a vocabulary of `vocab` split over `world` ranks."""
    if vocab % world:
        raise ValueError(f"the vocabulary ({vocab}) must divide by the TP size ({world}); pad it")
    per = vocab // world
    return rank * per, (rank + 1) * per


class _ReduceSum(torch.autograd.Function):
    """all_reduce (sum) forward, identity backward: every rank computes the same thing after."""

    @staticmethod
    def forward(ctx, x, group):  # noqa: ANN001, ANN205
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad, None


def reduce_sum(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Sum over the group's ranks (every rank must call it); its backward is the identity."""
    return _ReduceSum.apply(x, group)


class VocabParallelEmbedding(nn.Module):
    """The rows [start, end) of an embedding table; forward: masked lookup, then all_reduce.

    `VocabParallelEmbedding(full_weight, group)` slices the full [V, D] table for this rank."""

    def __init__(self, full_weight: torch.Tensor, group: Group = None, mask: bool = True):
        super().__init__()
        self.group, self.mask = group, mask
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.start, self.end = vocab_range(full_weight.shape[0], rank, world)
        self.weight = nn.Parameter(full_weight[self.start : self.end].clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        if not self.mask:  # the mistake: ids of other ranks clamped into this slice
            local = (ids - self.start).clamp(0, self.end - self.start - 1)
            return reduce_sum(F.embedding(local, self.weight), self.group)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_sum(out, self.group)


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group: Group = None, local_max: bool = False
) -> torch.Tensor:
    """Mean cross-entropy of [N, V/P] local logits (this rank's vocab slice) against global
    target ids [N]; differentiable; every rank gets the same loss. `local_max=True` is the
    mistake of shifting by each rank's own max before summing the sum-exps."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    start, end = vocab_range(logits.shape[-1] * world, rank, world)
    m = logits.detach().amax(dim=-1)  # the shift changes no gradient: keep it out of autograd
    if not local_max:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    sum_exp = reduce_sum(torch.exp(logits - m.unsqueeze(-1)).sum(dim=-1), group)
    inside = (target >= start) & (target < end)
    local = (target - start).masked_fill(~inside, 0)
    picked = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
    target_logit = reduce_sum(picked, group)
    return (torch.log(sum_exp) + m - target_logit).mean()


def gqa_kv_heads(num_heads: int, num_kv_heads: int, world: int, rank: int) -> list[int]:
    """The KV heads rank `rank` must hold for its H/P query heads (consecutive, from r H/P)."""
    if num_heads % world or num_heads % num_kv_heads:
        raise ValueError(
            f"query heads {num_heads} must divide by the TP size {world} and by the KV heads "
            f"{num_kv_heads}"
        )
    if world > num_kv_heads and world % num_kv_heads:
        raise ValueError(f"TP size {world} > KV heads {num_kv_heads} must be a multiple of them")
    if world % num_kv_heads and num_kv_heads % world:
        raise ValueError(f"KV heads {num_kv_heads} must divide by the TP size {world}")
    group = num_heads // num_kv_heads  # query heads per KV head
    per = num_heads // world
    first, last = rank * per, (rank + 1) * per - 1
    return list(range(first // group, last // group + 1))


def gqa_tp_attention(
    x: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    wv: torch.Tensor,
    wo: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    group: Group = None,
    kv_heads: list[int] | None = None,
) -> torch.Tensor:
    """Causal GQA attention, TP over heads: x [S, D] replicated, full weights wq [H d, D],
    wk/wv [H_kv d, D], wo [D, H d]; each rank slices its query heads' rows of wq, its KV heads'
    rows of wk/wv (`kv_heads`, default `gqa_kv_heads`), its columns of wo; all_reduce at the end."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    d = wq.shape[0] // num_heads
    per = num_heads // world
    kv = gqa_kv_heads(num_heads, num_kv_heads, world, rank) if kv_heads is None else kv_heads
    q_rows = slice(rank * per * d, (rank + 1) * per * d)
    kv_rows = torch.cat([torch.arange(h * d, (h + 1) * d) for h in kv]).to(x.device)
    q = (x @ wq[q_rows].T).view(-1, per, d).transpose(0, 1)  # [H/P, S, d]
    k = (x @ wk[kv_rows].T).view(-1, len(kv), d).transpose(0, 1)
    v = (x @ wv[kv_rows].T).view(-1, len(kv), d).transpose(0, 1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    partial = o.transpose(0, 1).reshape(x.shape[0], per * d) @ wo[:, q_rows].T
    return reduce_sum(partial, group)


def overlapped_all_gather_matmul(
    x: torch.Tensor, w: torch.Tensor, group: Group = None
) -> tuple[torch.Tensor, list[int]]:
    """all_gather(x) @ w, x [S/P, D] this rank's rows, chunk by chunk: at each of the P steps
    the chunk in hand is multiplied while the next travels (isend to rank+1, irecv from rank-1).
    Returns ([S, F], the source rank of each chunk multiplied, in order)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    if group is not None:
        nxt, prv = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prv)
    out = x.new_empty(x.shape[0] * world, w.shape[1])
    chunk, order = x.contiguous(), []
    for step in range(world):
        src = (rank - step) % world  # whose rows are in hand
        reqs, incoming = [], None
        if step < world - 1:  # start the next chunk's transfer before this chunk's matmul
            incoming = torch.empty_like(chunk)
            reqs = dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.isend, chunk, nxt, group),
                    dist.P2POp(dist.irecv, incoming, prv, group),
                ]
            )
        rows = slice(src * x.shape[0], (src + 1) * x.shape[0])
        torch.matmul(chunk, w, out=out[rows])  # overlaps the transfer above (on GPUs, NCCL)
        order.append(src)
        for req in reqs:
            req.wait()
        if incoming is not None:
            chunk = incoming
    return out, order
