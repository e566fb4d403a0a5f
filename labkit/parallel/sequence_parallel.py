"""Sequence parallelism beside Megatron tensor parallelism (runs on ranks).

A transformer block's MLP half, y = x + dropout(fc2(act(fc1(LN(x))))), on [batch, seq, hidden].
Tensor parallelism (`tensor_parallel.ParallelMLP`) splits fc1 by columns and fc2 by rows, but
leaves LayerNorm, dropout and the residual replicated: every rank holds all `s` positions of
those activations. Sequence parallelism (Korthikanti et al., 2022) shards that region along
the sequence dimension instead, so each rank holds `s/n` positions, and swaps the TP region's
collectives:

- before fc1 (column-parallel), an all_gather of the sequence (`gather_sequence`, Megatron's
  g): forward all_gather, backward reduce_scatter;
- after fc2 (row-parallel), a reduce_scatter of the partial sums along the sequence
  (`reduce_scatter_sequence`, g-bar): forward reduce_scatter, backward all_gather.

A ring all_reduce *is* a reduce_scatter followed by an all_gather, so in a ring (NCCL) the bytes
stay the same: each rank sends (n-1)/n·S for each, 2(n-1)/n·S in all, as for one all_reduce.
gloo's reduce_scatter sends 2(n-1)/n·S, as much as its all_reduce (measured with the OS's
TCP counters), so on CPU ranks SP's pair sends 1.5x TP's all_reduce.
The LayerNorm weights and fc2's bias stay replicated but now see only `s/n` positions per rank,
so their gradients are partial sums: `sync_replicated_grads` all_reduces them over the group.

`SequenceParallelBlock.from_dense` slices a dense `Block`; `dtensor_block` builds the same with
torch's `SequenceParallel` + `ColwiseParallel(input_layouts=Shard(1))` +
`RowwiseParallel(output_layouts=Shard(1))`. Both save the *gathered* input of fc1 for its
weight gradient: b·s·h numbers on every rank, not divided by n. Megatron-LM saves only this
rank's s/n positions of it and all-gathers them again in backward (`regather=True`,
`gather_linear`): then every saved activation is divided by n, at the price of one more
all_gather of S per layer in backward. `saved_tensors` lists every tensor autograd keeps
(one entry per storage, parameters left out), `block_saved_bytes` gives each term by formula
for each variant; `sp_comm_bytes` gives each collective's bytes. Every function that
communicates must be called by every rank of the group.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

__all__ = [
    "Block",
    "SequenceParallelBlock",
    "TensorParallelBlock",
    "block_saved_bytes",
    "dtensor_block",
    "gather_linear",
    "gather_sequence",
    "layernorm_saved_bytes",
    "reduce_scatter_sequence",
    "saved_activation_bytes",
    "saved_tensors",
    "sequence_slice",
    "sp_comm_bytes",
    "sync_replicated_grads",
]

Group = dist.ProcessGroup | None
SEQ_DIM = 1  # [batch, seq, hidden], as torch's SequenceParallel assumes by default


def _all_gather(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` (the collective gathers along dim 0)."""
    n = dist.get_world_size(group)
    first = x.movedim(dim, 0).contiguous()
    out = first.new_empty((n * first.shape[0], *first.shape[1:]))
    dist.all_gather_single(out, first, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Sum `x` over the ranks and keep this rank's 1/n of it along `dim`."""
    n = dist.get_world_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} must be a multiple of {n} ranks")
    first = x.movedim(dim, 0).contiguous()
    out = first.new_empty((first.shape[0] // n, *first.shape[1:]))
    dist.reduce_scatter_single(out, first, group=group)
    return out.movedim(0, dim)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # every rank's slice of the gathered sequence fed every rank's columns: sum, keep mine
        return _reduce_scatter(grad, ctx.group, ctx.dim), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # each partial sum's gradient is the whole output's gradient: gather the slices back
        return _all_gather(grad, ctx.group, ctx.dim), None, None


class _GatherLinear(torch.autograd.Function):
    """all_gather(x) @ W.T + b that saves only this rank's x and gathers it again in backward
    (Megatron-LM's sequence-parallel column linear)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Any, group: Group,
                dim: int) -> torch.Tensor:  # fmt: skip
        ctx.group, ctx.dim, ctx.has_bias = group, dim, bias is not None
        ctx.save_for_backward(x, weight)  # x: s/n positions, not the gathered s
        return F.linear(_all_gather(x, group, dim), weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        full = _all_gather(x, ctx.group, ctx.dim)  # the re-gather: one more all_gather of S
        grad_weight = grad.reshape(-1, grad.shape[-1]).T @ full.reshape(-1, full.shape[-1])
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        grad_x = _reduce_scatter(grad @ weight, ctx.group, ctx.dim)
        return grad_x, grad_weight, grad_bias, None, None


def gather_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Any = None, group: Group = None,
    dim: int = SEQ_DIM,
) -> torch.Tensor:  # fmt: skip
    """`F.linear(gather_sequence(x), weight, bias)` keeping only `x` (s/n positions) for
    backward, where it all_gathers `x` again. Every rank must call forward and backward."""
    return _GatherLinear.apply(x, weight, bias, group, dim)


def gather_sequence(x: torch.Tensor, group: Group = None, dim: int = SEQ_DIM) -> torch.Tensor:
    """All_gather along the sequence forward, reduce_scatter backward. Every rank must call."""
    return _Gather.apply(x, group, dim)


def reduce_scatter_sequence(
    x: torch.Tensor, group: Group = None, dim: int = SEQ_DIM
) -> torch.Tensor:
    """Reduce_scatter along the sequence forward, all_gather backward. Every rank must call."""
    return _ReduceScatter.apply(x, group, dim)


def sequence_slice(seq_len: int, rank: int, world_size: int) -> slice:
    """The positions rank `rank` holds in the sequence-parallel region: contiguous, s/n."""
    if seq_len % world_size:
        raise ValueError(f"seq_len must be a multiple of {world_size} ranks, got {seq_len}")
    c = seq_len // world_size
    return slice(rank * c, (rank + 1) * c)


class Block(nn.Module):
    """The dense reference: x + dropout(fc2(GELU(fc1(LayerNorm(x))))) on [batch, seq, dim]."""

    def __init__(self, dim: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(self.act(self.fc1(self.norm(x)))))


class TensorParallelBlock(nn.Module):
    """Megatron TP only: LayerNorm, dropout and residual on the whole sequence on every rank;
    one all_reduce forward (after fc2) and one backward (before fc1). Every rank must call."""

    def __init__(self, dense: Block, group: Group = None) -> None:
        super().__init__()
        self.group = group
        self.norm, self.act, self.drop = (
            copy.deepcopy(m) for m in (dense.norm, dense.act, dense.drop)
        )
        self.fc1 = ColumnParallelLinear(dense.fc1, group)
        self.fc2 = RowParallelLinear(dense.fc2, group)

    @classmethod
    def from_dense(cls, dense: Block, group: Group = None) -> TensorParallelBlock:
        return cls(dense, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(self.act(self.fc1(self.norm(x)))))


class SequenceParallelBlock(nn.Module):
    """TP plus SP: takes and returns this rank's s/n positions [batch, s/n, dim].

    LayerNorm, dropout and the residual run on s/n positions; all_gather before fc1 and
    reduce_scatter after fc2 (fc2's bias is added after the scatter, once per position). Call
    `sync_replicated_grads` after backward. Every rank must call forward and backward.

    `regather=False` saves fc1's gathered input (b·s·h per rank), as torch's
    `SequenceParallel` + `ColwiseParallel` do; `regather=True` saves only this rank's s/n
    positions and all_gathers them again in backward, as Megatron-LM does.
    """

    def __init__(self, dense: Block, group: Group = None, regather: bool = False) -> None:
        super().__init__()
        self.group, self.regather = group, regather
        self.norm, self.act, self.drop = (
            copy.deepcopy(m) for m in (dense.norm, dense.act, dense.drop)
        )
        self.fc1 = ColumnParallelLinear(dense.fc1, group, copy_input=False)
        self.fc2_weight = nn.Parameter(RowParallelLinear(dense.fc2, group).weight.detach())
        self.fc2_bias = nn.Parameter(dense.fc2.bias.detach().clone())
        self.fc2_start, self.fc2_stop = self.fc1.start, self.fc1.stop

    @classmethod
    def from_dense(
        cls, dense: Block, group: Group = None, regather: bool = False
    ) -> SequenceParallelBlock:
        return cls(dense, group, regather)

    def replicated(self) -> list[nn.Parameter]:
        """The parameters every rank holds whole, whose gradients are partial sums under SP."""
        return [*self.norm.parameters(), self.fc2_bias]

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        if self.regather:
            z = gather_linear(self.norm(x_local), self.fc1.weight, self.fc1.bias, self.group)
        else:
            z = self.fc1(gather_sequence(self.norm(x_local), self.group))  # saves [b, s, dim]
        partial = F.linear(self.act(z), self.fc2_weight)  # X_i B_i, [b, s, dim]
        y = reduce_scatter_sequence(partial, self.group) + self.fc2_bias  # [b, s/n, dim]
        return x_local + self.drop(y)


def sync_replicated_grads(params: list[nn.Parameter], group: Group = None) -> None:
    """All_reduce (sum) the gradients of parameters that saw only this rank's positions.

    One flat all_reduce for all of them. Every rank must call it, after backward."""
    grads = [p.grad for p in params]
    if any(g is None for g in grads):
        raise ValueError("every parameter needs a gradient: call it after backward")
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def dtensor_block(dense: Block, mesh: Any = None) -> Block:
    """A copy of `dense` parallelized by torch: SequenceParallel on the norm, fc1 colwise from
    a sequence-sharded input, fc2 rowwise to a sequence-sharded output. Its forward takes and
    returns this rank's s/n positions as plain tensors. Every rank of `mesh` must call it.

    The residual `x + ...` adds two local tensors: the norm's output is a DTensor (sharded on
    the sequence), fc2's is local (`use_local_output`), and x stays local.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if mesh is None:
        mesh = init_device_mesh(dense.fc1.weight.device.type, (dist.get_world_size(),))
    plan = {
        "norm": SequenceParallel(),
        "fc1": ColwiseParallel(input_layouts=Shard(SEQ_DIM)),
        "fc2": RowwiseParallel(output_layouts=Shard(SEQ_DIM)),
    }
    return parallelize_module(copy.deepcopy(dense), mesh, plan)


def saved_tensors(fn: Callable[[], Any], exclude: Any = ()) -> tuple[Any, list[dict]]:
    """Run `fn()`; return its result and every tensor autograd saved for backward meanwhile.

    One entry per storage (a tensor saved twice, or two views of one buffer, count once):
    {"shape", "dtype", "bytes"} of the storage's first saved view, bytes of the whole storage.
    Parameters, and views of the storages of the tensors in `exclude`, are left out (they are
    there anyway). DTensors count their local tensor: what this rank holds.
    """
    skip = {_local(t).untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, dict] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = _local(t)
        ptr = local.untyped_storage().data_ptr()
        if not isinstance(t, nn.Parameter) and ptr not in skip and ptr not in seen:
            seen[ptr] = {
                "shape": tuple(local.shape),
                "dtype": str(local.dtype).removeprefix("torch."),
                "bytes": local.untyped_storage().nbytes(),
            }
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, list(seen.values())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def saved_activation_bytes(fn: Callable[[], Any], exclude: Any = ()) -> tuple[Any, int]:
    """Run `fn()`; return its result and the bytes autograd saved for backward meanwhile
    (the sum of `saved_tensors`: one count per storage, parameters left out)."""
    result, saved = saved_tensors(fn, exclude)
    return result, sum(s["bytes"] for s in saved)


def layernorm_saved_bytes(batch: int, seq: int, dim: int, n: int = 1, elem: int = 4) -> int:
    """What a LayerNorm on [batch, seq/n, dim] saves: its input and the mean and 1/std per
    position: (b·s·h + 2·b·s)·elem/n. n = 1 for TP alone (the whole sequence on every rank)."""
    if seq % n:
        raise ValueError(f"seq must be a multiple of n={n}, got {seq}")
    positions = batch * seq // n
    return (positions * dim + 2 * positions) * elem


SAVED_VARIANTS = ("dense", "tp", "sp", "sp_regather")


def block_saved_bytes(
    batch: int, seq: int, dim: int, hidden: int, t: int, variant: str, elem: int = 4
) -> dict[str, int]:
    """What one rank saves for the block's backward, term by term, in bytes (dropout p = 0).

    P = b·s positions, h = dim, H = hidden, t the TP degree:

    | term                         | dense | tp    | sp    | sp_regather |
    | LayerNorm input              | P·h   | P·h   | P·h/t | P·h/t       |
    | LayerNorm mean               | P     | P     | P/t   | P/t         |
    | LayerNorm 1/std              | P     | P     | P/t   | P/t         |
    | fc1 input (LayerNorm output) | P·h   | P·h   | P·h   | P·h/t       |
    | GELU input (fc1 output)      | P·H   | P·H/t | P·H/t | P·H/t       |
    | fc2 input (GELU output)      | P·H   | P·H/t | P·H/t | P·H/t       |

    "sp" is labkit's `SequenceParallelBlock` and torch's SequenceParallel + ColwiseParallel:
    fc1 saves the gathered input whole. Only "sp_regather" (Megatron-LM) divides every term by
    t. A dropout with p > 0 would add its mask: P·h (dense, tp) or P·h/t (every SP variant).
    """
    if variant not in SAVED_VARIANTS:
        raise ValueError(f"variant must be one of {SAVED_VARIANTS}, got {variant!r}")
    if variant == "dense":
        t = 1
    if seq % t or hidden % t:
        raise ValueError(f"seq and hidden must be multiples of t={t}, got {seq}, {hidden}")
    p = batch * seq
    sharded = t if variant in ("sp", "sp_regather") else 1  # the LayerNorm region
    terms = {
        "LayerNorm input": p * dim // sharded,
        "LayerNorm mean": p // sharded,
        "LayerNorm 1/std": p // sharded,
        "fc1 input": p * dim // (t if variant == "sp_regather" else 1),
        "GELU input": p * hidden // t,
        "fc2 input": p * hidden // t,
    }
    return {k: v * elem for k, v in terms.items()}


def sp_comm_bytes(batch: int, seq: int, dim: int, n: int, elem: int = 4) -> dict[str, float]:
    """Per forward of the block: S = b·s·h·elem, the TP region's activation in bytes.

    TP alone: one all_reduce of S, each rank sending 2(n-1)/n·S. TP + SP: an all_gather and a
    reduce_scatter, each of S as nccl-tests counts it, each rank sending (n-1)/n·S for each in
    a ring (NCCL); gloo's reduce_scatter sends 2(n-1)/n·S instead.
    """
    s = batch * seq * dim * elem
    return {
        "S": s,
        "all_reduce sent": 2 * (n - 1) / n * s,
        "all_gather sent": (n - 1) / n * s,
        "reduce_scatter sent": (n - 1) / n * s,
    }
