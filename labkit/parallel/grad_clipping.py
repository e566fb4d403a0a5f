"""Gradient clipping when each rank holds a piece of the gradient (rank side).

torch.nn.utils.clip_grad_norm_ scales every gradient by max_norm / (norm + 1e-6), at most 1,
where norm is the L2 norm of the whole gradient. When rank r holds only a disjoint piece g_r
(ZeRO-2/3, FSDP, tensor parallel) that norm is

    ||g|| = sqrt(sum_r ||g_r||^2)

one all_reduce of a scalar. `clip_grad_norm_global` clips by it and equals the one-process
clip; `clip_grad_norm_local` is the classic mistake: each rank clips by the norm of its own
piece, so ranks scale by different factors. After `average_gradients` every rank holds the
whole gradient, and its local norm already is the global one.

Tensor parallelism adds a second mistake. Over t ranks a Megatron layer shards its weights, but
some parameters are *replicated*: LayerNorm's weight and bias, the row-parallel layer's bias.
Every rank holds the whole gradient of each of them (the same numbers), so summing every rank's
squares counts them t times:

    naive^2 = sum_r ||sharded_r||^2 + t * ||replicated||^2

Pass them as `replicated` and they count once. Megatron does the same by hand (it skips the
duplicates of parameters not sharded across tensor-parallel ranks on every rank but the first);
torch's DTensor does it by placement: `torch.nn.utils.clip_grad_norm_` on DTensor parameters
(FSDP2's `fully_shard`, `parallelize_module`) reduces Shard placements across ranks and takes a
Replicate one once, so it already is the global norm over the DTensors' mesh. It refuses a mix
of DTensors and plain tensors (a LayerNorm left out of the plan); across pipeline stages, or
parameters on another mesh (expert parallelism's), torchtitan's own clip_grad_norm_ adds the
missing reduction. All of this assumes a replicated parameter has the same gradient on every
rank: under sequence parallelism a LayerNorm's gradient is a partial sum per rank until it is
all-reduced over the tensor-parallel ranks (Megatron does so before the norm).
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


def _squares(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    # float64: the sum of many float32 squares loses digits that the comparison needs
    return sum(
        (g.detach().double().pow(2).sum() for g in grads),
        torch.zeros((), dtype=torch.float64, device=device),
    )


def global_grad_norm(
    params: Iterable[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    replicated: Iterable[torch.Tensor] = (),
) -> torch.Tensor:
    """L2 norm of a gradient split over ranks: sqrt(sum_r ||g_r||^2 + ||replicated||^2).

    Runs on every rank; every rank must call it. `params`: this rank's disjoint part of the
    gradient (ZeRO-2/3, FSDP, the sharded weights of tensor parallelism). `replicated`: the
    parameters every rank of `group` holds whole (tensor parallelism's LayerNorm and
    row-parallel bias), counted once. After `average_gradients` every rank holds the whole
    gradient, and its local norm already is the global one.

    Example: `global_grad_norm(sharded, replicated=[*norm.parameters(), row.bias])`.
    """
    grads, shared = _grads(params), _grads(replicated)
    device = _device(grads or shared)
    total_sq = _squares(grads, device)
    dist.all_reduce(total_sq, group=group)
    return (total_sq + _squares(shared, device)).sqrt()


def _scale(grads: Sequence[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    # Same rule as torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6), at most 1.
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))


def clip_grad_norm_global(
    params: Iterable[torch.Tensor],
    max_norm: float,
    group: dist.ProcessGroup | None = None,
    replicated: Iterable[torch.Tensor] = (),
) -> torch.Tensor:
    """Clip this rank's gradient pieces by the global norm (`global_grad_norm`); returns that norm.

    Runs on every rank; every rank must call it. Equals torch's clip_grad_norm_ on the whole
    gradient in one process. `replicated` parameters count once in the norm and are scaled too.
    """
    if max_norm <= 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    params, replicated = list(params), list(replicated)
    total = global_grad_norm(params, group, replicated)
    _scale(_grads(params) + _grads(replicated), total, max_norm)
    return total


def clip_grad_norm_local(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """The classic mistake: clip by the norm of this rank's pieces only; returns that norm.

    Each rank sees a smaller (or different) norm, so ranks scale by different factors and the
    result is not the single-process clip. Needs no collective.
    """
    if max_norm <= 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    grads = _grads(params)
    total = _squares(grads, _device(grads)).sqrt()
    _scale(grads, total, max_norm)
    return total
