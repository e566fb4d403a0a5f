"""The claims of notebook 15 that tests/test_failures.py does not already make: a mismatched
shape is stopped and named, a mismatched op is not an error at all (the trace shows it)."""

from __future__ import annotations

import pytest

from labkit import LabError

pytestmark = pytest.mark.timeout(120)


def test_shape_mismatch_is_stopped_and_names_the_op_and_shape(lab) -> None:
    with pytest.raises(LabError) as info:
        lab.run("x = torch.ones(8 if rank == 0 else 4)\ndist.all_reduce(x)")
    msg = str(info.value)
    assert "all_reduce" in msg and ("(8,)" in msg or "(4,)" in msg), msg
    assert "variables on the ranks were lost" in msg
    assert lab.run("rank").values_by_rank == {r: r for r in range(4)}


def test_op_mismatch_is_silent_and_visible_in_the_trace(lab) -> None:
    res = lab.run(
        "t = torch.tensor([rank + 1.0])\n"
        "dist.all_reduce(t, op=dist.ReduceOp.MAX if rank == 0 else dist.ReduceOp.SUM)\n"
        "t.item()"
    )
    assert not res.errors
    assert set(res.values_by_rank.values()) != {10.0}  # not the sum everywhere
    assert {r.rank: r.reduce_op for r in lab.trace()} == {0: "MAX", 1: "SUM", 2: "SUM", 3: "SUM"}
