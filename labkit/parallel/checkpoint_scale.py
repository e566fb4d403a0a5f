"""Checkpoints of sharded training with torch.distributed.checkpoint (rank side, notebook 44).

DCP writes one file per rank (`__<rank>_0.distcp`, that rank's shards) and a `.metadata` file
that records, for every tensor, its global shape and which chunk lies in which file at which
byte offset. Loading asks for the chunks the *new* layout needs and reads the overlapping pieces
of the old ones, so a checkpoint saved on 4 ranks with Shard(0) loads on 2 ranks with Shard(1):
resharding happens on load, from the metadata alone.

An exact resume needs more than model and optimizer: the data position (the sampler's epoch,
which seeds its permutation, and the batches already consumed in it) and every rank's own RNG
state (dropout masks differ per rank). DCP deduplicates entries whose key is the same on every
rank (one rank writes them, every rank reads that copy), which is right for replicated tensors
and wrong for per-rank RNG states: those need a key per rank (`rng_key`).

Everything here runs on every rank; functions that call into DCP or FSDP2 are collectives.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

__all__ = [
    "GatedWriter",
    "RecordingReader",
    "batches",
    "make_dropout_mlp",
    "restore_extra",
    "resume_extra",
    "rng_key",
    "rng_state",
    "set_rng_state",
    "shard_mlp",
    "train",
]


def make_dropout_mlp(
    seed: int, hidden: int = 128, p: float = 0.3, device: torch.device | str | None = None
) -> nn.Sequential:
    """A 64 -> hidden -> 10 MLP with dropout, initialised from `seed` (global RNG untouched).

    The dropout makes training depend on the RNG: an exact resume must restore it."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"p must be in [0, 1), got {p}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(
            nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(p), nn.Linear(hidden, 10)
        )
    return model.to(device)


def shard_mlp(model: nn.Module, mesh: Any, dim: int = 0) -> nn.Module:
    """FSDP2 over `mesh`: each Linear, then the root, every weight matrix cut on `dim`.

    Every rank must call it. `dim=0` is FSDP2's default (rows); `dim=1` cuts the columns
    (`shard_placement_fn`); 1-D biases are cut on dim 0 either way."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    if dim not in (0, 1):
        raise ValueError(f"dim must be 0 or 1, got {dim}")

    def placement(param: nn.Parameter) -> Shard:
        return Shard(dim if param.ndim == 2 else 0)

    for child in model.children():
        if isinstance(child, nn.Linear):
            fully_shard(child, mesh=mesh, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh, shard_placement_fn=placement)
    return model


def batches(sampler: Any, batch_size: int, epoch: int) -> list[torch.Tensor]:
    """This rank's index batches of `epoch`, in order (a trailing partial batch is dropped).

    Calls `sampler.set_epoch(epoch)` first: a DistributedSampler's permutation is seeded with
    seed + epoch, so the epoch is part of the data position."""
    sampler.set_epoch(epoch)
    order = torch.tensor(list(iter(sampler)))
    n = len(order) // batch_size
    return list(order[: n * batch_size].split(batch_size))


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    X: torch.Tensor,
    y: torch.Tensor,
    sampler: Any,
    batch_size: int,
    start: tuple[int, int],
    stop: tuple[int, int],
) -> tuple[int, int]:
    """Train from position `start` = (epoch, batches done in it) up to `stop`, one optimizer step
    per batch; returns the position reached (== stop). Every rank must call it (FSDP2)."""
    epoch, index = start
    while (epoch, index) < stop:
        order = batches(sampler, batch_size, epoch)
        for idx in order[index:]:
            if (epoch, index) >= stop:
                return epoch, index
            opt.zero_grad()
            nn.functional.cross_entropy(model(X[idx]), y[idx]).backward()
            opt.step()
            index += 1
        epoch, index = epoch + 1, 0
    return epoch, index


def rng_key(rank: int) -> str:
    """The DCP key of one rank's RNG state: a key per rank, so DCP keeps every rank's copy."""
    return f"rng_rank{rank}"


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's RNG state: the CPU generator and, on a CUDA rank, its device's generator
    (dropout on a GPU draws from the CUDA generator, not the CPU one)."""
    state = {"host": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Put back what `rng_state` returned (on the same kind of device)."""
    torch.set_rng_state(state["host"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def resume_extra(position: tuple[int, int], device: torch.device) -> dict[str, Any]:
    """What an exact resume saves beyond model and optimizer, on every rank: the data position
    (epoch and batches done; the same on every rank, so DCP keeps one copy) and this rank's RNG
    under its own key."""
    epoch, index = position
    return {"epoch": epoch, "index": index, rng_key(dist.get_rank()): rng_state(device)}


def restore_extra(extra: dict[str, Any], device: torch.device) -> tuple[int, int]:
    """After `dcp.load` filled `extra` (built by `resume_extra` as a template): put this rank's
    RNG back and return the position to train from."""
    set_rng_state(extra[rng_key(dist.get_rank())], device)
    return extra["epoch"], extra["index"]


class GatedWriter(FileSystemWriter):
    """A FileSystemWriter whose writes wait for `gate` (a threading.Event): a disk that is slow
    until the notebook says so, to show deterministically what async_save has and has not done
    when it returns. Staging (the copy of the state) is FileSystemWriter's own."""

    def __init__(self, path: str, gate: threading.Event, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.gate = gate

    def write_data(self, plan: Any, planner: Any) -> Any:
        if not self.gate.wait(timeout=120):
            raise TimeoutError("GatedWriter: the gate was never opened")
        return super().write_data(plan, planner)


class RecordingReader(FileSystemReader):
    """A FileSystemReader that notes what this rank reads, to show what resharding on load reads.

    `reads` gets one tuple per read: (key, offset of the saved chunk read from, offset of the
    piece in that chunk, offset of the piece in this rank's tensor, the piece's lengths), from
    the ReadItems of the load plan DCP hands to `read_data`. The reading is FileSystemReader's."""

    def __init__(self, path: str, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.reads: list[tuple[Any, ...]] = []

    def read_data(self, plan: Any, planner: Any) -> Any:
        for item in plan.items:
            index = item.storage_index
            self.reads.append(
                (
                    index.fqn,
                    tuple(index.offset or ()),
                    tuple(item.storage_offsets),
                    tuple(item.dest_offsets),
                    tuple(item.lengths),
                )
            )
        return super().read_data(plan, planner)
