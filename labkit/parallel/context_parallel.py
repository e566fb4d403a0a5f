"""Context parallelism: ring attention over send/recv, and the zig-zag layout that balances a
causal mask (runs on ranks; the reference, the layouts, the plans and the formulas also in one
process).

A sequence of S positions is cut over n ranks; rank r holds the queries, keys and values of
its positions. Attention needs every query against every (visible) key, so the K/V blocks go
round a ring: at step i rank r holds the block of rank (r - i) mod n, computes its queries
against it, and passes it on to rank r + 1 while receiving the next from rank r - 1 (the send
and receive are started before the compute, so they can overlap it). After n - 1 steps every
query has met every key. The ring holds two K/V blocks at a time beside the rank's own K and V:
the one it computes with and the one arriving.

The blocks' partial results merge exactly by their log-sum-exp. For a query row and a block b
with scores s_b: lse_b = log sum_j exp(s_bj) and o_b = softmax(s_b) V_b. Two blocks give
    lse = log(exp(lse_a) + exp(lse_b)),   o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b,
which is softmax over both blocks times their values: the order of the blocks does not matter,
and a row with no visible key in a block (lse_b = -inf) takes weight 0 from it.

What is computed. A layout cuts S into chunks (n of c = S/n, or 2n of h = S/(2n)); `plan` lists
the pieces of one step: for each of this rank's query chunks, the block's key chunks it can see,
computed as one rectangle, without a mask where every pair is visible and with it where the
query chunk meets itself. A key chunk after the query chunk is not computed at all. That is
what FlashAttention does at the granularity of its tiles (it skips tiles above the diagonal and
masks inside the diagonal ones); an eager `q @ k.T` computes whatever it is given, on any
device (so does SDPA's math backend), so here the skipping has to be in the plan.

Causal masks make the work uneven. With the contiguous layout (rank r: positions
[r*c, (r+1)*c)), rank r's queries see r*c earlier keys plus a triangle of its own:
    visible_r = c*c*r + c(c+1)/2 pairs,   computed_r = c*c*(r + 1) pairs
(the diagonal block is computed whole), so the last rank computes n times the first one's (and
about 2n - 1 times with fine tiles). The zig-zag layout gives rank r chunks r and 2n-1-r: an
early chunk and a late one. At step 0 it computes the early chunk against itself and the late
chunk against both (3 h*h); at every later step exactly half of the block is visible, the late
query chunk against the whole block (the block came from a later rank) or both query chunks
against the block's early chunk (from an earlier rank), 2 h*h, so every rank computes
    computed_r = h*h*(2n + 1),   visible_r = h*h*(2n - 1) + h(h + 1),
and the busiest rank computes (2n+1)/(4n) of the contiguous layout's busiest. torch's
`context_parallel` makes the same two cases after step 0 (its head-tail load balancer,
`_templated_ring_attention`); at step 0 it calls a causal kernel on the rank's own 2h
positions and leaves the skipping of the hidden quarter to the kernel.

Bytes: each rank sends n - 1 messages, each its current K and V block: c*(d_k + d_v)*b bytes
(b bytes per element), whatever the layout.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

__all__ = [
    "LAYOUTS",
    "Piece",
    "RingResult",
    "attention",
    "block_attention",
    "computed_per_rank",
    "live_peak",
    "merge",
    "plan",
    "positions",
    "ring_attention",
    "ring_bytes",
    "work_per_rank",
]

LAYOUTS = ("contiguous", "zigzag")
# the profiler's "Device Type" of a memory event: c10::DeviceType's numbers
DEVICE_TYPES = {"cpu": 0, "cuda": 1}
Group = dist.ProcessGroup | None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """The reference: softmax(Q K^T / sqrt(d)) V on [S, d], one process, positions 0..S-1."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[0]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    return torch.softmax(s, dim=-1) @ v


def _chunks(world_size: int, rank: int, layout: str) -> list[int]:
    """The chunk indices rank `rank` holds, in sequence order."""
    return [rank] if layout == "contiguous" else [rank, 2 * world_size - 1 - rank]


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
    return torch.cat(
        [torch.arange(c * size, (c + 1) * size) for c in _chunks(world_size, rank, layout)]
    )


class Piece(NamedTuple):
    queries: slice  # rows of this rank's q
    keys: slice  # rows of the K/V block it holds at this step
    masked: bool  # the rectangle holds a query chunk's own chunk: the causal mask is needed


def plan(
    seq_len: int, world_size: int, rank: int, step: int, layout: str, causal: bool = True
) -> list[Piece]:
    """The rectangles rank `rank` computes at ring step `step` (the block of rank
    (rank - step) mod n): each query chunk against the key chunks it can see, none after it."""
    positions(seq_len, world_size, rank, layout)  # validates the arguments
    size = seq_len // (world_size if layout == "contiguous" else 2 * world_size)
    held = _chunks(world_size, (rank - step) % world_size, layout)
    pieces: list[Piece] = []
    for a, chunk in enumerate(_chunks(world_size, rank, layout)):
        seen = [c for c in held if not causal or c <= chunk]  # a prefix: chunks ascend
        if not seen:
            continue
        keys, masked = slice(0, len(seen) * size), causal and seen[-1] == chunk
        last = pieces[-1] if pieces else None
        if last and last.keys == keys and last.masked == masked and last.queries.stop == a * size:
            pieces[-1] = Piece(slice(last.queries.start, (a + 1) * size), keys, masked)
        else:
            pieces.append(Piece(slice(a * size, (a + 1) * size), keys, masked))
    return pieces


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor | None = None,
    k_pos: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of q against one block: o = softmax(s) V within the block, lse = logsumexp(s)
    per row; with positions, keys after the query are masked (a fully masked row: o 0, -inf).
    As FlashAttention returns them: scores, softmax and lse in float32 at least, whatever q's
    dtype (a bfloat16 lse is off by up to 1 at scores near 300), o in v's dtype."""
    acc = torch.promote_types(q.dtype, torch.float32)  # scores rounded to bfloat16 lose ~1 at 300
    s = q.to(acc) @ k.to(acc).transpose(-1, -2) / math.sqrt(q.shape[-1])
    if q_pos is not None and k_pos is not None:
        s = s.masked_fill(k_pos[None, :].to(s.device) > q_pos[:, None].to(s.device), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[:, None]).nan_to_num(0.0)  # -inf - -inf on a fully masked row
    return p.to(v.dtype) @ v, lse


def merge(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two blocks' partial attention as one: weights exp(lse_x - lse), lse = logaddexp."""
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).nan_to_num(0.0)[:, None]  # both -inf: nothing seen yet
    w_b = torch.exp(lse_b - lse).nan_to_num(0.0)[:, None]
    return w_a * o_a + w_b * o_b, lse


class RingResult(NamedTuple):
    out: torch.Tensor  # [S/n, d_v] this rank's rows of the attention output, in v's dtype
    lse: torch.Tensor  # [S/n] their log-sum-exp over every visible key, float32 at least
    visible: list[int]  # visible (query, key) pairs in the block held at each step
    computed: list[int]  # (query, key) pairs computed at each step (0: nothing to compute)
    compute_s: list[float]  # seconds of compute at each step (see `_Clock`)


class _Clock:
    """The compute's own time, step by step. On the CPU, CPU time, so that waiting for the
    neighbour and the other processes of a busy machine do not count: the calling thread's
    when torch computes on it alone (`torch.set_num_threads(1)`), else the whole process's
    (then other threads of the process count too: gloo's, a lab's). On a GPU, CUDA events,
    since there the host only queues the kernels."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.now = time.thread_time if torch.get_num_threads() == 1 else time.process_time
        self.marks: list = []

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = self.now()

    def stop(self) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.marks.append((self._start, end))
        else:
            self.marks.append(self.now() - self._start)

    def seconds(self) -> list[float]:
        if not self.cuda:
            return self.marks
        torch.cuda.synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in self.marks]


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
    Each step computes `plan(S, n, rank, step, layout, causal)`: only the visible rectangles.
    """
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    seq_len = q.shape[0] * n
    q_pos = positions(seq_len, n, rank, layout)
    size = seq_len // (n if layout == "contiguous" else 2 * n)
    kv = torch.cat([k, v], dim=-1).contiguous()
    # one accumulator per query chunk (a step may compute only some of them), in float32 at
    # least, whatever q's dtype, as torch's ring and ring-flash-attention keep theirs: n merges
    # rounded to bfloat16 one by one would add their errors
    acc = torch.promote_types(q.dtype, torch.float32)
    outs = [q.new_zeros((size, v.shape[-1]), dtype=acc) for _ in range(q.shape[0] // size)]
    lses = [q.new_full((size,), -math.inf, dtype=acc) for _ in outs]
    nxt = dist.get_global_rank(group, (rank + 1) % n) if group is not None else (rank + 1) % n
    prv = dist.get_global_rank(group, (rank - 1) % n) if group is not None else (rank - 1) % n
    visible, computed, clock = [], [], _Clock(q.device)
    for step in range(n):
        # drop the last block's views and sends first: they would keep it alive as a third
        pending, (blk_k, blk_v) = [], kv.split([k.shape[-1], v.shape[-1]], dim=-1)
        if step < n - 1:  # start passing the block on before computing with it
            incoming = torch.empty_like(kv)
            pending = [dist.isend(kv, nxt, group=group), dist.irecv(incoming, prv, group=group)]
        k_pos = positions(seq_len, n, (rank - step) % n, layout)
        pieces = plan(seq_len, n, rank, step, layout, causal)
        clock.start()
        for qs, ks, masked in pieces:
            mask = (q_pos[qs], k_pos[ks]) if masked else ()
            o_b, lse_b = block_attention(q[qs], blk_k[ks], blk_v[ks], *mask)
            first = qs.start // size
            for a, (o_c, lse_c) in enumerate(zip(o_b.split(size), lse_b.split(size)), first):
                outs[a], lses[a] = merge(outs[a], lses[a], o_c, lse_c)
        clock.stop()
        seen = (
            int(torch.count_nonzero(k_pos[None, :] <= q_pos[:, None]))
            if causal
            else len(q_pos) ** 2
        )
        visible.append(seen)
        computed.append(sum((p.queries.stop - p.queries.start) * p.keys.stop for p in pieces))
        for w in pending:
            w.wait()
        if pending:
            kv = incoming
    out = torch.cat(outs).to(v.dtype)  # rounded once, at the end
    return RingResult(out, torch.cat(lses), visible, computed, clock.seconds())


def work_per_rank(seq_len: int, world_size: int, layout: str, causal: bool = True) -> list[int]:
    """Visible (query, key) pairs of each rank's queries, by the closed forms of the docstring."""
    positions(seq_len, world_size, 0, layout)  # validates the arguments
    n = world_size
    if not causal:
        return [seq_len // n * seq_len] * n
    if layout == "contiguous":
        c = seq_len // n
        return [c * c * r + c * (c + 1) // 2 for r in range(n)]
    h = seq_len // (2 * n)
    return [h * h * (2 * n - 1) + h * (h + 1)] * n


def computed_per_rank(seq_len: int, world_size: int, layout: str, causal: bool = True) -> list[int]:
    """(query, key) pairs each rank computes under `plan`, by the closed forms of the docstring."""
    positions(seq_len, world_size, 0, layout)  # validates the arguments
    n = world_size
    if not causal:
        return [seq_len // n * seq_len] * n
    if layout == "contiguous":
        c = seq_len // n
        return [c * c * (r + 1) for r in range(n)]
    h = seq_len // (2 * n)
    return [h * h * (2 * n + 1)] * n


def ring_bytes(seq_len: int, world_size: int, d_k: int, d_v: int, element_size: int) -> int:
    """Bytes one rank sends in a ring attention: n - 1 blocks of K and V."""
    return (world_size - 1) * (seq_len // world_size) * (d_k + d_v) * element_size


def live_peak(run: Callable[[], object], nbytes: int, device: Any = None) -> int:
    """The most allocations of exactly `nbytes` bytes alive at once while `run()` runs, read
    from torch's profiler (`profile_memory`: every allocation and free, with its address and
    device), not from the code that allocates. Runs where it is called; pick `nbytes` that only
    the buffers of interest have. `device` (a torch.device or its name) counts only that
    device's allocations: on ranks sharing a GPU over gloo, a point-to-point message also has a
    host copy of the same size (labkit.rank.host_staging), which is not the GPU's memory."""
    from torch.profiler import ProfilerActivity, profile

    want = None
    if device is not None:
        device = torch.device(device)
        if device.type not in DEVICE_TYPES:
            raise ValueError(f"device must be one of {sorted(DEVICE_TYPES)}, got {device}")
        want = DEVICE_TYPES[device.type], device.index
    activities = [ProfilerActivity.CPU]
    if want is not None and device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, profile_memory=True) as prof:
        run()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.remove(path)

    def mine(e: dict) -> bool:
        if want is None:
            return True
        kind, index = want
        a = e["args"]
        return a.get("Device Type") == kind and (index is None or a.get("Device Id") == index)

    memory = sorted(
        (e for e in events if e.get("name") == "[memory]" and mine(e)),
        key=lambda e: (e["ts"], e["args"].get("Ev Idx", 0)),
    )
    live: set[int] = set()
    peak = 0
    for e in memory:
        if e["args"]["Bytes"] == nbytes:
            live.add(e["args"]["Addr"])
        elif e["args"]["Bytes"] == -nbytes:
            live.discard(e["args"]["Addr"])
        peak = max(peak, len(live))
    return peak
