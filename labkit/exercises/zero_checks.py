"""Exercise of notebook 26, ZeRO and FSDP: bytes per rank (kernel side).

`check_zero_bytes` calls the learner's formula in the kernel (no ranks needed) and compares it
with `labkit.parallel.zero_redundancy.zero_memory` for stages 0-3. `solution_zero_bytes`
reveals one answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from labkit.exercises import Verdict, reveal, right, wrong


def check_zero_bytes(fn: Callable[[int, int, int], Any]) -> Verdict:
    """`fn(num_params, world_size, stage)` must return the bytes of weights + gradients + Adam
    state each rank holds under ZeRO `stage` (0-3) with mixed precision (2 + 2 + 12 bytes per
    parameter, a sharded part divided by world_size, rounded up to whole parameters)."""
    from labkit.parallel.zero_redundancy import zero_memory

    for num_params, world_size in ((7_500_000_000, 64), (1000, 4), (1001, 8)):
        for stage in range(4):
            expected = zero_memory(num_params, world_size, stage)["total"]
            try:
                got = fn(num_params, world_size, stage)
            except Exception as exc:  # noqa: BLE001 - the learner's error is the verdict
                return wrong(f"fn({num_params}, {world_size}, {stage}) raised {exc!r}")
            if got != expected:
                return wrong(
                    f"stage {stage}, {num_params:,} parameters on {world_size} ranks: "
                    f"got {got!r}, expected {expected:,} bytes"
                )
    return right("bytes per rank match the ZeRO formulas for stages 0-3")


def solution_zero_bytes() -> Any:
    return reveal("""
def zero_bytes(num_params, world_size, stage):
    shard = -(-num_params // world_size)              # ceil
    params = 2 * (shard if stage >= 3 else num_params)
    grads = 2 * (shard if stage >= 2 else num_params)
    optimizer = 12 * (shard if stage >= 1 else num_params)
    return params + grads + optimizer
""")
