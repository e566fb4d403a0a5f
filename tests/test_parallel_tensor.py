"""Tensor parallelism on 2 gloo ranks against the dense layers (outputs, input gradients and
every weight gradient slice, seeded, float32), plus torch's DTensor version and comm counts;
the gradient norm for clipping under tensor parallelism (replicated parameters counted once, or
t times by mistake) against one process."""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
from distributed import run_ranks
from torch import nn

from labkit.parallel.grad_clipping import clip_grad_norm_global, global_grad_norm
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
    out["deep"] = _deep_mlp(x)
    out["clip"] = _clip_tp(fc1, fc2, x)
    return out


def _deep_mlp(x: torch.Tensor) -> dict:
    """Two column->row pairs in a row: one all_reduce per pair each way (not "no sync")."""
    torch.manual_seed(1)
    layers = [nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 16), nn.Linear(16, 8)]
    deep = nn.Sequential(ParallelMLP(*layers[:2]), ParallelMLP(*layers[2:]))
    dense = nn.Sequential(layers[0], nn.GELU(), layers[1], layers[2], nn.GELU(), layers[3])
    xt = x.clone().requires_grad_()  # as in a model: the layer before needs dL/dx
    y, forward = count_collectives(lambda: deep(xt))
    _, backward = count_collectives(lambda: y.sum().backward())
    return {"forward": forward, "backward": backward, "err": (y - dense(x)).abs().max().item()}


def _clip_tp(fc1: nn.Linear, fc2: nn.Linear, x: torch.Tensor) -> dict:
    """LayerNorm + Megatron MLP: the gradient norm, replicated parameters once or t times."""
    torch.manual_seed(2)
    norm = nn.LayerNorm(8)
    nn.init.normal_(norm.weight)  # not all ones: its gradient is not a multiple of the bias's
    dense = nn.Sequential(copy.deepcopy(norm), copy.deepcopy(fc1), nn.GELU(), copy.deepcopy(fc2))
    dense(x).square().sum().backward()
    ref = torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.1).item()
    ref_grads = [p.grad for p in dense.parameters()]

    tp = nn.Sequential(copy.deepcopy(norm), ParallelMLP(fc1, fc2))
    tp(x).square().sum().backward()
    slices = weight_slices(tp)
    named = dict(tp.named_parameters())
    replicated = [p for n, p in named.items() if slices[n].dim is None]
    sharded = [p for n, p in named.items() if slices[n].dim is not None]
    naive = global_grad_norm(tp.parameters()).item()
    replicated_sq = sum(p.grad.square().sum().item() for p in replicated)  # before the clip
    once = clip_grad_norm_global(sharded, 0.1, replicated=replicated).item()
    clipped = {n: p.grad for n, p in named.items()}
    dense_names = ["0.weight", "0.bias", "1.fc1.weight", "1.fc1.bias", "1.fc2.weight", "1.fc2.bias"]
    clip_err = max(
        (clipped[n] - _slice(g, slices[n])).abs().max().item()
        for n, g in zip(dense_names, ref_grads)
    )
    # torch's DTensor: clip_grad_norm_ sees the placements (Shard summed, Replicate once)
    dt = dtensor_mlp(fc1, fc2, nn.GELU())
    dt(x).square().sum().backward()
    dense_mlp = nn.Sequential(copy.deepcopy(fc1), nn.GELU(), copy.deepcopy(fc2))
    dense_mlp(x).square().sum().backward()
    dt_ref = torch.nn.utils.clip_grad_norm_(dense_mlp.parameters(), 1e9).item()
    dt_norm = torch.nn.utils.clip_grad_norm_(dt.parameters(), 1e9).full_tensor().item()
    norm(x).sum().backward()
    try:  # a LayerNorm outside the plan: plain tensors beside DTensors
        torch.nn.utils.clip_grad_norm_([*norm.parameters(), *dt.parameters()], 1e9)
        mixed = "ran"
    except RuntimeError as err:
        mixed = str(err)
    return {
        "ref": ref,
        "naive": naive,
        "once": once,
        "replicated_sq": replicated_sq,
        "clip_err": clip_err,
        "dt_ref": dt_ref,
        "dt_norm": dt_norm,
        "mixed": mixed,
    }


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


@pytest.mark.timeout(120)
def test_deep_mlp_syncs_once_per_pair_each_way(two_ranks: list[dict]) -> None:
    for res in two_ranks:
        r = res["deep"]
        assert r["err"] < ATOL, r
        assert r["forward"] == {"allreduce_": 2} and r["backward"] == {"allreduce_": 2}, r  # c10d


@pytest.mark.timeout(120)
def test_clip_norm_counts_replicated_parameters_once(two_ranks: list[dict]) -> None:
    t = len(two_ranks)
    for res in two_ranks:
        r = res["clip"]
        assert r["ref"] > 0.1  # the clip acts
        assert r["once"] == pytest.approx(r["ref"], rel=1e-5), r
        assert r["clip_err"] < ATOL, r
        # summing every rank's squares counts LayerNorm and the row bias t times
        assert r["naive"] > r["ref"] * 1.01, r
        assert r["naive"] ** 2 == pytest.approx(r["ref"] ** 2 + (t - 1) * r["replicated_sq"])
        assert r["dt_norm"] == pytest.approx(r["dt_ref"], rel=1e-5), r
        assert "mixed torch.Tensor and DTensor" in r["mixed"], r
