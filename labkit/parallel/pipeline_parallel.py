"""Pipeline parallelism: micro-batches through model stages over point-to-point (runs on ranks).

A batch is cut into m micro-batches; stage s (group rank s of p) runs forward F(s, j) on
micro-batch j as soon as stage s-1 has sent its activation, and backward B(s, j) once stage s+1
has sent dL/da. With mean losses and equal micro-batches, L = (1/m) sum_j L_j, so each
micro-batch's loss is scaled by 1/m and the accumulated gradients equal the unsplit model's.

Schedules (order of F and B on each stage):
- GPipe: all m forwards, then all m backwards; a stage holds the activations of all m.
- 1F1B: stage s runs w = min(p-s-1, m) warm-up forwards, then alternates one forward and one
  backward, then drains the remaining backwards; it holds at most p-s <= p micro-batches.

With unit-time F and B both take 2(m+p-1) time steps for 2m steps of work per stage, so the
idle "bubble" is (p-1)/(m+p-1) of the step (`bubble_fraction`). Interleaving v model chunks per
stage shrinks the bubble to (p-1)/(v*m) relative to the ideal time (`bubble_overhead`), i.e.
(p-1)/(v*m+p-1) of the step. 1F1B does not shrink the bubble; it bounds memory.

`pipeline_step` runs a schedule with isend/recv and records, per stage, every F and B with its
start and end (wall clock, comparable across ranks on one host; on a GPU the stage waits for
its device before reading the clock, so an event is the GPU's work) and the peak number of
micro-batches whose activations it held. `torch_pipeline_step` runs the same stage under
`torch.distributed.pipelining` (ScheduleGPipe / Schedule1F1B), which works on CPU with gloo.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from labkit.parallel.layer_split import LossFn, module_device, recv_tensor, send_tensor
from labkit.wire.records import SpanRecord

__all__ = [
    "SCHEDULES",
    "PipelineResult",
    "StageEvent",
    "bubble_fraction",
    "bubble_overhead",
    "make_schedule",
    "measured_bubble_fraction",
    "pipeline_step",
    "replayed_bubble_fraction",
    "stage_order",
    "torch_pipeline_step",
]

SCHEDULES = ("gpipe", "1f1b")
_WALL_OFFSET = time.time() - time.perf_counter()


def _clock() -> float:
    """perf_counter's resolution on the wall clock, so stages on different ranks line up."""
    return time.perf_counter() + _WALL_OFFSET


def _wait_for(device: torch.device) -> None:
    """On a GPU, wait until the kernels queued so far on the current stream (a receive, which
    torch orders before what follows it there, a forward) have run: a GPU runs them after the
    host queues them, so an event timed on the host would otherwise be the launch, not the work.
    The current stream only, not the whole device (`torch.cuda.synchronize`): that would also
    wait for the sends still in flight on NCCL's streams, which the schedule overlaps with the
    next F or B, and count them as idle time of this stage. Nothing to wait for on the
    CPU, where each op runs when called."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _check(num_stages: int, num_microbatches: int, schedule: str) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be in [1, inf), got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be in [1, inf), got {num_microbatches}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")


def stage_order(
    num_stages: int, num_microbatches: int, stage: int, schedule: str = "1f1b"
) -> list[tuple[str, int]]:
    """The order in which `stage` runs its work: a list of ("F" | "B", microbatch)."""
    _check(num_stages, num_microbatches, schedule)
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in [0, {num_stages}), got {stage}")
    m = num_microbatches
    if schedule == "gpipe":
        return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
    warmup = min(num_stages - stage - 1, m)
    order = [("F", j) for j in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", j) for j in range(m - warmup, m)]


def make_schedule(
    num_stages: int, num_microbatches: int, schedule: str = "1f1b"
) -> list[tuple[int, int, str, int]]:
    """The pipeline as (time step, stage, "F" | "B", microbatch), sorted by time then stage.

    Every F and B takes one time step; each runs as early as its stage's order and its
    dependencies allow: F(s, j) after F(s-1, j); B(s, j) after F(s, j) and B(s+1, j).
    Pure function: no ranks needed (for drawing the ideal timeline).
    """
    orders = [stage_order(num_stages, num_microbatches, s, schedule) for s in range(num_stages)]
    done: dict[tuple[str, int, int], int] = {}  # (kind, stage, mb) -> finish time
    free, pos, steps = [0] * num_stages, [0] * num_stages, []
    while any(pos[s] < len(orders[s]) for s in range(num_stages)):
        progressed = False
        for s in range(num_stages):
            if pos[s] == len(orders[s]):
                continue
            kind, j = orders[s][pos[s]]
            deps = [("F", s - 1, j)] if kind == "F" and s > 0 else []
            if kind == "B":
                deps = [("F", s, j)] + ([("B", s + 1, j)] if s < num_stages - 1 else [])
            if all(d in done for d in deps):
                start = max([free[s]] + [done[d] for d in deps])
                steps.append((start, s, kind, j))
                done[(kind, s, j)] = free[s] = start + 1
                pos[s] += 1
                progressed = True
        assert progressed, "schedule deadlocks"
    return sorted(steps)


def bubble_fraction(num_stages: int, num_microbatches: int, num_chunks: int = 1) -> float:
    """Idle fraction of a pipeline step: (p-1)/(v*m+p-1); (p-1)/(m+p-1) for GPipe and 1F1B."""
    p, m, v = num_stages, num_microbatches, num_chunks
    if p < 1 or m < 1 or v < 1:
        raise ValueError(
            f"num_stages, num_microbatches, num_chunks must be in [1, inf), got {p, m, v}"
        )
    return (p - 1) / (v * m + p - 1)


def bubble_overhead(num_stages: int, num_microbatches: int, num_chunks: int = 1) -> float:
    """Bubble time relative to the ideal (bubble-free) time: (p-1)/(v*m) (Megatron-LM's form)."""
    p, m, v = num_stages, num_microbatches, num_chunks
    if p < 1 or m < 1 or v < 1:
        raise ValueError(
            f"num_stages, num_microbatches, num_chunks must be in [1, inf), got {p, m, v}"
        )
    return (p - 1) / (v * m)


@dataclass
class StageEvent:
    """One forward or backward of one micro-batch on one stage (compute only, not waiting)."""

    stage: int
    rank: int  # global rank
    kind: str  # "F" or "B"
    microbatch: int
    start: float  # wall-clock seconds
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_span(self) -> SpanRecord:
        """As a labkit span record (name "F3" / "B3"), for the timeline view."""
        return SpanRecord(
            rank=self.rank, name=f"{self.kind}{self.microbatch}", start=self.start, end=self.end
        )


@dataclass
class PipelineResult:
    """What `pipeline_step` returns on each rank."""

    loss: torch.Tensor | None  # mean loss over micro-batches, on the last stage only
    events: list[StageEvent] = field(default_factory=list)  # this stage's, in run order
    peak_in_flight: int = 0  # most micro-batches with activations held at once


def measured_bubble_fraction(events: list[StageEvent]) -> float:
    """1 - busy / (stages * span), from the events of all stages of one step (gathered)."""
    if not events:
        raise ValueError("events must be non-empty")
    span = max(e.end for e in events) - min(e.start for e in events)
    num_stages = len({e.stage for e in events})
    busy = sum(e.duration for e in events)
    return 1.0 - busy / (num_stages * span) if span > 0 else 0.0


def replayed_bubble_fraction(events: list[StageEvent]) -> float:
    """The bubble the step would have had if messages were free and instant.

    Replays each stage's ops in the order they ran, with the durations they really took: an
    op starts when the stage's previous op and its input are done (F(s, j) after F(s-1, j),
    B(s, j) after B(s+1, j)), never earlier. The wall clock cannot beat this, so the measured
    bubble is at least this one; the difference is time lost to messages and waking ranks. With
    equal durations it is (p-1)/(m+p-1); with a slower stage (a sleep that overshot on a busy
    machine) it moves either way, which is why the formula assumes balanced stages.
    """
    if not events:
        raise ValueError("events must be non-empty")
    num_stages = len({e.stage for e in events})
    by_stage: dict[int, list[StageEvent]] = {}
    for e in sorted(events, key=lambda e: e.start):
        by_stage.setdefault(e.stage, []).append(e)
    done: dict[tuple[int, str, int], float] = {}
    nxt = dict.fromkeys(by_stage, 0)
    free = dict.fromkeys(by_stage, 0.0)
    while any(nxt[s] < len(ops) for s, ops in by_stage.items()):
        moved = False
        for s, ops in by_stage.items():
            while nxt[s] < len(ops):
                e = ops[nxt[s]]
                src = s - 1 if e.kind == "F" else s + 1
                need = (src, e.kind, e.microbatch)
                if 0 <= src < num_stages and need not in done:
                    break
                start = max(free[s], done.get(need, 0.0))
                done[s, e.kind, e.microbatch] = free[s] = start + e.duration
                nxt[s] += 1
                moved = True
        if not moved:
            raise ValueError("events do not form a pipeline schedule (an input never arrives)")
    span = max(free.values())
    busy = sum(e.duration for e in events)
    return 1.0 - busy / (num_stages * span) if span > 0 else 0.0


def pipeline_step(
    stage_module: nn.Module,
    x: torch.Tensor | None,
    y: torch.Tensor | None,
    loss_fn: LossFn,
    num_microbatches: int,
    schedule: str = "1f1b",
    group: dist.ProcessGroup | None = None,
) -> PipelineResult:
    """One training step (forward and backward) of a pipelined model, by hand.

    Runs on every rank of the group; every rank must call it with the same num_microbatches
    and schedule. Group rank s holds stage s in `stage_module`; the first stage needs the
    batch `x` and the last the targets `y` (others may pass None); the batch size must be a
    multiple of num_microbatches. Gradients accumulate into the parameters. Returns the loss
    on the last stage, this stage's events and its peak number of micro-batches in flight.
    """
    stage, num_stages = dist.get_rank(group), dist.get_world_size(group)
    _check(num_stages, num_microbatches, schedule)
    first, last = stage == 0, stage == num_stages - 1
    m = num_microbatches
    for name, t, needed in (("x", x, first), ("y", y, last)):
        if needed and t is None:
            raise ValueError(f"stage {stage} needs {name}, got None")
        if t is not None and t.shape[0] % m:
            raise ValueError(
                f"{name}.shape[0] must be a multiple of num_microbatches={m}, got {t.shape[0]}"
            )
    xs = x.chunk(m) if first else None
    ys = y.chunk(m) if last else None
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    sends: list[dist.Work] = []
    losses: list[torch.Tensor] = []
    result = PipelineResult(loss=None)
    rank, device = dist.get_rank(), module_device(stage_module)
    for kind, j in stage_order(num_stages, m, stage, schedule):
        if kind == "F":
            inp = xs[j] if first else recv_tensor(stage - 1, group, tag=j, device=device)
            inp.requires_grad_()
            _wait_for(device)
            start = _clock()
            out = stage_module(inp)
            if last:
                out = loss_fn(out, ys[j]) / m
                losses.append(out.detach())
            inputs[j], outputs[j] = inp, out
            result.peak_in_flight = max(result.peak_in_flight, len(outputs))
        else:
            inp, out = inputs.pop(j), outputs.pop(j)
            grad = (
                None
                if last
                else recv_tensor(stage + 1, group, tag=j, shape=out.shape, device=device)
            )
            _wait_for(device)
            start = _clock()
            out.backward(grad)
        _wait_for(device)
        result.events.append(StageEvent(stage, rank, kind, j, start, _clock()))
        if kind == "F" and not last:
            sends += send_tensor(out, stage + 1, group, tag=j)
        if kind == "B" and not first:
            sends += send_tensor(inp.grad, stage - 1, group, tag=j, header=False)
    for work in sends:
        work.wait()
    if last:
        result.loss = torch.stack(losses).sum()
    return result


def torch_pipeline_step(
    stage_module: nn.Module,
    x: torch.Tensor | None,
    y: torch.Tensor | None,
    loss_fn: LossFn,
    num_microbatches: int,
    schedule: str = "1f1b",
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor | None:
    """The same step with torch.distributed.pipelining (PipelineStage + ScheduleGPipe/1F1B).

    Runs on every rank of the group; every rank must call it. Same arguments and gradients as
    `pipeline_step` (torch's schedules also scale each micro-batch's gradient by 1/m); returns
    the mean micro-batch loss on the last stage and None elsewhere. Builds the stage and the
    schedule on each call (shapes are inferred at run time), which keeps it simple, not fast.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage, num_stages = dist.get_rank(group), dist.get_world_size(group)
    _check(num_stages, num_microbatches, schedule)
    device = module_device(stage_module)
    pipe_stage = PipelineStage(stage_module, stage, num_stages, device, group=group)
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    runner = cls(pipe_stage, n_microbatches=num_microbatches, loss_fn=loss_fn)
    losses: list[torch.Tensor] = []
    if stage == 0 and stage == num_stages - 1:
        runner.step(x, target=y, losses=losses)
    elif stage == 0:
        runner.step(x)
    elif stage == num_stages - 1:
        runner.step(target=y, losses=losses)
    else:
        runner.step()
    return torch.stack(losses).mean().detach() if losses else None
