"""The checker of the 2-D parallelism notebook 39 (in this process): right per-axis byte
formulas pass, plausible wrong ones are named."""

from __future__ import annotations

import pytest

from labkit.exercises import two_d_checks as td
from labkit.parallel.two_d import axis_bytes


def reference(unit_bytes, activation_bytes, dp, tp):
    return {
        "dp": 3 * sum(unit_bytes) * (dp - 1) / dp,
        "tp": 2 * (tp - 1) / tp * activation_bytes,
    }


def from_labkit(unit_bytes, activation_bytes, dp, tp):
    a = axis_bytes(unit_bytes, activation_bytes, dp, tp)
    return {axis: a[axis]["sent"] for axis in a}


def per_unit_loop(unit_bytes, activation_bytes, dp, tp):
    dp_bytes = 0.0
    for u in unit_bytes:
        dp_bytes += u * (dp - 1) / dp  # forward all_gather
        dp_bytes += u * (dp - 1) / dp  # backward all_gather
        dp_bytes += u * (dp - 1) / dp  # reduce_scatter
    return {"dp": dp_bytes, "tp": activation_bytes * (tp - 1) / tp * 2}


def one_gather(unit_bytes, activation_bytes, dp, tp):
    return {"dp": 2 * sum(unit_bytes) * (dp - 1) / dp, "tp": 2 * (tp - 1) / tp * activation_bytes}


def traced_not_sent(unit_bytes, activation_bytes, dp, tp):
    return {"dp": 3 * sum(unit_bytes), "tp": activation_bytes}


def all_reduce_like_gather(unit_bytes, activation_bytes, dp, tp):
    return {"dp": 3 * sum(unit_bytes) * (dp - 1) / dp, "tp": (tp - 1) / tp * activation_bytes}


def swapped(unit_bytes, activation_bytes, dp, tp):
    return reference(unit_bytes, activation_bytes, tp, dp)


def whole_world(unit_bytes, activation_bytes, dp, tp):
    n = dp * tp
    return {"dp": 3 * sum(unit_bytes) * (n - 1) / n, "tp": 2 * (n - 1) / n * activation_bytes}


def grads_over_tp(unit_bytes, activation_bytes, dp, tp):
    u = sum(unit_bytes)
    return {
        "dp": 2 * u * (dp - 1) / dp + u * (tp - 1) / tp,
        "tp": 2 * (tp - 1) / tp * activation_bytes,
    }


def gloo_reduce_scatter(unit_bytes, activation_bytes, dp, tp):
    return {
        "dp": 4 * sum(unit_bytes) * (dp - 1) / dp,
        "tp": 2 * (tp - 1) / tp * activation_bytes,
    }


def tp_both_passes(unit_bytes, activation_bytes, dp, tp):
    return {
        "dp": 3 * sum(unit_bytes) * (dp - 1) / dp,
        "tp": 2 * 2 * (tp - 1) / tp * activation_bytes,
    }


@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (reference, True, "both axes' bytes match"),
        (from_labkit, True, "both axes' bytes match"),
        (per_unit_loop, True, "both axes' bytes match"),
        (one_gather, False, "gathers each unit again before its backward"),
        (traced_not_sent, False, "not what a rank sends"),
        (all_reduce_like_gather, False, "an all_reduce sends 2(n-1)/n"),
        (swapped, False, "the axes' sizes are swapped"),
        (whole_world, False, "the whole world is no axis"),
        (grads_over_tp, False, "the gradients are reduced over the tp axis"),
        (gloo_reduce_scatter, False, "that is gloo's reduce_scatter"),
        (tp_both_passes, False, "the tp all_reduce runs once, in forward"),
        (lambda u, a, dp, tp: (1, 2), False, "raised TypeError"),
    ],
)
def test_step_bytes(fn, ok: bool, says: str) -> None:
    verdict = td.check_step_bytes(fn)
    assert bool(verdict) is ok, verdict
    assert says in verdict.message, verdict


def test_step_bytes_solution() -> None:
    ns: dict = {}
    exec(td.solution_step_bytes().code, ns)
    assert td.check_step_bytes(ns["step_bytes"])
