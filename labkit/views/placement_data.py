"""Merging placement rows from all ranks and predicting memory (kernel side, pure data).

The rows come from `labkit.rank.placement_probe.describe_model` on each rank. Nothing here
draws; the placement view and tests use these functions directly.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["LAYOUTS", "memory_by_rank", "merge_placement", "shared_device_notes"]

LAYOUTS = {
    "replicated": "replicated (whole tensor on every rank)",
    "split": "split by layers (only on some ranks)",
    "sharded": "sharded (DTensor: a slice per rank)",
}


def merge_placement(
    rows: Iterable[Mapping[str, Any]], world_size: int | None = None
) -> list[dict[str, Any]]:
    """Copies of `rows` with `layout` set to 'replicated', 'split' or 'sharded'.

    A parameter is sharded when its rank said so (a DTensor shard), split when its rank said so
    or when fewer ranks than all hold a parameter of that name, replicated otherwise. "All" is
    every rank that sent a row, or `range(world_size)` when given.
    """
    out = [dict(r) for r in rows]
    ranks = {r["rank"] for r in out} | set(range(world_size or 0))
    holders: dict[str, set[int]] = defaultdict(set)
    for r in out:
        if r.get("kind") != "activation":
            holders[r["qualname"]].add(r["rank"])
    for r in out:
        if r.get("kind") == "activation":
            r["layout"] = "activation"
        elif r.get("placement") in ("sharded", "split"):
            r["layout"] = r["placement"]
        else:
            r["layout"] = "split" if len(holders[r["qualname"]]) < len(ranks) else "replicated"
    return out


def _formula(params: list[Mapping[str, Any]], total: int, extra: int) -> str:
    numel = sum(r["numel"] for r in params)
    sizes = {
        (r["bytes"] // max(r["numel"], 1), r.get("optim_slots") or 0, r["requires_grad"])
        for r in params
    }
    if len(sizes) == 1:
        e, slots, grad = sizes.pop()
        per = e * (1 + int(grad) + slots)
        text = f"{numel:,} params x {per} B ({e} param + {e * int(grad)} grad + {e * slots} optim)"
    else:
        text = f"{numel:,} params x (param + grad + optimizer slots) bytes each"
    if extra:
        text += f" + {extra:,} B buffers/activations"
    return f"{text} = {total:,} B"


def memory_by_rank(
    rows: Iterable[Mapping[str, Any]], predicted: int | Mapping[int, int] | None = None
) -> dict[int, dict[str, Any]]:
    """Per rank: bytes of params (incl. buffers), grads, optimizer, activations, total, predicted.

    The prediction, unless given, is sum(param bytes x (1 + requires_grad + optim_slots)) plus
    buffers and activations: what the rank will hold once gradients and optimizer state exist.
    """
    by_rank: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for r in rows:
        by_rank[r["rank"]].append(r)
    out = {}
    for rank, mine in sorted(by_rank.items()):
        params = [r for r in mine if r.get("kind") == "param"]
        buffers = sum(r["bytes"] for r in mine if r.get("kind") == "buffer")
        acts = sum(r["bytes"] for r in mine if r.get("kind") == "activation")
        m: dict[str, Any] = {
            "params": sum(r["bytes"] for r in params) + buffers,
            "grads": sum(r.get("grad_bytes", 0) for r in params),
            "optimizer": sum(r.get("optim_bytes", 0) for r in params),
            "activations": acts,
        }
        m["total"] = m["params"] + m["grads"] + m["optimizer"] + acts
        model = sum(
            r["bytes"] * (1 + int(r["requires_grad"]) + (r.get("optim_slots") or 0)) for r in params
        )
        m["predicted"] = model + buffers + acts
        m["formula"] = _formula(params, m["predicted"], buffers + acts) if params else ""
        if predicted is not None:
            given = predicted if isinstance(predicted, int) else predicted.get(rank, 0)
            m["predicted"], m["formula"] = given, f"given: {given:,} B"
        out[rank] = m
    return out


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def shared_device_notes(
    rows: Iterable[Mapping[str, Any]], info: Iterable[Mapping[str, Any]] = ()
) -> list[str]:
    """Notes for ranks that share one device: one GPU (memory adds up) or the host's CPU."""
    where: dict[int, tuple[str, str]] = {}
    for i in info:
        where[int(i["rank"])] = (str(i.get("host", "")), str(i["device"]))
    for r in rows:
        if r.get("kind") != "activation" and r.get("device"):
            where.setdefault(r["rank"], (str(r.get("host", "")), str(r["device"])))
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for rank, key in sorted(where.items()):
        groups[key].append(rank)
    notes = []
    for (host, device), ranks in groups.items():
        if len(ranks) < 2:
            continue
        on = f" on {host}" if host else ""
        if device.startswith("cpu"):
            notes.append(
                f"ranks {_ranks_text(ranks)} are CPU ranks{on}: they share its memory and CPU cores"
            )
        else:
            notes.append(
                f"ranks {_ranks_text(ranks)} share {device}{on}: their memory adds up "
                "on one device, and they need gloo (nccl wants a GPU per rank)"
            )
    return notes
