"""Checkpoints for replicated (data-parallel) training: save once, load everywhere (rank side).

With plain data parallelism every rank holds the same weights and optimizer state, so one rank
writes the file and the others wait at a barrier before anyone reads it (reading before the
writer finishes is the classic bug). Every rank then loads it with `map_location`, so a tensor
saved from cuda:0 does not land on rank 3's cuda:0. A reload is correct only if it is
bit-for-bit: `state_equal` compares with torch.equal, never with a tolerance.

Sharded state (ZeRO, FSDP2) differs per rank and needs torch.distributed.checkpoint instead;
this module does not cover it. The file is written to a temporary name and renamed, so a crash
mid-write never leaves a truncated checkpoint under the real name.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit.parallel.layer_split import module_device

__all__ = ["load_checkpoint", "save_checkpoint", "state_equal", "verify_reload"]


def _unwrap(model: nn.Module) -> nn.Module:
    # DDP's state_dict prefixes every key with "module."; save the plain model's keys.
    return getattr(model, "module", model)


def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
    src: int = 0,
) -> None:
    """Rank `src` writes model (and optimizer) state and `extra` to `path`; then a barrier.

    Runs on every rank; every rank must call it (the barrier), and all ranks must hold the
    same state (replicated training), since only rank `src`'s copy is written.
    """
    world_size = dist.get_world_size()
    if not 0 <= src < world_size:
        raise ValueError(f"src must be in [0, {world_size}), got {src}")
    if dist.get_rank() == src:
        state = {
            "model": _unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "extra": extra or {},
        }
        tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
        torch.save(state, tmp)
        os.replace(tmp, path)
    dist.barrier()  # nobody reads before the writer has finished


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    map_location: str | torch.device | None = None,
) -> dict[str, Any]:
    """Load `path` into `model` (and `optimizer`) on this rank; returns the saved `extra`.

    Needs no collective; call it on every rank after `save_checkpoint` returned there.
    map_location defaults to the device of the model's first parameter.
    """
    if map_location is None:
        map_location = module_device(_unwrap(model))
    state = torch.load(path, map_location=map_location, weights_only=True)
    _unwrap(model).load_state_dict(state["model"])
    if optimizer is not None:
        if state["optimizer"] is None:
            raise ValueError(f"{os.fspath(path)} holds no optimizer state; pass optimizer=None")
        optimizer.load_state_dict(state["optimizer"])
    return state["extra"]


def state_equal(a: Any, b: Any) -> bool:
    """True when two (nested) state dicts are bit-identical: same keys, dtypes, shapes, bytes."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.cpu(), b.cpu())
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(state_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(state_equal(x, y) for x, y in zip(a, b))
    return a == b


def verify_reload(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> bool:
    """True when the file at `path` holds exactly this rank's current model (and optimizer) state.

    Needs no collective. Loads onto the device of the model's first parameter (this rank's
    device, whichever rank saved the file), so it is safe to call on any rank.
    """
    state = torch.load(path, map_location=module_device(_unwrap(model)), weights_only=True)
    ok = state_equal(state["model"], _unwrap(model).state_dict())
    if optimizer is not None:
        ok = ok and state_equal(state["optimizer"], optimizer.state_dict())
    return ok
