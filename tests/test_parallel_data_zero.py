"""ZeRO memory formulas, ZeRO-1 by hand and FSDP2 against a replicated single-process reference."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from labkit.parallel import data_parallel, zero_redundancy, zero_stages
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


@pytest.mark.timeout(300)
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


def _traced(cell: int) -> list[tuple[str, int]]:
    from labkit.rank import trace_state

    return [(r.op, r.bytes) for r in trace_state.STATE.records.get(cell, []) if r.kind == "comm"]


def _stages_rank(rank: int, world_size: int) -> dict:
    from labkit.rank import dist_tracing, trace_state

    torch.set_num_threads(1)
    dist_tracing.install()
    X, y = load_digits()
    num_steps, b = 3, 12
    glob = [torch.arange(s * b * world_size, (s + 1) * b * world_size) for s in range(num_steps)]
    mine = [g[rank * b : (rank + 1) * b] for g in glob]
    ref = data_parallel.make_mlp(seed=3, hidden=21)
    _steps(ref, torch.optim.Adam(ref.parameters(), lr=0.01), X, y, glob)
    out = {"shapes": [tuple(p.shape) for p in ref.parameters()]}
    for stage, cls in ((2, zero_stages.Zero2Optimizer), (3, zero_stages.Zero3Optimizer)):
        model = data_parallel.make_mlp(seed=3, hidden=21)
        opt = cls(model, torch.optim.Adam, lr=0.01)
        _steps(model, opt, X, y, mine[:-1])
        trace_state.STATE.cell = stage  # the last step's collectives, apart
        opt.zero_grad()
        F.cross_entropy(model(X[mine[-1]]), y[mine[-1]]).backward()
        out[f"whole_grads_{stage}"] = sum(p.grad is not None for p in model.parameters())
        opt.step()
        trace_state.STATE.cell = 0
        out[f"traffic_{stage}"] = _traced(stage)
        out[f"bytes_{stage}"] = zero_redundancy.measure_state_bytes(model, opt)
        weights = opt.full_weights() if stage == 3 else list(model.parameters())
        out[f"diff_{stage}"] = max(
            (p - q).abs().max().item() for p, q in zip(weights, ref.parameters())
        )
        if stage == 3:
            out["whole_storage_3"] = sum(p.untyped_storage().nbytes() for p in model.parameters())
    model = zero_redundancy.fully_shard_model(data_parallel.make_mlp(seed=3, hidden=21))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _steps(model, opt, X, y, mine[:-1])
    trace_state.STATE.cell = 4
    _steps(model, opt, X, y, mine[-1:])
    trace_state.STATE.cell = 0
    out["traffic_fsdp"] = _traced(4)
    out["bytes_fsdp"] = zero_redundancy.measure_state_bytes(model, opt)
    return out


@pytest.mark.timeout(300)
def test_zero2_and_zero3_by_hand_equal_single_process_and_fsdp2():
    world_size = 2  # 21 rows do not divide by 2: the padding is exercised
    results = run_ranks(_stages_rank, world_size)
    shapes = results[0]["shapes"]
    num_params = sum(math.prod(s) for s in shapes)
    # each tensor padded on dim 0 to a multiple of 2 rows: 22 x 64 + 22 + 10 x 21 + 10
    padded = sum(-(-s[0] // world_size) * world_size * math.prod(s[1:]) for s in shapes)
    assert padded == 22 * 64 + 22 + 10 * 21 + 10
    held = [zero_stages.row_shard_numel(shapes, world_size, r) for r in range(world_size)]
    assert sum(held) == num_params and len(set(held)) > 1  # uneven pieces, no overlap
    layer0, layer2 = 4 * (22 * 64 + 22), 4 * (10 * 21 + 10)
    for r, res in enumerate(results):
        assert res["diff_2"] < 1e-6 and res["diff_3"] < 1e-6, res
        assert res["whole_grads_2"] == res["whole_grads_3"] == 0  # freed in backward
        assert res["whole_storage_3"] == 0  # whole weights freed outside forward/backward
        z2, z3, fsdp = res["bytes_2"], res["bytes_3"], res["bytes_fsdp"]
        assert z2["params"] == 4 * num_params and z2["grads"] == 4 * held[r]
        assert z3["params"] == z3["grads"] == 4 * held[r]
        assert z2["optimizer"] == z3["optimizer"] == 8 * held[r] + 4 * len(shapes)
        assert z3 == fsdp  # FSDP2 holds the same bytes, to the byte
        AG, RS = "all_gather_single", "reduce_scatter_single"
        assert sorted(res["traffic_2"]) == sorted(
            [(AG, layer0), (AG, layer2), (RS, layer0), (RS, layer2)]
        )
        assert (
            sorted(res["traffic_3"])
            == sorted(res["traffic_fsdp"])
            == sorted([(AG, layer0), (AG, layer2)] * 2 + [(RS, layer0), (RS, layer2)])
        )
        for stage in (2, 3):
            formula = zero_redundancy.zero_traffic(padded, stage)
            assert sum(b for _, b in res[f"traffic_{stage}"]) == formula["total"]


def test_zero_traffic_formula():
    ar_only = {"all_reduce": 400, "reduce_scatter": 0, "all_gather": 0, "total": 400}
    assert zero_redundancy.zero_traffic(100, 0) == ar_only
    rs_ag = {"all_reduce": 0, "reduce_scatter": 400, "all_gather": 400, "total": 800}
    assert zero_redundancy.zero_traffic(100, 1) == zero_redundancy.zero_traffic(100, 2) == rs_ag
    stage3 = {"all_reduce": 0, "reduce_scatter": 400, "all_gather": 800, "total": 1200}
    assert zero_redundancy.zero_traffic(100, 3) == stage3
    assert zero_redundancy.zero_traffic(100, 3, element_size=2)["total"] == 600
    with pytest.raises(ValueError, match=r"stage must be in \[0, 3\]"):
        zero_redundancy.zero_traffic(100, -1)


def test_row_shard_numel_is_torch_chunk():
    shapes = [(10, 256), (10,), (256, 64), (3, 2, 2)]
    for n in (1, 3, 4, 16):
        for r in range(n):
            pieces = [torch.empty(s).chunk(n) for s in shapes]
            expected = sum(p[r].numel() for p in pieces if r < len(p))
            assert zero_stages.row_shard_numel(shapes, n, r) == expected, (n, r)


def test_zero_stages_reject_a_model_without_weights():
    for cls in (zero_stages.Zero2Optimizer, zero_stages.Zero3Optimizer):
        with pytest.raises(ValueError, match="at least 1 parameter"):
            cls(torch.nn.ReLU())


def _fsdp_peak_rank(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 256) for _ in range(3)]
    model = zero_redundancy.fully_shard_model(torch.nn.Sequential(*layers))
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(1, 256)
    model(x).square().mean().backward()  # a first step: Adam's state exists from here on
    opt.step()
    opt.zero_grad()
    before = zero_redundancy.measure_state_bytes(model, opt)
    peaks = []
    floor = zero_redundancy.fsdp_peak_bytes(4 * (256 * 256 + 256), world_size, activations=0)
    # the profiler misses the frees gloo's own thread makes, so a pass can only read too high:
    # up to 8 passes, until one reads at most a few activations above the floor (the test
    # checks the least; on a busy machine gloo's thread drops a buffer last more often)
    while len(peaks) < 8 and (len(peaks) < 3 or min(peaks) > floor + 8 * 1024):
        opt.zero_grad()
        with zero_redundancy.AllocationPeak() as backward:
            model(x).square().mean().backward()
        peaks.append(backward.peak)
    opt.step()
    after = zero_redundancy.measure_state_bytes(model, opt)
    return {"before": before, "after": after, "peaks": peaks, "end": backward.end}


@pytest.mark.timeout(300)
def test_fsdp2_peak_holds_gathered_units_and_unsharded_grads():
    """3 units of U = 4·(256·256 + 256) = 263,168 bytes (256 rows divide by 4: no padding), 4
    ranks, fp32, a batch of 1 (activations of 1 KB each). After step() a rank holds
    16·Psi/N = 4·Psi/N (weights) + 4·Psi/N (grads) + 8·Psi/N (Adam) = 789,504 bytes + 6 step
    counters. In backward, at the middle unit: its gathered weights U + its whole gradient U +
    the first unit prefetched U + the last unit's reduce-scatter in flight U + that
    reduce-scatter's output U/4 = 4U + U/4 = 1,118,464 bytes above the sharded weights and
    Adam state, plus activations: at most 7 tensors of 1,024 bytes live (the 2 hidden
    linear inputs and the output saved, gradients in flight and being made) and scalars.
    Every backward pass peaks at least there; the profiler misses the frees made by gloo's own
    threads, so on a busy machine a pass can read a unit higher (a whole run with a
    second pytest beside this one read 1,384,712 in 3 of 3 passes): the least of 3 to 8 passes
    must match.
    The old claim (the peak is the table's 16·Psi/N) fails by more than a factor 2."""
    unit, n = 4 * (256 * 256 + 256), 4
    psi = 3 * unit // 4  # elements
    for res in run_ranks(_fsdp_peak_rank, n):
        after = res["after"]
        assert after["total"] == 16 * psi // n + 6 * 4  # ZeRO's formula, + 6 step counters
        assert res["end"] >= 4 * psi // n  # backward leaves at least the sharded gradients
        floor = zero_redundancy.fsdp_peak_bytes(unit, n, activations=0)
        assert floor == 1_118_464
        assert all(p >= floor for p in res["peaks"]), res["peaks"]
        assert min(res["peaks"]) <= floor + 7 * 1024 + 64, res["peaks"]
        peak_total = res["before"]["total"] + min(res["peaks"])
        assert peak_total > 2 * after["total"]  # the peak is more than twice 16·Psi/N
