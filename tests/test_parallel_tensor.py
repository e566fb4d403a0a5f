"""Tensor parallelism on 2 gloo ranks against the dense layers (outputs, input gradients and
every weight gradient slice, seeded, float32), plus torch's DTensor version and comm counts."""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
from distributed import run_ranks
from torch import nn

from labkit.parallel.tensor_parallel import (
    ColumnParallelLinear,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
    SelfAttention,
    WeightSlice,
    count_collectives,
    dtensor_mlp,
    weight_slices,
)

ATOL = 1e-6


def _slice(t: torch.Tensor, s: WeightSlice) -> torch.Tensor:
    return t if s.dim is None else t.narrow(s.dim, s.start, s.stop - s.start)


def _step(module: nn.Module, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = module(x)
    (y * w).sum().backward()  # a loss whose gradient dL/dy = w is not uniform
    return y.detach()


def _compare(dense: nn.Module, tp: nn.Module, x: torch.Tensor, w: torch.Tensor) -> dict:
    xd, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    yd = _step(dense, xd, w)
    yt, counts = count_collectives(lambda: _step(tp, xt, w))
    dense_params = dict(dense.named_parameters())
    slices = weight_slices(tp)
    grad_err = max(
        (p.grad - _slice(dense_params[n].grad, slices[n])).abs().max().item()
        for n, p in tp.named_parameters()
    )
    weight_err = max(
        (p - _slice(dense_params[n], slices[n])).abs().max().item()
        for n, p in tp.named_parameters()
    )
    return {
        "out_err": (yt - yd).abs().max().item(),
        "x_grad_err": (xt.grad - xd.grad).abs().max().item(),
        "grad_err": grad_err,
        "weight_err": weight_err,
        "all_reduces": sum(n for k, n in counts.items() if "all_reduce" in k or "allreduce" in k),
        "slices": slices,
    }


def _tp_rank(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    fc1, fc2, attn = nn.Linear(8, 16), nn.Linear(16, 8), SelfAttention(8, 4)
    x, w = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    out: dict = {}

    dense_mlp = nn.Sequential(
        OrderedDict(fc1=copy.deepcopy(fc1), act=nn.GELU(), fc2=copy.deepcopy(fc2))
    )
    out["mlp"] = _compare(dense_mlp, ParallelMLP.from_dense(fc1, fc2, nn.GELU()), x, w)
    out["attention"] = _compare(copy.deepcopy(attn), ParallelSelfAttention.from_dense(attn), x, w)

    col = ColumnParallelLinear.from_dense(fc1)
    out["col_err"] = (col(x) - fc1(x)[..., col.start : col.stop]).abs().max().item()
    row = RowParallelLinear.from_dense(fc2)
    h = torch.randn(2, 5, 16)
    out["row_err"] = (row(h[..., row.start : row.stop]) - fc2(h)).abs().max().item()
    _, fwd_counts = count_collectives(lambda: ParallelMLP(fc1, fc2)(x))
    out["mlp_forward_counts"] = fwd_counts
    try:
        ColumnParallelLinear(nn.Linear(4, 3))
    except ValueError as e:
        out["error"] = str(e)

    # torch's own: DTensor + parallelize_module on a CPU mesh with gloo
    dense = nn.Sequential(copy.deepcopy(fc1), nn.GELU(), copy.deepcopy(fc2))
    yd = _step(dense, x, w)
    dt = dtensor_mlp(fc1, fc2, nn.GELU())
    yt, counts = count_collectives(lambda: _step(dt, x, w))
    grads = [p.grad.full_tensor() for p in dt.parameters()]
    out["dtensor"] = {
        "out_err": (yt - yd).abs().max().item(),  # the output is replicated: a plain tensor
        "grad_err": max((g - p.grad).abs().max().item() for g, p in zip(grads, dense.parameters())),
        "counts": counts,
        "placements": str(dt[0].weight.placements),
    }
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_tp_rank, 2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layer", ["mlp", "attention"])
def test_tp_layer_equals_dense(two_ranks: list[dict], layer: str) -> None:
    for res in two_ranks:
        r = res[layer]
        assert r["weight_err"] == 0.0  # the slices reported are the slices held
        assert r["out_err"] < ATOL and r["x_grad_err"] < ATOL and r["grad_err"] < ATOL, r
        assert r["all_reduces"] == 2  # one in forward (g), one in backward for dL/dx (f)


@pytest.mark.timeout(120)
def test_column_row_linears_and_placement(two_ranks: list[dict]) -> None:
    for rank, res in enumerate(two_ranks):
        assert res["col_err"] < ATOL and res["row_err"] < ATOL
        s = res["mlp"]["slices"]
        assert s["fc1.weight"] == WeightSlice(0, 8 * rank, 8 * rank + 8, (16, 8))
        assert s["fc1.bias"] == WeightSlice(0, 8 * rank, 8 * rank + 8, (16,))
        assert s["fc2.weight"] == WeightSlice(1, 8 * rank, 8 * rank + 8, (8, 16))
        assert s["fc2.bias"].dim is None  # replicated
        assert res["attention"]["slices"]["o.weight"] == WeightSlice(
            1, 4 * rank, 4 * rank + 4, (8, 8)
        )
        forward = res["mlp_forward_counts"]
        assert sum(n for k, n in forward.items() if "allreduce" in k or "all_reduce" in k) == 1
        assert "out_features must be a multiple of the group size 2, got 3" in res["error"]


@pytest.mark.timeout(120)
def test_dtensor_mlp_equals_dense(two_ranks: list[dict]) -> None:
    for res in two_ranks:
        r = res["dtensor"]
        assert r["out_err"] < ATOL and r["grad_err"] < ATOL, r
        assert "Shard(dim=0)" in r["placements"]
        assert sum(n for k, n in r["counts"].items() if "all_reduce" in k) == 1, r["counts"]


def test_dense_attention_rejects_bad_heads() -> None:
    with pytest.raises(ValueError, match="num_heads must divide dim=8"):
        SelfAttention(8, 3)
