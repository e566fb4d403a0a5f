"""A Llama-style model split dp x tp x pp: FSDP2 over dp, Megatron TP, one stage per pp rank.

Runs on the ranks, or on one process playing them (`labkit.simulate`). Bias-free, as Llama:
each layer is attention (q, k, v, o: 4h^2; as many key/value heads as query heads) and a SwiGLU
MLP (w1, w3: h -> f, w2: f -> h: 3hf), with RMSNorms *without* a learnable scale (a scale
would be h numbers held whole by every TP rank, which `Psi / tp` does not count). It also
leaves out the rotary position embedding on q and k (RoPE, which has no parameters) and the
final RMSNorm before the output projection, and uses full multi-head attention where Llama 2
70B and Llama 3 use grouped-query attention (fewer k, v heads: smaller k and v weights).

The model is `num_units` equal units, the embedding, `num_layers` layers and the output
projection, when `vocab * hidden` equals a layer's parameters: then every pipeline stage holds
the same number of parameters, as `labkit.parallel.config_memory` assumes (`Psi / (tp pp)`
per rank).

`build_stage(mesh, ...)` builds the units of this rank's stage (by its "pp" coordinate),
applies TP on mesh["tp"] (q, k, v, w1, w3 and the output by columns; o and w2 by rows; the
embedding by rows of its table) and FSDP2 on mesh["dp"] (each layer a unit, then the stage),
and `step(stage, mesh, ...)` runs one forward and backward with the activations sent to the
next stage and their gradients back (send / recv on the pp axis): the collectives a
training step makes, on every axis.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "Stage", "build_stage", "layer_params", "step"]


def layer_params(hidden: int, ffn: int) -> int:
    """Parameters of one layer: 4h^2 (attention) + 3hf (SwiGLU)."""
    return 4 * hidden * hidden + 3 * hidden * ffn


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.norm1 = nn.RMSNorm(hidden, elementwise_affine=False)
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden, bias=False) for _ in "qkvo")
        self.norm2 = nn.RMSNorm(hidden, elementwise_affine=False)
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm1(x)
        # -1 heads: all of them, or this TP rank's share
        q, k, v = (
            p(h).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        h = self.norm2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Stage(nn.Module):
    """A pipeline stage: its units run in order, named as a ModuleDict would name them.

    A Module with a forward rather than an `nn.ModuleDict`: torch 2.11's `fully_shard` refuses
    a ModuleDict or ModuleList ("containers that do not implement forward"), even one that
    defines forward (seen on an H200 with torch 2.11; 2.13 no longer refuses it)."""

    def __setitem__(self, name: str, module: nn.Module) -> None:
        self.add_module(name, module)

    def __getitem__(self, name: str) -> nn.Module:
        return self._modules[name]

    def items(self):  # noqa: ANN201 - (name, unit) in order
        return self._modules.items()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for part in self._modules.values():
            x = part(x)
        return x


def _units(stage: int, stages: int, num_units: int) -> range:
    if num_units % stages:
        raise ValueError(f"num_layers + 2 = {num_units} units must divide into pp={stages} stages")
    per = num_units // stages
    return range(stage * per, (stage + 1) * per)


def build_stage(
    mesh, *, hidden: int, heads: int, ffn: int, vocab: int, num_layers: int, seed: int = 0
) -> Stage:
    """This rank's stage (units in order: "embed", "layer3", "output"), TP then FSDP2 applied.

    `mesh` has axes "dp", "tp" and "pp" (any of size 1). Every rank of the stage builds the
    same weights (`seed`), as a real job loads the same checkpoint."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    stage, stages = mesh["pp"].get_local_rank(), mesh["pp"].size()
    torch.manual_seed(seed + stage)
    parts = Stage()
    for u in _units(stage, stages, num_layers + 2):
        if u == 0:
            parts["embed"] = nn.Embedding(vocab, hidden)
        elif u == num_layers + 1:
            parts["output"] = nn.Linear(hidden, vocab, bias=False)
        else:
            parts[f"layer{u - 1}"] = Block(hidden, heads, ffn)
    tp, dp = mesh["tp"], mesh["dp"]
    for name, part in parts.items():
        if name == "embed":
            parallelize_module(part, tp, RowwiseParallel(input_layouts=Replicate()))
        elif name == "output":
            parallelize_module(part, tp, ColwiseParallel(output_layouts=Shard(-1)))
        else:
            col, row = ColwiseParallel(), RowwiseParallel()
            plan = {"q": col, "k": col, "v": col, "o": row, "w1": col, "w3": col, "w2": row}
            parallelize_module(part, tp, plan)
            fully_shard(part, mesh=dp)
    fully_shard(parts, mesh=dp)
    return parts


def step(stage: Stage, mesh, *, batch: int, seq: int, hidden: int, vocab: int) -> None:
    """One forward and backward of one micro-batch through the pipeline (this rank's part):
    receive the activations from the previous stage, send them on, and the gradients back."""
    pp = mesh["pp"]
    group, me, stages = pp.get_group(), pp.get_local_rank(), pp.size()
    prev = dist.get_global_rank(group, me - 1) if me > 0 else None
    nxt = dist.get_global_rank(group, me + 1) if me < stages - 1 else None
    if prev is None:
        x = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    else:
        x = torch.empty(batch, seq, hidden)
        dist.recv(x, prev)
        x.requires_grad_(True)
    with warnings.catch_warnings():  # the stage's output is a view of its last TP output
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
        y = stage(x)
    if nxt is None:
        y.float().square().mean().backward()
    else:
        dist.send(y.detach(), nxt)
        grad = torch.empty_like(y)
        dist.recv(grad, nxt)
        y.backward(grad)
    if prev is not None:
        dist.send(x.grad, prev)
