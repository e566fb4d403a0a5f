"""Data parallelism by hand: gradient averaging, training, replica checks (rank side).

Every rank holds a full replica of the model and a disjoint shard of each global batch of B
samples (b = B / W per rank). After the backward pass every rank all-reduces its gradient and
divides by W:

    g = (1/W) * sum_r g_r,   g_r = (1/b) * sum_{i in batch_r} grad loss_i

With equal shards this is exactly the gradient of the mean loss over the global batch, so W
replicas that start from the same weights and apply the same update stay bit-identical, and
training equals one process on the whole batch (to float rounding, ~1e-6). `train_sync_sgd`
does this with plain collectives; its `mistake` argument breaks one assumption at a time.

`replica_report` measures how far the replicas have drifted apart.

What else must see the whole global batch lives beside this module: BatchNorm's statistics
(`sync_batch_norm`), the gradient norm for clipping (`grad_clipping`), and accumulation over
micro-batches with one all_reduce (`grad_accumulation`).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit.parallel.datasets import batches, partition, shard_sizes

__all__ = [
    "MISTAKES",
    "average_gradients",
    "broadcast_parameters",
    "make_mlp",
    "param_checksums",
    "replica_report",
    "step_batches",
    "train_reference",
    "train_sync_sgd",
]

Mistake = Literal[
    "no_average",
    "sum_not_average",
    "average_params_after_step",
    "different_seeds",
    "unequal_shards",
]
MISTAKES: tuple[str | None, ...] = (
    None,
    "no_average",  # no all_reduce at all: every replica follows its own shard and drifts
    "sum_not_average",  # all_reduce SUM without / W: replicas agree, the step is W times too big
    "average_params_after_step",  # step on local grads, then average weights: same for SGD only
    "different_seeds",  # seed + rank everywhere, no broadcast: replicas start (and stay) apart
    "unequal_shards",  # lopsided shards: the mean of rank means weights samples unequally
)
Optimizer = Literal["sgd", "adam"]


def make_mlp(
    seed: int, hidden: int = 32, device: torch.device | str | None = None
) -> nn.Sequential:
    """A 64 -> hidden -> 10 MLP for the digits, initialised from `seed` (global RNG untouched),
    then moved to `device` (the lab's `device`): the same weights on every device."""
    if hidden < 1:
        raise ValueError(f"hidden must be >= 1, got {hidden}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    return model.to(device)


def _reinit(model: nn.Module, seed: int) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()


def average_gradients(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """g <- (1/W) * sum_r g_r for every parameter that has a gradient: all_reduce SUM, then / W.

    Runs on every rank; every rank must call it with the same parameters holding gradients.
    (The teaching version: one all_reduce per tensor; DDP packs them into ~25 MB buckets.)
    """
    world_size = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
            p.grad.div_(world_size)


def broadcast_parameters(
    model: nn.Module, src: int = 0, group: dist.ProcessGroup | None = None
) -> None:
    """Copy rank `src`'s parameters and buffers to every rank (what DDP does at construction).

    Runs on every rank; every rank must call it. `src` is a global rank.
    """
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t, src=src, group=group)


def step_batches(
    n: int,
    world_size: int,
    rank: int,
    global_batch: int,
    seed: int,
    epoch: int,
    equal: bool = True,
) -> list[torch.Tensor]:
    """The index batches rank `rank` trains on in `epoch` (pure: any rank can compute any rank's).

    equal=True: b = global_batch / world_size samples per step from an equal shard.
    equal=False: lopsided shards, and rank r's batch is its share of the global batch, so every
    rank still runs the same number of steps (otherwise the extra steps would hang).
    """
    if world_size < 1 or global_batch % world_size:
        raise ValueError(
            f"global_batch must be a positive multiple of world_size ({world_size}), "
            f"got {global_batch}"
        )
    sizes = shard_sizes(n, world_size, equal)
    if equal:
        local = [global_batch // world_size] * world_size
    else:
        local = [max(1, round(global_batch * s / n)) for s in sizes]
    if any(b > s for b, s in zip(local, sizes)):
        raise ValueError(
            f"global_batch must be in [{world_size}, {sum(sizes)}], got {global_batch}"
        )
    num_steps = min(s // b for s, b in zip(sizes, local))
    shard = partition(n, world_size, rank, seed, equal)
    return batches(shard, local[rank], seed, epoch)[:num_steps]


def _make_optimizer(model: nn.Module, name: str, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr)
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr)
    raise ValueError(f"optimizer must be one of ('sgd', 'adam'), got {name!r}")


def train_sync_sgd(
    model: nn.Module,
    X: torch.Tensor,
    y: torch.Tensor,
    epochs: int,
    global_batch: int,
    lr: float,
    seed: int,
    mistake: Mistake | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    optimizer: Optimizer = "sgd",
) -> list[dict[str, Any]]:
    """Synchronous data-parallel training by hand on the default group; returns one record per step.

    Runs on every rank; every rank must call it with the same arguments and the whole (X, y)
    (each rank picks its own shard). Per step: forward/backward on b = global_batch / W local
    samples, `average_gradients`, optimizer step. The model is first broadcast from rank 0.
    `mistake` (one of MISTAKES) breaks one assumption; see `MISTAKES` for what each does.
    Each record (also passed to `on_step`) holds rank, epoch, step, the loss and accuracy over
    the global batch (one small extra all_reduce per step), and local_loss and local_accuracy
    over this rank's own b samples (they differ from rank to rank).
    """
    if mistake not in MISTAKES:
        raise ValueError(f"mistake must be one of {MISTAKES}, got {mistake!r}")
    if epochs < 0:
        raise ValueError(f"epochs must be >= 0, got {epochs}")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    data_seed = seed + rank if mistake == "different_seeds" else seed
    if mistake == "different_seeds":
        _reinit(model, seed + rank)
    else:
        broadcast_parameters(model, src=0)
    opt = _make_optimizer(model, optimizer, lr)
    history: list[dict[str, Any]] = []
    step = 0
    for epoch in range(epochs):
        equal = mistake != "unequal_shards"
        for idx in step_batches(len(X), world_size, rank, global_batch, data_seed, epoch, equal):
            opt.zero_grad(set_to_none=True)
            logits = model(X[idx])
            loss = F.cross_entropy(logits, y[idx])
            loss.backward()
            if mistake in (None, "different_seeds", "unequal_shards"):
                average_gradients(model)
            elif mistake == "sum_not_average":
                for p in model.parameters():
                    dist.all_reduce(p.grad)
            opt.step()
            if mistake == "average_params_after_step":
                with torch.no_grad():
                    for p in model.parameters():
                        dist.all_reduce(p)
                        p.div_(world_size)
            stats = torch.tensor(
                [
                    loss.item() * len(idx),
                    (logits.argmax(1) == y[idx]).sum().item(),
                    len(idx),
                ],
                dtype=torch.float64,
                device=logits.device,
            )
            dist.all_reduce(stats)
            step += 1
            local_correct = (logits.argmax(1) == y[idx]).sum().item()
            record = {
                "rank": rank,
                "epoch": epoch,
                "step": step,
                "loss": (stats[0] / stats[2]).item(),
                "accuracy": (stats[1] / stats[2]).item(),
                "local_loss": loss.item(),
                "local_accuracy": local_correct / len(idx),
            }
            history.append(record)
            if on_step is not None:
                on_step(record)
    return history


def train_reference(
    model: nn.Module,
    X: torch.Tensor,
    y: torch.Tensor,
    epochs: int,
    global_batch: int,
    lr: float,
    seed: int,
    world_size: int,
    optimizer: Optimizer = "sgd",
) -> list[dict[str, Any]]:
    """What `train_sync_sgd` on `world_size` ranks should equal, in one process (no collectives).

    Each step uses the union of the W ranks' batches of that step, in rank order, as one batch.
    """
    opt = _make_optimizer(model, optimizer, lr)
    history: list[dict[str, Any]] = []
    step = 0
    for epoch in range(epochs):
        per_rank = [
            step_batches(len(X), world_size, r, global_batch, seed, epoch)
            for r in range(world_size)
        ]
        for parts in zip(*per_rank):
            idx = torch.cat(parts)
            opt.zero_grad(set_to_none=True)
            logits = model(X[idx])
            loss = F.cross_entropy(logits, y[idx])
            loss.backward()
            opt.step()
            step += 1
            accuracy = (logits.argmax(1) == y[idx]).float().mean().item()
            history.append(
                {
                    "rank": 0,
                    "epoch": epoch,
                    "step": step,
                    "loss": loss.item(),
                    "accuracy": accuracy,
                }
            )
    return history


def _tensor_crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())


def param_checksums(model: nn.Module) -> dict[str, int]:
    """CRC-32 of each parameter's raw bytes: equal checksums mean bit-identical tensors."""
    return {name: _tensor_crc(p) for name, p in model.named_parameters()}


def replica_report(model: nn.Module, group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """How far the replicas of `model` have drifted apart; the same report on every rank.

    Runs on every rank; every rank must call it (two all_gathers: checksums, then weights).
    Returns checksums (one whole-model CRC-32 per rank), max_abs_diff (largest
    max_r(w) - min_r(w) over all weights), per_param (the same per parameter) and identical.
    """
    world_size = dist.get_world_size(group)
    names, params = zip(*model.named_parameters())
    crc = 0
    for p in params:
        crc = zlib.crc32(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes(), crc)
    mine = torch.tensor([crc], dtype=torch.int64, device=params[0].device)
    crcs = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(crcs, mine, group=group)
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat, group=group)
    stacked = torch.stack(gathered)
    spread = (stacked.max(0).values - stacked.min(0).values).to(torch.float64)
    per_param, start = {}, 0
    for name, p in zip(names, params):
        per_param[name] = spread[start : start + p.numel()].max().item()
        start += p.numel()
    checksums = [int(c.item()) for c in crcs]
    max_abs_diff = spread.max().item()
    return {
        "checksums": checksums,
        "max_abs_diff": max_abs_diff,
        "per_param": per_param,
        "identical": len(set(checksums)) == 1 and max_abs_diff == 0.0,
    }
