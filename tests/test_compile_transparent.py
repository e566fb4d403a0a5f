"""labkit's wrappers stand aside while torch.compile traces (2 CPU ranks, gloo): a function that
calls `dist.all_reduce` or a functional all-reduce compiles to one graph with no break, as in a
torchrun process, and gives the same values; the compiled all-reduce is still in the cell's
trace, read from torch's Flight Recorder (labkit's own wrappers did not run)."""

from __future__ import annotations

import pytest

import labkit
from labkit.rank import ddp_tracing

CELL = """
import torch._dynamo
import torch.distributed._functional_collectives as funcol

def with_c10d(x):
    y = x * 2
    dist.all_reduce(y)
    return y + 1

def with_funcol(x):
    return funcol.all_reduce(x * 2, "sum", list(range(world_size))) + 1

torch._dynamo.reset()
explained = [torch._dynamo.explain(f)(torch.ones(4)) for f in (with_c10d, with_funcol)]
graphs = [(e.graph_count, e.graph_break_count) for e in explained]
compiled = torch.compile(with_c10d, backend="eager")
compiled(torch.ones(3))  # compiled once here
"""


@pytest.mark.timeout(180)
def test_compiled_collectives_compile_to_one_graph_and_are_still_recorded():
    with labkit.Lab(2, device="cpu") as lab:
        lab.run(CELL).raise_for_errors()
        got = lab.run("graphs, compiled(torch.ones(5)).tolist()")
        got.raise_for_errors()
        records = lab.trace()
    for r in range(2):
        graphs, values = got[r].value
        assert graphs == [(1, 0), (1, 0)], (r, graphs)  # no break of labkit's making
        assert values == [5.0] * 5  # (1 * 2) summed over 2 ranks, + 1
    ops = [(c.rank, c.op, c.bytes) for c in records if c.kind == "comm"]
    assert sorted(ops) == [(0, "all_reduce", 20), (1, "all_reduce", 20)], ops
    assert all(
        c.recorded_by == ddp_tracing.BY for c in records if c.kind == "comm"
    )  # from torch's records: labkit's wrapper did not run inside the compiled code
