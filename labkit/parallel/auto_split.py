"""Automatic model parallelism: choose where to cut an `nn.Sequential` into pipeline stages.

Layer i costs c_i (forward+backward seconds, measured). A contiguous split into p stages
puts layers [b_s, b_{s+1}) on stage s; in a pipeline the slowest stage sets the pace
(step time = sum_s C_s + (m-1) max_s C_s), so we minimise the bottleneck max_s C_s, where
C_s = sum of c_i over the stage.

Exact optimum, dynamic programming in O(n^2 p): with best[k][j] the smallest bottleneck that
puts the first j layers on k stages,
    best[k][j] = min over i < j of max(best[k-1][i], c_i + ... + c_{j-1}),
and best[p][n] is the answer (a stage that breaks the memory cap is not allowed). No split
beats the lower bound max(sum_i c_i / p, max_i c_i): the average, and the largest layer, which
cannot be cut. Heuristics for comparison: equal layer counts, balanced parameter counts, and a
greedy that fills each stage up to sum/p. The optimum is never worse than any of them.

`profile_layers` runs in one process; measured times differ between ranks, so compute the plan
once (e.g. on rank 0) and `broadcast_plan` it before every rank takes its `stage_module`.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "LayerCost",
    "Plan",
    "auto_split",
    "broadcast_plan",
    "lower_bound",
    "partition_by_params",
    "partition_greedy",
    "partition_optimal",
    "partition_uniform",
    "profile_layers",
]


@dataclass
class LayerCost:
    """What one layer costs: time (seconds, forward+backward) and memory (bytes)."""

    index: int
    name: str
    time: float
    param_bytes: int = 0
    activation_bytes: int = 0  # bytes of the layer's output for the profiled sample

    @property
    def memory(self) -> int:
        """Bytes a stage holds for this layer: parameters plus the activation kept for backward."""
        return self.param_bytes + self.activation_bytes


@dataclass
class Plan:
    """A contiguous split: stage s holds layers [boundaries[s], boundaries[s+1])."""

    boundaries: list[int]
    stage_costs: list[float]  # predicted seconds per stage
    stage_memory: list[int]  # predicted bytes per stage
    method: str

    @property
    def num_stages(self) -> int:
        return len(self.boundaries) - 1

    @property
    def bottleneck(self) -> float:
        return max(self.stage_costs)

    @property
    def stage_of_layer(self) -> list[int]:
        return [s for s in range(self.num_stages) for _ in range(*self.boundaries[s : s + 2])]

    def stage_module(self, model: nn.Sequential, stage: int) -> nn.Sequential:
        """The layers of `stage` (sharing `model`'s parameters), ready for a pipeline stage."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage must be in [0, {self.num_stages}), got {stage}")
        if len(model) != self.boundaries[-1]:
            raise ValueError(f"model must have {self.boundaries[-1]} layers, got {len(model)}")
        return model[self.boundaries[stage] : self.boundaries[stage + 1]]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def profile_layers(model: nn.Sequential, sample: torch.Tensor, repeats: int = 5) -> list[LayerCost]:
    """Measure each layer on the activations `sample` produces: median forward+backward time.

    Runs in one process (no communication). Parameters' `.grad` are left untouched.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be in [1, inf), got {repeats}")
    costs, x = [], sample.detach()
    for i, (name, layer) in enumerate(model.named_children()):
        trainable = [p for p in layer.parameters() if p.requires_grad]
        times = []
        for _ in range(repeats):
            inp = x.clone().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            out = layer(inp)
            if out.requires_grad:  # autograd.grad, unlike backward(), leaves .grad alone
                wrt = [inp, *trainable] if inp.requires_grad else trainable
                torch.autograd.grad(out, wrt, torch.ones_like(out), allow_unused=True)
            times.append(time.perf_counter() - start)
        x = out.detach()
        param_bytes = sum(_nbytes(p) for p in layer.parameters())
        costs.append(LayerCost(i, name, statistics.median(times), param_bytes, _nbytes(x)))
    return costs


def lower_bound(costs: Sequence[LayerCost], stages: int) -> float:
    """No contiguous split into `stages` has a smaller bottleneck: max(total/p, largest layer)."""
    _check(costs, stages)
    times = [c.time for c in costs]
    return max(sum(times) / stages, max(times))


def _check(costs: Sequence[LayerCost], stages: int) -> None:
    if not 1 <= stages <= len(costs):
        raise ValueError(f"stages must be in [1, {len(costs)}], got {stages}")


def _plan(costs: Sequence[LayerCost], boundaries: list[int], method: str) -> Plan:
    pairs = list(itertools.pairwise(boundaries))
    return Plan(
        boundaries=list(boundaries),
        stage_costs=[sum(c.time for c in costs[a:b]) for a, b in pairs],
        stage_memory=[sum(c.memory for c in costs[a:b]) for a, b in pairs],
        method=method,
    )


def partition_optimal(
    costs: Sequence[LayerCost], stages: int, memory_cap: int | None = None
) -> Plan:
    """The exact min-max contiguous split by dynamic programming, O(n^2 p) time.

    With `memory_cap` (bytes), no stage's memory may exceed it; ValueError if no split fits.
    """
    _check(costs, stages)
    n, inf = len(costs), float("inf")
    tsum = [0.0, *itertools.accumulate(c.time for c in costs)]
    msum = [0, *itertools.accumulate(c.memory for c in costs)]
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):  # leave at least one layer per later stage
            for i in range(k - 1, j):
                if memory_cap is not None and msum[j] - msum[i] > memory_cap:
                    continue
                value = max(best[k - 1][i], tsum[j] - tsum[i])
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    if best[stages][n] == inf:
        largest = max(c.memory for c in costs)
        raise ValueError(
            f"no split into {stages} stages fits memory_cap={memory_cap} bytes "
            f"(the largest layer alone needs {largest}; memory_cap must be at least that)"
        )
    boundaries = [n]
    for k in range(stages, 0, -1):
        boundaries.append(cut[k][boundaries[-1]])
    return _plan(costs, boundaries[::-1], "optimal")


def _by_threshold(
    costs: Sequence[LayerCost], stages: int, weight: Callable[[LayerCost], float], method: str
) -> Plan:
    """Cut where the cumulative weight first reaches s/p of the total (every stage non-empty)."""
    _check(costs, stages)
    n = len(costs)
    prefix = list(itertools.accumulate(weight(c) for c in costs))
    total, boundaries = prefix[-1], [0]
    for s in range(1, stages):
        j = next((i + 1 for i in range(n) if prefix[i] >= total * s / stages), n)
        boundaries.append(min(max(j, boundaries[-1] + 1), n - (stages - s)))
    return _plan(costs, [*boundaries, n], method)


def partition_uniform(costs: Sequence[LayerCost], stages: int) -> Plan:
    """Equal layer counts (what you do without a profile)."""
    return _by_threshold(costs, stages, lambda c: 1.0, "uniform")


def partition_by_params(costs: Sequence[LayerCost], stages: int) -> Plan:
    """Balanced parameter bytes: cut where the cumulative parameters cross s/p of the total."""
    return _by_threshold(costs, stages, lambda c: float(c.param_bytes), "params")


def partition_greedy(costs: Sequence[LayerCost], stages: int) -> Plan:
    """Fill each stage with layers while its time stays within total/p, then start the next."""
    _check(costs, stages)
    n, target = len(costs), sum(c.time for c in costs) / stages
    boundaries, acc = [0], 0.0
    for i, c in enumerate(costs):
        left = stages - len(boundaries)  # stages still to open after the current one
        must_cut = n - i == left  # every later stage needs a layer
        can_cut = i > boundaries[-1] and left > 0
        if can_cut and (must_cut or acc + c.time > target):
            boundaries.append(i)
            acc = 0.0
        acc += c.time
    return _plan(costs, [*boundaries, n], "greedy")


def auto_split(
    model: nn.Sequential,
    sample: torch.Tensor,
    stages: int,
    memory_cap: int | None = None,
    repeats: int = 5,
) -> Plan:
    """Profile `model` on `sample` and return the optimal plan: the split into `stages`
    contiguous stages whose slowest stage is fastest (within `memory_cap` bytes per stage).

    Runs in the process that calls it, with no communication: usually a rank in a `%%ranks`
    cell (then `broadcast_plan` gives every rank rank 0's plan), or the kernel. Example::

        plan = labkit.auto_split(nn.Sequential(*layers), torch.randn(8, 64), stages=2)
        plan.boundaries  # e.g. [0, 3, 6]: stage 0 holds layers 0-2, stage 1 layers 3-5
    """
    return partition_optimal(profile_layers(model, sample, repeats), stages, memory_cap)


def broadcast_plan(plan: Plan | None, src: int = 0, group: dist.ProcessGroup | None = None) -> Plan:
    """Give every rank the plan made on group rank `src` (others may pass None).

    Runs on every rank of the group; every rank must call it.
    """
    box = [plan]
    dist.broadcast_object_list(
        box, src=src if group is None else dist.get_global_rank(group, src), group=group
    )
    assert box[0] is not None
    return box[0]
