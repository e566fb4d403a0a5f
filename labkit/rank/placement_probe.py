"""Where a model's parameters live, described by the rank that holds them (runs on a rank).

`describe_model(model)` returns one plain row (a dict) per parameter and buffer that this rank
holds: its path, global and local shape, dtype, device and bytes, and how it is placed. A plain
tensor is `replicated` (the kernel later calls it `split` when only some ranks hold it); a DTensor
is `sharded`, with its placements, device mesh and the slice `(dim, start, stop)` of the global
shape that is local here. Gradient and optimizer-state bytes are counted from what is allocated
now (nothing before the first backward / step); `optim_slots` says how many parameter-sized state
tensors the optimizer will hold (Adam: 2), so the kernel can predict memory before they exist.

A model split by layers: each rank calls `describe_model` on the part it holds, with `prefix` set
to that part's path in the whole model (or names that already match, as torch.distributed.
pipelining keeps them), and the kernel merges the rows (`labkit.views.show_placement`). Each
rank calls this independently; no collective is made. Imports only torch and the stdlib.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["activation_bytes", "describe_model", "optimizer_slots"]


def _bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = _local(t)
    return t.numel() * t.element_size()


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # DTensor
    return to_local() if callable(to_local) else t


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(t, DTensor)


def optimizer_slots(optimizer: torch.optim.Optimizer | None, param: torch.Tensor) -> int | None:
    """Parameter-sized state tensors `optimizer` keeps for `param` (None when unknown)."""
    if optimizer is None:
        return 0
    group = next((g for g in optimizer.param_groups if any(p is param for p in g["params"])), {})
    kind = type(optimizer).__name__
    if kind in ("Adam", "AdamW", "Adamax", "NAdam", "RAdam"):
        return 2 + int(bool(group.get("amsgrad", False)))
    if kind == "SGD":
        return int(group.get("momentum", 0) != 0)
    if kind == "RMSprop":
        return 1 + int(group.get("momentum", 0) != 0) + int(bool(group.get("centered", False)))
    if kind == "Adagrad":
        return 1
    if kind == "Adadelta":
        return 2
    return None


def _state_bytes(optimizer: torch.optim.Optimizer | None, param: torch.Tensor) -> int:
    if optimizer is None:
        return 0
    state = optimizer.state.get(param, {})
    return sum(_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))


def _sharding(param: torch.Tensor) -> dict[str, Any]:
    """Placements, mesh and local slices of a DTensor (no slices where this torch lacks
    torch_compat's `dtensor_local_shape`: the placements still say how it is split)."""
    from labkit.rank import torch_compat

    mesh = param.device_mesh
    dims = sorted({p.dim for p in param.placements if p.is_shard()})
    local_shape_and_offset = torch_compat.get("dtensor_local_shape")
    shard = []
    if local_shape_and_offset is not None:
        local_shape, offset = local_shape_and_offset(param.shape, mesh, param.placements)
        shard = [(d, int(offset[d]), int(offset[d] + local_shape[d])) for d in dims]
    return {
        "placement": "sharded" if dims else "replicated",
        "placements": [repr(p) for p in param.placements],
        "mesh": mesh.mesh.tolist(),
        "mesh_dim_names": list(mesh.mesh_dim_names or ()),
        "shard": shard,
    }


def _row(rank: int, host: str, name: str, kind: str, path: str, tensor: torch.Tensor) -> dict:
    module, _, attr = path.rpartition(".")
    local = _local(tensor)
    return {
        "rank": rank,
        "host": host,
        "model": name,
        "kind": kind,
        "module": module,
        "param": attr,
        "qualname": path,
        "shape": tuple(tensor.shape),
        "local_shape": tuple(local.shape),
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "device": str(local.device),
        "numel": local.numel(),
        "global_numel": tensor.numel(),
        "bytes": _bytes(local),
        "requires_grad": bool(tensor.requires_grad),
        "placement": "replicated",
        "placements": [],
        "mesh": None,
        "mesh_dim_names": [],
        "shard": [],
        "grad_bytes": 0,
        "optim_bytes": 0,
        "optim_slots": 0,
        "optimizer": "",
    }


def describe_model(
    model: nn.Module,
    name: str = "model",
    *,
    optimizer: torch.optim.Optimizer | None = None,
    activations: Mapping[str, int] | int | None = None,
    rank: int | None = None,
    prefix: str = "",
    placement: str | None = None,
) -> list[dict[str, Any]]:
    """One row per parameter and buffer this rank holds, plus one per activation entry.

    `optimizer` adds gradient/state bytes and `optim_slots`; `activations` is bytes per module
    path (see `activation_bytes`) or one total; `rank` defaults to the process group's rank (0
    without one); `prefix` is prepended to every path (the part's place in the whole model);
    `placement` overrides the placement of every row (e.g. "split" for a stage of a pipeline).
    """
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    host = socket.gethostname()
    pre = f"{prefix}." if prefix and not prefix.endswith(".") else prefix
    rows = []
    for path, p in model.named_parameters():
        row = _row(rank, host, name, "param", pre + path, p)
        if _is_dtensor(p):
            row.update(_sharding(p))
        row["grad_bytes"] = _bytes(p.grad)
        row["optim_bytes"] = _state_bytes(optimizer, p)
        row["optim_slots"] = optimizer_slots(optimizer, p)
        row["optimizer"] = type(optimizer).__name__ if optimizer is not None else ""
        rows.append(row)
    for path, b in model.named_buffers():
        row = _row(rank, host, name, "buffer", pre + path, b)
        if _is_dtensor(b):
            row.update(_sharding(b))
        rows.append(row)
    if placement is not None:
        for row in rows:
            row["placement"] = placement
    if isinstance(activations, int):
        activations = {"": activations}
    for path, nbytes in (activations or {}).items():
        act = {"rank": rank, "host": host, "model": name, "kind": "activation"}
        rows.append(
            act | {"module": pre + path if path else prefix, "qualname": "", "bytes": nbytes}
        )
    return rows


def activation_bytes(model: nn.Module, *inputs: Any, **kwargs: Any) -> dict[str, int]:
    """Bytes of each leaf module's output tensors over one forward pass of `model(*inputs)`.

    An upper-bound-ish estimate of what autograd keeps for backward; run on the rank that holds
    `model` (no collective). The forward runs under `torch.no_grad()`, so nothing is kept.
    """
    sizes: dict[str, int] = {}

    def hook(path: str) -> Any:
        def record(_module: nn.Module, _args: Any, output: Any) -> None:
            outs = output if isinstance(output, tuple | list) else (output,)
            total = sum(_bytes(o) for o in outs if isinstance(o, torch.Tensor))
            sizes[path] = sizes.get(path, 0) + total

        return record

    leaves = [(p, m) for p, m in model.named_modules() if not any(True for _ in m.children())]
    handles = [m.register_forward_hook(hook(p)) for p, m in leaves]
    try:
        with torch.no_grad():
            model(*inputs, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return sizes
