"""Stragglers are healthy: a rank that computes for seconds before a collective or a p2p op, while
its peers wait in it, must never get the cell stopped (kernel and ranks, 4 CPU ranks with gloo).

Each test sets a variable on every rank, runs a cell where one rank sleeps (its "compute")
before the op while the others already wait in it, and checks the values, that the ranks are
the same processes (no restart) and that the variable survived. After the op the waiting ranks
work on briefly, so the kernel sees the straggler finish while the others' last heartbeat still
says "blocked in the op for N s": the moment the old watchdog took for a stuck cell.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(120)
AFTER = "if rank not in late:\n    time.sleep(1.0)  # the others work on after the op\n"


def run_straggler(lab, late: list[int], seconds: float, body: str):
    """Run `body` after the `late` ranks sleep `seconds`; the lab must keep ranks and variables."""
    pids = dict(lab.pids)
    lab.run(f"kept = 100 + rank\nlate = {late}")
    res = lab.run(
        "import time\nt = torch.full((2,), float(rank + 1))\n"
        f"if rank in late:\n    time.sleep({seconds})\n{body}{AFTER}t.tolist()",
        timeout=seconds + 60,
    )
    assert lab.pids == pids, "the ranks were restarted"
    assert lab.run("kept").values_by_rank == {r: 100 + r for r in range(lab.world_size)}
    return res.values_by_rank


def test_straggler_before_all_reduce(lab):
    values = run_straggler(lab, [0], 6, "dist.all_reduce(t)\n")
    assert values == {r: [10.0, 10.0] for r in range(4)}


@pytest.mark.timeout(180)
def test_long_straggler_before_all_reduce(lab):
    values = run_straggler(lab, [2], 20, "dist.all_reduce(t)\n")
    assert values == {r: [10.0, 10.0] for r in range(4)}


def test_straggler_before_send_and_before_recv(lab):
    # rank 0 computes before it sends to rank 1 (waiting in recv); rank 3 computes before it
    # receives from rank 2 (which waits in send, or finishes if gloo buffers the message)
    body = (
        "if rank == 0:\n    dist.send(t, 1)\n"
        "elif rank == 1:\n    dist.recv(t, 0)\n"
        "elif rank == 2:\n    dist.send(t, 3)\n"
        "else:\n    dist.recv(t, 2)\n"
    )
    values = run_straggler(lab, [0, 3], 6, body)
    assert values == {0: [1.0, 1.0], 1: [1.0, 1.0], 2: [3.0, 3.0], 3: [3.0, 3.0]}


@pytest.mark.parametrize("straggler", [0, 3])
def test_straggler_before_broadcast(lab, straggler):
    # the source is late (everyone waits for it), or one receiver is late
    values = run_straggler(lab, [straggler], 6, "dist.broadcast(t, src=0)\n")
    assert values == {r: [1.0, 1.0] for r in range(4)}


def test_straggler_before_gather_while_the_others_finish(lab):
    # ranks 1 and 2 send their part to the root and finish; the root waits for rank 3
    body = "dist.gather(t, [torch.zeros(2) for _ in range(4)] if rank == 0 else None, dst=0)\n"
    values = run_straggler(lab, [3], 12, body)  # > 2 LONG_GRACE after ranks 1, 2 finish
    assert values == {r: [r + 1.0] * 2 for r in range(4)}
