"""Exercise of the uneven-inputs notebook 29 (kernel side).

`check_join_gradient` tests a learner's gradient of one step under `Join`: given each rank's
gradient and which ranks are still active, the gradient every rank gets (joined ranks add
zeros; the sum is divided by the world size or by the number of active ranks).

What happens without Join (the active ranks wait forever in an all_reduce the joined ones
never call) is shown on ranks in notebook 29; this checker is the arithmetic Join does
instead. Classic wrong answers it rejects (tests/test_checkers_uneven.py): a joined rank
contributing its last gradient instead of zeros; the divisor ignoring
divide_by_initial_world_size (always the world size, or always the active count); the
active flags applied to the wrong ranks. The cases put joined ranks first, last and in the
middle, and include a step where every rank is active.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from labkit.exercises import Verdict, reveal, right, wrong

__all__ = ["check_join_gradient", "solution_join_gradient"]


def _want(grads: list, active: list[bool], initial: bool) -> Any:
    total = sum(g for g, a in zip(grads, active) if a)
    return total / (len(grads) if initial else sum(active))


def check_join_gradient(fn: Callable[..., Any]) -> Verdict:
    """`fn(grads, active, divide_by_initial_world_size)` -> the averaged gradient of the step."""
    import torch

    g = torch.Generator().manual_seed(0)
    cases = [
        ([True, True, False], True),
        ([True, True, False], False),
        ([True, False, False, True], True),
        ([False, True, True, True], False),
        ([True, True], True),
        ([True, True, True], False),
        ([False, False, True, True], True),
    ]
    for i, (active, initial) in enumerate(cases):
        grads = [torch.randn(5, generator=g) for _ in active]
        want = _want(grads, active, initial)
        try:
            got = torch.as_tensor(
                fn([t.clone() for t in grads], list(active), initial), dtype=torch.float32
            )
        except Exception as exc:  # noqa: BLE001 - a learner's error is a verdict
            return wrong(f"raised {type(exc).__name__}: {exc}")
        if got.shape == want.shape and torch.allclose(got, want, atol=1e-6):
            continue
        what = f"case {i + 1} (active {active}, divide_by_initial_world_size={initial})"
        everyone = sum(grads) / (len(grads) if initial else sum(active))
        if got.shape == want.shape and torch.allclose(got, everyone, atol=1e-6):
            why = "a joined rank adds zeros, not its last gradient"
        elif got.shape == want.shape and torch.allclose(
            got, _want(grads, active, not initial), atol=1e-6
        ):
            why = (
                "wrong divisor: the world size when divide_by_initial_world_size is True, "
                "the number of active ranks when it is False"
            )
        else:
            why = "not the sum of the active ranks' gradients over the divisor"
        return wrong(f"{what}: {why}")
    return right("the active ranks' gradients, summed, over the right divisor in every case")


def solution_join_gradient() -> Any:
    return reveal("""
def join_gradient(grads, active, divide_by_initial_world_size):
    total = sum(g for g, a in zip(grads, active) if a)   # joined ranks all-reduce zeros
    divisor = len(grads) if divide_by_initial_world_size else sum(active)
    return total / divisor
""")
