"""Exercise of notebook 28, RPC: change a value where it lives (kernel side).

`check_add_on_owner` runs the learner's `fn(rref, delta)` on every rank of `lab` (through
`lab.run`), with RPC up: each rank holds an RRef to a tensor owned by its right neighbour,
calls `fn` twice, and reports what `fn` returned and what the owner holds afterwards. Right:
the owner's tensor grew by both deltas and `fn` returned the new value each time.
`solution_add_on_owner` reveals one answer.

Classic wrong answers it rejects (tests/test_rpc.py): `rref.to_here().add_(delta)` (to_here
copies: the owner's tensor never changes); `rref.rpc_sync().add(delta)` (runs on the owner
but out of place); `rref.local_value()` on a worker that is not the owner; returning
nothing, or an unwaited future (`rpc_async()` without `.wait()`: no tensor comes back). Two
calls in a row check that the second sees the first's change (a copy would not).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from labkit.exercises import Verdict, rank_error, reveal, right, wrong

DELTAS = ([1.0, 2.0, 3.0], [10.0, 20.0, 30.0])


def check_add_on_owner(lab: Any, fn: Callable[..., Any]) -> Verdict:
    """`fn(rref, delta)` must add `delta` to the tensor `rref` refers to, in place on its owner
    (which is another worker), and return the new value."""

    def task(rank: int, world_size: int) -> Any:
        import torch
        import torch.distributed.rpc as rpc

        try:
            rpc.get_worker_info()
        except RuntimeError:  # "RPC has not been initialized"
            return "no rpc"
        owner = f"worker{(rank + 1) % world_size}"
        # a torch op called over RPC must match its schema exactly: zeros takes a size list
        rref = rpc.remote(owner, torch.zeros, args=((3,),))
        returned = []
        for delta in DELTAS:
            out = fn(rref, torch.tensor(delta))
            returned.append(None if not isinstance(out, torch.Tensor) else out.clone())
        return {"returned": returned, "owner": rref.owner().name, "held": rref.to_here()}

    results = lab.run(task)
    if (bad := rank_error(results)) is not None:
        return bad
    values = results.values_by_rank
    if any(v == "no rpc" for v in values.values()):
        return wrong("RPC is not initialised on the ranks: run the init_rpc cell first")
    world_size = len(values)
    first = torch.tensor(DELTAS[0])
    both = first + torch.tensor(DELTAS[1])
    for r, got in sorted(values.items()):
        if got["owner"] != f"worker{(r + 1) % world_size}":
            return wrong(f"rank {r}: the RRef's owner changed to {got['owner']}")
        held = got["held"]
        if torch.allclose(held, torch.zeros(3)):
            return wrong(
                f"rank {r}: the owner's tensor is still zeros; the change happened to a copy "
                "(to_here() copies), or out of place (add returns a new tensor)"
            )
        if not torch.allclose(held, both):
            return wrong(f"rank {r}: the owner holds {held.tolist()}, expected {both.tolist()}")
        for i, (out, want) in enumerate(zip(got["returned"], (first, both))):
            if out is None:
                return wrong(f"rank {r}: call {i + 1} returned no tensor; return the new value")
            if not torch.allclose(out, want):
                return wrong(
                    f"rank {r}: call {i + 1} returned {out.tolist()}, expected {want.tolist()}"
                )
    return right("every owner's tensor changed in place, and each call returned the new value")


def solution_add_on_owner() -> Any:
    return reveal("""
def add_on_owner(rref, delta):
    # the method runs on the owner, on the object itself (rref.remote().add_(delta).to_here()
    # or rref.rpc_async().add_(delta).wait() do the same)
    return rref.rpc_sync().add_(delta)
""")
