"""Uneven inputs under DDP, and what `Join` does about them (runs on ranks).

With DDP every backward all-reduces the gradients, so every rank must run the same number of
backwards. When rank r has n_r batches and the n_r differ, the ranks with more batches wait in
an all-reduce that the ranks that have finished never join: a hang (until the group's timeout).

`torch.distributed.algorithms.join.Join([ddp])` fixes it: a rank whose loop has ended waits in
the context manager's exit, and for every step its peers still run it *shadows* their
collectives, joining each gradient all-reduce with zeros. At step k the gradient every active
rank gets is therefore

    g_k = (1/d_k) * sum over ranks r with k < n_r of grad L_r(batch k of r)

with d_k = the world size (DDP's default, `divide_by_initial_world_size=True`) or the number of
ranks still active (`False`). `join_reference` trains one process by that formula.

- `uneven_batches(rank, counts, batch_size)`: the indices of each of rank r's n_r batches
  (disjoint across ranks and steps).
- `train_ddp(ddp, X, y, batches, lr, join)`: plain SGD on `batches`, inside `Join` if asked.
- `join_reference(model, X, y, counts, batch_size, lr, divide_by_initial_world_size)`: one
  process, the formula above.
- `restart_data()`, `restart_model()`, `train_one_process(steps)`: the seeded data and model of
  `examples/elastic_restart.py` (no data set to load: its workers start twice), and the run of
  one process that never fails, which the restarted job must equal.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import nn

__all__ = [
    "RESTART_BATCH",
    "RESTART_LR",
    "join_reference",
    "restart_data",
    "restart_model",
    "shadow_steps",
    "train_ddp",
    "train_one_process",
    "uneven_batches",
]

RESTART_BATCH, RESTART_LR = 32, 0.5  # per worker and step, in examples/elastic_restart.py


def _check_counts(counts: Sequence[int], batch_size: int) -> None:
    if not counts or any(int(n) < 0 for n in counts):
        raise ValueError(f"counts must be a non-empty list of batch counts >= 0, got {counts}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")


def uneven_batches(rank: int, counts: Sequence[int], batch_size: int) -> list[torch.Tensor]:
    """Rank `rank`'s counts[rank] batches of sample indices: batch k of rank r is the
    (sum(counts[:r]) + k)-th block of `batch_size` samples."""
    _check_counts(counts, batch_size)
    if not 0 <= rank < len(counts):
        raise ValueError(f"rank must be in [0, {len(counts)}), got {rank}")
    start = sum(counts[:rank])
    return [
        torch.arange((start + k) * batch_size, (start + k + 1) * batch_size)
        for k in range(counts[rank])
    ]


def shadow_steps(counts: Sequence[int]) -> list[int]:
    """Per rank: the steps it shadows after its own loop ended, max(counts) - counts[r]."""
    _check_counts(counts, 1)
    return [max(counts) - n for n in counts]


def train_ddp(
    ddp: nn.Module,
    X: torch.Tensor,
    y: torch.Tensor,
    batches: Sequence[torch.Tensor],
    lr: float,
    join: bool = True,
    divide_by_initial_world_size: bool = True,
) -> int:
    """SGD with cross-entropy on this rank's `batches`; with `join`, inside `Join([ddp])`.

    Runs on every rank of the DDP model's group. Without `join` and with uneven batch counts,
    the ranks with more batches wait in an all-reduce nobody else joins. Returns the number of
    steps this rank ran itself."""
    from torch.distributed.algorithms.join import Join

    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    context = (
        Join([ddp], divide_by_initial_world_size=divide_by_initial_world_size)
        if join
        else contextlib.nullcontext()
    )
    with context:
        for b in batches:
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(X[b]), y[b]).backward()
            opt.step()
    return len(batches)


def join_reference(
    model: nn.Module,
    X: torch.Tensor,
    y: torch.Tensor,
    counts: Sequence[int],
    batch_size: int,
    lr: float,
    divide_by_initial_world_size: bool = True,
) -> nn.Module:
    """Train `model` in place, in one process, as DDP under Join does: at step k, the sum of
    the active ranks' gradients divided by the world size (or by the active ranks' count)."""
    _check_counts(counts, batch_size)
    world = len(counts)
    batches = [uneven_batches(r, counts, batch_size) for r in range(world)]
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for k in range(max(counts)):
        active = [r for r in range(world) if k < counts[r]]
        divisor = world if divide_by_initial_world_size else len(active)
        opt.zero_grad()
        for r in active:
            b = batches[r][k]
            (nn.functional.cross_entropy(model(X[b]), y[b]) / divisor).backward()
        opt.step()
    return model


def restart_data(samples: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded inputs (samples x 16) and labels (0..3) for the elastic-restart script."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(samples, 16, generator=g)
    return X, (X[:, :4].sum(1) > 0).long() + 2 * (X[:, 4:8].sum(1) > 0).long()


def restart_model() -> nn.Sequential:
    """The elastic-restart script's model, the same seeded weights in every process."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def train_one_process(steps: int, world_size: int = 2) -> nn.Sequential:
    """What the script's DDP job computes, in one process that never fails: at each step the
    mean loss over every worker's batch (block step*world_size + r of RESTART_BATCH samples)."""
    X, y = restart_data()
    model = restart_model()
    opt = torch.optim.SGD(model.parameters(), lr=RESTART_LR)
    for step in range(steps):
        n = world_size * RESTART_BATCH
        b = torch.arange(step * n, (step + 1) * n)
        opt.zero_grad()
        nn.functional.cross_entropy(model(X[b]), y[b]).backward()
        opt.step()
    return model
