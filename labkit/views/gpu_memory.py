"""Each rank's CUDA memory and, on a shared GPU, the ranks' sum against the card (kernel side,
pure data).

The numbers come from `labkit.rank.cuda_memory.snapshot()` on each rank (through the heartbeat
for `%lab status`, asked for by `show_placement`): None for a rank without CUDA, shown as
"no GPU", never as zeros. The placement view and `%lab status` both use these functions.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from labkit.views._common import human_bytes

__all__ = ["NO_GPU", "rank_text", "shared_gpu_notes"]

NO_GPU = "no GPU"


def rank_text(memory: Mapping[str, Any] | None) -> str:
    """One rank's CUDA memory in words ('no GPU' without a snapshot)."""
    if not memory:
        return NO_GPU
    return (
        f"{memory['device']}: {human_bytes(memory['allocated'])} allocated, "
        f"{human_bytes(memory['reserved'])} reserved, {human_bytes(memory['peak'])} peak"
    )


def shared_gpu_notes(
    memory: Mapping[int, Mapping[str, Any] | None], hosts: Mapping[int, str] | None = None
) -> list[str]:
    """For each GPU two or more ranks share: their allocated and reserved sums, and the card's
    total and free memory (the driver's figures, every process on the card included)."""
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for rank, m in sorted(memory.items()):
        if m:
            groups[(hosts or {}).get(rank, ""), m["device"]].append(rank)
    notes = []
    for (host, device), ranks in groups.items():
        if len(ranks) < 2:
            continue
        ms = [memory[r] for r in ranks]
        latest = ms[-1]  # the card's figures: each rank read the same card, at its own moment
        on = f" on {host}" if host else ""
        notes.append(
            f"ranks {', '.join(map(str, ranks))} share {device}{on}: "
            f"{human_bytes(sum(m['allocated'] for m in ms))} allocated, "
            f"{human_bytes(sum(m['reserved'] for m in ms))} reserved in all, of the card's "
            f"{human_bytes(latest['total'])} ({human_bytes(latest['free'])} free, "
            "every process on it counted)"
        )
    return notes
