"""Megatron-style tensor parallelism from two identities (runs on ranks).

With n ranks and a linear layer Y = XA (torch stores A^T as `weight`, shape [out, in]):
- column split, A = [A_1, ..., A_n] by output columns: XA = [XA_1, ..., XA_n], so rank i
  computes XA_i from the full X and holds a slice of the output features;
- row split, A = [A_1; ...; A_n] by input rows and X = [X_1, ..., X_n]: XA = sum_i X_i A_i, so
  rank i computes a partial sum and an all_reduce adds them.

An MLP Y = act(X A) B splits A by columns and B by rows: the activation is elementwise, so
act(X A_i) B_i needs nothing from other ranks and the layer costs one all_reduce in forward.
Autograd needs the mirror image, written as two small Functions (Megatron's f and g):
- `copy_to_parallel` (f): identity forward; backward all_reduces dL/dX, because every rank's
  slice contributed to the loss through the same X;
- `reduce_from_parallel` (g): all_reduce forward; identity backward (the sum's gradient is
  the same for every addend).
Self-attention splits the same way by heads: Q, K, V column-split (whole heads per rank), the
output projection row-split, one all_reduce in forward and one in backward for dL/dX.

Constructors `from_dense` slice a dense layer's weights, so a test can compare with it;
`weight_slices` says which slice of each dense weight a rank holds. `dtensor_mlp` builds the
same MLP with torch's DTensor `parallelize_module` (ColwiseParallel, RowwiseParallel), which
works on a CPU DeviceMesh with gloo; `count_collectives` counts collectives with CommDebugMode.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ColumnParallelLinear",
    "ParallelMLP",
    "ParallelSelfAttention",
    "RowParallelLinear",
    "SelfAttention",
    "WeightSlice",
    "copy_to_parallel",
    "count_collectives",
    "dtensor_mlp",
    "reduce_from_parallel",
    "weight_slices",
]

Group = dist.ProcessGroup | None


class _CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        x = x.clone().contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_parallel(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """f: identity forward, all_reduce of the gradient in backward. Every rank must call it."""
    return _CopyToParallel.apply(x, group)


def reduce_from_parallel(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """g: all_reduce (sum) forward, identity backward. Every rank must call it."""
    return _ReduceFromParallel.apply(x, group)


def _shard(size: int, group: Group, what: str) -> tuple[int, int]:
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    if size % n:
        raise ValueError(f"{what} must be a multiple of the group size {n}, got {size}")
    return rank * size // n, (rank + 1) * size // n


class ColumnParallelLinear(nn.Module):
    """Y_i = X A_i + b_i: this rank's slice [start, stop) of the output features.

    Runs on every rank of the group; every rank must call forward (backward all_reduces dL/dX
    unless `copy_input` is False, when the caller has already applied `copy_to_parallel`).
    """

    def __init__(self, dense: nn.Linear, group: Group = None, copy_input: bool = True) -> None:
        super().__init__()
        self.group, self.copy_input = group, copy_input
        self.start, self.stop = _shard(dense.out_features, group, "out_features")
        self.full_shape = tuple(dense.weight.shape)
        self.weight = nn.Parameter(dense.weight.detach()[self.start : self.stop].clone())
        b = dense.bias
        self.bias = None if b is None else nn.Parameter(b.detach()[self.start : self.stop].clone())

    @classmethod
    def from_dense(cls, dense: nn.Linear, group: Group = None) -> ColumnParallelLinear:
        return cls(dense, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = copy_to_parallel(x, self.group)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = sum_i X_i A_i + b: takes this rank's slice of the input features, all_reduces.

    Runs on every rank of the group; every rank must call forward. The bias is replicated and
    added once, after the sum.
    """

    def __init__(self, dense: nn.Linear, group: Group = None) -> None:
        super().__init__()
        self.group = group
        self.start, self.stop = _shard(dense.in_features, group, "in_features")
        self.full_shape = tuple(dense.weight.shape)
        self.weight = nn.Parameter(dense.weight.detach()[:, self.start : self.stop].clone())
        b = dense.bias
        self.bias = None if b is None else nn.Parameter(b.detach().clone())

    @classmethod
    def from_dense(cls, dense: nn.Linear, group: Group = None) -> RowParallelLinear:
        return cls(dense, group)

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        y = reduce_from_parallel(F.linear(x_local, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class ParallelMLP(nn.Module):
    """fc2(act(fc1(x))) with fc1 column-split and fc2 row-split: one all_reduce in forward.

    Runs on every rank of the group; every rank must call forward.
    """

    def __init__(
        self,
        fc1: nn.Linear,
        fc2: nn.Linear,
        activation: nn.Module | None = None,
        group: Group = None,
    ) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(fc1, group)
        self.act = activation if activation is not None else nn.GELU()
        self.fc2 = RowParallelLinear(fc2, group)

    @classmethod
    def from_dense(
        cls,
        fc1: nn.Linear,
        fc2: nn.Linear,
        activation: nn.Module | None = None,
        group: Group = None,
    ) -> ParallelMLP:
        return cls(fc1, fc2, activation, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, causal: bool
) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d)) V per head; [batch, seq, heads*d] in and out."""
    b, t, _ = q.shape
    q, k, v = (z.view(b, t, num_heads, -1).transpose(1, 2) for z in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return out.transpose(1, 2).reshape(b, t, -1)


class SelfAttention(nn.Module):
    """Dense multi-head self-attention on [batch, seq, dim], the reference for the split one."""

    def __init__(self, dim: int, num_heads: int, causal: bool = True) -> None:
        super().__init__()
        if num_heads < 1 or dim % num_heads:
            raise ValueError(f"num_heads must divide dim={dim} and be >= 1, got {num_heads}")
        self.num_heads, self.causal = num_heads, causal
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(_attend(self.q(x), self.k(x), self.v(x), self.num_heads, self.causal))


class ParallelSelfAttention(nn.Module):
    """SelfAttention with num_heads / n whole heads per rank (Q, K, V by columns, O by rows).

    Runs on every rank of the group; every rank must call forward.
    """

    def __init__(self, dense: SelfAttention, group: Group = None) -> None:
        super().__init__()
        n = dist.get_world_size(group)
        if dense.num_heads % n:
            raise ValueError(
                f"num_heads must be a multiple of the group size {n}, got {dense.num_heads}"
            )
        self.group, self.causal = group, dense.causal
        self.local_heads = dense.num_heads // n
        self.q, self.k, self.v = (ColumnParallelLinear(m, group, copy_input=False)
                                  for m in (dense.q, dense.k, dense.v))  # fmt: skip
        self.o = RowParallelLinear(dense.o, group)

    @classmethod
    def from_dense(cls, dense: SelfAttention, group: Group = None) -> ParallelSelfAttention:
        return cls(dense, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_parallel(x, self.group)  # once for Q, K and V: one all_reduce in backward
        heads = _attend(self.q(x), self.k(x), self.v(x), self.local_heads, self.causal)
        return self.o(heads)


class WeightSlice(NamedTuple):
    """Which part of the dense parameter a rank holds: dim None means a full replica."""

    dim: int | None
    start: int
    stop: int
    full_shape: tuple[int, ...]


def weight_slices(module: nn.Module) -> dict[str, WeightSlice]:
    """For each parameter of `module`: the slice of the dense parameter this rank holds."""
    out: dict[str, WeightSlice] = {}
    for name, param in module.named_parameters():
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        shape = tuple(param.shape)
        if isinstance(owner, ColumnParallelLinear):
            full = owner.full_shape if leaf == "weight" else owner.full_shape[:1]
            out[name] = WeightSlice(0, owner.start, owner.stop, full)
        elif isinstance(owner, RowParallelLinear) and leaf == "weight":
            out[name] = WeightSlice(1, owner.start, owner.stop, owner.full_shape)
        else:
            out[name] = WeightSlice(None, 0, shape[0] if shape else 1, shape)
    return out


def dtensor_mlp(
    fc1: nn.Linear, fc2: nn.Linear, activation: nn.Module | None = None, mesh: Any = None
) -> nn.Sequential:
    """The same MLP as ParallelMLP, built by torch: parallelize_module with Colwise/Rowwise.

    Runs on every rank of the mesh; every rank must call it. The weights become DTensors
    sharded over the 1-D `mesh` (default: a mesh over the whole default group, of the device
    type of `fc1`'s weight: a CUDA mesh for a model on the GPU, a CPU one for a model on the CPU).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if mesh is None:
        mesh = init_device_mesh(fc1.weight.device.type, (dist.get_world_size(),))
    act = activation if activation is not None else nn.GELU()
    model = nn.Sequential(copy.deepcopy(fc1), act, copy.deepcopy(fc2))
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def count_collectives(fn: Callable[[], Any]) -> tuple[Any, dict[str, int]]:
    """Run `fn()` under CommDebugMode; return its result and {collective name: count}.

    Counts torch's functional collectives (DTensor) and plain c10d calls alike.
    """
    from torch.distributed.tensor.debug import CommDebugMode

    mode = CommDebugMode()
    with warnings.catch_warnings():
        # CommDebugMode's module hooks warn when no input requires grad; that is expected here.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        with mode:
            result = fn()
    counts = {getattr(op, "__name__", str(op)): n for op, n in mode.get_comm_counts().items()}
    return result, counts
