"""The checker of the pipeline-schedules notebook 40 (in this process): right closed forms for
the zero-bubble idle fraction pass, the plausible wrong ones are named."""

from __future__ import annotations

from labkit.exercises import pipeline_schedule_checks as ps
from labkit.parallel.pipeline_parallel import bubble_fraction
from labkit.parallel.pipeline_schedules import zero_bubble_fraction


def by_idle_time(p, m, v, tf, tb, tw):
    one_f_one_b_idle = (p - 1) * (tf + tb + tw) / v
    idle = one_f_one_b_idle - 2 * (p - 1) * tw / v  # the W's moved into the bubble
    return idle / (idle + m * (tf + tb + tw))


def test_right_answers_pass() -> None:
    namespace: dict = {}
    exec(ps.solution_zero_bubble().code, namespace)
    assert ps.check_zero_bubble(namespace["zero_bubble"])
    assert ps.check_zero_bubble(by_idle_time)
    assert ps.check_zero_bubble(lambda p, m, v, *t: zero_bubble_fraction(p, m, v, t))


def test_wrong_answers_are_named() -> None:
    cases = {
        "the W's that run in the bubble": lambda p, m, v, *t: bubble_fraction(p, m, v),
        "shorten it": lambda p, m, v, tf, tb, tw: (  # W added to the idle time, not taken off
            (p - 1) * (tf + tb + tw) / v / (m * (tf + tb + tw) + (p - 1) * (tf + tb + tw) / v)
        ),
        "divided by v": lambda p, m, v, tf, tb, tw: (
            (p - 1) * (tf + tb - tw) / (m * (tf + tb + tw) + (p - 1) * (tf + tb - tw))
        ),
        "divides by the whole step": lambda p, m, v, tf, tb, tw: (
            (p - 1) * (tf + tb - tw) / v / (m * (tf + tb + tw))
        ),
        "raised ZeroDivisionError": lambda p, m, v, *t: 1 / 0,
        "not the idle fraction": lambda p, m, v, *t: 0.5,
    }
    for words, fn in cases.items():
        verdict = ps.check_zero_bubble(fn)
        assert not verdict, words
        assert words in verdict.message, (words, verdict.message)


def test_zero_bubble_classic_slips_are_named() -> None:
    cases = {
        "m and p are swapped": lambda p, m, v, tf, tb, tw: (
            zero_bubble_fraction(m, p, v, (tf, tb, tw)) if tw <= tf else 0.0
        ),
        "plain 1F1B's": lambda p, m, v, *t: bubble_fraction(p, m),
        "zero bubble still idles": lambda p, m, v, *t: 0.0,
    }
    for words, fn in cases.items():
        verdict = ps.check_zero_bubble(fn)
        assert not verdict, words
        assert words in verdict.message, (words, verdict.message)


def one_f_one_b_loop(p, m, stage):
    order, f, b = [], 0, 0
    while f < min(p - stage - 1, m):
        order.append(("F", f))
        f += 1
    while b < m:
        if f < m:
            order.append(("F", f))
            f += 1
        order.append(("B", b))
        b += 1
    return order


def gpipe(p, m, stage):
    return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]


def backward_first(p, m, stage):
    order = []
    for j in range(m):
        order += [("B", j), ("F", j)]
    return order


def reversed_microbatches(p, m, stage):
    return [(k, m - 1 - j) for k, j in one_f_one_b_loop(p, m, stage)]


def warmup_too_long(p, m, stage):
    warm = min(p - stage, m)
    order = [("F", j) for j in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i), ("B", i)]
    return order + [("B", j) for j in range(m - warm, m)]


def warmup_wrong_end(p, m, stage):
    warm = min(stage, m)
    order = [("F", j) for j in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i), ("B", i)]
    return order + [("B", j) for j in range(m - warm, m)]


def test_one_f_one_b_right_and_wrong() -> None:
    from labkit.parallel.pipeline_parallel import stage_order

    namespace: dict = {}
    exec(ps.solution_one_f_one_b().code, namespace)
    assert ps.check_one_f_one_b(namespace["one_f_one_b"])
    assert ps.check_one_f_one_b(one_f_one_b_loop)
    assert ps.check_one_f_one_b(lambda p, m, s: stage_order(p, m, s, "1f1b"))
    cases = {
        "that is GPipe's order": gpipe,
        "the backward of micro-batch 0 runs before its forward": backward_first,
        "out of order": reversed_microbatches,
        "one warm-up forward too many": warmup_too_long,
        "deadlock": warmup_wrong_end,  # the last stage waits for forwards the first never sent
        "raised ZeroDivisionError": lambda p, m, s: 1 / 0,
    }
    for words, fn in cases.items():
        verdict = ps.check_one_f_one_b(fn)
        assert not verdict, words
        assert words in verdict.message, (words, verdict.message)
