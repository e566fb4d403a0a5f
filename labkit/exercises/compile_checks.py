"""Exercise of notebook 49, torch.compile with DDP: predict DDP's gradient buckets, which are
also where DDPOptimizer cuts a compiled graph (kernel side).

`check_buckets` calls the learner's `buckets(shapes, element_size, cap_bytes, first_cap_bytes)`
in this process (no ranks needed) and compares it with
`labkit.parallel.compile_dist.buckets_by_size` applied to the parameters in the order their
gradients become ready (the reverse of registration, for a chain of layers), which notebook 49
and tests/test_compile_dist.py check against DDP's own reducer on 4 gloo ranks. The answer is
the parameters' registration indices, bucket by bucket, in the order the buckets are reduced.
The classic wrong answers it names, each on cases where it differs from the right one:

- buckets filled in forward (registration) order: DDP fills them from the last layer, whose
  gradients are ready first;
- the first bucket given the same cap as the others (its own cap is what starts the first
  all-reduce early);
- counting elements instead of bytes (the cap is in bytes: an fp32 element is 4);
- closing a bucket before the tensor that would cross the cap (DDP adds it, then closes);
- closing only once the bytes pass the cap (`>`), where DDP closes once they reach it (`>=`):
  the last case's layer is exactly the cap.
"""

from __future__ import annotations

from collections.abc import Callable
from math import prod
from typing import Any

from labkit.exercises import Verdict, reveal, right, wrong

__all__ = ["check_buckets", "solution_buckets"]

# (shapes in registration order, element_size, cap_bytes, first_cap_bytes)
CASES = (
    ([(64, 64), (64,)] * 4, 4, 33_000, 17_000),
    ([(32, 32), (32,), (32, 64), (64,), (64, 16), (16,)], 4, 8_192, 4_096),
    ([(100,), (200,), (300,), (400,), (500,)], 2, 1_000, 600),
    ([(128, 128), (128,)] * 3, 4, 70_000, 70_000),
    ([(16, 16), (16,)] * 2, 4, 1_088, 1_088),  # a layer is 1,088 bytes: exactly the cap
)


def _reference(
    shapes,
    element_size,
    cap,
    first_cap,
    *,
    forward=False,
    first=True,
    unit=None,
    before=False,
    strict=False,
) -> list[list[int]]:
    from labkit.parallel.compile_dist import buckets_by_size

    order = list(range(len(shapes))) if forward else list(range(len(shapes)))[::-1]
    size = unit or element_size
    sizes = [prod(shapes[i]) * size for i in order]
    first_cap = first_cap if first else cap
    if not (before or strict):
        groups = buckets_by_size(sizes, cap, first_cap)
    else:  # never let a bucket cross its cap, or close it only once it passes the cap
        groups, filled = [[]], 0
        for j, s in enumerate(sizes):
            limit = first_cap if len(groups) == 1 else cap
            if groups[-1] and (filled + s > limit if before else filled > limit):
                groups.append([])
                filled = 0
            groups[-1].append(j)
            filled += s
    return [[order[j] for j in g] for g in groups]


SLIPS = {
    "buckets filled in forward order: DDP fills them from the last layer, whose gradients "
    "are ready first in backward": {"forward": True},
    "the first bucket has its own cap (first_cap_bytes), so the first all-reduce starts "
    "early; the others have cap_bytes": {"first": False},
    "the caps are in bytes: multiply each tensor's elements by element_size": {"unit": 1},
    "a bucket closes once its bytes reach the cap, with the tensor that crossed it inside: "
    "add the tensor first, then close": {"before": True},
    "a bucket closes as soon as its bytes reach the cap (>=), not only once they pass it": {
        "strict": True
    },
}


def check_buckets(fn: Callable[..., Any]) -> Verdict:
    """`fn(shapes, element_size, cap_bytes, first_cap_bytes)` -> list of buckets, each a list
    of parameter indices (registration order), in the order DDP reduces them."""
    for shapes, element_size, cap, first_cap in CASES:
        want = _reference(shapes, element_size, cap, first_cap)
        try:
            got = [[int(i) for i in b] for b in fn(list(shapes), element_size, cap, first_cap)]
        except Exception as exc:  # noqa: BLE001 - a learner's error is a verdict
            return wrong(f"raised {type(exc).__name__}: {exc} (return a list of lists of ints)")
        if got == want:
            continue
        where = f"shapes {shapes}, {element_size}-byte elements, caps {cap} / first {first_cap}"
        for why, kw in SLIPS.items():
            slip = _reference(shapes, element_size, cap, first_cap, **kw)
            if slip != want and got == slip:
                return wrong(f"{where}: {why}")
        return wrong(f"{where}: got {got}, expected {want}")
    return right(f"every bucket matches on {len(CASES)} models")


def solution_buckets() -> Any:
    return reveal("""
def buckets(shapes, element_size, cap_bytes, first_cap_bytes):
    out, filled = [[]], 0
    for i in reversed(range(len(shapes))):          # gradients ready last layer first
        limit = first_cap_bytes if len(out) == 1 else cap_bytes
        if out[-1] and filled >= limit:             # the previous tensor reached the cap
            out.append([])
            filled = 0
        out[-1].append(i)
        n = 1
        for d in shapes[i]:
            n *= d
        filled += n * element_size                  # bytes, not elements
    return out
""")
