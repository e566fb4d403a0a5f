"""Ring all-reduce from isend/recv: the schedule by hand, and the ranks' result, step count and
bytes sent checked against dist.all_reduce and 2(p-1)/p of the buffer (docs/references.md)."""

from __future__ import annotations

import pytest
import torch

from labkit.parallel.ring_allreduce import RingStep, ring_bytes_per_rank, ring_schedule

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------- pure: the schedule


def test_schedule_has_two_phases_of_p_minus_1_steps() -> None:
    for p in range(1, 7):
        steps = ring_schedule(p)
        assert len(steps) == 2 * (p - 1)
        assert [ph for ph, _ in steps] == ["reduce-scatter"] * (p - 1) + ["all-gather"] * (p - 1)
        for _, plan in steps:  # what position i sends is what position i+1 receives
            assert all(plan[i][0] == plan[(i + 1) % p][1] for i in range(p))


def test_schedule_simulated_gives_the_sum_everywhere() -> None:
    """Run the schedule on sets of contributors: reduce-scatter leaves position i with the full
    chunk (i+1) mod p, all-gather gives everyone everything."""
    for p in range(1, 7):
        held = [[{i} for _ in range(p)] for i in range(p)]
        steps = ring_schedule(p)
        for k, (phase, plan) in enumerate(steps):
            sent = [set(held[i][plan[i][0]]) for i in range(p)]
            for i in range(p):
                got = sent[(i - 1) % p]
                c = plan[i][1]
                held[i][c] = held[i][c] | got if phase == "reduce-scatter" else got
            if k == p - 2:
                for i in range(p):
                    assert held[i][(i + 1) % p] == set(range(p))
        assert all(h == set(range(p)) for row in held for h in row)


def test_bytes_per_rank_formula() -> None:
    assert ring_bytes_per_rank(4096, 4) == 2 * 3 / 4 * 4096
    assert ring_bytes_per_rank(100, 1) == 0
    with pytest.raises(ValueError, match="p must be >= 1"):
        ring_schedule(0)


# ---------------------------------------------------------------- on 4 ranks


def _ring_on(lab, code_group: str, length: int):
    lab.run(
        f"from labkit.parallel.ring_allreduce import ring_all_reduce\n"
        f"group = {code_group}\n"
        f"torch.manual_seed(rank)\n"
        f"x = torch.randint(-50, 50, ({length},)).float()\n"
        f"ref = x.clone()\n"
        f"members = dist.get_process_group_ranks(group or dist.group.WORLD)\n"
        f"if rank in members:\n"
        f"    dist.all_reduce(ref, group=group)\n"
        f"    steps = ring_all_reduce(x, group, record=True)\n"
        f"else:\n"
        f"    steps = []\n"
    )
    return lab.trace()


@pytest.mark.parametrize("length", [8, 10, 3])
def test_ring_equals_all_reduce_on_world(lab, length: int) -> None:
    records = _ring_on(lab, "None", length)
    got = lab.run("bool(torch.equal(x, ref)), x.tolist()").values_by_rank
    assert all(ok for ok, _ in got.values()), got
    p = 4
    sends = [r for r in records if r.op == "isend"]
    for r in range(p):  # 2(p-1) sends and receives per rank, each one chunk
        mine = [s for s in sends if s.rank == r]
        assert len(mine) == 2 * (p - 1)
        assert len([s for s in records if s.rank == r and s.op == "recv"]) == 2 * (p - 1)
        assert all(s.peer == (r + 1) % p for s in mine)
    if length % p == 0:  # each rank sends 2(p-1)/p of the buffer
        assert all(
            sum(s.bytes for s in sends if s.rank == r) == ring_bytes_per_rank(4 * length, p)
            for r in range(p)
        )


def test_ring_on_a_subgroup_of_three(lab) -> None:
    _ring_on(lab, "dist.new_group([0, 1, 3])", 7)
    got = lab.run("bool(torch.equal(x, ref)), len(steps)").values_by_rank
    assert got[0] == got[1] == got[3] == (True, 1 + 2 * 2)
    assert got[2] == (True, 0)


def test_recorded_steps_show_the_schedule(lab) -> None:
    lab.run(
        "from labkit.parallel.ring_allreduce import ring_all_reduce\n"
        "x = torch.full((4,), 10.0 ** rank)\n"
        "steps = ring_all_reduce(x, record=True)"
    )
    steps = lab.pull("steps")
    sched = ring_schedule(4)
    for r, recs in steps.items():
        assert [s.step for s in recs] == list(range(7))
        assert isinstance(recs[0], RingStep) and recs[0].chunks == [[10.0**r]] * 4
        for rec, (phase, plan) in zip(recs[1:], sched):
            assert (rec.phase, rec.send_chunk, rec.recv_chunk) == (phase, *plan[r])
            assert rec.send_to == (r + 1) % 4 and rec.recv_from == (r - 1) % 4
            assert rec.bytes_sent == 4
        after_rs = recs[3].chunks[(r + 1) % 4]  # the full sum after reduce-scatter: 1111
        assert after_rs == [1111.0]
        assert recs[-1].chunks == [[1111.0]] * 4


def test_naive_all_reduce_bytes_and_result(lab) -> None:
    lab.run(
        "from labkit.parallel.ring_allreduce import naive_all_reduce\n"
        "x = torch.arange(6.) * (rank + 1)\n"
        "sent = naive_all_reduce(x)"
    )
    records = lab.trace()
    got = lab.run("x.tolist(), sent").values_by_rank
    expected = (torch.arange(6.0) * 10).tolist()
    assert got == {0: (expected, 3 * 24), 1: (expected, 24), 2: (expected, 24), 3: (expected, 24)}
    sends = {r: sum(s.bytes for s in records if s.rank == r and s.op == "send") for r in range(4)}
    assert sends == {0: 3 * 24, 1: 24, 2: 24, 3: 24}


def test_ring_rejects_non_contiguous(lab) -> None:
    res = lab.run(
        "from labkit.parallel.ring_allreduce import ring_all_reduce\n"
        "ring_all_reduce(torch.ones(4, 4).t())"
    )
    assert all("contiguous" in e["message"] for e in res.errors.values()) and len(res.errors) == 4
