"""Notebook 10's rules of new_group and notebook 12's reduce ops, on 3 CPU ranks with gloo:
who must call new_group in each mode, what breaks when the rule is broken, and which reduce
ops gloo runs (the notebooks assert the same on a lab; these keep the lessons true when torch
changes)."""

from __future__ import annotations

import datetime

import pytest
from distributed import run_ranks

pytestmark = pytest.mark.timeout(300)


def _group_sum(ranks, seconds=60, **kwargs):
    import torch
    import torch.distributed as dist

    try:
        group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=seconds), **kwargs)
        if group == dist.GroupMember.NON_GROUP_MEMBER:
            return "not a member"
        one = torch.ones(1)
        dist.all_reduce(one, group=group)
        return int(one.item())
    except RuntimeError as err:
        return "failed: " + str(err).splitlines()[0]


def _rules(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    seen = {"default": _group_sum([1, 2])}  # every rank calls it
    if rank in (1, 2):  # only the members call it
        seen["local"] = _group_sum([1, 2], use_local_synchronization=True)
    seen["counted"] = c10d._world.group_count  # the local call is not counted
    # From here the rules are broken on purpose, and what the ranks then wait for depends on
    # timing: rank 0's next group takes the number of the one it skipped, so its store keys
    # collide with ranks 1 and 2's group of that number, and a rank can connect to the wrong
    # peer. Every wait is bounded so that each way this can go ends in seconds (CI once saw
    # rank 1 wait past the test's 240 s here): the groups' own timeouts, and the store's for
    # the keys gloo reads while it connects (30 min by default).
    c10d._get_default_store().set_timeout(datetime.timedelta(seconds=20))
    if rank != 0:  # broken: rank 0 skips a default-mode group it is not in
        _group_sum([1, 2], seconds=5)
    seen["after_skip"] = _group_sum([0, 1, 2], seconds=2)
    if rank in (0, 1):  # broken: members that belong to 1 and 4 groups make a local one
        seen["local_01"] = _group_sum([0, 1], seconds=2, use_local_synchronization=True)
    dist.barrier()
    return seen


def test_new_group_rules_in_both_modes_and_what_breaking_them_does():
    rows = run_ranks(_rules, 3)
    assert [r["default"] for r in rows] == ["not a member", 2, 2]
    assert "local" not in rows[0] and rows[1]["local"] == rows[2]["local"] == 2
    assert [r["counted"] for r in rows] == [2, 2, 2]  # the world, then [1, 2]: numbered alike
    assert all(r["after_skip"].startswith("failed") for r in rows), rows
    assert all(rows[r]["local_01"].startswith("failed") for r in (0, 1)), rows


def _reduce_ops(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist

    out = {}
    for name in dist.ReduceOp.RedOpType.__members__:
        op = getattr(dist.ReduceOp, name)
        if name == "PREMUL_SUM":
            op = dist.ReduceOp.PREMUL_SUM(0.5)
        integer = name in ("BAND", "BOR", "BXOR")
        t = torch.tensor([(1 << rank) | 16, 7]) if integer else torch.tensor([rank + 1.0])
        try:
            dist.all_reduce(t, op=op)
            out[name] = t.tolist()
        except (RuntimeError, ValueError) as err:
            out[name] = f"refused: {err}"
    return out


def test_gloo_runs_eight_of_torchs_nine_reduce_ops():
    rows = run_ranks(_reduce_ops, 3)
    want = {  # ranks start from 1, 2, 3 and from (bit r | 16, 7)
        "SUM": [6.0],
        "AVG": [2.0],
        "PRODUCT": [6.0],
        "MIN": [1.0],
        "MAX": [3.0],
        "BAND": [16, 7],
        "BOR": [23, 7],
        "BXOR": [7 ^ 16, 7],
    }
    for got in rows:
        assert list(got) == [*want, "PREMUL_SUM"]  # torch's list: nine ops, not four
        assert {k: got[k] for k in want} == want
        assert "PREMUL_SUM with Gloo" in got["PREMUL_SUM"]


def test_premul_sum_is_made_by_its_enum_member_and_fsdp2_averages_by_default():
    """Notebook 12: `ReduceOp.PREMUL_SUM(factor)` makes the op (no private helper needed), and
    FSDP2 reduce-scatters fp32/bf16 gradients with AVG unless given a divide factor of its own."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        _get_gradient_divide_factors,
    )

    assert isinstance(dist.ReduceOp.PREMUL_SUM(0.5), dist.ReduceOp)

    class Group:  # what the function reads of a process group
        def size(self):
            return 4

    for dtype in (torch.float32, torch.bfloat16):
        *_, rs_op, _ = _get_gradient_divide_factors(Group(), None, dtype)
        assert rs_op == dist.ReduceOp.AVG
    *_, rs_op, _ = _get_gradient_divide_factors(Group(), None, torch.float32, factor=3.0)
    assert rs_op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM)  # PREMUL_SUM(1/3)
