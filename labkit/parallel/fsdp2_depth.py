"""FSDP2 in depth: mixed precision, HSDP, resharding, prefetching, accumulation, offload
(runs on the ranks; the formulas are plain functions, usable anywhere).

Notebook 26 shards a model with `fully_shard` and its defaults. This module carries what its
options change, each as a formula the notebook 41 checks against torch's own behaviour:

- **collectives per step** (`step_collectives`): each unit (a module given to `fully_shard`)
  is all-gathered before every forward and, unless `reshard_after_forward=False` keeps it
  gathered, again before every backward; its gradient is reduce-scattered after every backward
  that syncs (`set_requires_gradient_sync(False)` skips the sync on the first m-1 of m
  micro-batches). With `reshard_after_forward=k` (an int, a divisor of the shard axis) the
  weights are re-sharded over groups of k ranks after forward: the backward all-gather still
  happens, inside a group of k. On an HSDP mesh (replicate x shard) each reduce-scatter over
  the shard axis is followed by an all-reduce of its output over the replicate axis.
- **bytes of a unit** (`unit_bytes`): each tensor's dim 0 padded up to a multiple of the
  shard axis, times the element size of the dtype it is sent in: `param_dtype` for the
  all-gathers, `reduce_dtype` for the reductions (`MixedPrecisionPolicy`).
- **what a rank holds between forward and backward** (`held_after_forward`): nothing more
  than its shard with True, the whole unit with False, U / k with an int k.
- **what a rank sends** (`sent_bytes`): a ring (NCCL) sends (n-1)/n of an all-gather's or a
  reduce-scatter's buffer and 2(n-1)/n of an all-reduce's; gloo's reduce-scatter sends what
  its all-reduce sends (notebook 26 measured it).

`bf16_reference_grads` is the single-process reference for `MixedPrecisionPolicy(
param_dtype=bfloat16, reduce_dtype=float32)`: each rank's batch through a bf16 copy of the
whole model, its gradients cast to fp32 and averaged in fp32. `mark_forwards` puts a span
around each unit's forward, so the trace shows where the all-gathers sit between them.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from labkit.parallel.two_d import fsdp_step_collectives

__all__ = [
    "bf16_reference_grads",
    "event_order",
    "held_after_forward",
    "make_stack",
    "mark_forwards",
    "sent_bytes",
    "step_collectives",
    "unit_bytes",
    "units",
]


def make_stack(num_layers: int, hidden: int, seed: int = 0, device: Any = None) -> nn.Sequential:
    """`num_layers` Linear(hidden, hidden) layers with a Tanh between them, seeded: the same
    weights on every rank and in the kernel. They are drawn on the host and then moved to
    `device`: drawn on a GPU they would come from the GPU's random generator, another sequence
    than the kernel's CPU one for the same seed (seen on an H200: HSDP's step then differed from
    the kernel's by 0.17)."""
    if num_layers < 1 or hidden < 1:
        raise ValueError(f"num_layers and hidden must be >= 1, got {num_layers}, {hidden}")
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(num_layers):
        if i:
            layers.append(nn.Tanh())
        layers.append(nn.Linear(hidden, hidden))
    return nn.Sequential(*layers).to(device)


def units(model: nn.Module) -> list[nn.Module]:
    """The children of `model` that hold parameters: the modules `fully_shard` is applied to
    one by one (a Tanh has nothing to shard)."""
    return [m for m in model.children() if any(True for _ in m.parameters())]


def unit_bytes(shapes: Iterable[tuple[int, ...]], shard_size: int, element_size: int = 4) -> int:
    """Bytes of one unit's all-gather or reduce-scatter buffer over a shard axis of
    `shard_size` ranks: every tensor's dim 0 padded up to a multiple of `shard_size` (FSDP2
    cuts dim 0 with torch.chunk and pads the pieces to one size)."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    total = 0
    for shape in shapes:
        rows = -(-shape[0] // shard_size) * shard_size
        total += rows * math.prod(shape[1:]) * element_size
    return total


def step_collectives(
    num_units: int, microbatches: int = 1, reshard_after_forward: bool | int = True,
    sync_last_only: bool = False, replicate: int = 1,
) -> dict[str, int]:  # fmt: skip
    """FSDP2's collectives in one step of `microbatches` forward + backward passes over
    `num_units` units (none of them the root holding parameters of its own: the root's
    default is `reshard_after_forward=False`).

    all_gather: one per unit before each forward, and one more before each backward unless
    `reshard_after_forward` is False (an int k re-shards to groups of k: the gather stays, over
    k ranks). reduce_scatter: one per unit per synced backward (only the last one with
    `sync_last_only`, i.e. `set_requires_gradient_sync(False)` on the others). all_reduce: on
    an HSDP mesh (`replicate` > 1) one per reduce-scatter, over the replicate axis."""
    if replicate < 1:
        raise ValueError(f"replicate must be >= 1, got {replicate}")
    if not isinstance(reshard_after_forward, bool) and reshard_after_forward < 1:
        raise ValueError(f"reshard_after_forward must be a bool or an int >= 1, got "
                         f"{reshard_after_forward}")  # fmt: skip
    # an int 1 is False (torch warns so); `True == 1` in Python, so bools are told apart first
    if isinstance(reshard_after_forward, bool):
        gathers_twice = reshard_after_forward
    else:
        gathers_twice = reshard_after_forward > 1
    counts = fsdp_step_collectives(
        num_units, microbatches, not sync_last_only, reshard_after_forward=gathers_twice
    )
    counts["all_reduce"] = counts["reduce_scatter"] if replicate > 1 else 0
    return counts


def held_after_forward(
    unit_sizes: Iterable[int], reshard_after_forward: bool | int, shard_size: int
) -> int:
    """Bytes a rank holds between forward and backward beyond its sharded weights (and the
    activations): 0 with True (the gathered copy is freed), every unit whole with False, and a
    piece of 1/k of every unit with an int k (a second shard, over groups of k ranks)."""
    total = sum(unit_sizes)
    if isinstance(reshard_after_forward, bool):
        return 0 if reshard_after_forward else total
    if reshard_after_forward == shard_size:
        return 0
    if reshard_after_forward == 1:
        return total
    if shard_size % reshard_after_forward:
        raise ValueError(
            f"reshard_after_forward must divide the shard axis {shard_size}, got "
            f"{reshard_after_forward}"
        )
    return total // reshard_after_forward


# bytes a rank sends per byte of a collective's buffer, with n ranks in its group
RING = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}  # x (n-1)/n: NCCL's rings
GLOO = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 2}  # gloo's reduce-scatter


def sent_bytes(calls: Iterable[tuple[str, int, int]], algorithms: str = "ring") -> float:
    """Bytes one rank sends for `calls`, (op, buffer bytes, group size) each, op one of
    all_gather / reduce_scatter / all_reduce: "ring" (NCCL) or "gloo" (its reduce-scatter
    is an all-reduce that keeps a slice)."""
    factors = {"ring": RING, "gloo": GLOO}[algorithms]
    return sum(factors[op] * nbytes * (n - 1) / n for op, nbytes, n in calls)


def bf16_reference_grads(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    param_dtype: torch.dtype = torch.bfloat16,
) -> list[torch.Tensor]:
    """One process's version of FSDP2 with `MixedPrecisionPolicy(param_dtype, reduce_dtype=
    float32)`: for each (x, y) in `batches` (one per data-parallel rank), forward and backward
    through a `param_dtype` copy of `model` (input cast too, as `cast_forward_inputs` does),
    the gradients cast to fp32; returns their fp32 mean, one tensor per parameter. No
    communication; `model` is not changed."""
    low = copy.deepcopy(model).to(param_dtype)
    sums = [torch.zeros_like(p, dtype=torch.float32) for p in model.parameters()]
    count = 0
    for x, y in batches:
        low.zero_grad()
        loss_fn(low(x.to(param_dtype)).float(), y).backward()
        for s, p in zip(sums, low.parameters()):
            s += p.grad.float()
        count += 1
    return [s / count for s in sums]


def mark_forwards(modules: Iterable[nn.Module], prefix: str = "forward") -> None:
    """Wrap each module's forward in `labkit.span(f"{prefix} {i}")`, so the trace shows where
    each unit computes. FSDP2's pre-forward hook (its all-gather) runs before the span opens."""
    from labkit.rank.trace import span

    for i, module in enumerate(modules):
        inner = module.forward

        @functools.wraps(inner)
        def forward(*args: Any, _inner: Any = inner, _name: str = f"{prefix} {i}", **kw: Any):
            with span(_name):
                return _inner(*args, **kw)

        module.forward = forward


def event_order(records: Iterable[Any], rank: int, prefix: str = "forward") -> list[str]:
    """A rank's trace in issue order: each collective as "AG", "RS" or "AR", each span of
    `mark_forwards` as "F<i>" (at its start). Plain records in, plain strings out."""
    short = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}
    out = []
    for r in records:
        if r.rank != rank:
            continue
        if r.kind == "span" and r.name.startswith(prefix + " "):
            out.append((r.start, 1, "F" + r.name.split()[-1]))
        elif r.kind == "comm":
            op = r.op.replace("_single", "").replace("_into_tensor", "").replace("_tensor", "")
            out.append((r.start, 0, short.get(op, op)))
    return [label for _, _, label in sorted(out)]
