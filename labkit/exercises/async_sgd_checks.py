"""Exercise of notebook 25, synchronous vs asynchronous SGD: the server's rule (kernel side).

`check_server_update` runs the learner's update rule on every rank of `lab` (through
`lab.run`) for 6 pushes and compares weights, version and staleness with the rule computed
here. `solution_server_update` reveals one answer.

Classic wrong answers it rejects (tests/test_checkers_data.py): updating w in place (the
workers that pulled w would see it change under them; `w -= ...`, `w.sub_`); the gradient
added instead of subtracted; the version not advanced, or advanced from the pulled version;
staleness with the sign reversed, or counted after the version advanced (off by one). The
pushes mix fresh gradients (staleness 0) with stale ones, in an order where version and
pulled version differ by 0, 1, 2 and 3.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from labkit.exercises import Verdict, reveal, right, run_on_ranks, wrong

TOL = 1e-6


def check_server_update(lab: Any, fn: Callable[..., Any]) -> Verdict:
    """`fn(w, grad, version, pulled, lr)` is the parameter server's rule for one push: it must
    return (new weights w - lr * grad, version + 1, staleness = version - pulled), leaving `w`
    itself unchanged. The checker replays the same 6 pushes on every rank and compares."""
    pushes = [(0, 0), (1, 0), (2, 1), (3, 3), (4, 1), (5, 5)]  # (server version, pulled version)

    def task() -> list[Any]:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(10, generator=g)
        out = []
        for version, pulled in pushes:
            grad = torch.randn(10, generator=g)
            before = w.clone()
            new_w, new_version, staleness = fn(w, grad, version, pulled, 0.1)
            out.append((new_w.clone(), int(new_version), int(staleness), torch.equal(w, before)))
            w = new_w
        return out

    results, bad = run_on_ranks(lab, task)
    if bad is not None:
        return bad
    g = torch.Generator().manual_seed(0)
    w = torch.randn(10, generator=g)
    for i, (version, pulled) in enumerate(pushes):
        w = w - 0.1 * torch.randn(10, generator=g)
        for r, out in sorted(results.values_by_rank.items()):
            got_w, got_version, got_staleness, untouched = out[i]
            if not untouched:
                return wrong(f"push {i}: fn changed w in place; return a new tensor")
            if got_version != version + 1:
                return wrong(f"push {i}: version {got_version}, expected {version + 1}")
            if got_staleness != version - pulled:
                return wrong(
                    f"push {i} (server at {version}, gradient from {pulled}): staleness "
                    f"{got_staleness}, expected {version - pulled} on rank {r}"
                )
            if (got_w - w).abs().max().item() > TOL:
                return wrong(f"push {i}: weights differ from w - lr * grad on rank {r}")
    return right("new weights, version and staleness follow the server's rule for all 6 pushes")


def solution_server_update() -> Any:
    return reveal("""
def server_update(w, grad, version, pulled, lr):
    return w - lr * grad, version + 1, version - pulled
""")
