"""This rank's CUDA memory, as torch's caching allocator and the driver see it (rank side).

`snapshot()` returns allocated / reserved / peak bytes on the rank's current CUDA device
(`torch.cuda.memory_allocated`, `memory_reserved`, `max_memory_allocated`) and the card's free
and total bytes (`torch.cuda.mem_get_info`, the whole card: every process on it), or None where
the rank has not initialised CUDA (a CPU rank, or one that has not touched the GPU yet): it never
initialises CUDA itself, so the heartbeat thread may call it. Nothing is zero-filled: no GPU, no
numbers. The heartbeat sends it (labkit.rank.side); the placement view asks for it.
"""

from __future__ import annotations

import sys
from typing import Any


def snapshot() -> dict[str, Any] | None:
    """This rank's CUDA memory in bytes, or None without an initialised CUDA device."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    try:
        index = torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(index)
        return {
            "device": f"cuda:{index}",
            "allocated": int(torch.cuda.memory_allocated(index)),
            "reserved": int(torch.cuda.memory_reserved(index)),
            "peak": int(torch.cuda.max_memory_allocated(index)),
            "free": int(free),
            "total": int(total),
        }
    except Exception:  # noqa: BLE001 - a device lost or busy: no numbers rather than wrong ones
        return None
