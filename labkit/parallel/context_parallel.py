"""Context parallelism: ring attention over send/recv, and the zig-zag layout that balances a
causal mask (runs on ranks; the reference, the layouts and the formulas also in one process).

A sequence of S positions is cut over n ranks; rank r holds the queries, keys and values of
its positions. Attention needs every query against every (visible) key, so the K/V blocks go
round a ring: at step i rank r holds the block of rank (r - i) mod n, computes its queries
against it, and passes it on to rank r + 1 while receiving the next from rank r - 1 (the send
and receive are started before the compute, so they can overlap it). After n - 1 steps every
query has met every key.

The blocks' partial results merge exactly by their log-sum-exp. For a query row and a block b
with scores s_b: lse_b = log sum_j exp(s_bj) and o_b = softmax(s_b) V_b. Two blocks give
    lse = log(exp(lse_a) + exp(lse_b)),   o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b,
which is softmax over both blocks times their values: the order of the blocks does not matter,
and a row with no visible key in a block (lse_b = -inf) takes weight 0 from it.

Causal masks make the work uneven. With the contiguous layout (rank r: positions
[r*c, (r+1)*c), c = S/n), rank r's queries see r*c earlier keys plus a triangle of its own:
    work_r = c*c*r + c(c+1)/2 visible (query, key) pairs,
so the last rank does about 2n - 1 times the first one's work and the ring waits for it. The
zig-zag layout cuts S into 2n chunks of h = S/(2n) and gives rank r chunks r and 2n-1-r: an
early chunk and a late one, so every rank does the same work,
    work_r = h*h*(2n - 1) + h(h + 1).
Blocks in which no pair is visible are skipped (no compute), which is where the saving lies.

Bytes: each rank sends n - 1 messages, each its current K and V block: c*(d_k + d_v)*b bytes
(b bytes per element), whatever the layout.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

__all__ = [
    "LAYOUTS",
    "RingResult",
    "attention",
    "block_attention",
    "merge",
    "positions",
    "ring_attention",
    "ring_bytes",
    "work_per_rank",
]

LAYOUTS = ("contiguous", "zigzag")
Group = dist.ProcessGroup | None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """The reference: softmax(Q K^T / sqrt(d)) V on [S, d], one process, positions 0..S-1."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[0]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    return torch.softmax(s, dim=-1) @ v


def positions(seq_len: int, world_size: int, rank: int, layout: str) -> torch.Tensor:
    """The global positions rank `rank` holds, in the order it holds them."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    parts = world_size if layout == "contiguous" else 2 * world_size
    if seq_len % parts:
        raise ValueError(
            f"seq_len must be a multiple of {parts} for the {layout} layout on {world_size} "
            f"ranks, got {seq_len}"
        )
    size = seq_len // parts
    chunks = [rank] if layout == "contiguous" else [rank, 2 * world_size - 1 - rank]
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks])


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor | None = None,
    k_pos: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of q against one block: o = softmax(s) V within the block, lse = logsumexp(s)
    per row; with positions, keys after the query are masked (a fully masked row: o 0, -inf)."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if q_pos is not None and k_pos is not None:
        s = s.masked_fill(k_pos[None, :].to(s.device) > q_pos[:, None].to(s.device), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[:, None]).nan_to_num(0.0)  # -inf - -inf on a fully masked row
    return p @ v, lse


def merge(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two blocks' partial attention as one: weights exp(lse_x - lse), lse = logaddexp."""
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).nan_to_num(0.0)[:, None]  # both -inf: nothing seen yet
    w_b = torch.exp(lse_b - lse).nan_to_num(0.0)[:, None]
    return w_a * o_a + w_b * o_b, lse


class RingResult(NamedTuple):
    out: torch.Tensor  # [S/n, d_v] this rank's rows of the attention output
    lse: torch.Tensor  # [S/n] their log-sum-exp over every visible key
    work: list[int]  # visible (query, key) pairs computed at each step (0: block skipped)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: str = "contiguous",
    causal: bool = True,
    group: Group = None,
) -> RingResult:
    """This rank's rows of attention over the whole sequence, K/V passed round the ring.

    q, k, v: [S/n, d] this rank's rows, at the positions `positions(S, n, rank, layout)`.
    Runs on every rank of the group; every rank must call it (n - 1 isend/irecv pairs each).
    """
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    seq_len = q.shape[0] * n
    q_pos = positions(seq_len, n, rank, layout)
    kv = torch.cat([k, v], dim=-1).contiguous()
    out = q.new_zeros((q.shape[0], v.shape[-1]))
    lse = q.new_full((q.shape[0],), -math.inf)
    nxt = dist.get_global_rank(group, (rank + 1) % n) if group is not None else (rank + 1) % n
    prv = dist.get_global_rank(group, (rank - 1) % n) if group is not None else (rank - 1) % n
    work = []
    for step in range(n):
        pending = []
        if step < n - 1:  # start passing the block on before computing with it
            incoming = torch.empty_like(kv)
            pending = [dist.isend(kv, nxt, group=group), dist.irecv(incoming, prv, group=group)]
        k_pos = positions(seq_len, n, (rank - step) % n, layout)
        visible = int((k_pos[None, :] <= q_pos[:, None]).sum()) if causal else q_pos.numel() ** 2
        if visible:
            blk_k, blk_v = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
            o_b, lse_b = block_attention(q, blk_k, blk_v, *((q_pos, k_pos) if causal else ()))
            out, lse = merge(out, lse, o_b, lse_b)
        work.append(visible)
        for w in pending:
            w.wait()
        if pending:
            kv = incoming
    return RingResult(out, lse, work)


def work_per_rank(seq_len: int, world_size: int, layout: str, causal: bool = True) -> list[int]:
    """Visible (query, key) pairs each rank computes, by the closed forms of the docstring."""
    positions(seq_len, world_size, 0, layout)  # validates the arguments
    n = world_size
    if not causal:
        return [seq_len // n * seq_len] * n
    if layout == "contiguous":
        c = seq_len // n
        return [c * c * r + c * (c + 1) // 2 for r in range(n)]
    h = seq_len // (2 * n)
    return [h * h * (2 * n - 1) + h * (h + 1)] * n


def ring_bytes(seq_len: int, world_size: int, d_k: int, d_v: int, element_size: int) -> int:
    """Bytes one rank sends in a ring attention: n - 1 blocks of K and V."""
    return (world_size - 1) * (seq_len // world_size) * (d_k + d_v) * element_size
