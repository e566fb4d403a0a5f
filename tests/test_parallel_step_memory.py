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


def _local(t):
    return (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()


def _unique_saved_bytes(fn, model):
    """Bytes of the distinct storages autograd saves while `fn()` runs, the parameters' left
    out (DTensors counted by their local shard): a count independent of SavedBytes."""
    params = {_local(p.detach()).data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = _local(t)
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def _parallel_rank(rank: int, world_size: int) -> dict:
    from labkit.parallel import sequence_parallel as sp

    out = {}
    torch.manual_seed(0)
    layer = Stack(1, 32, 4, attention="sdpa").split_tensor_parallel()
    with SavedBytes(layer) as saved:
        y = layer(torch.randn(2, 8, 32, requires_grad=True))
    saved.backward(y.sum())
    out["tp_sdpa"] = saved.per_layer
    torch.manual_seed(0)
    mlp = sp.dtensor_block(sp.Block(32, 128))  # torch's SequenceParallel + Colwise + Rowwise
    x = torch.randn(2, 8 // world_size, 32, requires_grad=True)
    y, out["sp_mlp"] = _unique_saved_bytes(lambda: mlp(x), mlp)
    y.sum().backward()
    return out


@pytest.mark.timeout(180)
def test_sdpa_under_tp_and_torch_sequence_parallel_match_the_formula():
    n = 2
    ranks = run_ranks(_parallel_rank, n)
    want = layer_activation_bytes(2, 8, 32, 4, 4, tp=n, attention="sdpa")["total"]
    sp = layer_activation_bytes(2, 8, 32, 4, 4, tp=n, sequence_parallel=True)
    tp = layer_activation_bytes(2, 8, 32, 4, 4, tp=n)
    for res in ranks:
        assert res["tp_sdpa"] == [want]
        # one LayerNorm + the MLP: what torch's SequenceParallel plan keeps per rank, and
        # not what plain TP keeps (LayerNorm whole) nor everything / n (Megatron's re-gather)
        assert res["sp_mlp"] == sp["mlp"] + sp["layernorm"] // 2
        assert res["sp_mlp"] != tp["mlp"] + tp["layernorm"] // 2
        assert res["sp_mlp"] != (4 * 10 * 2 * 8 * 32 + 2 * 4 * 2 * 8) // n


def _saved(model, x, autocast=False):
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.enable_grad()
    with ctx, SavedBytes(model) as saved:
        out = model(x)
    saved.backward(out.float().sum())
    return saved


@pytest.mark.timeout(60)
def test_sdpa_keeps_its_output_and_an_fp32_log_sum_exp_not_the_scores():
    b, h, a = 2, 32, 4
    per = {}
    for dtype in (torch.float32, torch.bfloat16):
        stats = layernorm_stats_size(dtype, "cpu")
        for kind in ("eager", "sdpa"):
            for s in (16, 32, 64):
                torch.manual_seed(0)
                model = Stack(1, h, a, attention=kind).to(dtype)
                saved = _saved(model, torch.randn(b, s, h, dtype=dtype))
                want = layer_activation_bytes(b, s, h, a, dtype.itemsize, stats_size=stats,
                                              attention=kind)  # fmt: skip
                assert saved.per_layer == [want["total"]], (dtype, kind, s)
                sizes = sorted(n for _, _, n, _ in saved.records)
                if kind == "sdpa":  # the log-sum-exp: b·a·s fp32, whatever the dtype
                    assert [d for _, d, n, _ in saved.records if n == 4 * b * a * s] == [
                        torch.float32]  # fmt: skip
                    assert max(sizes) == dtype.itemsize * b * s * 4 * h  # no s² storage
                else:
                    assert dtype.itemsize * a * b * s * s in sizes
                per[(dtype, kind, s)] = saved.per_layer[0]
        # SDPA grows as s, eager's extra over linear growth is the s² term
        assert (
            per[(dtype, "sdpa", 64)] == 2 * per[(dtype, "sdpa", 32)] == 4 * per[(dtype, "sdpa", 16)]
        )
        quad = per[(dtype, "eager", 64)] - 2 * per[(dtype, "eager", 32)]
        assert quad == dtype.itemsize * a * b * (64**2 - 2 * 32**2)


@pytest.mark.timeout(60)
def test_autocast_saves_fp32_stream_and_bf16_rest_as_worked_out():
    from labkit.parallel.mixed_precision import autocast_activation_bytes

    for kind in ("eager", "sdpa"):
        for b, s, h, a in ((3, 8, 32, 4), (2, 16, 64, 8)):
            torch.manual_seed(0)
            saved = _saved(Stack(1, h, a, attention=kind), torch.randn(b, s, h), autocast=True)
            want = autocast_activation_bytes(b, s, h, a, attention=kind)
            assert saved.per_layer == [want["total"]]
            fp32 = sum(n for _, d, n, _ in saved.records if d == torch.float32)
            lse = 4 * b * a * s if kind == "sdpa" else 0
            assert fp32 == want["fp32_stream"] + want["stats"] + lse
            # the fused 16-bit layout's formula is not what autocast keeps
            assert want["total"] != layer_activation_bytes(b, s, h, a, 2, attention=kind)["total"]
    cuda = autocast_activation_bytes(1, 8, 16, 2, device_type="cuda")
    cpu = autocast_activation_bytes(1, 8, 16, 2)
    assert cuda["attention"] - cpu["attention"] == 4 * 2 * 8 * 8  # fp32 softmax output
    with pytest.raises(ValueError, match=r"must be one of \('cpu', 'cuda'\)"):
        autocast_activation_bytes(1, 8, 16, 2, device_type="mps")


def test_allocator_rounding_explains_the_recorded_gpu_figure():
    # the issue-32 H200 run: notebook 37's (2, 32) forward of 2 layers, h=64, 4 heads, fp32;
    # memory_allocated grew 593,920 bytes, the old check expected at least 608,256
    from labkit.parallel.step_memory import allocator_bytes

    torch.manual_seed(0)
    model, x = Stack(2, 64, 4), torch.randn(2, 32, 64)
    with SavedBytes(model) as saved:
        out = model(x)
    assert saved.total + out.nbytes == 608_256  # what the old check took as a lower bound
    made = [n for _, _, n, ptr in saved.records if ptr != x.untyped_storage().data_ptr()]
    assert allocator_bytes(made + [out.nbytes]) == 593_920  # x predates the reading; 512 B
    assert allocator_bytes([1, 512, 513, 0]) == 512 + 512 + 1024  # no allocation for 0 bytes


@pytest.mark.timeout(60)
def test_recomputation_costs_one_more_forward_in_flops():
    from torch.utils.flop_counter import FlopCounterMode

    from labkit.parallel.step_memory import layer_forward_flops

    torch.manual_seed(0)
    model, x = Stack(2, 32, 4), torch.randn(2, 16, 32)
    flops = {}
    for recompute in (False, True):
        model.recompute = recompute
        with FlopCounterMode(display=False) as counter:
            model(x).square().mean().backward()
        flops[recompute] = counter.get_total_flops()
    with FlopCounterMode(display=False) as counter:
        model(x)
    assert counter.get_total_flops() == 2 * layer_forward_flops(2, 16, 32)  # by hand
    assert flops[False] == 3 * counter.get_total_flops()
    assert flops[True] * 3 == flops[False] * 4
    # torch's default early stop ends the rerun once fc2 has saved its input: fc2's matmul
    # (2·T·4h² FLOPs a layer) is skipped, as notebook 37 says (1.24 there)
    from torch.utils.checkpoint import checkpoint

    with FlopCounterMode(display=False) as counter:
        h = x
        for layer in model.layers:
            h = checkpoint(layer._layer, h, use_reentrant=False)
        h.square().mean().backward()
    fc2 = 2 * 2 * 16 * 4 * 32 * 32
    assert counter.get_total_flops() == flops[True] - 2 * fc2


def test_sdpa_block_computes_what_the_eager_block_computes():
    x = torch.randn(2, 16, 32, requires_grad=True)
    outs, grads = [], []
    for kind in ("eager", "sdpa"):
        torch.manual_seed(0)  # the same weights: the modules are made in the same order
        model = Stack(2, 32, 4, attention=kind)
        outs.append(model(x))
        outs[-1].square().mean().backward()
        grads.append([p.grad for p in model.parameters()])
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-5)
    with pytest.raises(ValueError, match=r"attention='flash': must be one of"):
        Stack(1, 32, 4, attention="flash")


def test_tiled_attention_is_attention_without_the_s_by_s_matrix():
    from labkit.parallel.fused_attention import eager_attention, sdpa_ops, tiled_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 16) * 4 for _ in range(3))  # large scores: max matters
    out, lse, largest = tiled_attention(q, k, v, block=16)
    assert torch.allclose(out, eager_attention(q, k, v), atol=1e-5)
    assert torch.allclose(out, torch.nn.functional.scaled_dot_product_attention(q, k, v),
                          atol=1e-5)  # fmt: skip
    scores = (q @ k.transpose(-2, -1)) / 4
    assert torch.allclose(lse, torch.logsumexp(scores, dim=-1), atol=1e-4)
    assert largest == 2 * 4 * 64 * 16 == scores.numel() // 4
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in sdpa_ops(q, k, v)
    with pytest.raises(ValueError, match="block=0 must be >= 1"):
        tiled_attention(q, k, v, block=0)
