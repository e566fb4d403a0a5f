"""Tensors gloo cannot move are staged through host memory (labkit.rank.host_staging), tested on
CPU ranks: `set_device_types({"cpu"})` makes CPU tensors count as needing staging, as CUDA
tensors do over gloo. Results equal the unstaged run and a single-process reference; what is
received reaches the user's tensor only at wait() (gloo having finished before) or when
is_completed() says True; tags, groups
and all_to_all's in-place outputs hold; the trace names the copies; an error names the rank.
NCCL, mixed backends and unstaged device types go straight to torch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import labkit
from labkit.rank import host_staging

N = 2

CELL = """
import time
import torch, torch.distributed as dist
from labkit.rank import host_staging

def _until(done, what):  # the op has completed in gloo (its inner Work), not waited for by us
    deadline = time.monotonic() + 60
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)

peer = 1 - rank
out = {}
# blocking send/recv, a tag, recv from any source returning the sender
x = torch.arange(4.0) + 10 * rank
got = torch.full((4,), -1.0)
if rank == 0:
    dist.send(x, 1, tag=3)
    out["sender"] = dist.recv(got)
else:
    dist.recv(got, 0, tag=3)
    dist.send(x, 0)
    out["sender"] = 0
out["recv"] = got.clone()

# irecv: gloo writes into a host buffer, the user's tensor is written at wait()
sentinel = torch.full((3,), -7.0)
y = torch.full((3,), float(rank + 1))
w_recv = dist.irecv(sentinel, peer)
w_send = dist.isend(y, peer)
staged_work = next(
    (w for w in (w_recv, getattr(w_recv, "_work", None)) if hasattr(w, "_staging")), None
)
out["landing"] = "host buffer" if staged_work else "tensor"
if staged_work:
    assert staged_work._staging.host_received[0] is not sentinel
out["before_wait"] = sentinel.clone()
w_recv.wait(); w_send.wait()
if staged_work:
    w_recv.wait()  # a second wait returns (gloo's own p2p Work waits for ever)
out["after_wait"] = sentinel.clone()

# tags select the message: two in flight, received in the other order
a, b = torch.full((2,), 1.0 + rank), torch.full((2,), 2.0 + rank)
ra, rb = torch.zeros(2), torch.zeros(2)
works = [dist.isend(a, peer, tag=1), dist.isend(b, peer, tag=2)]
works += [dist.irecv(rb, peer, tag=2), dist.irecv(ra, peer, tag=1)]
for w in works:
    w.wait()
out["tags"] = (ra.clone(), rb.clone())

# a group, peers named by group rank, and batch_isend_irecv
group = dist.new_group([0, 1])
left = torch.zeros(3)
ops = [
    dist.P2POp(dist.isend, torch.full((3,), float(rank)), group=group, group_peer=peer),
    dist.P2POp(dist.irecv, left, group=group, group_peer=peer),
]
for w in dist.batch_isend_irecv(ops):
    w.wait()
out["batch"] = left.clone()

# the list all_to_all: outputs written in place, sync and async
ins = [torch.full((2,), 10.0 * rank + j) for j in range(world_size)]
outs = [torch.full((2,), -1.0) for _ in range(world_size)]
ids = [id(t) for t in outs]
dist.all_to_all(outs, ins)
out["all_to_all"] = [t.clone() for t in outs]
out["same_tensors"] = ids == [id(t) for t in outs]
outs2 = [torch.full((2,), -1.0) for _ in range(world_size)]
w = dist.all_to_all(outs2, ins, async_op=True)
inner = w
while hasattr(inner, "_work"):  # TracedWork -> StagedWork -> gloo's Work
    inner = inner._work
_until(inner.is_completed, "all_to_all did not complete")
out["a2a_before_wait"] = [t.clone() for t in outs2]
w.wait()
out["a2a_after_wait"] = [t.clone() for t in outs2]
outs3 = [torch.full((2,), -1.0) for _ in range(world_size)]
w = dist.all_to_all(outs3, ins, async_op=True)
_until(w.is_completed, "all_to_all never completed")  # True: the outputs are there
out["is_completed"] = [t.clone() for t in outs3]
w.wait()

# a receive buffer that is a leaf requiring grad (torch.distributed.pipelining's): torch's
# recv writes it outside autograd, and so must the staged copy; a sent tensor that requires
# grad is sent as data
leaf = torch.zeros(2, requires_grad=True)
sent = torch.full((2,), 5.0 + rank, requires_grad=True)
w_leaf = [dist.irecv(leaf, peer), dist.isend(sent, peer)]
for w in w_leaf:
    w.wait()
out["leaf"] = (leaf.detach().clone(), leaf.requires_grad, leaf.is_leaf, leaf.grad_fn)

# an error names the rank and the staging
try:
    dist.send(torch.zeros(1), rank)  # to itself: torch refuses it
except Exception as err:
    out["error"] = " ".join(getattr(err, "__notes__", []))
dist.barrier()
"""


def _reference(rank: int) -> dict:
    """What each result must be, worked out in one process from the cell's rules."""
    peer = 1 - rank
    return {
        "sender": 1 if rank == 0 else 0,
        "recv": torch.arange(4.0) + 10 * peer,
        "after_wait": torch.full((3,), float(peer + 1)),
        "tags": (torch.full((2,), 1.0 + peer), torch.full((2,), 2.0 + peer)),
        "batch": torch.full((3,), float(peer)),
        "all_to_all": [torch.full((2,), 10.0 * j + rank) for j in range(N)],
        "is_completed": [torch.full((2,), 10.0 * j + rank) for j in range(N)],
        "leaf": (torch.full((2,), 5.0 + peer), True, True, None),
    }


@pytest.mark.timeout(150)
def test_staged_p2p_and_all_to_all_keep_torch_semantics_on_cpu_ranks():
    with labkit.Lab(N, device="cpu") as lab:
        lab.run("from labkit.rank import host_staging").raise_for_errors()
        runs = {}
        for staged, tracing in ((False, True), (True, True), (True, False)):
            lab.trace(enabled=tracing)
            types = "{'cpu'}" if staged else "()"
            lab.run(f"host_staging.set_device_types({types})").raise_for_errors()
            lab.run(CELL).raise_for_errors()
            runs[staged, tracing] = (lab.pull("out"), lab.trace() if tracing else [])
        lab.run("host_staging.set_device_types({'cuda'})").raise_for_errors()

    for (staged, tracing), (out, _) in runs.items():
        for rank in range(N):
            got, want = out[rank], _reference(rank)
            for key, value in want.items():
                assert _equal(got[key], value), (staged, tracing, rank, key, got[key], value)
            assert got["same_tensors"], (staged, rank)
            assert _equal(got["a2a_after_wait"], want["all_to_all"])
            if staged:  # untouched until wait(); unstaged, gloo may have written it already
                assert got["before_wait"].tolist() == [-7.0] * 3, (staged, tracing, rank)
            assert got["landing"] == ("host buffer" if staged else "tensor")
            if staged:  # all_to_all's outputs are written at wait(), not when gloo finished
                assert all(t.tolist() == [-1.0, -1.0] for t in got["a2a_before_wait"])
                assert f"rank {rank}: labkit moved this dist.send's cpu tensors" in got["error"]
            else:  # gloo wrote into the user's tensors itself: what staging must not do early
                assert _equal(got["a2a_before_wait"], want["all_to_all"])
                assert got["error"] == ""

    records = {staged: recs for (staged, tracing), (_, recs) in runs.items() if tracing}
    kinds = {"send": "d2h", "isend": "d2h", "recv": "h2d", "irecv": "h2d"}
    kinds["all_to_all"] = "d2h+h2d"
    staged_recs = [r for r in records[True] if r.op in kinds]
    assert staged_recs and all(r.staged == kinds[r.op] for r in staged_recs), staged_recs
    assert all(r.stage_time > 0 for r in staged_recs)
    assert all(r.staged == "" and r.stage_time == 0 for r in records[False])
    # the trace is the user's calls either way: same ops, peers and bytes, staged or not
    plain = [(r.rank, r.op, r.peer, r.bytes) for r in records[False]]
    assert sorted(plain) == sorted((r.rank, r.op, r.peer, r.bytes) for r in records[True])
    sends = [r for r in records[True] if r.op == "send" and r.rank == 0]
    assert sends[0].bytes == 16 and sends[0].shape == (4,)


def _equal(a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


class _Fake:  # what plan reads of a tensor, without a GPU here
    def __init__(self, device: str):
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_nccl_and_mixed_backends_are_not_staged(monkeypatch, backend):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist.distributed_c10d, "_rank_not_in_group", lambda group: False)
    assert host_staging.plan("send", (_Fake("cuda:0"), 1), {}) is None


def test_cuda_over_gloo_is_staged_and_cpu_or_other_ops_are_not(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist.distributed_c10d, "_rank_not_in_group", lambda group: False)
    assert host_staging.plan("irecv", (), {"tensor": _Fake("cuda:1"), "src": 0}) is not None
    assert host_staging.plan("all_to_all", ([_Fake("cpu")], [_Fake("cuda:0")]), {}) is not None
    assert host_staging.plan("send", (_Fake("cpu"), 1), {}) is None
    assert host_staging.plan("all_reduce", (_Fake("cuda:0"),), {}) is None  # gloo moves it
    # a rank outside the group: torch warns and does nothing, so nothing is copied back
    monkeypatch.setattr(dist.distributed_c10d, "_rank_not_in_group", lambda group: True)
    assert host_staging.plan("recv", (_Fake("cuda:0"), 0), {}) is None


def test_device_types_switch_rejects_unknown_types():
    with pytest.raises(ValueError, match=r"unknown device types \['gpu'\]; allowed: \["):
        host_staging.set_device_types({"gpu"})
    assert host_staging.device_types() == {"cuda"}


def test_staging_cost_script_times_both_copies_per_mib(capsys):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "scripts" / "staging_cost.py"
    spec = importlib.util.spec_from_file_location("staging_cost", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.measure("cpu", [0.25, 1], repeat=1)
    assert [r["mb"] for r in rows] == [0.25, 1]
    assert all(r["d2h_ms_per_mb"] > 0 and r["h2d_ms_per_mb"] > 0 for r in rows)
    assert module.main(["--sizes-mb", "0.5", "--repeat", "1"]) == 0
    assert "D2H ms/MiB" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_the_environment_switch_stages_cpu_tensors_in_every_rank(monkeypatch):
    """LABKIT_STAGE_DEVICE_TYPES=cpu (a developers' switch) makes a lab's ranks stage CPU tensors
    as they stage CUDA ones, so the curriculum's staged paths run on CPU ranks."""

    monkeypatch.setenv(
        host_staging.ENV, "cpu"
    )  # a spare fork server is not used: it has the old one
    with labkit.Lab(N, device="cpu") as lab:
        got = lab.run(
            "from labkit.rank import host_staging\n"
            "t = torch.full((2,), float(rank))\n"
            "dist.send(t, 1) if rank == 0 else dist.recv(t, 0)\n"
            "sorted(host_staging.device_types()), t.tolist()"
        )
        got.raise_for_errors()
        records = [r for r in lab.trace() if r.kind == "comm" and r.op in ("send", "recv")]
    assert {r: got[r].value for r in range(N)} == {
        0: (["cpu"], [0.0, 0.0]),
        1: (["cpu"], [0.0, 0.0]),
    }
    assert sorted(r.staged for r in records) == ["d2h", "h2d"]
