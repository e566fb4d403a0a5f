"""Exercise of the 2-D parallelism notebook 39 (kernel side).

`check_step_bytes` tests a learner's per-axis volume formula, in this process: the bytes one
rank sends per training step on the dp axis (FSDP2: two all_gathers and one reduce_scatter of
each unit's TP-local weights) and on the tp axis (one all_reduce of the row-parallel output),
over several mesh shapes and sizes. The usual slips are named: one all_gather per unit, the
buffer S instead of what a rank sends, the all_gather factor for an all_reduce, the axes'
sizes (the mesh dims) swapped, the gradients reduced over the tp axis instead of dp, the
whole world's size for an axis's, gloo's reduce_scatter bytes for the ring's, the tp all_reduce
counted in backward too. One micro-batch per step (with m, FSDP2 does it all m times).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from labkit.exercises import Verdict, reveal, right, wrong

__all__ = ["check_step_bytes", "solution_step_bytes"]

CASES = (
    ([33280, 5160], 2560, 2, 2),
    ([1000, 400, 64], 512, 4, 2),
    ([4096], 1024, 2, 8),
    ([800, 800], 96, 8, 1),
    ([128, 256], 300, 3, 5),
)


def _want(units: list[int], act: int, dp: int, tp: int) -> tuple[float, float]:
    return 3 * sum(units) * (dp - 1) / dp, 2 * (tp - 1) / tp * act


def _slips(units: list[int], act: int, dp: int, tp: int) -> dict[str, tuple[float, float]]:
    u = sum(units)
    want_dp, want_tp = _want(units, act, dp, tp)
    return {
        "one all_gather per unit: FSDP2 re-shards after forward and gathers each unit again "
        "before its backward (2 all_gathers + 1 reduce_scatter)": (2 * u * (dp - 1) / dp, want_tp),
        "that is the buffer S the trace records, not what a rank sends: multiply by the bus "
        "factor, (n-1)/n for all_gather and reduce_scatter, 2(n-1)/n for all_reduce": (3 * u, act),
        "an all_reduce sends 2(n-1)/n of its buffer, twice an all_gather's (n-1)/n": (
            want_dp,
            (tp - 1) / tp * act,
        ),
        "the axes' sizes are swapped: the dp traffic runs in groups of dp ranks, the tp "
        "traffic in groups of tp ranks": (3 * u * (tp - 1) / tp, 2 * (dp - 1) / dp * act),
        "the gradients are reduced over the tp axis: the ranks of a tp group hold different "
        "slices of the weights, the ranks of a dp group the same slice, so the reduce_scatter "
        "runs in the dp group": (2 * u * (dp - 1) / dp + u * (tp - 1) / tp, want_tp),
        "that is gloo's reduce_scatter, which sends as much as an all_reduce: the exercise asks "
        "for the ring (NCCL's algorithms), where it sends (n-1)/n of its buffer": (
            4 * u * (dp - 1) / dp,
            want_tp,
        ),
        "the tp all_reduce runs once, in forward: the MLP's input is data, so backward has no "
        "dL/dx to sum": (want_dp, 2 * want_tp),
        "the whole world is no axis: each collective runs in the groups of one axis, of dp or "
        "tp ranks, not dp·tp": (
            3 * u * (dp * tp - 1) / (dp * tp),
            2 * (dp * tp - 1) / (dp * tp) * act,
        ),
    }


def check_step_bytes(fn: Callable[..., Any]) -> Verdict:
    """`fn(unit_bytes, activation_bytes, dp, tp)` -> {"dp": bytes, "tp": bytes} that one rank
    sends per step on each axis."""
    for units, act, dp, tp in CASES:
        want = _want(units, act, dp, tp)
        try:
            got = fn(list(units), act, dp, tp)
            pair = (float(got["dp"]), float(got["tp"]))
        except Exception as exc:  # noqa: BLE001 - a learner's error is a verdict
            return wrong(f"raised {type(exc).__name__}: {exc} (return {{'dp': ..., 'tp': ...}})")
        if all(abs(g - w) <= 1e-6 * max(1.0, w) for g, w in zip(pair, want)):
            continue
        case = f"units {units}, activation {act}, dp={dp}, tp={tp}"
        for why, slip in _slips(units, act, dp, tp).items():
            if all(abs(g - s) <= 1e-6 * max(1.0, s) for g, s in zip(pair, slip)):
                return wrong(f"{case}: {why}")
        return wrong(f"{case}: got dp={pair[0]:g}, tp={pair[1]:g}; expected dp={want[0]:g}, "
                     f"tp={want[1]:g}")  # fmt: skip
    return right(f"both axes' bytes match on {len(CASES)} meshes, tp=1 and dp=1 included")


def solution_step_bytes() -> Any:
    return reveal("""
def step_bytes(unit_bytes, activation_bytes, dp, tp):
    fsdp = 3 * sum(unit_bytes)                 # 2 all_gathers + 1 reduce_scatter per unit
    return {"dp": fsdp * (dp - 1) / dp,        # each sends (n-1)/n of its buffer
            "tp": activation_bytes * 2 * (tp - 1) / tp}   # one all_reduce: 2(n-1)/n
""")
