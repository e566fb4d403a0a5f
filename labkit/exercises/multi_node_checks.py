"""Exercise of notebook 27, beyond one machine: where am I? (kernel side).

`check_where_am_i` runs the learner's function on every rank of `lab` (through `lab.run`),
once as the lab is and once under the environment torchrun would set on the second of 2
nodes, and checks rank, world size, local rank and node. `solution_where_am_i` reveals one
answer.

Classic wrong answers it rejects (tests/test_checkers_data.py): dist.get_rank() and friends
(right in the lab, but not what torchrun's variables say on another node: the checker's
second run changes only the environment); LOCAL_RANK used as the global rank (right on one
node only); the node as rank // WORLD_SIZE or rank % LOCAL_WORLD_SIZE instead of
rank // LOCAL_WORLD_SIZE (or GROUP_RANK).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from labkit.exercises import Verdict, reveal, right, run_on_ranks, wrong

NODES = 2  # the checker's pretend cluster: 2 nodes x world_size ranks


def check_where_am_i(lab: Any, fn: Callable[[], Any]) -> Verdict:
    """`fn()` runs on every rank and must return (rank, world_size, local_rank, node) read from
    the torchrun variables in os.environ, node being the index of this rank's machine (nodes
    of LOCAL_WORLD_SIZE ranks each). It runs twice: in the lab as it is (one node), and with
    the environment torchrun would set for this process on the second of 2 nodes."""

    def task(rank: int, world_size: int) -> list[Any]:
        import os

        real = dict(os.environ)
        out = [fn()]
        fake = {
            "RANK": str(world_size + rank),
            "WORLD_SIZE": str(NODES * world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "GROUP_RANK": "1",
        }
        os.environ.update(fake)
        try:
            out.append(fn())
        finally:
            os.environ.clear()
            os.environ.update(real)
        return [tuple(int(v) for v in o) if isinstance(o, (tuple, list)) else o for o in out]

    results, bad = run_on_ranks(lab, task)
    if bad is not None:
        return bad
    n = lab.world_size
    for r, (one_node, two_nodes) in sorted(results.values_by_rank.items()):
        cases = (
            ("in the lab", one_node, (r, n, r, 0)),
            (f"as rank {n + r} on node 1 of {NODES}", two_nodes, (n + r, NODES * n, r, 1)),
        )
        for where, got, expected in cases:
            if got != expected:
                hint = ""
                if where != "in the lab" and got == one_node:
                    hint = " (the same as in the lab: read the values from os.environ)"
                return wrong(f"rank {r}, {where}: got {got!r}, expected {expected}{hint}")
    return right("rank, world size, local rank and node agree with torchrun's variables")


def solution_where_am_i() -> Any:
    return reveal("""
def where_am_i():
    rank = int(os.environ["RANK"])
    local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
    return (rank, int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]),
            rank // local_world_size)
""")
