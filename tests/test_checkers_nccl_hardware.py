"""The exercise of notebook 50 (labkit.exercises.nccl_hardware_checks): the right answer
passes, each classic mistake is rejected with its own reason. The answers are written here,
not taken from the checker."""

from __future__ import annotations

import pytest

from labkit.exercises import nccl_hardware_checks as nh


def _bytes_one_way(link, *, bits_as_bytes=False, both=False):
    rate = link["rate"] * 1e9
    if link["unit"] == "Gb/s" and not bits_as_bytes:
        rate = rate / 8
    if link["both_ways"] and not both:
        rate = rate / 2
    return rate


def right(n, p, links):
    return 2 * (p - 1) / p * n / min(_bytes_one_way(x) for x in links)


def right_in_bits(n, p, links):  # the same arithmetic in bits: also right
    bits = [x["rate"] * 1e9 * (8 if x["unit"] == "GB/s" else 1) for x in links]
    one_way = [b / 2 if x["both_ways"] else b for b, x in zip(bits, links)]
    return 2 * (p - 1) * 8 * n / (p * min(one_way))


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (right, True, "all three machines"),
        (right_in_bits, True, "all three machines"),
        (
            lambda n, p, ls: (
                2 * (p - 1) / p * n / min(_bytes_one_way(x, bits_as_bytes=True) for x in ls)
            ),
            False,
            "divide it by 8",
        ),
        (lambda n, p, ls: n / min(_bytes_one_way(x) for x in ls), False, "2(p-1)/p"),
        (lambda n, p, ls: 2 * n / min(_bytes_one_way(x) for x in ls), False, "not 2p"),
        (
            lambda n, p, ls: 2 * (p - 1) / p * n / min(_bytes_one_way(x, both=True) for x in ls),
            False,
            "half of it each way",
        ),
        (
            lambda n, p, ls: 2 * (p - 1) / p * n / max(_bytes_one_way(x) for x in ls),
            False,
            "slowest",
        ),
        (lambda n, p, ls: 2 * (p - 1) / p * n / 50e9, False, "expected"),  # one machine's speed
        (lambda n, p: 0.0, False, "raised TypeError"),
    ],
)
def test_check_allreduce_seconds(fn, ok, says):
    verdict = nh.check_allreduce_seconds(fn)
    assert bool(verdict) is ok and says in verdict.message, verdict.message


@pytest.mark.timeout(10)
def test_solution_passes_and_machines_are_worked_by_hand():
    namespace: dict = {}
    exec(nh.solution_allreduce_seconds().code, namespace)
    assert nh.check_allreduce_seconds(namespace["allreduce_seconds"])
    assert [m[-1] for m in nh.MACHINES] == pytest.approx([0.075, 3.8889e-3, 0.03072], rel=1e-4)


@pytest.mark.timeout(10)
def test_a_learner_who_edits_links_does_not_change_the_next_case():
    def mutating(n, p, links):
        for x in links:
            x["rate"] = 1  # spoils its own copy only
        return right(n, p, links)

    assert not nh.check_allreduce_seconds(mutating)
    assert nh.check_allreduce_seconds(right)
