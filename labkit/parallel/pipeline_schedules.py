"""Pipeline schedules beyond 1F1B: interleaved 1F1B and zero bubble (runs on ranks).

Interleaved 1F1B gives each of the p ranks v model chunks ("virtual stages"): with V = v*p
chunks, chunk c lives on rank c mod p, so a micro-batch goes round the ranks v times. Each
chunk does 1/v of the rank's work, so the warm-up and drain that make the bubble are v times
shorter: the idle time is (p-1)/(v*m) of the ideal time, (p-1)/(v*m+p-1) of the step
(`pipeline_parallel.bubble_fraction(p, m, v)`), paid for with v times as many messages.

Zero bubble splits each backward in two: B, the gradient with respect to the chunk's input
(which the previous stage waits for), and W, the gradient with respect to its weights (which
nobody waits for). A schedule can run B early and slot the W's into the time a rank would
otherwise idle. With per-rank times tf, tb, tw for the F, B and W of a micro-batch (each chunk
doing 1/v of them), torch's `ScheduleInterleavedZeroBubble` idles (p-1)(tf+tb-tw)/v per step
where interleaved 1F1B idles (p-1)(tf+tb+tw)/v and plain 1F1B (v = 1) (p-1)(tf+tb+tw)
(`zero_bubble_fraction`; checked against `simulate` of torch's own order for p = 2-4, m a
multiple of p, tw <= tf, and against the idle ticks torch itself plans, `torch_tick_table`):
the W's fill 2(p-1)tw/v of the bubble, and with tw = 0 nothing is gained. So "zero bubble"
still has a bubble; torch's `ScheduleZBVZeroBubble` plans the same idle ticks on these sizes.
Qi et al. (2023) get near zero with ZB-H2, at more memory (more micro-batches' activations
in flight). torch 2.13 also has `ScheduleDualPipeV` and `ScheduleLoopedBFS`.

- `SleepChunk`: one chunk of a model (Linear + Tanh) whose forward, input gradient and weight
  gradient each also take a fixed time (a sleep: compute that needs no core, so ranks really
  overlap on a busy machine), and that records every F, B and W it runs as a `ChunkEvent`.
- `TorchPipeline`: this rank's chunks under one of torch's schedules; `step` runs one
  training step and returns the loss (last rank) and this rank's events.
- `torch_orders`, `torch_tick_table`, `tick_bubble`: the order of work torch's schedule gives
  each rank, and the idle ticks torch itself plans (no ranks needed).
- The step's arithmetic lives in `labkit.parallel.pipeline_bubbles` and can be imported from
  here too: `zero_bubble_fraction`, `simulate` / `simulated_bubble` (orders on paper),
  `measured_bubble` and `replayed_bubble` (a step's events, with and without the time lost
  between ops).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from labkit.parallel.pipeline_bubbles import (  # the step's arithmetic, importable from here too
    measured_bubble,
    replayed_bubble,
    simulate,
    simulated_bubble,
    zero_bubble_fraction,
)
from labkit.wire.records import SpanRecord

__all__ = [
    "TORCH_SCHEDULES",
    "ChunkEvent",
    "SleepChunk",
    "TorchPipeline",
    "build_chunks",
    "measured_bubble",
    "replayed_bubble",
    "simulate",
    "simulated_bubble",
    "tick_bubble",
    "torch_orders",
    "torch_tick_table",
    "zero_bubble_fraction",
]

# our name -> (torch class name, chunks per rank it needs: None = any v >= 1, else exactly)
TORCH_SCHEDULES = {
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", None),
    "zero_bubble": ("ScheduleInterleavedZeroBubble", None),
}
_WALL_OFFSET = time.time() - time.perf_counter()


def _clock() -> float:
    return time.perf_counter() + _WALL_OFFSET


@dataclass
class ChunkEvent:
    """One F (forward), B (input gradient) or W (weight gradient) of one micro-batch."""

    rank: int
    chunk: int  # the global chunk (virtual stage) index, 0 .. v*p-1
    kind: str
    microbatch: int
    start: float  # wall-clock seconds, comparable across ranks on one host
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_span(self) -> SpanRecord:
        """As a span named like "F3 c1" (kind, micro-batch, chunk), for the timeline view."""
        name = f"{self.kind}{self.microbatch} c{self.chunk}"
        return SpanRecord(rank=self.rank, name=name, start=self.start, end=self.end)


class _Timed(torch.autograd.Function):
    """The identity; its forward and its backward each sleep and record an event."""

    @staticmethod
    def forward(ctx, x, chunk, forward_kind, backward_kind):
        ctx.chunk, ctx.backward_kind = chunk, backward_kind
        if forward_kind is not None and not x.is_meta:  # meta: torch inferring shapes
            chunk._record(forward_kind)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if not grad.is_meta:
            ctx.chunk._record(ctx.backward_kind)
        return grad, None, None, None


class SleepChunk(nn.Module):
    """Linear + Tanh whose F, B and W take `seconds` = (forward, input grad, weight grad) more.

    The input-gradient sleep sits on the chunk's output (every backward passes it, the first
    chunk's too); the weight-gradient sleep sits on the weight alone, so a backward that asks
    only for the input's gradient skips it, and a full backward runs both, B then W. Events go
    to `self.events`; the n-th F (or B, or W) this chunk runs is micro-batch n, which holds in
    every schedule here (each chunk takes its micro-batches in order).
    """

    def __init__(self, width: int, chunk: int, seconds: Sequence[float] = (0.0, 0.0, 0.0)):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.chunk, self.seconds = chunk, tuple(seconds)
        self.events: list[ChunkEvent] = []

    def reset(self) -> None:
        self.events = []

    def _record(self, kind: str) -> None:
        seconds = self.seconds["FBW".index(kind)]
        start = _clock()
        if seconds > 0:
            time.sleep(seconds)
        n = sum(e.kind == kind for e in self.events)
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.events.append(ChunkEvent(rank, self.chunk, kind, n, start, _clock()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = _Timed.apply(self.linear.weight, self, None, "W")
        out = torch.tanh(nn.functional.linear(x, weight, self.linear.bias))
        return _Timed.apply(out, self, "F", "B")


def build_chunks(
    width: int, num_chunks: int, seconds: Sequence[float] = (0.0, 0.0, 0.0), seed: int = 0
) -> nn.Sequential:
    """The whole model, `num_chunks` seeded SleepChunks in a row (every rank builds the same)."""
    torch.manual_seed(seed)
    return nn.Sequential(*(SleepChunk(width, c, seconds) for c in range(num_chunks)))


class TorchPipeline:
    """This rank's chunks under one of torch's schedules, built once and stepped many times.

    Runs on every rank of the group, which must all build it with the same arguments.
    `chunks` are this rank's SleepChunks, global chunks rank, rank+p, ... of `num_chunks` = v*p.
    The first `step` also runs torch's set-up (a forward and backward to learn the shapes
    that travel between stages), so time the steps after it.
    """

    def __init__(
        self,
        chunks: Sequence[SleepChunk],
        num_chunks: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        num_microbatches: int,
        schedule: str,
        group: dist.ProcessGroup | None = None,
    ):
        import torch.distributed.pipelining as pp

        if schedule not in TORCH_SCHEDULES:
            raise ValueError(f"schedule must be one of {tuple(TORCH_SCHEDULES)}, got {schedule!r}")
        rank, p = dist.get_rank(group), dist.get_world_size(group)
        name, v_needed = TORCH_SCHEDULES[schedule]
        v = len(chunks)
        want = list(range(rank, num_chunks, p))
        if num_chunks % p or [c.chunk for c in chunks] != want:
            raise ValueError(
                f"rank {rank} must hold chunks {want} (rank, rank + p, ... below num_chunks = "
                f"{num_chunks}, a multiple of p = {p}), got chunks {[c.chunk for c in chunks]}"
            )
        if v_needed is not None and v != v_needed:
            raise ValueError(f"{schedule} runs {v_needed} chunk per rank, got {v}")
        self.chunks, self.schedule = list(chunks), schedule
        self.first, self.last = rank == 0, rank == p - 1
        device = next(chunks[0].parameters()).device
        stages = [pp.PipelineStage(c, c.chunk, num_chunks, device, group=group) for c in chunks]
        cls = getattr(pp, name)
        self.runner = cls(
            stages if v_needed is None else stages[0], num_microbatches, loss_fn=loss_fn
        )

    def step(
        self, x: torch.Tensor | None, y: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, list[ChunkEvent]]:
        """One training step; the first rank needs `x`, the last `y` (others may pass None).

        Gradients accumulate, each micro-batch's scaled by 1/m (a mean loss gives the unsplit
        model's gradients). Returns (the mean micro-batch loss on the last rank, else None;
        this rank's events in start order).
        """
        for c in self.chunks:
            c.reset()
        losses: list[torch.Tensor] = []
        kwargs = {"target": y, "losses": losses} if self.last else {}
        self.runner.step(*([x] if self.first else []), **kwargs)
        events = sorted((e for c in self.chunks for e in c.events), key=lambda e: e.start)
        return (torch.stack(losses).mean().detach() if losses else None), events


# ---------------------------------------------------------------- pure: orders and simulation

Order = list[tuple[str, int, int]]  # per rank: (kind "F" | "B" | "W" | "BW", chunk, microbatch)


def torch_orders(schedule: str, num_ranks: int, num_microbatches: int, v: int = 1) -> dict:
    """{rank: [(kind, chunk, microbatch), ...]}: the compute order torch's schedule gives each
    rank. kind is "F", "B" (input gradient), "W" (weight gradient) or "BW" (a full backward).
    Built from the schedule class's own `pipeline_order` (interleaved and zero bubble) or from
    the single-stage schedules' rule (GPipe: all F then all BW; 1F1B: p-r-1 warm-up F's, then
    alternate, then drain). Needs no ranks."""
    from labkit.parallel.pipeline_parallel import stage_order

    if schedule not in TORCH_SCHEDULES:
        raise ValueError(f"schedule must be one of {tuple(TORCH_SCHEDULES)}, got {schedule!r}")
    _, v_needed = TORCH_SCHEDULES[schedule]
    if v_needed is not None and v != v_needed:
        raise ValueError(f"{schedule} runs {v_needed} chunk per rank, got v={v}")
    if v_needed is not None:
        return {
            r: [
                ("F" if k == "F" else "BW", r, j)
                for k, j in stage_order(num_ranks, num_microbatches, r, schedule)
            ]
            for r in range(num_ranks)
        }
    return _pipeline_order(schedule, num_ranks, num_microbatches, v)


def _planner(class_name: str, p: int, m: int, v: int):
    """One of torch's schedule objects with only its planning state (no stages, no groups)."""
    import torch.distributed.pipelining as pp

    cls = getattr(pp, class_name)
    runner = cls.__new__(cls)
    runner.pp_group_size, runner.n_local_stages, runner._n_microbatches = p, v, m
    runner.number_of_rounds = max(1, m // p)
    runner.microbatches_per_round = m // runner.number_of_rounds
    runner._num_stages = runner.num_stages = p * v
    if m % runner.number_of_rounds:
        raise ValueError(f"{class_name} needs m to be a multiple of {runner.number_of_rounds}")
    return runner


_KINDS = {"F": "F", "I": "B", "W": "W", "B": "BW"}


def _pipeline_order(schedule: str, p: int, m: int, v: int) -> dict:
    runner = _planner(TORCH_SCHEDULES[schedule][0], p, m, v)
    orders = {}
    for r in range(p):
        runner.rank = r
        ops = runner._calculate_single_rank_operations(r)
        orders[r] = [
            (_KINDS[a.computation_type.value], a.stage_index, a.microbatch_index)
            for a in ops
            if a is not None and a.computation_type.value in _KINDS
        ]
    return orders


ZERO_BUBBLE_TABLES = {
    "zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}


def torch_tick_table(schedule: str, p: int, m: int) -> dict[int, list]:
    """torch's own plan of a zero-bubble schedule with 2 chunks per rank, one tick per F, B or
    W of one chunk: {rank: [(kind, chunk, microbatch) or None (an idle tick), ...]}.

    "zero_bubble": `ScheduleInterleavedZeroBubble` after its `_add_bubbles_to_actions`; "zbv":
    `ScheduleZBVZeroBubble` (rank r holds chunks r and 2p-1-r; torch plans max(m, 2p-1)
    micro-batches, so m >= 2p-1 here). An independent route to the idle time: torch inserted
    these Nones, not `simulate`. Needs no ranks."""
    if schedule not in ZERO_BUBBLE_TABLES:
        raise ValueError(f"schedule must be one of {tuple(ZERO_BUBBLE_TABLES)}, got {schedule!r}")
    if schedule == "zbv" and m < 2 * p - 1:
        raise ValueError(f"zbv plans at least 2p-1 = {2 * p - 1} micro-batches, got m={m}")
    runner = _planner(ZERO_BUBBLE_TABLES[schedule], p, m, 2)
    runner.pipeline_order = {}
    for r in range(p):
        runner.rank = r
        runner.pipeline_order[r] = runner._calculate_single_rank_operations(r)
    table = runner.pipeline_order
    if schedule == "zero_bubble":
        table = runner._add_bubbles_to_actions(2 * p)
    return {
        r: [
            None
            if a is None
            else (_KINDS[a.computation_type.value], a.stage_index, a.microbatch_index)
            for a in actions
        ]  # fmt: skip
        for r, actions in table.items()
    }


def tick_bubble(table: dict[int, list]) -> float:
    """1 - busy / (ranks * span) of a tick table: every tick one unit, None idle, and a rank
    whose list ends early idles until the longest ends."""
    span = max(len(ticks) for ticks in table.values())
    busy = sum(a is not None for ticks in table.values() for a in ticks)
    return 1.0 - busy / (len(table) * span)
