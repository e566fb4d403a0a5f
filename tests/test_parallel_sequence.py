"""Sequence parallelism on 4 gloo ranks against the dense block in one process: the
hand-written TP and TP+SP blocks and DTensor's SequenceParallel plan, outputs and every
gradient, seeded, float32; the collectives each made (from labkit's trace) and their bytes,
and the LayerNorm's saved activations, against the formulas."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks

from labkit.parallel.sequence_parallel import (
    Block,
    SequenceParallelBlock,
    TensorParallelBlock,
    dtensor_block,
    layernorm_saved_bytes,
    saved_activation_bytes,
    sequence_slice,
    sp_comm_bytes,
    sync_replicated_grads,
)
from labkit.rank import trace

ATOL = 1e-5
B, S, D, H = 2, 8, 16, 32


def _grads_vs_dense(named: dict, dense: Block, slices: dict) -> dict[str, float]:
    ref = dict(dense.named_parameters())
    out = {}
    for name, grad in named.items():
        dense_name, dim_slice = slices.get(name, (name, None))
        want = ref[dense_name].grad
        if dim_slice is not None:
            dim, sl = dim_slice
            want = want.narrow(dim, sl.start, sl.stop - sl.start)
        out[name] = (grad - want).abs().max().item()
    return out


def _comm(cell: int) -> list[tuple[str, int]]:
    return [(r.op, r.bytes) for r in trace.records(cell) if r.kind == "comm"]


def _sp_rank(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    dense = Block(D, H)
    x = torch.randn(B, S, D)
    xd = x.clone().requires_grad_()
    ref = dense(xd)
    ref.square().sum().backward()
    mine = sequence_slice(S, rank, world_size)
    trace.install()
    out: dict = {}

    tp = TensorParallelBlock.from_dense(dense)
    xt = x.clone().requires_grad_()
    trace.begin_cell(1, rank)
    yt = tp(xt)
    trace.begin_cell(2, rank)
    yt.square().sum().backward()
    cols = (0, slice(tp.fc1.start, tp.fc1.stop))
    out["tp"] = {
        "out": (yt - ref).abs().max().item(),
        "x grad": (xt.grad - xd.grad).abs().max().item(),
        "grads": _grads_vs_dense(
            {n: p.grad for n, p in tp.named_parameters()},
            dense,
            {
                "fc1.weight": ("fc1.weight", cols),
                "fc1.bias": ("fc1.bias", cols),
                "fc2.weight": ("fc2.weight", (1, cols[1])),
            },  # fmt: skip
        ),
        "fwd": _comm(1),
        "bwd": _comm(2),
    }

    sp = SequenceParallelBlock.from_dense(dense)
    xs = x[:, mine].clone().requires_grad_()
    trace.begin_cell(3, rank)
    ys = sp(xs)
    trace.begin_cell(4, rank)
    ys.square().sum().backward()
    partial_norm = (sp.norm.weight.grad - dense.norm.weight.grad).abs().max().item()
    sync_replicated_grads(sp.replicated())
    out["sp"] = {
        "out": (ys - ref[:, mine]).abs().max().item(),
        "x grad": (xs.grad - xd.grad[:, mine]).abs().max().item(),
        "grads": _grads_vs_dense(
            {n: p.grad for n, p in sp.named_parameters()},
            dense,
            {
                "fc1.weight": ("fc1.weight", cols),
                "fc1.bias": ("fc1.bias", cols),
                "fc2_weight": ("fc2.weight", (1, cols[1])),
                "fc2_bias": ("fc2.bias", None),
            },  # fmt: skip
        ),
        "partial norm grad": partial_norm,
        "fwd": _comm(3),
        "bwd": _comm(4),
    }
    out["saved"] = {
        "tp": saved_activation_bytes(lambda: tp.norm(xt))[1],
        "sp": saved_activation_bytes(lambda: sp.norm(xs))[1],
    }

    dt = dtensor_block(dense)
    xdt = x[:, mine].clone().requires_grad_()
    trace.begin_cell(5, rank)
    ydt = dt(xdt)
    trace.begin_cell(6, rank)
    ydt.square().sum().backward()
    dt_bwd = _comm(6)  # before full_tensor() gathers the gradients for the comparison
    out["dtensor"] = {
        "out": (ydt - ref[:, mine]).abs().max().item(),
        "x grad": (xdt.grad - xd.grad[:, mine]).abs().max().item(),
        "grads": _grads_vs_dense(
            {n: p.grad.full_tensor() for n, p in dt.named_parameters()}, dense, {}
        ),
        "fwd": _comm(5),
        "bwd": dt_bwd,
        "saved": saved_activation_bytes(lambda: dt.norm(xs))[1],
    }
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_sp_rank, 4, timeout=240)


@pytest.mark.timeout(300)
def test_every_block_equals_the_dense_one(ranks: list[dict]) -> None:
    for rank, res in enumerate(ranks):
        for kind in ("tp", "sp", "dtensor"):
            r = res[kind]
            assert r["out"] < ATOL and r["x grad"] < ATOL, (rank, kind, r)
            assert max(r["grads"].values()) < ATOL, (rank, kind, r["grads"])


@pytest.mark.timeout(300)
def test_sp_layernorm_grads_are_partial_until_summed(ranks: list[dict]) -> None:
    # before sync_replicated_grads each rank holds the sum over its own positions only
    assert all(res["sp"]["partial norm grad"] > 1e-3 for res in ranks)


@pytest.mark.timeout(300)
def test_collectives_and_bytes_equal_the_formulas(ranks: list[dict]) -> None:
    n = len(ranks)
    f = sp_comm_bytes(B, S, D, n)
    s = int(f["S"])
    assert s == B * S * D * 4
    ag, rs = "all_gather_single", "reduce_scatter_single"
    for res in ranks:
        assert res["tp"]["fwd"] == [("all_reduce", s)]
        assert res["tp"]["bwd"] == [("all_reduce", s)]
        assert res["sp"]["fwd"] == [(ag, s), (rs, s)]
        # the mirror image in reverse order, then the replicated parameters' partial grads
        assert res["sp"]["bwd"] == [(ag, s), (rs, s), ("all_reduce", 3 * D * 4)]
        assert res["dtensor"]["fwd"] == [(ag, s), (rs, s)]
        assert sorted(res["dtensor"]["bwd"]) == [(ag, s), (rs, s)]
    assert f["all_gather sent"] + f["reduce_scatter sent"] == f["all_reduce sent"]
    assert f["all_reduce sent"] == 2 * (n - 1) / n * s


@pytest.mark.timeout(300)
def test_layernorm_activations_divide_by_the_tp_degree(ranks: list[dict]) -> None:
    n = len(ranks)
    for res in ranks:
        assert res["saved"]["tp"] == layernorm_saved_bytes(B, S, D) == (B * S * D + 2 * B * S) * 4
        assert res["saved"]["sp"] == layernorm_saved_bytes(B, S, D, n)
        assert res["dtensor"]["saved"] == layernorm_saved_bytes(B, S, D, n)
        assert res["saved"]["tp"] == n * res["saved"]["sp"]


def test_formulas_reject_uneven_sequences() -> None:
    with pytest.raises(ValueError, match="multiple of 3"):
        sequence_slice(8, 0, 3)
    with pytest.raises(ValueError, match="multiple of n=3"):
        layernorm_saved_bytes(1, 8, 4, 3)
    assert sequence_slice(8, 3, 4) == slice(6, 8)
