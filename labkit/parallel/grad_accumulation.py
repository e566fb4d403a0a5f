"""Gradient accumulation under DDP: k micro-batches, one all_reduce (rank side).

A global batch too large for memory runs as k micro-batches per rank. Inside DDP's `no_sync()`
a backward pass only adds to the local gradients; the k-th backward, outside it, lets DDP
all-reduce once. With each loss divided by k and equal micro-batches, the gradient is the one
of the mean loss over all k * W micro-batches: one large batch, for 1/k of the communication.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["accumulate_gradients"]


def accumulate_gradients(
    ddp_model: nn.parallel.DistributedDataParallel,
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
) -> float:
    """Accumulate gradients over k micro-batches with one all_reduce: returns the mean loss.

    Runs on every rank; every rank must call it with the same k. The first k-1 backward passes
    run inside `ddp_model.no_sync()` (gradients only add up locally); the last one lets DDP
    all-reduce. Each loss is divided by k, so with equal micro-batches the result is the
    gradient of the mean loss over all k * W micro-batches: one large batch.
    """
    if not micro_batches:
        raise ValueError("micro_batches must hold at least 1 (input, target) pair, got 0")
    if not hasattr(ddp_model, "no_sync"):
        raise ValueError(
            f"ddp_model must be a DistributedDataParallel, got {type(ddp_model).__name__}"
        )
    k = len(micro_batches)
    total = 0.0
    for i, (x, target) in enumerate(micro_batches):
        ctx = ddp_model.no_sync() if i < k - 1 else nullcontext()
        with ctx:
            loss = loss_fn(ddp_model(x), target) / k
            loss.backward()
        total += loss.item()
    return total
