"""ZeRO: shard what data parallelism replicates; memory formulas and ZeRO-1 by hand (rank side).

Adam training holds per parameter (Rajbhandari et al., ZeRO, 2020), Psi = number of parameters:

    mixed precision: 2 (fp16 weights) + 2 (fp16 grads) + 12 (fp32 master weights, m, v) = 16 B
    plain fp32:      4 (weights)      + 4 (grads)      +  8 (m, v)                      = 16 B

Plain data parallelism keeps all 16 Psi bytes on each of N ranks. ZeRO stage 1 shards the
optimizer state (12 Psi / N), stage 2 also the gradients (2 Psi / N), stage 3 also the weights
(2 Psi / N). E.g. Psi = 7.5e9, N = 64: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per rank.

ZeRO-1 step on rank r, which owns slice r of the flattened (padded) parameter vector:
reduce_scatter the gradients (sum, / N) so rank r gets the averaged gradient of its slice, step
the optimizer on that slice only, all_gather the slices. Communication equals one all_reduce
(= reduce_scatter + all_gather); the result equals the replicated optimizer step exactly,
because Adam and SGD are elementwise. ZeRO-2 and ZeRO-3 by hand are in `zero_stages`; FSDP2
(`fully_shard`) is PyTorch's ZeRO-3. `zero_traffic` gives each stage's collectives per step.

16 Psi / N is what a ZeRO-3 rank holds *after* `step()`. Its peak, in backward, holds more:
the unit being computed gathered whole, the next unit prefetched, the unit's whole gradient
before its reduce-scatter and the previous unit's reduce-scatter still in flight (each a whole
unit, U bytes), plus the activations. `AllocationPeak` measures that peak from the allocator's
own records (torch.profiler, `profile_memory=True`), on CPU ranks too, where torch keeps no
allocator statistics; notebook 26 sets it beside the formula `fsdp_peak_bytes`.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit.parallel.layer_split import module_device

__all__ = [
    "AllocationPeak",
    "Zero1Optimizer",
    "adam_bytes_breakdown",
    "adam_bytes_per_param",
    "fsdp_peak_bytes",
    "fully_shard_model",
    "measure_state_bytes",
    "zero_memory",
    "zero_traffic",
]


def adam_bytes_breakdown(mixed_precision: bool = True) -> dict[str, int]:
    """Bytes per parameter for Adam training: weights, grads, optimizer state (see module doc)."""
    if mixed_precision:
        return {"params": 2, "grads": 2, "optimizer": 12}
    return {"params": 4, "grads": 4, "optimizer": 8}


def adam_bytes_per_param(mixed_precision: bool = True) -> int:
    """16: both mixed-precision (2 + 2 + 12) and fp32 (4 + 4 + 8) Adam hold 16 bytes/param."""
    return sum(adam_bytes_breakdown(mixed_precision).values())


def zero_memory(
    num_params: int, world_size: int, stage: int, mixed_precision: bool = True
) -> dict[str, int]:
    """Bytes each rank holds for weights, grads and optimizer state under ZeRO `stage` (0-3).

    Stage 0 is plain data parallelism. A sharded part holds ceil(num_params / world_size)
    parameters per rank (the padded shard). Keys: params, grads, optimizer, total.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be in [0, 3], got {stage}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, got {num_params}")
    per_param = adam_bytes_breakdown(mixed_precision)
    shard = math.ceil(num_params / world_size)
    sharded = {"optimizer": stage >= 1, "grads": stage >= 2, "params": stage >= 3}
    out = {k: per_param[k] * (shard if sharded[k] else num_params) for k in per_param}
    out["total"] = sum(out.values())
    return out


def zero_traffic(num_params: int, stage: int, element_size: int = 4) -> dict[str, int]:
    """Bytes of one step's collectives on a rank, as labkit's trace records them (per op).

    A record's bytes are the whole buffer (nccl-tests' S): an all_gather's gathered output, a
    reduce_scatter's unsplit input. `num_params` counts the parameters as sent, padded to whole
    shards. Stage 0 all-reduces the gradients (S = Psi); stages 1 and 2 reduce-scatter them and
    all-gather the updated weights (Psi + Psi, the same as an all-reduce); stage 3 all-gathers
    the weights before forward and again before backward (2 Psi) and reduce-scatters the
    gradients (Psi). A ring sends (N-1)/N of S per rank for each all_gather and reduce_scatter
    and twice that for an all_reduce: stage 3 moves 1.5 times what stages 0-2 move.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be in [0, 3], got {stage}")
    psi = num_params * element_size
    out = {
        "all_reduce": psi if stage == 0 else 0,
        "reduce_scatter": psi if stage >= 1 else 0,
        "all_gather": {0: 0, 1: psi, 2: psi, 3: 2 * psi}[stage],
    }
    out["total"] = sum(out.values())
    return out


class Zero1Optimizer:
    """ZeRO-1 by hand: each rank keeps optimizer state for 1/N of the weights only.

    Built on every rank from the same model; `step()` runs on every rank and every rank must
    call it. The parameters are moved into one flat vector (they become views of it, padded to
    a multiple of N); rank r owns slice r and its inner optimizer (`optimizer_cls`, e.g.
    torch.optim.Adam) sees only that slice. Use like an optimizer: backward, `step()`,
    `zero_grad()`. Gradients need not be averaged first: `step()` reduce-scatters them.
    Not a torch.optim.Optimizer (LR schedulers do not attach to it). `zero_stages` goes on:
    ZeRO-2 frees the whole gradients after a reduce_scatter per layer, ZeRO-3 the weights too.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        optimizer_cls: Callable[..., torch.optim.Optimizer] = torch.optim.Adam,
        group: dist.ProcessGroup | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        self.params = list(params)
        if not self.params:
            raise ValueError("params must hold at least 1 parameter, got 0")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"params must share one dtype, got {sorted(map(str, dtypes))}")
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        total = sum(p.numel() for p in self.params)
        self.shard_size = math.ceil(total / self.world_size)
        self.flat = torch.zeros(
            self.shard_size * self.world_size, dtype=dtypes.pop(), device=self.params[0].device
        )
        offset = 0
        with torch.no_grad():
            for p in self.params:
                view = self.flat[offset : offset + p.numel()]
                view.copy_(p.reshape(-1))
                p.data = view.view_as(p)  # the model now reads its weights from self.flat
                offset += p.numel()
        # A Parameter made from a view shares its storage: stepping it updates self.flat.
        lo = self.rank * self.shard_size
        self.shard = nn.Parameter(self.flat[lo : lo + self.shard_size])
        self.optimizer = optimizer_cls([self.shard], **optimizer_kwargs)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.shard.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """reduce_scatter grads (mean), step own slice, all_gather slices. Every rank calls it."""
        flat_grad = torch.zeros_like(self.flat)
        offset = 0
        for p in self.params:
            if p.grad is not None:
                flat_grad[offset : offset + p.numel()].copy_(p.grad.reshape(-1))
            offset += p.numel()
        shard_grad = torch.empty(self.shard_size, dtype=self.flat.dtype, device=self.flat.device)
        dist.reduce_scatter(shard_grad, list(flat_grad.chunk(self.world_size)), group=self.group)
        self.shard.grad = shard_grad.div_(self.world_size)
        self.optimizer.step()
        # Own slice is already updated in place; fetch everyone's (input cloned: no aliasing).
        slices = list(self.flat.chunk(self.world_size))
        dist.all_gather(slices, self.shard.detach().clone(), group=self.group)


def _local(t: torch.Tensor) -> torch.Tensor:
    # FSDP2 parameters and their optimizer state are DTensors: count only this rank's piece.
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def measure_state_bytes(model: nn.Module, optimizer: Any) -> dict[str, int]:
    """Bytes this rank actually holds for weights, grads and optimizer state (no collectives).

    Counts this rank's local piece of sharded (FSDP2 DTensor) tensors; for the by-hand
    optimizers (Zero1Optimizer, zero_stages' Zero2Optimizer and Zero3Optimizer) the optimizer
    state is their inner optimizer's state for the owned rows, and ZeRO-2/3 say which weights
    and gradients they keep (`held()`). Keys: params, grads, optimizer, total.
    """
    if hasattr(optimizer, "held"):
        weights, grads = optimizer.held()
    else:
        weights = list(model.parameters())
        grads = [p.grad for p in weights if p.grad is not None]
    inner = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer.optimizer
    state = [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    out = {
        "params": sum(_nbytes(p) for p in weights),
        "grads": sum(_nbytes(g) for g in grads),
        "optimizer": sum(_nbytes(v) for v in state),
    }
    out["total"] = sum(out.values())
    return out


def fully_shard_model(model: nn.Module, mesh: Any = None) -> nn.Module:
    """Shard `model` with FSDP2 (ZeRO-3): each child with weights, then the root.

    Runs on every rank; every rank must call it. Works on CPU with gloo in torch 2.13 (checked
    by the tests): parameters become DTensors sharded on dim 0 over all ranks, gathered for
    each forward/backward and re-sharded after; gradients are reduce-scattered. `mesh`
    defaults to one over the default group of the model's device type: torch's own default is
    the machine's accelerator, a CUDA mesh even for CPU ranks that share a GPU with gloo.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        mesh = init_device_mesh(module_device(model).type, (dist.get_world_size(),))
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp_peak_bytes(unit_bytes: int, world_size: int, activations: int) -> int:
    """Bytes FSDP2 (ZeRO-3) allocates above its sharded weights and optimizer state at the
    peak of a backward of units of `unit_bytes` each (padded, in the weights' dtype), once
    3 or more units run: the unit computed (gathered), the next one prefetched, the unit's
    whole gradient, the previous unit's reduce-scatter in flight (FSDP2 waits for it only
    when it issues the next), that reduce-scatter's output shard, and `activations`."""
    return 4 * unit_bytes + unit_bytes // world_size + activations


class AllocationPeak:
    """Peak bytes allocated on `device_type` inside the block, above what was allocated when
    it began, from torch.profiler's allocation records (rank side; nothing collective).

    `peak`: the highest running sum of allocations minus frees; `end`: that sum at the end.
    It counts every tensor the block allocates (collective buffers, gradients, activations),
    as the allocator reports them: on CPU ranks too, where torch keeps no allocator statistics
    (on CUDA `torch.cuda.max_memory_allocated` gives the same view).
    The profiler records only the allocations and frees made on the thread that profiles: a
    buffer that gloo's own thread frees (the last reference to a collective's tensor) can go
    missing, so a run may read one buffer too high. Take the least of several runs.

        with AllocationPeak() as mem:
            loss.backward()
        mem.peak, mem.end
    """

    def __init__(self, device_type: str = "cpu") -> None:
        self.device_type = device_type
        self.peak = self.end = 0

    def __enter__(self) -> AllocationPeak:
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _quiet_stderr():
            self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        with _quiet_stderr():
            self._prof.__exit__(*exc)
        running = peak = 0
        for _, size in sorted(_allocations(self._prof, self.device_type)):
            running += size
            peak = max(peak, running)
        self.peak, self.end = peak, running


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """fd 2 to /dev/null: kineto writes a "profiler_start" / "profiler_stop" line from C++ at
    every start and stop, which would fill a notebook cell's output on every rank."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _allocations(prof: Any, device_type: str) -> list[tuple[int, int]]:
    """(time in ns, bytes: + allocated, - freed) of the profiler's allocation events. The event
    tree is torch's experimental API (2.x); feature-detected here, in one place."""
    results = getattr(prof.profiler, "kineto_results", None)
    tree = getattr(results, "experimental_event_tree", None)
    if tree is None:
        raise RuntimeError("this torch's profiler has no event tree; AllocationPeak needs one")
    from labkit.rank import torch_compat

    _EventType = torch_compat.get("profiler_event_tree")
    if _EventType is None:
        raise RuntimeError(torch_compat.missing("profiler_event_tree"))
    out, stack = [], list(tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            if fields.device.type == device_type:
                out.append((node.start_time_ns, fields.alloc_size))
    return out
