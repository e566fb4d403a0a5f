"""Two-dimensional parallelism: FSDP2 over a data axis, tensor parallelism over a tensor axis
(runs on ranks).

A 2-D `DeviceMesh` of `dp x tp` ranks, row-major: rank r sits at (r // tp, r % tp). The ranks
of one row (same dp index) form a **tp group**: they hold slices of the same weights and see
the same batch; the ranks of one column (same tp index) form a **dp group**: they hold the same
slice and see different batches. `parallelize_2d` applies the Megatron plan over `mesh["tp"]`
(`ColwiseParallel` on the first Linear, `RowwiseParallel` on the last), then `fully_shard`
over `mesh["dp"]`, which cuts each TP slice again, by dim 0, across the dp group (torch writes
the composed placement as `(_StridedShard(0), Shard(0))` when both cut dim 0).

Per training step each axis carries its own traffic (`axis_bytes`):
- tp axis: one all_reduce of the row-parallel layer's output, [batch/dp, out] (and one of dL/dx
  in backward if the input needed a gradient: not here, the input is data);
- dp axis: FSDP2's all_gather of each unit's TP-local weights before forward and again before
  backward (re-sharded in between), and one reduce_scatter of its gradients.
Collectives of one axis run only inside that axis's groups: what the trace's `group` shows.
With m micro-batches per step (gradient accumulation), FSDP2 does this per micro-batch: 2m
all_gathers + m reduce_scatters per unit, unless the first m-1 skip the gradient sync
(`set_requires_gradient_sync(False)`: one reduce_scatter per step) and/or the unit stays
gathered between forward and backward (`reshard_after_forward=False`: m all_gathers, more
memory), and/or stays gathered from one micro-batch's backward to the next one's forward
(`set_reshard_after_backward(False)` on the first m-1: one all_gather fewer per micro-batch
after the first). `fsdp_step_collectives` counts them.
Every function here that communicates must be called by every rank of the mesh.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = [
    "accumulate_step",
    "axis_bytes",
    "axis_groups",
    "axis_of",
    "batch_rows",
    "fsdp_step_collectives",
    "fsdp_unit_bytes",
    "local_piece",
    "make_2d_mesh",
    "parallelize_2d",
    "train_step",
]


def make_2d_mesh(device_type: str, dp: int, tp: int) -> Any:
    """`init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))`, with a clear
    error when dp·tp is not the world size. Every rank must call it."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if dp < 1 or tp < 1 or dp * tp != world:
        raise ValueError(f"dp x tp must equal the world size {world}, got {dp} x {tp}")
    return init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))


def axis_groups(shape: tuple[int, ...], axis: int) -> list[list[int]]:
    """The groups of global ranks along `axis` of a row-major mesh of `shape` (what
    `init_device_mesh` builds): ranks that differ only in their index on that axis."""
    if not 0 <= axis < len(shape):
        raise ValueError(f"axis must be in [0, {len(shape)}), got {axis}")
    ranks = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    moved = ranks.movedim(axis, -1).reshape(-1, shape[axis])
    return [row.tolist() for row in moved]


def axis_of(group: tuple[int, ...], axes: dict[tuple[int, ...], str], world_size: int) -> str:
    """The mesh axis a traced collective ran on, from its record's `group` (the global ranks):
    the axis name when `axes` (group -> axis) knows the group, "world" for all ranks, "none"
    when the record holds no group (the tracer could not resolve the process group), else
    "other". Never raises: an unexpected record must not break a view of the others."""
    group = tuple(group or ())
    if not group:
        return "none"
    if group in axes:
        return axes[group]
    if sorted(group) == list(range(world_size)):
        return "world"
    return "other"


def parallelize_2d(
    model: nn.Sequential, mesh: Any, reshard_after_forward: bool = True
) -> nn.Sequential:
    """TP over `mesh["tp"]` (first Linear column-, last Linear row-parallel), then FSDP2 over
    `mesh["dp"]` on each Linear and on the whole. Modifies and returns `model`. Every rank of
    the mesh must call it."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    linears = [name for name, m in model.named_children() if isinstance(m, nn.Linear)]
    if len(linears) != 2:
        raise ValueError(f"expected a model with two Linear children, got {linears}")
    first, last = linears
    parallelize_module(model, mesh["tp"], {first: ColwiseParallel(), last: RowwiseParallel()})
    for name in linears:
        fully_shard(
            model.get_submodule(name), mesh=mesh["dp"], reshard_after_forward=reshard_after_forward
        )
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
    return model


def batch_rows(batch: int, dp_rank: int, dp: int) -> torch.Tensor:
    """The rows of a `batch` one dp index trains on: dp_rank, dp_rank + dp, ... Every rank of a
    tp group gets the same rows (they split the weights, not the data)."""
    if batch % dp:
        raise ValueError(f"batch must be a multiple of dp={dp}, got {batch}")
    return torch.arange(dp_rank, batch, dp)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor):
    """One step of cross-entropy on (x, y); returns the loss. Under FSDP2 the gradients come
    out averaged over the dp group, so the step equals one process on every group's rows."""
    opt.zero_grad()
    with warnings.catch_warnings():
        # TP's to_local() outputs are views, and FSDP2 warns that an in-place op on them would
        # skip its backward hook; none follows here (cross_entropy is out of place)
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def accumulate_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
    microbatches: int, sync_every_microbatch: bool = True,
    reshard_every_backward: bool = True,
) -> torch.Tensor:  # fmt: skip
    """One step of `microbatches` forward + backward passes (gradient accumulation, each loss
    divided by m), then the optimizer; returns the mean loss. With `sync_every_microbatch`
    False, FSDP2 reduce-scatters only the last micro-batch's gradients
    (`set_requires_gradient_sync`), the first m-1 accumulate unsharded. With
    `reshard_every_backward` False, only the last backward reshards the weights
    (`set_reshard_after_backward`): the next micro-batch's forward finds them gathered. Every
    rank of the mesh must call it."""
    opt.zero_grad()
    losses = []
    for i, (xs, ys) in enumerate(zip(x.chunk(microbatches), y.chunk(microbatches))):
        if not sync_every_microbatch:
            model.set_requires_gradient_sync(i == microbatches - 1)
        if not reshard_every_backward:
            model.set_reshard_after_backward(i == microbatches - 1)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
            loss = F.cross_entropy(model(xs), ys) / microbatches
        loss.backward()
        losses.append(loss.detach())
    if not sync_every_microbatch:
        model.set_requires_gradient_sync(True)
    if not reshard_every_backward:
        model.set_reshard_after_backward(True)
    opt.step()
    return torch.stack(losses).sum()


def local_piece(param: Any, full: torch.Tensor) -> torch.Tensor:
    """The part of `full` (the whole tensor, as one process holds it) that the DTensor `param`
    keeps on this rank, found from its placements on every mesh axis. No communication."""
    from labkit.rank import torch_compat

    compute_local_shape_and_global_offset = torch_compat.get("dtensor_local_shape")
    if compute_local_shape_and_global_offset is None:
        raise RuntimeError(torch_compat.missing("dtensor_local_shape"))
    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    piece = full
    for dim, (size, start) in enumerate(zip(shape, offset)):
        piece = piece.narrow(dim, start, size)
    return piece


def fsdp_unit_bytes(shapes: list[tuple[int, ...]], tp_dims: list[int | None], tp: int, dp: int,
                    elem: int = 4) -> int:  # fmt: skip
    """Bytes one FSDP2 unit all-gathers over a dp group: each tensor's TP-local shape (dim
    `tp_dims[i]` divided by tp, None when replicated on the tp axis) with dim 0 padded up to a
    multiple of dp."""
    total = 0
    for shape, tp_dim in zip(shapes, tp_dims, strict=True):
        local = list(shape)
        if tp_dim is not None:
            local[tp_dim] //= tp
        rows = -(-local[0] // dp) * dp
        total += rows * int(torch.tensor(local[1:], dtype=torch.long).prod()) * elem
    return total


def fsdp_step_collectives(
    num_units: int, microbatches: int, sync_every_microbatch: bool = True,
    reshard_after_forward: bool = True, reshard_every_backward: bool = True,
) -> dict[str, int]:  # fmt: skip
    """FSDP2's collectives on the dp axis per step of `microbatches` forward + backward passes:
    {"all_gather": ..., "reduce_scatter": ...} over `num_units` units (each holding
    parameters). Each micro-batch's forward gathers each unit, unless the previous backward
    left it gathered (`reshard_every_backward` False); its backward gathers it again when
    forward resharded it; each synced backward reduce-scatters its gradients."""
    if num_units < 1 or microbatches < 1:
        raise ValueError(
            f"num_units and microbatches must be >= 1, got {num_units}, {microbatches}"
        )
    forward_gathers = microbatches if reshard_every_backward else 1
    gathers = forward_gathers + (microbatches if reshard_after_forward else 0)
    syncs = microbatches if sync_every_microbatch else 1
    return {"all_gather": num_units * gathers, "reduce_scatter": num_units * syncs}


def axis_bytes(unit_bytes: list[int], activation_bytes: int, dp: int, tp: int,
               gathers_per_unit: int = 2) -> dict[str, dict[str, float]]:  # fmt: skip
    """Per step and rank, on each axis: the bytes as the trace records them (nccl-tests' S)
    and the bytes the rank sends (S times the bus factor).

    dp: `gathers_per_unit` all_gathers and one reduce_scatter of each unit's bytes, each
    sending (dp-1)/dp of it; tp: one all_reduce of the activation, sending 2(tp-1)/tp of it.
    """
    dp_traced = sum(unit_bytes) * (gathers_per_unit + 1)
    return {
        "dp": {"traced": dp_traced, "sent": (dp - 1) / dp * dp_traced},
        "tp": {"traced": activation_bytes, "sent": 2 * (tp - 1) / tp * activation_bytes},
    }
