"""ZeRO-2 and ZeRO-3 by hand, per layer, sharded the way FSDP2 shards (rank side).

A *unit* is a module that holds parameters itself (each `Linear` of an MLP). Each tensor of a
unit is cut on dim 0 into N pieces of ceil(rows / N) rows, as `torch.chunk` and FSDP2's
`fully_shard` cut it: rank r keeps rows [r * c, min(rows, (r + 1) * c)), the last pieces
shorter or empty. On the wire each piece is padded to c rows, so a unit's all-gather and
reduce-scatter move N * sum(c * row size) elements: the same buffers FSDP2 sends.

- `Zero2Optimizer`: weights stay whole; as soon as backward has accumulated every gradient of
  a unit (post-accumulate-grad hooks), the unit's gradients are reduce-scattered and the whole
  gradients freed, so a rank keeps only its rows' averaged gradient; the inner optimizer steps
  those rows; `step()` all-gathers each unit's updated rows back into the whole weights.
- `Zero3Optimizer`: weights are sharded too. Each unit's whole weights exist only while it
  runs: all-gathered by a forward pre-hook, freed after its forward, all-gathered again when
  the gradient of its output arrives in backward, freed with its gradients after the
  reduce-scatter. Freeing resizes the tensors' storage to 0 bytes, so the tensors autograd
  saved for backward see the regathered values.

Both are used like an optimizer (every rank calls `step()`), need every parameter of a unit to
get a gradient in each backward, and expose `held()`, the tensors the rank keeps, which
`zero_redundancy.measure_state_bytes` counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Zero2Optimizer", "Zero3Optimizer", "row_shard_numel", "units_of"]


def units_of(model: nn.Module) -> list[nn.Module]:
    """The modules that hold parameters themselves, in `model.modules()` order."""
    return [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]


def row_shard_numel(shapes: list[tuple[int, ...]], world_size: int, rank: int) -> int:
    """Elements rank `rank` keeps of tensors `shapes` cut on dim 0 like `torch.chunk`."""
    out = 0
    for s in shapes:
        c = math.ceil(s[0] / world_size)
        rows = max(0, min(s[0], (rank + 1) * c) - rank * c)
        out += rows * math.prod(s[1:])
    return out


class _Unit:
    """One unit's tensors, this rank's rows of each (`local`) and the padded wire layout."""

    def __init__(self, module: nn.Module, world_size: int, rank: int) -> None:
        self.params = list(module.parameters(recurse=False))
        self.n, self.rank = world_size, rank
        self.rows = [math.ceil(p.shape[0] / world_size) for p in self.params]  # padded piece
        self.width = [math.prod(p.shape[1:]) for p in self.params]
        self.size = sum(c * w for c, w in zip(self.rows, self.width))  # one rank's wire piece
        self.local = []
        with torch.no_grad():
            for p, c in zip(self.params, self.rows):
                lo, hi = min(p.shape[0], rank * c), min(p.shape[0], (rank + 1) * c)
                self.local.append(nn.Parameter(p[lo:hi].detach().clone()))
        self.pending = 0  # gradients accumulated in this backward so far

    def gather(self) -> None:
        """All-gather every rank's rows into the whole tensors (their storage re-allocated)."""
        p0 = self.params[0]
        send = torch.zeros(self.size, dtype=p0.dtype, device=p0.device)
        off = 0
        for loc, c, w in zip(self.local, self.rows, self.width):
            send[off : off + loc.numel()].copy_(loc.detach().reshape(-1))
            off += c * w
        out = torch.empty(self.n * self.size, dtype=p0.dtype, device=p0.device)
        dist.all_gather_single(out, send)
        out = out.view(self.n, self.size)
        off = 0
        with torch.no_grad():
            for p, c, w in zip(self.params, self.rows, self.width):
                storage = p.untyped_storage()
                if storage.nbytes() == 0:
                    storage.resize_(p.numel() * p.element_size())
                rows = out[:, off : off + c * w].reshape(self.n * c, *p.shape[1:])
                p.data.copy_(rows[: p.shape[0]])  # .data: autograd's saved copies stay valid
                off += c * w

    def free(self) -> None:
        for p in self.params:
            p.untyped_storage().resize_(0)

    def reduce_scatter_grads(self) -> None:
        """Sum the units' gradients over ranks, keep the mean of this rank's rows, drop the rest."""
        p0 = self.params[0]
        send = torch.zeros(self.n, self.size, dtype=p0.dtype, device=p0.device)
        off = 0
        for p, c, w in zip(self.params, self.rows, self.width):
            padded = torch.zeros(self.n * c, w, dtype=p.dtype, device=p.device)
            padded[: p.shape[0]].copy_(p.grad.reshape(p.shape[0], w))
            send[:, off : off + c * w].copy_(padded.view(self.n, c * w))
            p.grad = None  # the whole gradient is freed as soon as it is sent
            off += c * w
        mine = torch.empty(self.size, dtype=p0.dtype, device=p0.device)
        dist.reduce_scatter_single(mine, send.view(-1))
        mine.div_(self.n)
        off = 0
        for loc, c, w in zip(self.local, self.rows, self.width):
            g = mine[off : off + loc.numel()].view_as(loc).clone()  # own memory, no padding
            loc.grad = g if loc.grad is None else loc.grad.add_(g)
            off += c * w


class _ShardedOptimizer:
    """What ZeRO-2 and ZeRO-3 share: units, hooks that reduce-scatter each unit's gradients."""

    free_weights = False

    def __init__(
        self,
        model: nn.Module,
        optimizer_cls: Callable[..., torch.optim.Optimizer] = torch.optim.Adam,
        group: dist.ProcessGroup | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        if group is not None and group is not dist.group.WORLD:
            raise ValueError("group must be the default (world) group; subgroups are not supported")
        self.model = model
        self.modules = units_of(model)
        self.units = [_Unit(m, dist.get_world_size(), dist.get_rank()) for m in self.modules]
        if not self.units:
            raise ValueError("model must hold at least 1 parameter, got 0")
        for unit in self.units:
            for p in unit.params:
                p.register_post_accumulate_grad_hook(self._grad_ready(unit))
        self.optimizer = optimizer_cls(
            [loc for u in self.units for loc in u.local], **optimizer_kwargs
        )

    def _grad_ready(self, unit: _Unit) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            unit.pending += 1
            if unit.pending == len(unit.params):  # the unit's last gradient is in
                unit.pending = 0
                unit.reduce_scatter_grads()
                if self.free_weights:
                    unit.free()

        return hook

    def zero_grad(self) -> None:
        for unit in self.units:
            for t in unit.params + unit.local:
                t.grad = None

    def held(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(weights, gradients) this rank keeps now; whole weights count their storage."""
        weights = [loc for u in self.units for loc in u.local] if self.free_weights else []
        weights += [p for u in self.units for p in u.params if p.untyped_storage().nbytes()]
        grads = [t.grad for u in self.units for t in u.params + u.local if t.grad is not None]
        return weights, grads


class Zero2Optimizer(_ShardedOptimizer):
    """ZeRO-2 by hand: gradients reduce-scattered per unit in backward, optimizer state sharded.

    `held()` counts the whole weights and only this rank's rows of the gradients: the whole
    gradients are freed by the backward hooks. `step()` steps this rank's rows, then
    all-gathers each unit's rows into the whole weights. Every rank calls it.
    """

    @torch.no_grad()
    def step(self) -> None:
        self.optimizer.step()
        for unit in self.units:
            unit.gather()


class Zero3Optimizer(_ShardedOptimizer):
    """ZeRO-3 by hand: also the weights are sharded; gathered per unit only while it runs.

    Built on every rank from the same model: it installs hooks on the model's units and frees
    their whole weights. Forward all-gathers a unit before it runs and frees it after; in
    backward the gradient of the unit's output triggers a second all-gather, the unit's last
    accumulated gradient a reduce-scatter and the freeing. `step()` only steps this rank's
    rows (the next forward gathers them). Every rank calls it.
    """

    free_weights = True

    def __init__(self, model: nn.Module, *args: Any, **kwargs: Any) -> None:
        super().__init__(model, *args, **kwargs)
        for module, unit in zip(self.modules, self.units):
            module.register_forward_pre_hook(lambda *_, u=unit: u.gather())
            module.register_forward_hook(lambda m, i, out, u=unit: self._after_forward(u, out))
            unit.free()

    @staticmethod
    def _after_forward(unit: _Unit, out: Any) -> None:
        unit.free()
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: unit.gather())  # before this unit's backward

    def step(self) -> None:
        self.optimizer.step()

    def full_weights(self) -> list[torch.Tensor]:
        """Every unit's whole weights, gathered (a collective: every rank calls it), as copies."""
        out = []
        for unit in self.units:
            unit.gather()
            out += [p.detach().clone() for p in unit.params]
            unit.free()
        return out
