"""The rank-side tracer records communication however it is issued (2 CPU ranks, gloo).

Plain `dist.*` calls, `P2POp` batches (as torch.distributed.pipelining issues them), DDP's bucket
all_reduces (made by the C++ reducer, read from torch's Flight Recorder) and DTensor's functional
collectives each leave records with op, group, peer and bytes; async ops end when they complete;
DDP's math is unchanged (tests/test_ddp_observed.py checks it bitwise on 3 ranks).
"""

from __future__ import annotations

import pytest
import torch

import labkit
from labkit.rank import trace_state
from labkit.views.comm_view import op_summary
from labkit.wire.records import CommRecord


@pytest.fixture(scope="module")
def lab():
    lab = labkit.Lab(2, device="cpu")
    yield lab
    lab.stop()


def _ops(lab, rank: int = 0) -> list:
    return [r for r in lab.trace() if r.rank == rank and r.kind == "comm"]


@pytest.mark.timeout(120)
def test_sync_and_async_calls(lab) -> None:
    lab.run(
        """
x = torch.ones(256)
dist.all_reduce(x)
w = dist.all_reduce(x, async_op=True)
w.wait()
fut = dist.broadcast(x, src=1, async_op=True).get_future()
fut.wait()
"""
    ).raise_for_errors()
    recs = _ops(lab)
    assert [r.op for r in recs] == ["all_reduce", "all_reduce", "broadcast"]
    assert [r.seq - recs[0].seq for r in recs] == [0, 1, 2]  # one count per group
    assert all(r.group == (0, 1) and r.bytes == 1024 and r.end >= r.start for r in recs)
    assert [r.async_op for r in recs] == [False, True, True]
    assert recs[2].peer == 1 and recs[0].line == 3 and recs[0].reduce_op == "SUM"


@pytest.mark.timeout(120)
def test_single_ops_one_record_per_call_with_the_ring_factor(lab) -> None:
    results = lab.run(
        """
import warnings
mine, out = torch.arange(3.) + 10 * rank, torch.empty(6)
dist.all_gather_single(out, mine)
dist.all_gather_single(out, mine, async_op=True).wait()
parts = torch.arange(8.) * (rank + 1)
half = torch.empty(4)
dist.reduce_scatter_single(half, parts)
dist.reduce_scatter_single(half, parts, async_op=True).wait()
with warnings.catch_warnings():  # the deprecated names call the ones above
    warnings.simplefilter("ignore", FutureWarning)
    dist.all_gather_into_tensor(out, mine, async_op=True).wait()
    dist.reduce_scatter_tensor(half, parts, async_op=True).wait()
    dist.all_gather_into_tensor(out, mine)
    dist.reduce_scatter_tensor(half, parts)
(out, half)
"""
    )
    for rank in (0, 1):
        out, half = results[rank].value
        assert torch.equal(out, torch.cat([torch.arange(3.0), torch.arange(3.0) + 10]))
        assert torch.equal(half, (torch.arange(8.0) * 3).chunk(2)[rank])
    recs = _ops(lab)
    ag, rs = ("all_gather_single", 24), ("reduce_scatter_single", 32)  # S: gathered, unsplit
    assert [(r.op, r.bytes, r.async_op) for r in recs] == [
        (*ag, False),
        (*ag, True),
        (*rs, False),
        (*rs, True),
        ("all_gather_into_tensor", 24, True),
        ("reduce_scatter_tensor", 32, True),
        ("all_gather_into_tensor", 24, False),
        ("reduce_scatter_tensor", 32, False),
    ]
    assert [r.seq - recs[0].seq for r in recs] == list(range(8))
    rows = {row["op"]: row for row in op_summary(lab.trace())}
    for op in ("all_gather_single", "reduce_scatter_single", "reduce_scatter_tensor"):
        assert rows[op]["busbw"] == pytest.approx(rows[op]["algbw"] / 2), op  # (p-1)/p, p = 2


@pytest.mark.timeout(120)
def test_p2p_batch_records_each_op_with_its_peer(lab) -> None:
    results = lab.run(
        """
peer = 1 - rank
send, recv = torch.arange(3.) + rank, torch.empty(3)
ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
for work in dist.batch_isend_irecv(ops):
    work.wait()
recv
"""
    )
    assert torch.equal(results[0].value, torch.arange(3.0) + 1)
    recs = _ops(lab, 1)
    assert [(r.op, r.peer, r.bytes, r.async_op) for r in recs] == [
        ("isend", 0, 12, True),
        ("irecv", 0, 12, True),
    ]
    assert all(r.end >= r.start for r in recs)


@pytest.mark.timeout(180)
def test_pipelining_schedule_is_traced(lab) -> None:
    lab.run(
        """
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
torch.manual_seed(0)
layers = [nn.Linear(4, 4) for _ in range(world_size)]
stage = PipelineStage(layers[rank], rank, world_size, torch.device("cpu"))
schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, y: ((out - y) ** 2).mean())
x, y = torch.randn(4, 4), torch.randn(4, 4)
schedule.step(x) if rank == 0 else schedule.step(target=y)
"""
    ).raise_for_errors()
    sends = [r for r in _ops(lab, 0) if r.op in ("isend", "send")]
    recvs = [r for r in _ops(lab, 1) if r.op in ("irecv", "recv")]
    # 2 micro-batches of activations (2 x 4 floats) go forward, from stage 0 to stage 1
    assert len(sends) >= 2 and all(r.peer == 1 for r in sends)
    assert len(recvs) >= 2 and all(r.peer == 0 for r in recvs)
    assert {r.bytes for r in sends} >= {2 * 4 * 4}


DDP_CELL = """
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))
ddp = DDP(model)
torch.manual_seed(1 + rank)
ddp(torch.randn(3, 6)).sum().backward()
[p.grad.clone() for p in model.parameters()]
"""


@pytest.mark.timeout(180)
def test_ddp_buckets_are_traced_and_grads_unchanged(lab) -> None:
    traced = lab.run(DDP_CELL)
    recs = _ops(lab)
    num_params = 6 * 5 + 5 + 5 * 2 + 2
    buckets = [r for r in recs if r.op == "all_reduce"]
    assert buckets and sum(r.bytes for r in buckets) == num_params * 4
    assert all(r.group == (0, 1) and r.end >= r.start for r in buckets)
    assert all(r.recorded_by == "flight_recorder" for r in buckets)
    lab.trace(enabled=False)  # nothing recorded: DDP runs as it did with tracing on
    try:
        plain = lab.run(DDP_CELL)
        assert not _ops(lab)
    finally:
        lab.trace(enabled=True)
    for rank in (0, 1):
        for a, b in zip(traced[rank].value, plain[rank].value, strict=True):
            assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(traced[0].value, traced[1].value, strict=True))


JOIN_CELL = """
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
ddp = DDP(nn.Linear(4, 2))
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
torch.manual_seed(1 + rank)
with Join([ddp], divide_by_initial_world_size=DIVIDE_BY_INITIAL):
    for _ in range(2 + rank):  # rank 1 runs one step more
        opt.zero_grad()
        ddp(torch.randn(3, 4)).sum().backward()
        opt.step()
[p.detach().clone() for p in ddp.parameters()]
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("divide_by_initial", [True, False])
def test_ddp_under_join_with_uneven_steps(lab, divide_by_initial) -> None:
    # the reducer takes the Work of Join's per-forward all_reduce: it must be torch's own (the
    # wrapper lets it through), and the reducer divides as it would without labkit
    lab.push(DIVIDE_BY_INITIAL=divide_by_initial)
    res = lab.run(JOIN_CELL)
    res.raise_for_errors()
    assert all(torch.equal(a, b) for a, b in zip(res[0].value, res[1].value, strict=True))
    recs = _ops(lab, rank=1)
    assert recs and all(r.end >= r.start for r in recs)
    lab.trace(enabled=False)  # untraced: the same DDP, the same math
    try:
        plain = lab.run(JOIN_CELL)
    finally:
        lab.trace(enabled=True)
    for a, b in zip(res[1].value, plain[1].value, strict=True):
        assert torch.equal(a, b)


@pytest.mark.timeout(180)
def test_dtensor_functional_collectives_are_traced(lab) -> None:
    results = lab.run(
        """
from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor
import torch.distributed._functional_collectives as funcol
mesh = DeviceMesh("cpu", [0, 1])
d = distribute_tensor(torch.arange(8.), mesh, [Shard(0)])
full = d.redistribute(mesh, [Replicate()]).to_local()
s = funcol.all_reduce(torch.ones(4) * (rank + 1), "sum", mesh)
(full, s + 0, hasattr(funcol.all_reduce, "__labkit_traced__"))
"""
    )
    full, summed, patched = results[0].value
    assert torch.equal(full, torch.arange(8.0)) and torch.equal(summed, torch.full((4,), 3.0))
    assert patched
    recs = _ops(lab)
    gathers = [r for r in recs if r.op == "all_gather_single"]  # dist's name for the same op
    reduces = [r for r in recs if r.op == "all_reduce"]
    assert len(gathers) == 1 and gathers[0].bytes == 8 * 4 and gathers[0].group == (0, 1)
    assert len(reduces) == 1 and reduces[0].reduce_op == "SUM" and reduces[0].async_op
    assert all(r.end >= r.start for r in recs)


def test_cuda_device_time() -> None:
    if not torch.cuda.is_available():
        pytest.skip("device_time comes from CUDA events: needs a GPU (CPU records leave it None)")
    t = torch.ones(1024, device="cuda")
    event = trace_state.cuda_event([t])
    rec = CommRecord(rank=0, op="all_reduce", seq=1, group=(0,))
    t.mul_(2)
    trace_state.end_event(rec, event)
    torch.cuda.synchronize()
    trace_state.resolve_events()
    assert rec.device_time is not None and rec.device_time >= 0


def test_no_cuda_event_for_cpu_tensors() -> None:
    assert trace_state.cuda_event([torch.ones(2)]) is None and trace_state.cuda_event([]) is None


@pytest.mark.timeout(120)
def test_fsdp2_all_gathers_and_reduce_scatters_are_traced():
    import labkit

    with labkit.Lab(2, device="cpu") as lab:
        lab.run(
            "from torch.distributed.fsdp import fully_shard\n"
            "m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))\n"
            "for layer in m:\n    fully_shard(layer)\nfully_shard(m)"
        )
        lab.run("m(torch.randn(4, 8)).sum().backward()")
        ops = {(r.op, r.bytes) for r in lab.trace() if r.rank == 0}
    # per layer: the whole (gathered) parameters, 4 bytes each: 8*8+8 = 72 and 8*2+2 = 18
    assert ("all_gather_single", 72 * 4) in ops and ("reduce_scatter_single", 72 * 4) in ops
    assert ("all_gather_single", 18 * 4) in ops and ("reduce_scatter_single", 18 * 4) in ops


@pytest.mark.timeout(180)
def test_forked_ranks_records_are_on_the_kernels_clock_under_load(cpu_load) -> None:
    """Forked ranks read this machine's clock: their offsets are exactly 0, so a span that can
    only start after another rank's ended is never drawn before it, however busy the machine
    (a measured offset erred by up to half a ping's round trip: tens of ms under load)."""
    lab = labkit.Lab(2, device="cpu")
    try:
        lab.restart()  # the offsets are set on every start
        assert lab.offsets == {0: 0.0, 1: 0.0}
        lab.run(
            """
import time
import labkit
x = torch.zeros(1)
for step in range(5):
    if rank == 0:
        with labkit.span("first"):
            time.sleep(0.01)
        dist.send(x, 1)
    else:
        dist.recv(x, 0)
        with labkit.span("second"):
            time.sleep(0.01)
"""
        ).raise_for_errors()
        spans = [r for r in lab.trace() if r.kind == "span"]
        firsts = sorted((r for r in spans if r.name == "first"), key=lambda r: r.start)
        seconds = sorted((r for r in spans if r.name == "second"), key=lambda r: r.start)
        assert len(firsts) == len(seconds) == 5
        for a, b in zip(firsts, seconds):
            assert b.start >= a.end, (a, b)
    finally:
        lab.stop()
