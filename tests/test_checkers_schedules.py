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
        "not the idle fraction": lambda p, m, v, *t: 0.0,
    }
    for words, fn in cases.items():
        verdict = ps.check_zero_bubble(fn)
        assert not verdict, words
        assert words in verdict.message, (words, verdict.message)
