"""Which backend and device a lab uses, and checks of what a user asked for (kernel side).

The rule (`choose`, one for forked and attached ranks), per host of `local` ranks and `gpus`:

- no GPU: every rank on the CPU with gloo;
- a GPU per rank (`gpus >= local`): rank r on `cuda:(local_rank % gpus)`, backend
  "cpu:gloo,cuda:nccl": NCCL for CUDA tensors, gloo for CPU tensors and object collectives
  (the exercise checkers gather CPU tensors and Python objects);
- more ranks than GPUs (4 ranks on 1 GPU in a workshop): NCCL refuses two ranks on one GPU, so
  the ranks would talk over gloo. On CUDA tensors gloo runs most collectives (an H200 with
  torch 2.11, 2026-11-27: all_reduce, broadcast, reduce, all_gather in both forms, gather,
  scatter, reduce_scatter in both forms, all_to_all_single) but crashes the rank on
  point-to-point and on the functional all-gather DTensor uses, and refuses the list
  all_to_all; labkit moves those through host memory (labkit.rank.host_staging,
  labkit.rank.funcol_staging). The curriculum has not yet passed whole that way on a GPU
  (docs/gpu.md), so by default the ranks stay on the CPU with gloo, where every notebook passes;
  `device="cuda"` puts them on the shared GPU(s).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from labkit.wire.config import MIXED

BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")


def max_world_size() -> int:
    return int(os.environ.get("LABKIT_MAX_WORLD_SIZE", "64"))


@dataclass(frozen=True)
class Choice:
    world_size: int
    backend: str
    device: str
    gpus: int
    reason: str


def threads_per_rank(cpus: int | None, ranks_on_host: int, asked: int | None = None) -> int | None:
    """torch's intra-op threads for each rank: what the user asked, else None (torch decides)
    where OMP_NUM_THREADS is set, else the host's cores shared out, at least 1 each.

    Ranks that each use every core compete for them (torchrun sets OMP_NUM_THREADS=1 for the
    same reason): a 1M-float all_reduce cell of 4 ranks on 2 cores takes about twice as long.
    """
    if asked is not None:
        if isinstance(asked, bool) or not isinstance(asked, int) or asked < 1:
            raise ValueError(f"threads must be an int >= 1 or None, got {asked!r}")
        return asked
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    return max(1, (cpus or 1) // max(1, ranks_on_host))


def default_device(device: str, env: Any = os.environ) -> str:
    """`device`, or for "auto" the LABKIT_DEVICE environment variable where set: how
    `labkit check --device cuda` runs unchanged notebooks, whose `Lab(4)` asks for "auto"."""
    if device != "auto" or not env.get("LABKIT_DEVICE"):
        return device
    wanted = env["LABKIT_DEVICE"]
    if wanted not in DEVICES:
        raise ValueError(f"LABKIT_DEVICE must be one of {', '.join(DEVICES)}; got {wanted!r}")
    return wanted


def check_world_size(world_size: Any) -> int:
    limit = max_world_size()
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise ValueError(f"world_size must be an int in [1, {limit}], got {world_size!r}")
    if not 1 <= world_size <= limit:
        raise ValueError(
            f"world_size must be in [1, {limit}], got {world_size} "
            "(set LABKIT_MAX_WORLD_SIZE to allow more)"
        )
    return world_size


def choose(
    world_size: int | None,
    backend: str,
    device: str,
    facts: dict[str, Any],
    ranks_per_host: int | None = None,
) -> Choice:
    """Resolve 'auto' against what a host has (GPUs, backends): the one rule for every lab.

    `facts` are those of the fork server, or of the least-equipped node of a torchrun job;
    `ranks_per_host` is how many ranks share that host's GPUs (all of them by default).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}; got {device!r}")
    gpus = int(facts.get("gpus", 0))
    if world_size is None:
        world_size = gpus or 4
    world_size = check_world_size(world_size)
    local = ranks_per_host or world_size
    nccl = bool(facts.get("nccl"))
    if device == "cuda" and gpus == 0:
        raise ValueError(
            "device='cuda' needs a GPU, but torch sees none here "
            f"(torch {facts.get('torch', '?')}, CUDA build {facts.get('cuda') or 'none'}); "
            f"available: device='cpu' ({facts.get('cpus')} cores) with backend='gloo'"
        )
    if device == "auto":  # CUDA only where NCCL can serve it: gloo lacks most ops on CUDA
        device = "cuda" if local <= gpus and nccl and backend != "gloo" else "cpu"
    if backend == "nccl" and (device != "cuda" or gpus < local or not nccl):
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: {local} ranks per host, "
            f"GPUs {gpus}, NCCL {'built' if nccl else 'missing'}; "
            "use backend='gloo' (ranks can share a GPU with gloo)"
        )
    if backend in ("auto", "nccl"):
        backend = MIXED if device == "cuda" and gpus >= local and nccl else "gloo"
    return Choice(
        world_size, backend, device, gpus, _reason(world_size, local, backend, device, gpus, facts)
    )


def _reason(
    world_size: int, local: int, backend: str, device: str, gpus: int, facts: dict[str, Any]
) -> str:
    if device == "cuda":
        share = f"{local} ranks sharing {gpus} GPU(s)" if local > gpus else "one GPU per rank"
        where = share
        if backend == "gloo":
            where += (
                "; over gloo, labkit moves point-to-point, the list all_to_all and the "
                "functional all-gather through host memory (gloo crashes or refuses them on "
                "CUDA tensors)"
            )
    else:
        where = f"{world_size} CPU ranks on {facts.get('cpus')} cores"
        if gpus:
            why = "NCCL needs one per rank" if local > gpus else "this torch has no NCCL"
            where += (
                f"; {gpus} GPU(s) per host for {local} ranks: {why}; the curriculum has not "
                "yet passed whole on ranks sharing a GPU over gloo (docs/gpu.md): "
                "device='cuda' puts them there"
            )
    return f"{backend} on {device}: {where}"
