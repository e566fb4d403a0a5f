"""The memory of a step on 2 gloo ranks (each its own micro-batch) against the formulas and a
single process: saved bytes per layer, recomputation (fewer bytes, same gradients, one more
forward a layer), mixed-precision Adam's bytes; and the configuration finder's predictions
against what ZeRO-1, FSDP2 and the tensor-parallel layers hold and send (labkit's trace)."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks
from torch import nn

from labkit.parallel.config_finder import Config, Model, collective_calls, model_state_bytes
from labkit.parallel.step_memory import (
    SavedBytes,
    Stack,
    adam_state_bytes,
    layer_activation_bytes,
    layernorm_stats_size,
    mixed_precision_adam,
    mixed_precision_bytes,
    mixed_precision_step,
    recompute_activation_bytes,
)
from labkit.rank import trace

LAYERS, HIDDEN, HEADS = 2, 16, 4
SIZES = [(2, 8), (3, 16)]  # (batch, seq)


def _step(model, x, recompute):
    model.recompute = recompute
    model.zero_grad()
    with SavedBytes(model) as saved:
        loss = model(x).square().mean()
    saved.backward(loss)
    grads = [p.grad.clone() for p in model.parameters()]
    return saved.per_layer, saved.forwards, grads


def _memory_rank(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = Stack(LAYERS, HIDDEN, HEADS)
    out = {}
    for b, s in SIZES:
        x = torch.randn(b, s, HIDDEN, generator=torch.Generator().manual_seed(rank))
        out[(b, s)] = {"plain": _step(model, x, False), "recompute": _step(model, x, True)}
    model.recompute = False
    masters, opt = mixed_precision_adam(model)
    with SavedBytes(model) as saved:
        loss = model(torch.randn(2, 8, HIDDEN).bfloat16()).float().square().mean()
    saved.backward(loss)
    mixed_precision_step(model, masters, opt)
    out["mixed"] = (saved.per_layer, mixed_precision_bytes(model, masters, opt))
    return out


def _single(b, s, rank):
    torch.manual_seed(0)
    model = Stack(LAYERS, HIDDEN, HEADS)
    x = torch.randn(b, s, HIDDEN, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    return [p.grad for p in model.parameters()]


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_memory_rank, 2)


@pytest.mark.timeout(120)
def test_saved_bytes_equal_the_formula_on_every_rank(ranks):
    for b, s in SIZES:
        want = layer_activation_bytes(b, s, HIDDEN, HEADS, 4)["total"]
        for res in ranks:
            per_layer, forwards, _ = res[(b, s)]["plain"]
            assert per_layer == [want] * LAYERS and forwards == LAYERS
    # the s² term: from (2, 8) to (3, 16) the scores grow 3/2 · 4 times, the rest 3/2 · 2
    small, big = (layer_activation_bytes(b, s, HIDDEN, HEADS, 4) for b, s in SIZES)
    assert big["mlp"] == 3 * small["mlp"] and big["total"] > 3 * small["total"]


@pytest.mark.timeout(120)
def test_recompute_keeps_inputs_and_gives_the_same_grads(ranks):
    for rank, res in enumerate(ranks):
        for b, s in SIZES:
            plain, rec = res[(b, s)]["plain"], res[(b, s)]["recompute"]
            assert rec[0] == [recompute_activation_bytes(b, s, HIDDEN, 4)] * LAYERS
            assert rec[1] == 2 * LAYERS  # every layer's forward ran twice
            ref = _single(b, s, rank)
            for a, g, r in zip(plain[2], rec[2], ref):
                assert torch.allclose(a, g, atol=1e-6) and torch.allclose(a, r, atol=1e-6)
    assert not torch.equal(ranks[0][SIZES[0]]["plain"][2][0], ranks[1][SIZES[0]]["plain"][2][0])


@pytest.mark.timeout(120)
def test_mixed_precision_adam_holds_16_bytes_a_parameter(ranks):
    psi = sum(p.numel() for p in Stack(LAYERS, HIDDEN, HEADS).parameters())
    num_tensors = len(list(Stack(LAYERS, HIDDEN, HEADS).parameters()))
    stats = layernorm_stats_size(torch.bfloat16, "cpu")
    for res in ranks:
        per_layer, held = res["mixed"]
        assert per_layer == [layer_activation_bytes(2, 8, HIDDEN, HEADS, 2, stats_size=stats)[
            "total"]] * LAYERS  # fmt: skip
        want = adam_state_bytes(psi, mixed_precision=True)
        assert {k: held[k] for k in ("params", "grads", "master", "moments")} == {
            k: want[k] for k in ("params", "grads", "master", "moments")
        }
        assert held["steps"] == 4 * num_tensors  # Adam's step counters, fp32 scalars
        assert held["total"] == 16 * psi + 4 * num_tensors


def _finder_rank(rank: int, world_size: int) -> dict:
    from labkit.parallel.zero_redundancy import (
        Zero1Optimizer,
        fully_shard_model,
        measure_state_bytes,
    )

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))

    x = torch.randn(8, 64)
    trace.install()
    out = {}
    for cell, name in enumerate(("zero1", "fsdp"), start=1):
        if name == "zero1":
            model = mlp()
            opt = Zero1Optimizer(model.parameters(), torch.optim.Adam)
        else:
            model = fully_shard_model(mlp())
            opt = torch.optim.Adam(model.parameters())
        trace.begin_cell(cell, rank)
        model(x).square().mean().backward()
        opt.step()
        comm = [(r.op, r.bytes) for r in trace.records(cell) if r.kind == "comm"]
        out[name] = (measure_state_bytes(model, opt), comm)
    torch.manual_seed(0)
    layer = Stack(1, 32, 4).split_tensor_parallel()
    h = torch.randn(2, 6, 32, requires_grad=True)
    trace.begin_cell(3, rank)
    with SavedBytes(layer) as saved:
        y = layer(h)
    saved.backward(y.sum())
    out["tp"] = [(r.op, r.bytes) for r in trace.records(3) if r.kind == "comm"]
    out["tp_saved"] = saved.per_layer
    out["tp_out"] = (y.detach(), h.grad)
    return out


@pytest.mark.timeout(180)
def test_finder_predicts_measured_bytes():
    n = 2
    ranks = run_ranks(_finder_rank, n)
    psi = 64 * 256 + 256 + 256 * 64 + 64
    model = Model(psi, 1, 64, 1, 1, global_batch=n, mixed_precision=False)
    for zero, name in ((1, "zero1"), (3, "fsdp")):
        want = model_state_bytes(model, Config(n, 1, 1, zero=zero))
        calls = collective_calls(model, Config(n, 1, 1, zero=zero))["dp"]
        for res in ranks:
            held, comm = res[name]
            steps = 4 * (1 if name == "zero1" else 4)  # Adam's step counters
            assert held["params"] == want["params"] and held["grads"] == want["grads"]
            assert held["optimizer"] == want["optimizer"] + steps
            for op, count, size in calls:  # FSDP2 per layer: the sizes add up to the buffer
                got = [b for o, b in comm if o.startswith(op)]
                assert sum(got) == count * size, (name, op, comm)
    tp = Model(10**6, 1, 32, 4, 6, global_batch=2, micro_batch=2, mixed_precision=False)
    ((op, count, size),) = collective_calls(tp, Config(1, n, 1))["tp"]
    torch.manual_seed(0)
    dense = Stack(1, 32, 4)
    h = torch.randn(2, 6, 32, requires_grad=True)
    want = dense(h)
    want.sum().backward()
    for res in ranks:
        assert res["tp"] == [(op, size)] * count, res["tp"]
        assert res["tp_saved"] == [layer_activation_bytes(2, 6, 32, 4, 4, tp=n)["total"]]
        y, grad = res["tp_out"]
        assert torch.allclose(y, want, atol=1e-5) and torch.allclose(grad, h.grad, atol=1e-5)


def test_bad_shapes_say_what_is_wrong():
    from labkit.parallel.step_memory import Block

    with pytest.raises(ValueError, match="must be >= 1 and divide heads=4"):
        layer_activation_bytes(1, 2, 8, 4, 4, tp=3)
    with pytest.raises(ValueError, match="hidden=10 must be a multiple of heads=4"):
        Block(10, 4)


def test_attention_and_sequence_parallel_options_by_hand():
    # b=2, s=8, h=16, a=4, fp32: T·h = 256 elements, a·b·s² = 512, b·a·s = 64
    eager = layer_activation_bytes(2, 8, 16, 4, 4)
    assert eager == layer_activation_bytes(2, 8, 16, 4, 4, attention="eager")
    assert eager["attention"] == 4 * (6 * 256 + 512)
    sdpa = layer_activation_bytes(2, 8, 16, 4, 4, attention="sdpa")
    assert sdpa["attention"] == 4 * 6 * 256 + 4 * 64 and sdpa["mlp"] == eager["mlp"]
    # torch's SequenceParallel at tp=2: LN inputs and statistics halve, LN outputs stay whole
    sp = layer_activation_bytes(2, 8, 16, 4, 4, tp=2, sequence_parallel=True)
    assert sp["attention"] == 4 * (128 + 256 + (4 * 256 + 512) // 2)
    assert sp["mlp"] == 4 * (128 + 256 + 8 * 256 // 2)
    assert sp["layernorm"] == 2 * 2 * 4 * 16 // 2
    assert layer_activation_bytes(2, 8, 16, 4, 4, tp=1, sequence_parallel=True) == eager
    with pytest.raises(ValueError, match=r"must be one of \('eager', 'sdpa'\)"):
        layer_activation_bytes(2, 8, 16, 4, 4, attention="flash")
    with pytest.raises(ValueError, match="must be True or False"):
        layer_activation_bytes(2, 8, 16, 4, 4, sequence_parallel="yes")
    with pytest.raises(ValueError, match="tp=4 must divide it"):
        layer_activation_bytes(2, 6, 16, 4, 4, tp=4, sequence_parallel=True)
