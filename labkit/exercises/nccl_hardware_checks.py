"""Exercise of notebook 50, NCCL and the hardware: an all-reduce's time from link specs (kernel
side).

`check_allreduce_seconds` calls the learner's `allreduce_seconds(nbytes, num_gpus, links)` on
three machines and compares it with the bandwidth term of a ring all-reduce worked out here:
each GPU sends 2(p-1)/p of the buffer, and every step of the ring waits for its slowest link,
taken one direction at a time, in bytes. `links` lists the kinds of link the ring crosses as
vendors quote them: {"name", "rate", "unit": "GB/s" or "Gb/s", "both_ways": True when the rate
adds both directions together (NVIDIA's "900 GB/s" NVLink)}.

Classic wrong answers it rejects and names (tests/test_checkers_nccl_hardware.py): Gb/s read
as GB/s, the buffer without the 2(p-1)/p factor, 2p/p
(p steps instead of p-1), a both-ways rate used as one direction, and the fastest link taken as
the bottleneck. Each differs from the right answer, and from the others, on the first machine
where it is wrong, so the checker names the mistake made.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from labkit.exercises import Verdict, reveal, right, wrong

__all__ = ["MACHINES", "check_allreduce_seconds", "solution_allreduce_seconds"]

NVLINK4 = {"name": "NVLink 4 (NV18)", "rate": 900, "unit": "GB/s", "both_ways": True}
IB_NDR = {"name": "InfiniBand NDR", "rate": 400, "unit": "Gb/s", "both_ways": False}
PCIE4 = {"name": "PCIe Gen4 x16", "rate": 64, "unit": "GB/s", "both_ways": True}
ETH100 = {"name": "100 Gb Ethernet", "rate": 100, "unit": "Gb/s", "both_ways": False}

# (what, nbytes, num_gpus, links) -> the right answer in seconds, worked out by hand:
MACHINES = (
    # 2 nodes x 8 H100, one NDR port per GPU: 2·15/16 · 2e9 B at 50 GB/s = 0.075 s
    ("2 nodes x 8 GPUs, NVLink + InfiniBand", 2e9, 16, [NVLINK4, IB_NDR], 0.075),
    # one node of 8 on NVSwitch: 2·7/8 · 1e9 B at 450 GB/s = 3.888... ms
    ("1 node x 8 GPUs, NVLink", 1e9, 8, [NVLINK4], 2 * 7 / 8 * 1e9 / 450e9),
    # 4 PCIe GPUs over 2 hosts, 100 Gb Ethernet: 2·3/4 · 2.56e8 B at 12.5 GB/s = 30.72 ms
    ("2 hosts x 2 PCIe GPUs, Ethernet", 2.56e8, 4, [PCIE4, ETH100], 0.03072),
)


def _one_way(link: dict[str, Any], *, bits_as_bytes: bool = False, both: bool = False) -> float:
    rate = link["rate"] * 1e9
    if link["unit"] == "Gb/s" and not bits_as_bytes:
        rate /= 8
    return rate if (both or not link["both_ways"]) else rate / 2


def _ring(
    nbytes: float, p: int, links: list, factor: Any = None, pick: Any = min, **how: bool
) -> float:
    f = 2 * (p - 1) / p if factor is None else factor(p)
    return f * nbytes / pick(_one_way(link, **how) for link in links)


MISTAKES: tuple[tuple[Callable[[float, int, list], float], str], ...] = (
    (
        lambda n, p, ls: _ring(n, p, ls, bits_as_bytes=True),
        "a rate in Gb/s (bits) was read as GB/s (bytes): divide it by 8",
    ),
    (
        lambda n, p, ls: _ring(n, p, ls, factor=lambda p: 1.0),
        "each GPU sends 2(p-1)/p of the buffer in a ring all-reduce, not the buffer once",
    ),
    (
        lambda n, p, ls: _ring(n, p, ls, factor=lambda p: 2.0),
        "2p/p: the ring has 2(p-1) steps of n/p, not 2p",
    ),
    (
        lambda n, p, ls: _ring(n, p, ls, both=True),
        "a rate quoted for both directions together (both_ways) carries half of it each way",
    ),
    (
        lambda n, p, ls: _ring(n, p, ls, pick=max),
        "every step of the ring waits for its slowest link, not its fastest",
    ),
)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * abs(b)


def check_allreduce_seconds(fn: Callable[..., Any]) -> Verdict:
    """`fn(nbytes, num_gpus, links)` must return the seconds of a ring all-reduce of `nbytes`
    over `num_gpus` GPUs whose ring crosses every kind of link in `links`, latency ignored.
    Example: `check_allreduce_seconds(allreduce_seconds)`."""
    for what, nbytes, p, links, want in MACHINES:
        try:
            got = float(fn(nbytes, p, copy.deepcopy(links)))
        except Exception as exc:  # the learner's code: any error is an answer
            return wrong(f"{what}: fn raised {type(exc).__name__}: {exc}")
        if _close(got, want):
            continue
        case = f"{what}, {nbytes:.3g} B: got {got:.6g} s, expected {want:.6g} s"
        for mistake, why in MISTAKES:
            if _close(got, mistake(nbytes, p, links)):
                return wrong(f"{case}: {why}")
        return wrong(case)
    return right("the ring's time on all three machines")


def solution_allreduce_seconds() -> Any:
    """One answer, revealed."""
    return reveal(
        """
def allreduce_seconds(nbytes, num_gpus, links):
    def one_way(link):  # bytes per second, one direction
        rate = link["rate"] * 1e9
        if link["unit"] == "Gb/s":
            rate /= 8  # bits to bytes
        return rate / 2 if link["both_ways"] else rate
    slowest = min(one_way(link) for link in links)
    return 2 * (num_gpus - 1) / num_gpus * nbytes / slowest
"""
    )
