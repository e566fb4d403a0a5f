"""Synchronised batch norm: normalise with the statistics of the global batch (rank side).

With data parallelism each rank sees b = B / W samples. BatchNorm computed per rank normalises
by those b samples only, so the replicas train a different model than one process on the
whole batch. `sync_batch_norm` all-reduces the count, the sum and the squared deviations, so
every rank uses the mean and variance of the B samples; the all_reduces are differentiable,
so the backward pass is the global one too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["sync_batch_norm"]


class _AllReduceSum(torch.autograd.Function):
    """y = sum_r x_r on every rank; backward: dL/dx_r = sum_s dL_s/dy (also an all_reduce)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sync_batch_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Batch norm of x (N_r, C) with the mean and variance of the global batch (training mode).

    Runs on every rank; every rank must call it (three all_reduces forward; two backward, as the
    count carries no gradient).
    mean = sum_r sum_i x / N, var = sum_r sum_i (x - mean)^2 / N (biased, as BatchNorm uses to
    normalise), N = sum_r N_r. Equals torch.nn.BatchNorm1d on the concatenated batch in one
    process, gradients included (the all_reduces are differentiable). What nn.SyncBatchNorm
    computes, written out so it also runs on CPU ranks (torch's needs a GPU); no running stats.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (batch, channels), got shape {tuple(x.shape)}")
    count = _AllReduceSum.apply(
        torch.tensor([float(x.shape[0])], dtype=x.dtype, device=x.device), group
    )
    mean = _AllReduceSum.apply(x.sum(0), group) / count
    var = _AllReduceSum.apply((x - mean).pow(2).sum(0), group) / count
    out = (x - mean) / torch.sqrt(var + eps)
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out
