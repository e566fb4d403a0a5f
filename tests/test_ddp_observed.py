"""DDP in a lab is observed, never altered (3 CPU ranks, gloo).

labkit registers no comm hook and wraps no Work: a DDP model keeps the hooks its user left (none,
or theirs, which still runs), its gradients are bitwise those of the same steps in plain gloo
processes (tests/distributed.py), under Join with uneven inputs too, and each bucket DDP made
still leaves one record, read from torch's Flight Recorder: its bytes are the bucket's (as DDP's
own logging data and the layer sizes give them), its start when it was issued, inside backward.
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks

import labkit
from labkit.rank import ddp_tracing
from labkit.wire.records import CommRecord

pytestmark = pytest.mark.timeout(300)

N = 3
LAYER = (512 * 512 + 512) * 4  # bytes of one Linear(512, 512)'s gradients: over 1 MiB
# Three Linear(512, 512) under bucket_cap_mb=1: DDP's first backward reduces one bucket of
# everything; it then rebuilds its buckets in the order the gradients came, one layer each.
STEP1, STEP2 = [3 * LAYER], [LAYER] * 3

SRC = """
def ddp_steps(rank, world_size, steps, join=False, initial=True, hook=False):
    import contextlib
    import torch, torch.nn as nn, torch.distributed as dist
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP
    import labkit

    torch.set_num_threads(1)
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(*[nn.Linear(512, 512) for _ in range(3)]), bucket_cap_mb=1)
    calls = []
    if hook:
        def counting(state, bucket):  # DDP's average, through dist.all_reduce, counted
            calls.append(bucket.buffer().numel())
            t = bucket.buffer().div_(world_size)
            return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])
        ddp.register_comm_hook(None, counting)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    torch.manual_seed(1 + rank)
    xs = [torch.randn(8, 512) for _ in range(steps + (rank if join else 0))]
    with Join([ddp], divide_by_initial_world_size=initial) if join else contextlib.nullcontext():
        for x in xs:
            opt.zero_grad()
            loss = ddp(x).square().mean()
            with labkit.span("backward"):
                loss.backward()
            opt.step()
    return {
        "grads": [p.grad.clone() for p in ddp.parameters()],
        "params": [p.detach().clone() for p in ddp.parameters()],
        "hooks": [h.__name__ for h, _ in ddp._comm_hooks],
        "calls": calls,
        "first_buckets": [int(b) for b in ddp._get_ddp_logging_data()["bucket_sizes"].split(",")],
        # DDP's buckets now, as its reducer holds them (the layout it rebuilt after step 1)
        "buckets": [4 * b.buffer().numel() for b in ddp.reducer._get_zeros_like_grad_buckets()],
    }
"""


def _plain(rank, world_size, kwargs):
    ns: dict = {}
    exec(SRC, ns)
    return ns["ddp_steps"](rank, world_size, **kwargs)


@pytest.fixture(scope="module")
def lab():
    lab = labkit.Lab(N, device="cpu")
    lab.run(SRC).raise_for_errors()
    yield lab
    lab.stop()


def _in_lab(lab, **kwargs):
    res = lab.run(f"ddp_steps(rank, world_size, **{kwargs!r})")
    res.raise_for_errors()
    return {r: res[r].value for r in range(N)}, lab.trace()


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _fr(records, rank, op="all_reduce"):
    return [
        r
        for r in records
        if isinstance(r, CommRecord)
        and r.rank == rank
        and r.op == op
        and r.recorded_by == ddp_tracing.BY
    ]


def test_no_hook_is_added_one_record_per_bucket_issued_inside_backward(lab) -> None:
    got, records = _in_lab(lab, steps=2)
    plain = run_ranks(_plain, N, {"steps": 2})
    for r in range(N):
        assert got[r]["hooks"] == [] == plain[r]["hooks"]  # DDP keeps its C++ all_reduce
        # bitwise: DDP's own math (sum, then divide), not a hook's (divide, then sum)
        assert _same(got[r]["grads"], plain[r]["grads"]), r
        assert _same(got[r]["params"], plain[r]["params"]), r
        assert got[r]["first_buckets"] == STEP1 and got[r]["buckets"] == STEP2  # DDP says so
        buckets = _fr(records, r)
        assert [b.bytes for b in buckets] == STEP1 + STEP2, buckets
        assert all(b.group == tuple(range(N)) and b.dtype == "float32" for b in buckets)
        assert all(b.end == b.start and b.line is None for b in buckets)  # no end on gloo
        # DDP's start-up broadcast of the parameters, also issued from C++
        assert sum(b.bytes for b in _fr(records, r, "broadcast")) >= 3 * LAYER
        spans = [s for s in records if s.kind == "span" and s.rank == r]
        assert len(spans) == 2
        step2 = buckets[1:]
        # issued while backward ran, one after the other (bucket 0 as soon as its gradients
        # were ready, before backward had computed the others)
        assert all(spans[1].start <= b.start <= spans[1].end for b in step2), (spans, step2)
        assert step2[0].start < step2[1].start < step2[2].start
        assert spans[0].start <= buckets[0].start <= spans[0].end
    seqs = {r: [b.seq for b in _fr(records, r)] for r in range(N)}
    assert all(s == seqs[0] for s in seqs.values()) and len(set(seqs[0])) == 4  # same numbers


def test_a_users_hook_stays_and_runs_and_is_traced_once(lab) -> None:
    got, records = _in_lab(lab, steps=2, hook=True)
    plain = run_ranks(_plain, N, {"steps": 2, "hook": True})
    for r in range(N):
        assert got[r]["hooks"] == ["counting"] == plain[r]["hooks"]
        assert [4 * n for n in got[r]["calls"]] == STEP1 + STEP2  # the user's hook ran
        assert _same(got[r]["grads"], plain[r]["grads"]), r
        traced = [c for c in records if c.kind == "comm" and c.rank == r and c.op == "all_reduce"]
        # the hook's dist.all_reduce is traced by labkit; the Flight Recorder adds no copy
        assert [c.bytes for c in traced] == STEP1 + STEP2, traced
        assert all(c.recorded_by == "" for c in traced)


def test_join_with_uneven_inputs_keeps_ddps_divisor(lab) -> None:
    initial = False  # DDP divides by the ranks not joined yet: Join's all_reduce of ones
    got, records = _in_lab(lab, steps=2, join=True, initial=initial)
    plain = run_ranks(_plain, N, {"steps": 2, "join": True, "initial": initial})
    for r in range(N):  # rank r runs 2 + r steps; the others shadow it
        assert got[r]["hooks"] == []
        assert _same(got[r]["params"], plain[r]["params"]), (r, initial)
    assert _same(got[0]["params"], got[N - 1]["params"])
    # Join's all_reduce of ones at each forward goes to torch unwrapped (DDP's reducer takes
    # torch's Work only) and is recorded from the Flight Recorder: 4 bytes, one per step
    ones = [c for c in _fr(records, N - 1) if c.bytes == 4]
    assert len(ones) >= 2 + N - 1, ones
    # every step of the longest rank reduced its buckets: 1 of everything, then 3 per step
    assert [c.bytes for c in _fr(records, N - 1) if c.bytes >= LAYER] == STEP1 + STEP2 * (N)
