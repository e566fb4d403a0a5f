"""The checker of notebook 47's exercise (in this process, simulated ranks): the right Ulysses
layouts pass; a reshape in the wrong dim order, scattering along the sequence, a transpose too
many after receiving, forgetting the second all_to_all, merging heads in the wrong order and
sending a non-contiguous view are each named."""

from __future__ import annotations

import pytest

from labkit.exercises import ulysses_checks as ux


def seq_to_heads(x, P, all_to_all):
    s, h, d = x.shape
    send = x.reshape(s, P, h // P, d).transpose(0, 1)
    return all_to_all(send.contiguous()).reshape(P * s, h // P, d)


def heads_to_seq(x, P, all_to_all):
    s, h, d = x.shape
    got = all_to_all(x.reshape(P, s // P, h, d).contiguous())
    return got.transpose(0, 1).reshape(s // P, P * h, d)


def wrong_dim_order(x, P, all_to_all):  # reshape straight to [P, ...]: cuts by positions
    s, h, d = x.shape
    return all_to_all(x.reshape(P, s, h // P, d)).reshape(P * s, h // P, d)


def along_sequence(x, P, all_to_all):  # scatters positions, keeps all heads
    s, h, d = x.shape
    return all_to_all(x.reshape(P, s // P, h, d)).reshape(s, h, d)


def transposed_after(x, P, all_to_all):  # receives right, then interleaves the positions
    s, h, d = x.shape
    send = x.reshape(s, P, h // P, d).transpose(0, 1).contiguous()
    return all_to_all(send).transpose(0, 1).reshape(P * s, h // P, d)


def no_second(x, P, all_to_all):  # the second all_to_all forgotten
    s, h, d = x.shape
    return x.reshape(s // P, P * h, d)


def not_contiguous(x, P, all_to_all):  # the transposed view sent as it is
    s, h, d = x.shape
    return all_to_all(x.reshape(s, P, h // P, d).transpose(0, 1)).reshape(P * s, h // P, d)


def merged_wrong(x, P, all_to_all):  # no transpose: group and positions mixed
    s, h, d = x.shape
    return all_to_all(x.reshape(P, s // P, h, d).contiguous()).reshape(s // P, P * h, d)


@pytest.mark.timeout(60)
def test_right_answers_pass():
    assert ux.check_ulysses(seq_to_heads, heads_to_seq)
    ns: dict = {}
    exec(ux.solution_ulysses().code, ns)
    assert ux.check_ulysses(ns["seq_to_heads"], ns["heads_to_seq"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("first", "second", "says"),
    [
        (wrong_dim_order, heads_to_seq, "it holds heads [0, 1, 2, 3, 4, 5, 6, 7], want [0, 1]"),
        (along_sequence, heads_to_seq, "shape [4, 8, 2], want [16, 2, 2]"),
        (transposed_after, heads_to_seq, "positions out of order"),
        (seq_to_heads, no_second, "second all_to_all forgotten"),
        (seq_to_heads, merged_wrong, "heads_to_seq, rank 0"),
        (not_contiguous, heads_to_seq, "call .contiguous() first"),
    ],
)
def test_classic_mistakes_named(first, second, says):
    verdict = ux.check_ulysses(first, second)
    assert not verdict
    assert says in verdict.message, verdict.message
