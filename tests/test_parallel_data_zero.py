"""ZeRO memory formulas, ZeRO-1 by hand and FSDP2 against a replicated single-process reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from labkit.parallel import data_parallel, zero_redundancy
from labkit.parallel.datasets import load_digits

try:
    from tests.distributed import run_ranks
except ImportError:  # tests/ itself on sys.path (pytest's default rootdir-less import)
    from distributed import run_ranks


def test_adam_needs_16_bytes_per_param():
    assert zero_redundancy.adam_bytes_per_param() == 16
    assert zero_redundancy.adam_bytes_breakdown() == {"params": 2, "grads": 2, "optimizer": 12}
    assert zero_redundancy.adam_bytes_per_param(mixed_precision=False) == 16
    assert zero_redundancy.adam_bytes_breakdown(False) == {"params": 4, "grads": 4, "optimizer": 8}


def test_zero_memory_reproduces_paper_example():
    # ZeRO paper, Figure 1: 7.5B parameters, 64 GPUs, K = 12.
    psi, n = 7_500_000_000, 64
    totals = [zero_redundancy.zero_memory(psi, n, s)["total"] / 1e9 for s in range(4)]
    assert totals == pytest.approx([120.0, 31.4, 16.6, 1.9], abs=0.05)
    s1 = zero_redundancy.zero_memory(psi, n, 1)
    assert s1["params"] == 2 * psi and s1["grads"] == 2 * psi and s1["optimizer"] == 12 * psi // n
    assert zero_redundancy.zero_memory(10, 4, 3) == {
        "params": 6,
        "grads": 6,
        "optimizer": 36,
        "total": 48,
    }  # ceil
    assert zero_redundancy.zero_memory(10, 1, 3)["total"] == 160


def test_zero_memory_rejects_bad_stage():
    with pytest.raises(ValueError, match=r"stage must be in \[0, 3\]"):
        zero_redundancy.zero_memory(100, 2, 4)
    with pytest.raises(ValueError, match="world_size"):
        zero_redundancy.zero_memory(100, 0, 1)


def _steps(model: torch.nn.Module, opt, X, y, batches_of_rank) -> list[float]:
    losses = []
    for idx in batches_of_rank:
        opt.zero_grad()
        loss = F.cross_entropy(model(X[idx]), y[idx])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _zero_rank(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    X, y = load_digits()
    num_steps, b = 3, 16
    glob = [torch.arange(s * b * world_size, (s + 1) * b * world_size) for s in range(num_steps)]
    mine = [g[rank * b : (rank + 1) * b] for g in glob]
    out = {}
    for name, cls, kw in (
        ("adam", torch.optim.Adam, {"lr": 0.01}),
        ("sgd", torch.optim.SGD, {"lr": 0.5, "momentum": 0.9}),
    ):
        ref = data_parallel.make_mlp(seed=2, hidden=20)
        ref_opt = cls(ref.parameters(), **kw)
        _steps(ref, ref_opt, X, y, glob)
        model = data_parallel.make_mlp(seed=2, hidden=20)
        opt = zero_redundancy.Zero1Optimizer(model.parameters(), cls, **kw)
        _steps(model, opt, X, y, mine)
        out[name] = max(
            (p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())
        )
        out[name + "_bytes"] = zero_redundancy.measure_state_bytes(model, opt)
        out[name + "_ref_bytes"] = zero_redundancy.measure_state_bytes(ref, ref_opt)
    # FSDP2 (ZeRO-3) with Adam: same steps, weights sharded.
    model = zero_redundancy.fully_shard_model(data_parallel.make_mlp(seed=2, hidden=20))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _steps(model, opt, X, y, mine)
    out["fsdp_bytes"] = zero_redundancy.measure_state_bytes(model, opt)
    full = [p.full_tensor() for p in model.parameters()]  # a collective: every rank calls it
    ref = data_parallel.make_mlp(seed=2, hidden=20)
    _steps(ref, torch.optim.Adam(ref.parameters(), lr=0.01), X, y, glob)
    out["fsdp"] = max((p - q).abs().max().item() for p, q in zip(full, ref.parameters()))
    out["num_params"] = sum(p.numel() for p in ref.parameters())
    return out


@pytest.mark.timeout(120)
def test_zero1_and_fsdp2_equal_plain_step_with_sharded_state():
    world_size = 2
    for r in run_ranks(_zero_rank, world_size):
        assert r["adam"] < 1e-6 and r["sgd"] < 1e-6 and r["fsdp"] < 1e-6
        n = r["num_params"]  # 64*20 + 20 + 20*10 + 10 = 1510, 755 per rank
        plain, z1 = r["adam_ref_bytes"], r["adam_bytes"]
        assert plain["optimizer"] == 2 * 4 * n + 4 * 4  # m, v in fp32 + a step counter per tensor
        assert z1["optimizer"] == 2 * 4 * n // world_size + 4  # one slice, one counter
        assert z1["params"] == plain["params"] == 4 * n  # ZeRO-1 keeps full weights
        fsdp = r["fsdp_bytes"]
        assert fsdp["params"] < 4 * n * 0.6 and fsdp["optimizer"] < 2 * 4 * n * 0.6  # ZeRO-3


def test_zero1_rejects_empty_params():
    with pytest.raises(ValueError, match="at least 1"):
        zero_redundancy.Zero1Optimizer([])
