"""Parsing rank selections such as "0,2", "1-3" or [0, 2] (kernel side)."""

from __future__ import annotations

from typing import Any


def parse_ranks(spec: Any, world_size: int) -> list[int]:
    """Sorted, unique ranks in [0, world_size); None, "all" or "*" mean every rank."""
    if spec is None or (isinstance(spec, str) and spec.strip() in ("", "all", "*")):
        return list(range(world_size))
    allowed = f"ranks are 0-{world_size - 1}" if world_size > 1 else "the only rank is 0"
    if isinstance(spec, bool):
        raise ValueError(f"ranks must be like 0, '0,2', '1-3' or [0, 2]; got {spec!r}")
    if isinstance(spec, int):
        items: list[int] = [spec]
    elif isinstance(spec, str):
        items = []
        for part in spec.replace(" ", "").split(","):
            try:
                if "-" in part[1:]:
                    lo, hi = part.split("-", 1) if not part.startswith("-") else ("", "")
                    a, b = int(lo), int(hi)
                    if a > b:
                        raise ValueError
                    items.extend(range(a, b + 1))
                else:
                    items.append(int(part))
            except ValueError:
                raise ValueError(
                    f"cannot read ranks {spec!r}: write them like '0,2' or '1-3' ({allowed})"
                ) from None
    else:
        try:
            items = [int(r) for r in spec if not isinstance(r, bool)]
        except (TypeError, ValueError):
            raise ValueError(
                f"ranks must be like 0, '0,2', '1-3' or [0, 2]; got {spec!r}"
            ) from None
        if not items:
            raise ValueError(f"ranks must name at least one rank; {allowed}")
    bad = sorted({r for r in items if not 0 <= r < world_size})
    if bad:
        raise ValueError(
            f"rank {', '.join(map(str, bad))} out of range: this lab has "
            f"{world_size} rank{'s' if world_size != 1 else ''} ({allowed})"
        )
    return sorted(set(items))
