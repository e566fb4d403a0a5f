"""Functional all-gathers over gloo run on host copies (labkit.rank.funcol_staging), tested on 2
CPU ranks: `host_staging.set_device_types({"cpu"})` makes CPU tensors count as needing staging,
as CUDA tensors do over gloo. DTensor's full_tensor, the plain and the autograd all-gather and
the coalesced one give what the same calls give unstaged (and what one process works out); the
gradient through the autograd gather is the same; the trace records the user's call, with the
copies noted; another device type, or a group that is not plain gloo, is left to torch."""

from __future__ import annotations

import pytest
import torch

import labkit

N = 2

CELL = """
import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from labkit.rank import funcol_staging, host_staging

host_staging.set_device_types(TYPES)
out = {}
x = torch.arange(3.0) + 10 * rank
g = funcol.all_gather_tensor(x, 0, list(range(world_size)))
out["gather"] = torch.as_tensor(g).clone()
xs = [torch.full((2,), float(rank)), torch.full((1,), 5.0 + rank)]
out["coalesced"] = [torch.as_tensor(t).clone() for t in funcol.all_gather_into_tensor_coalesced(
    xs, list(range(world_size)))]
leaf = (torch.arange(2.0) + rank).requires_grad_()
gathered = funcol.all_gather_tensor_autograd(leaf, 0, list(range(world_size)))
(gathered * torch.arange(1.0, 2.0 * world_size + 1)).sum().backward()
out["grad"] = leaf.grad.clone()
mesh = init_device_mesh("cpu", (world_size,))
d = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
out["full"] = d.full_tensor().clone()
out["staged_types"] = sorted(host_staging.device_types())
host_staging.set_device_types({"cuda"})
"""


def _reference(rank: int) -> dict:
    """Worked out by hand: the gather concatenates the ranks' inputs in rank order; the
    gradient of sum(w * gather(x)) for rank r's input is the sum over ranks of w's slice for r
    (the backward of an all-gather is a reduce-scatter of the incoming gradient)."""
    w = torch.arange(1.0, 2.0 * N + 1)
    return {
        "gather": torch.cat([torch.arange(3.0) + 10 * r for r in range(N)]),
        "coalesced": [
            torch.cat([torch.full((2,), float(r)) for r in range(N)]),
            torch.cat([torch.full((1,), 5.0 + r) for r in range(N)]),
        ],
        "grad": N * w[2 * rank : 2 * rank + 2],
        "full": torch.arange(8.0).reshape(4, 2),
    }


@pytest.mark.timeout(150)
def test_functional_all_gathers_on_host_copies_give_torchs_results():
    with labkit.Lab(N, device="cpu") as lab:
        runs = {}
        for staged in (False, True):
            types = "{'cpu'}" if staged else "()"
            lab.run(f"TYPES = {types}").raise_for_errors()
            lab.run(CELL).raise_for_errors()
            runs[staged] = (lab.pull("out"), lab.trace())
    for staged, (out, _) in runs.items():
        for rank in range(N):
            for key, want in _reference(rank).items():
                got = out[rank][key]
                if isinstance(want, list):
                    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), key
                else:
                    assert torch.equal(got, want), (staged, rank, key, got, want)
    gathers = {
        staged: [r for r in recs if r.kind == "comm" and r.op == "all_gather_single"]
        for staged, (_, recs) in runs.items()
    }
    # the same records either way: the user's calls (op, bytes of the gathered output)
    key = [(r.rank, r.op, r.bytes) for r in gathers[False]]
    assert key and sorted(key) == sorted((r.rank, r.op, r.bytes) for r in gathers[True])
    assert all(r.staged == "" for r in gathers[False])
    assert all(r.staged == "d2h+h2d" and r.stage_time > 0 for r in gathers[True]), gathers[True]


def test_not_staged_off_gloo_or_for_other_device_types(monkeypatch):
    import torch.distributed as dist

    from labkit.rank import funcol_staging, host_staging

    calls = []

    def fake_gather(self, gather_dim, group, tag=""):
        calls.append(self)
        return self

    staged = funcol_staging.wrap(fake_gather)
    x = torch.ones(2)
    assert staged(x, 0, [0]) is x and calls == [x]  # CUDA is staged, this CPU tensor is not
    previous = host_staging.set_device_types({"cpu"})
    try:
        monkeypatch.setattr(funcol_staging, "resolve_group", lambda g: object())
        monkeypatch.setattr(dist, "get_backend", lambda g: "nccl")
        assert staged(x, 0, [0]) is x  # a group that is not plain gloo: torch's call as it is
        monkeypatch.setattr(funcol_staging, "resolve_group", lambda g: None)
        assert staged(x, 0, [0]) is x  # a group this rank cannot resolve: likewise
    finally:
        host_staging.set_device_types(previous)
    assert len(calls) == 3


def test_a_staged_function_calling_another_copies_once(monkeypatch):
    """torch 2.13's all_gather_tensor calls all_gather_single, both wrapped: the inner call
    gets the outer's host copy as it is (on a GPU it is on the host already; where CPU tensors
    count as staged, as in the tests, it would be copied twice)."""
    from labkit.rank import funcol_staging, host_staging

    seen = {}

    def inner(self, gather_dim, group, tag=""):
        seen["inner"] = self
        return self

    wrapped_inner = funcol_staging.wrap(inner)

    def outer(self, gather_dim, group, tag=""):
        seen["outer"] = self
        return wrapped_inner(self, gather_dim, group, tag)

    staged = funcol_staging.wrap(outer)
    previous = host_staging.set_device_types({"cpu"})
    try:
        monkeypatch.setattr(funcol_staging, "resolve_group", lambda g: object())
        monkeypatch.setattr(host_staging, "plain_gloo", lambda g: True)
        x = torch.ones(2)
        out = staged(x, 0, [0])
    finally:
        host_staging.set_device_types(previous)
    assert seen["outer"] is not x and seen["inner"] is seen["outer"]
    assert torch.equal(out, x) and out is not x
    assert funcol_staging.take()[0] == "d2h+h2d"
