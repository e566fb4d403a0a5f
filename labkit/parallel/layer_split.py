"""Model parallelism by hand: an `nn.Sequential` split by layers across ranks (runs on ranks).

A sequential model is a composition f = f_{p-1} o ... o f_1 o f_0 of p stages, stage s on
group rank s. Forward: a_s = f_s(a_{s-1}) with a_{-1} = x; stage s receives a_{s-1} from s-1 and
sends a_s to s+1; the last stage computes the loss L(a_{p-1}, y). Backward is the chain rule
taken stage by stage: stage s receives g_s = dL/da_s from s+1, runs autograd on its own piece
(which gives dL/dtheta_s and g_{s-1} = J_s^T g_s) and sends g_{s-1} to s-1. Each parameter's
gradient is therefore exactly the unsplit model's: splitting changes where the numbers live,
not the numbers.

An activation's shape is not known to the receiver in advance, so `send_tensor` first sends a
small header (ndim and the dims), then the data; a gradient has the shape of the activation it
belongs to, so it goes without a header.

`grid_groups` adds data parallelism on top (a 2-D grid): with dp x mp ranks, replica r holds
ranks [r*mp, (r+1)*mp) and splits the model over them; the ranks that hold the same stage in
different replicas average their gradients with one all_reduce.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "GridGroups",
    "all_reduce_gradients",
    "forward_backward_step",
    "grid_groups",
    "module_device",
    "recv_tensor",
    "send_tensor",
    "split_boundaries",
    "split_sequential",
    "train_step",
]

MAX_DIMS = 8
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def split_boundaries(num_layers: int, num_stages: int) -> list[int]:
    """Boundaries [0, b_1, ..., num_layers] of a split into near-equal layer counts.

    Stage s holds layers [b_s, b_{s+1}); the first `num_layers % num_stages` stages get one more.
    """
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"num_stages must be in [1, {num_layers}], got {num_stages}")
    base, extra = divmod(num_layers, num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return bounds


def split_sequential(
    model: nn.Sequential, num_stages: int, boundaries: list[int] | None = None
) -> list[nn.Sequential]:
    """Cut `model` into `num_stages` contiguous pieces (they share the model's parameters).

    `boundaries` is [0, b_1, ..., len(model)], increasing; by default equal layer counts.
    """
    n = len(model)
    if boundaries is None:
        boundaries = split_boundaries(n, num_stages)
    ok = len(boundaries) == num_stages + 1 and boundaries[0] == 0 and boundaries[-1] == n
    if not ok or any(a >= b for a, b in itertools.pairwise(boundaries)):
        raise ValueError(
            f"boundaries must be {num_stages + 1} increasing integers from 0 to {n}, "
            f"got {boundaries}"
        )
    return [model[a:b] for a, b in itertools.pairwise(boundaries)]


def module_device(module: nn.Module) -> torch.device:
    """The device of `module`'s first parameter (a stage's activations live there), else CPU."""
    first = next(module.parameters(), None)
    return first.device if first is not None else torch.device("cpu")  # no parameters: CPU


def _global(group: dist.ProcessGroup | None, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def send_tensor(
    tensor: torch.Tensor,
    dst: int,
    group: dist.ProcessGroup | None = None,
    tag: int = 0,
    header: bool = True,
) -> list[dist.Work]:
    """Start sending `tensor` to group rank `dst` (after a shape header unless header=False).

    Non-blocking (isend): the caller keeps the returned works and `wait()`s on them (which also
    keeps the buffers alive). Over gloo, two stages that both send before they receive cannot
    deadlock. Over NCCL, the sends and receives between two ranks run in order on one stream,
    and a send larger than NCCL's buffers can wait there for the peer's receive: stages that
    cross large sends can hang, which is why torch's pipelining and Megatron post such a send
    and receive together (`dist.batch_isend_irecv`).
    Tags 2*tag and 2*tag+1 are used for the header and the data.
    """
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"tensor.dim() must be in [0, {MAX_DIMS}], got {tensor.dim()}")
    peer, data = _global(group, dst), tensor.detach().contiguous()
    works = []
    if header:
        head = torch.zeros(MAX_DIMS + 1, dtype=torch.int64, device=data.device)
        head[0] = data.dim()
        head[1 : 1 + data.dim()] = torch.tensor(data.shape, dtype=torch.int64)
        works.append(dist.isend(head, peer, group=group, tag=2 * tag))
    works.append(dist.isend(data, peer, group=group, tag=2 * tag + 1))
    return works


def recv_tensor(
    src: int,
    group: dist.ProcessGroup | None = None,
    tag: int = 0,
    shape: torch.Size | tuple[int, ...] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Receive a tensor from group rank `src` (blocking) onto `device` (default: the CPU; the
    sender's header went from the same kind of device); its shape from a header unless given."""
    peer = _global(group, src)
    if shape is None:
        head = torch.empty(MAX_DIMS + 1, dtype=torch.int64, device=device)
        dist.recv(head, peer, group=group, tag=2 * tag)
        shape = tuple(head[1 : 1 + int(head[0])].tolist())
    out = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(out, peer, group=group, tag=2 * tag + 1)
    return out


def forward_backward_step(
    stage_module: nn.Module,
    x: torch.Tensor | None,
    y: torch.Tensor | None,
    loss_fn: LossFn,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor | None:
    """One forward and backward through a model split over the ranks of `group`.

    Runs on every rank of the group; every rank must call it. Group rank s runs stage s:
    the first stage needs `x`, the last needs `y` (others may pass None). Gradients accumulate
    into `stage_module`'s parameters, as with `loss.backward()`. Returns the loss (detached)
    on the last stage and None elsewhere.
    """
    stage, num_stages = dist.get_rank(group), dist.get_world_size(group)
    first, last = stage == 0, stage == num_stages - 1
    if first and x is None or last and y is None:
        raise ValueError("the first stage needs x and the last stage needs y")
    device = module_device(stage_module)
    inp = x if first else recv_tensor(stage - 1, group, device=device).requires_grad_()
    out = stage_module(inp)
    if last:
        loss = loss_fn(out, y)
        loss.backward()
    else:
        for work in send_tensor(out, stage + 1, group):
            work.wait()
        grad = recv_tensor(stage + 1, group, shape=out.shape, dtype=out.dtype, device=device)
        out.backward(grad)
    if not first:
        # The receiver knows the gradient's shape: it is that of the activation it sent.
        for work in send_tensor(inp.grad, stage - 1, group, header=False):
            work.wait()
    return loss.detach() if last else None


def train_step(
    stage_module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    x: torch.Tensor | None,
    y: torch.Tensor | None,
    loss_fn: LossFn,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor | None:
    """zero_grad, `forward_backward_step`, optimizer step: one training step of a split model.

    Runs on every rank of the group; every rank must call it. Each rank's optimizer holds only
    its stage's parameters (no communication is needed for the update); a stage without
    parameters passes None. Returns the loss on the last stage and None elsewhere.
    """
    if optimizer is not None:
        optimizer.zero_grad()
    loss = forward_backward_step(stage_module, x, y, loss_fn, group)
    if optimizer is not None:
        optimizer.step()
    return loss


@dataclass
class GridGroups:
    """This rank's place in a dp x mp grid and the two groups it belongs to."""

    dp_rank: int  # which replica
    mp_rank: int  # which stage inside the replica
    dp_group: dist.ProcessGroup  # same stage, all replicas: gradients are averaged here
    mp_group: dist.ProcessGroup  # one replica, all stages: activations flow here


def grid_groups(dp_size: int = 2, mp_size: int = 2) -> GridGroups:
    """Build the data-parallel and model-parallel groups of a dp_size x mp_size grid.

    Runs on every rank of the default group; every rank must call it (each `dist.new_group`
    is collective, so all ranks create every group in the same order). Global rank
    r = dp_rank * mp_size + mp_rank.
    """
    world = dist.get_world_size()
    if dp_size < 1 or mp_size < 1 or dp_size * mp_size != world:
        raise ValueError(
            f"dp_size * mp_size must equal world_size={world}, got {dp_size}x{mp_size}"
        )
    rank = dist.get_rank()
    dp_rank, mp_rank = divmod(rank, mp_size)
    dp_group = mp_group = None
    for m in range(mp_size):
        g = dist.new_group([d * mp_size + m for d in range(dp_size)])
        if m == mp_rank:
            dp_group = g
    for d in range(dp_size):
        g = dist.new_group([d * mp_size + m for m in range(mp_size)])
        if d == dp_rank:
            mp_group = g
    assert dp_group is not None and mp_group is not None
    return GridGroups(dp_rank, mp_rank, dp_group, mp_group)


def all_reduce_gradients(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Average every parameter gradient of `module` over `group` (one all_reduce each).

    Runs on every rank of the group; every rank must call it with the same module structure.
    """
    size = dist.get_world_size(group)
    for param in module.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, group=group)
            param.grad /= size
