"""The checker of the uneven-inputs notebook 29 (in this process): right gradients of a step
under Join pass, the plausible wrong ones are named."""

from __future__ import annotations

import torch

from labkit.exercises import uneven_inputs_checks as ui


def stacked(grads, active, divide_by_initial_world_size):
    g = torch.stack(grads) * torch.tensor(active, dtype=torch.float32)[:, None]
    n = len(grads) if divide_by_initial_world_size else sum(active)
    return g.sum(0) / n


def test_right_answers_pass() -> None:
    namespace: dict = {}
    exec(ui.solution_join_gradient().code, namespace)
    assert ui.check_join_gradient(namespace["join_gradient"])
    assert ui.check_join_gradient(stacked)


def test_wrong_answers_are_named() -> None:
    cases = {
        "adds zeros": lambda g, a, i: sum(g) / (len(g) if i else sum(a)),
        "wrong divisor": lambda g, a, i: sum(x for x, y in zip(g, a) if y) / sum(a),
        "wrong divisor: the world size": lambda g, a, i: sum(x for x, y in zip(g, a) if y) / len(g),
        "not the sum": lambda g, a, i: g[0],
        "not the sum of the active": lambda g, a, i: (
            sum(x for x, y in zip(g, a[::-1]) if y) / (len(g) if i else sum(a))
        ),
        "raised KeyError": lambda g, a, i: {}[0],
    }
    for words, fn in cases.items():
        verdict = ui.check_join_gradient(fn)
        assert not verdict, words
        assert words in verdict.message, (words, verdict.message)
