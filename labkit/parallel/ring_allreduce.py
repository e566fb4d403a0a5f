"""All-reduce built from point-to-point sends: the ring, and the naive gather-then-broadcast
(runs on the ranks; every rank of the group must call the same function).

Ring all-reduce over p ranks splits the buffer into p chunks and runs two phases of p-1 steps:

- reduce-scatter, step s = 0..p-2: rank i sends chunk (i - s) mod p to the next rank and adds
  the chunk (i - s - 1) mod p it receives from the previous rank into its own. Afterwards rank i
  holds the full sum of chunk (i + 1) mod p.
- all-gather, step s = 0..p-2: rank i sends chunk (i + 1 - s) mod p and overwrites chunk
  (i - s) mod p with what it receives, so every rank ends with every summed chunk.

That is 2(p-1) steps; each rank sends 2(p-1) chunks of n/p elements, 2(p-1)/p of the buffer,
whatever p is (docs/references.md). The naive version sends every buffer to a root, which sums them
and sends the result back: the root sends and receives (p-1)·n, the others n each.

Each step posts its send with `isend`, receives with `recv`, then waits for the send: if every
rank called a blocking `send` first, each send could wait for a `recv` that its peer has not
posted yet, the deadlock of notebook 11. With `record=True` each rank returns one `RingStep` per
step (step 0 is the starting state) holding a copy of its buffer, chunk by chunk, so the kernel
can show what each rank sent and held after each step (`labkit.views.stepper_view`).

This module never imports IPython, ipywidgets or plotly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "RingStep",
    "naive_all_reduce",
    "ring_all_reduce",
    "ring_bytes_per_rank",
    "ring_schedule",
]


@dataclass
class RingStep:
    """One rank's part of one step (a plain record; `chunks` is its buffer after the step)."""

    step: int  # 0 = before the first step, then 1 .. 2(p-1)
    phase: str  # "start", "reduce-scatter" or "all-gather"
    rank: int  # global rank
    send_chunk: int | None = None
    send_to: int | None = None
    recv_chunk: int | None = None
    recv_from: int | None = None
    bytes_sent: int = 0
    chunks: list[list[float]] = field(default_factory=list)


def ring_schedule(p: int) -> list[tuple[str, list[tuple[int, int]]]]:
    """[(phase, [(send_chunk, recv_chunk) for each group position i])] for the 2(p-1) steps.

    Pure; position i sends to i+1 and receives from i-1 (mod p). Raises ValueError if p < 1.
    """
    if p < 1:
        raise ValueError(f"p must be >= 1 (ranks in the ring), got {p}")
    steps = []
    for s in range(p - 1):
        steps.append(("reduce-scatter", [((i - s) % p, (i - s - 1) % p) for i in range(p)]))
    for s in range(p - 1):
        steps.append(("all-gather", [((i + 1 - s) % p, (i - s) % p) for i in range(p)]))
    return steps


def ring_bytes_per_rank(nbytes: int, p: int) -> float:
    """Bytes each rank sends in a ring all-reduce of an `nbytes` buffer: 2(p-1)/p · nbytes."""
    if p < 1:
        raise ValueError(f"p must be >= 1 (ranks in the ring), got {p}")
    return 2 * (p - 1) / p * nbytes


def _group_ranks(group: Any) -> list[int]:
    return list(dist.get_process_group_ranks(group or dist.group.WORLD))


def _snapshot(chunks: list[torch.Tensor]) -> list[list[float]]:
    return [c.detach().cpu().tolist() for c in chunks]


def ring_all_reduce(
    tensor: torch.Tensor, group: Any = None, *, record: bool = False
) -> list[RingStep]:
    """Sum `tensor` over the ranks of `group` in place, with a ring of isend/recv (rank side).

    Every rank of the group must call it with a tensor of the same shape and dtype. The buffer
    is split into p nearly equal chunks (`tensor_split`, so any length works). Returns the
    per-step records when `record` is true, else an empty list.
    """
    if not tensor.is_contiguous():
        raise ValueError("ring_all_reduce needs a contiguous tensor (call .contiguous() first)")
    ranks = _group_ranks(group)
    me = dist.get_rank()
    if me not in ranks:
        raise ValueError(f"rank {me} is not in the group {ranks}")
    p, i = len(ranks), ranks.index(me)
    nxt, prev = ranks[(i + 1) % p], ranks[(i - 1) % p]
    chunks = list(tensor.view(-1).tensor_split(p))
    steps = [RingStep(0, "start", me, chunks=_snapshot(chunks))] if record else []
    for k, (phase, plan) in enumerate(ring_schedule(p), start=1):
        send_c, recv_c = plan[i]
        out = chunks[send_c]
        incoming = torch.empty_like(chunks[recv_c])
        work = dist.isend(out, dst=nxt, group=group)
        dist.recv(incoming, src=prev, group=group)
        work.wait()  # `out` may be overwritten only after its send completed
        if phase == "reduce-scatter":
            chunks[recv_c].add_(incoming)
        else:
            chunks[recv_c].copy_(incoming)
        if record:
            steps.append(
                RingStep(
                    k,
                    phase,
                    me,
                    send_c,
                    nxt,
                    recv_c,
                    prev,
                    out.numel() * out.element_size(),
                    _snapshot(chunks),
                )
            )
    return steps


def naive_all_reduce(tensor: torch.Tensor, group: Any = None, *, root: int | None = None) -> int:
    """Sum `tensor` over `group` in place: everyone sends to `root`, which sums and sends the
    result back to each (rank side; every rank of the group calls it). Returns the bytes this
    rank sent: (p-1)·n on the root, n elsewhere. `root` is a global rank (default: the group's
    first)."""
    ranks = _group_ranks(group)
    root = ranks[0] if root is None else root
    if root not in ranks:
        raise ValueError(f"root must be one of the group's ranks {ranks}, got {root}")
    me, n = dist.get_rank(), tensor.numel() * tensor.element_size()
    if me != root:
        dist.send(tensor, dst=root, group=group)
        dist.recv(tensor, src=root, group=group)
        return n
    incoming = torch.empty_like(tensor)
    for r in ranks:
        if r != root:
            dist.recv(incoming, src=r, group=group)
            tensor.add_(incoming)
    for r in ranks:
        if r != root:
            dist.send(tensor, dst=r, group=group)
    return (len(ranks) - 1) * n
