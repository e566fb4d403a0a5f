"""Gradient clipping when each rank holds a piece of the gradient (rank side).

torch.nn.utils.clip_grad_norm_ scales every gradient by max_norm / (norm + 1e-6), at most 1,
where norm is the L2 norm of the whole gradient. When rank r holds only a disjoint piece g_r
(ZeRO-2/3, FSDP, tensor parallel) that norm is

    ||g|| = sqrt(sum_r ||g_r||^2)

one all_reduce of a scalar. `clip_grad_norm_global` clips by it and equals the one-process
clip; `clip_grad_norm_local` is the classic mistake: each rank clips by the norm of its own
piece, so ranks scale by different factors. After `average_gradients` every rank holds the
whole gradient, and its local norm already is the global one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

__all__ = ["clip_grad_norm_global", "clip_grad_norm_local", "global_grad_norm"]


def _grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def _device(grads: Sequence[torch.Tensor]) -> torch.device:
    """Where the norm is summed: the gradients' device (a rank with none: the CPU)."""
    return grads[0].device if grads else torch.device("cpu")  # no gradients: nothing to follow


def global_grad_norm(
    params: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """L2 norm of a gradient split over ranks: sqrt(sum_r ||g_r||^2), g_r = this rank's pieces.

    Runs on every rank; every rank must call it. Use it when each rank holds a disjoint part of
    the gradient (ZeRO-2/3, FSDP, tensor parallel). After `average_gradients` every rank holds
    the whole gradient, and its local norm already is the global one.
    """
    grads = _grads(params)
    local_sq = sum(
        (g.detach().double().pow(2).sum() for g in grads),
        torch.zeros((), dtype=torch.float64, device=_device(grads)),
    )
    dist.all_reduce(local_sq, group=group)
    return local_sq.sqrt()


def _scale(grads: Sequence[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    # Same rule as torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6), at most 1.
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))


def clip_grad_norm_global(
    params: Iterable[torch.Tensor],
    max_norm: float,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Clip this rank's gradient pieces by the global norm (`global_grad_norm`); returns that norm.

    Runs on every rank; every rank must call it. Equals torch's clip_grad_norm_ on the whole
    gradient in one process.
    """
    if max_norm <= 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    params = list(params)
    total = global_grad_norm(params, group)
    _scale(_grads(params), total, max_norm)
    return total


def clip_grad_norm_local(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """The classic mistake: clip by the norm of this rank's pieces only; returns that norm.

    Each rank sees a smaller (or different) norm, so ranks scale by different factors and the
    result is not the single-process clip. Needs no collective.
    """
    if max_norm <= 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    grads = _grads(params)
    total = torch.sqrt(
        sum(
            (g.detach().double().pow(2).sum() for g in grads),
            torch.zeros((), dtype=torch.float64, device=_device(grads)),
        )
    )
    _scale(grads, total, max_norm)
    return total
