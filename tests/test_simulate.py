"""`labkit.simulate` (one process playing every rank on torch's fake process group) against a
real 4-rank gloo lab running the same setup, shard by shard and collective by collective, and
a world of 256 ranks against notebook 42's memory formula (`config_memory`), computed from
the architecture by hand; the per-axis traffic view against the ring convention by hand."""

from __future__ import annotations

import warnings

import pytest
import torch
from distributed import run_ranks

from labkit.parallel.config_memory import Overheads, memory_breakdown
from labkit.parallel.config_model import Config, Model
from labkit.parallel.llama_3d import build_stage, layer_params, step
from labkit.rank import torch_compat
from labkit.rank.fake_world import simulate

NAMES = ("dp", "tp", "pp")
H, HEADS, FFN, LAYERS = 32, 2, 64, 2
VOCAB = layer_params(H, FFN) // H  # the embedding and the output weigh a layer each: 320


def _llama(mesh):
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    stage = build_stage(mesh, hidden=H, heads=HEADS, ffn=FFN, vocab=VOCAB, num_layers=LAYERS)
    step(stage, mesh, batch=1, seq=8, hidden=H, vocab=VOCAB)
    return stage, torch.optim.Adam(stage.parameters())


def _shards(rows):
    return sorted(
        (r["rank"], r["qualname"], r["local_shape"], r["bytes"], r["shard"]) for r in rows
    )


def _calls(records):
    return sorted((r.rank, r.op, r.group, r.peer, r.bytes) for r in records)


def _real_rank(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from labkit.rank import placement_probe, trace

    torch.set_num_threads(1)
    trace.install()
    out = {}
    for cell, shape in enumerate(((2, 2, 1), (1, 2, 2)), start=1):
        trace.begin_cell(cell, rank)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=NAMES)
        model, opt = _llama(mesh)
        records = [r for r in trace.records(cell) if r.kind == "comm"]
        rows = placement_probe.describe_model(model, optimizer=opt, rank=rank)
        out[shape] = (_shards(rows), _calls(records))
    return out


@pytest.mark.timeout(300)
def test_a_simulated_world_agrees_with_a_real_4_rank_gloo_lab() -> None:
    real = run_ranks(_real_rank, 4, timeout=240)
    for shape in ((2, 2, 1), (1, 2, 2)):
        want_shards = sorted(s for r in real for s in r[shape][0])
        want_calls = sorted(c for r in real for c in r[shape][1])
        # pp = 2 stages build different layers: one representative each, dp x tp derived
        world = simulate(shape, NAMES, _llama)
        assert len(world.ran) == shape[2]
        assert _shards(world.placement()) == want_shards, shape
        assert _calls(world.traffic()) == want_calls, shape
        ops = {c[1] for c in want_calls}  # FSDP2 over dp, TP, DTensor's scatter, the pipeline
        assert ops >= ({"all_gather_single", "reduce_scatter_single"} if shape[0] > 1 else set())
        assert ops >= {"all_reduce", "scatter"} | ({"send", "recv"} if shape[2] > 1 else set())


def _small_llama(mesh):
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    stage = build_stage(mesh, hidden=64, heads=4, ffn=128, vocab=640, num_layers=2)
    step(stage, mesh, batch=1, seq=8, hidden=64, vocab=640)
    adam = torch.optim.Adam(stage.parameters())
    adam.step()  # the gradients and Adam's state exist: measured on the ranks that ran
    return stage, adam


@pytest.mark.timeout(240)
def test_a_256_rank_world_holds_what_notebook_42s_formula_says() -> None:
    dp, tp, pp = 16, 4, 4
    world = simulate((dp, tp, pp), NAMES, _small_llama)
    assert world.world_size == 256 and world.ran == [0, 1, 2, 3]
    # by hand: 4 equal units (embedding 640 x 64, two layers of 4h^2 + 3hf, output 640 x 64)
    psi = 4 * (4 * 64 * 64 + 3 * 64 * 128)
    assert psi == 163_840
    model = Model(psi, 2, 64, 4, 16, global_batch=dp, mixed_precision=False, vocab=640)
    want = memory_breakdown(model, Config(dp, tp, pp, zero=3), Overheads.none())
    assert (want.params, want.grads, want.optimizer) == (4 * 640, 4 * 640, 8 * 640)
    memory = world.memory()
    assert len(memory) == 256
    for rank, m in memory.items():
        assert (m["params"], m["grads"], m["optimizer"]) == (
            want.params,
            want.grads,
            want.optimizer,
        ), rank
    from labkit.views.placement_data import memory_by_rank, merge_placement

    for rank in world.ran:  # what torch allocated there, not memory()'s prediction from params
        params = [x for x in world.placement([rank]) if x["kind"] == "param"]
        assert sum(x["grad_bytes"] for x in params) == want.grads
        # Adam's two moments, and its step counter: a 4-byte scalar per tensor
        assert sum(x["optim_bytes"] for x in params) == want.optimizer + 4 * len(params)
    some = world.placement(range(0, 256, 17))
    for rank, m in memory_by_rank(merge_placement(some)).items():
        assert m["predicted"] == memory[rank]["total"]


@pytest.mark.timeout(120)
def test_show_world_sums_bytes_per_mesh_axis_by_the_ring_convention() -> None:
    from labkit.views.world_view import axis_traffic, show_world

    world = simulate((2, 2, 2), NAMES, _llama)
    traffic = axis_traffic(world)
    assert list(traffic) == ["dp", "tp", "pp"]
    for axis in ("dp", "tp"):
        n = 2
        calls = [r for r in world.traffic() if r.rank == 5 and world.axes_of(r.group) == (axis,)]
        # all_reduce 2(n-1)/n S, all_gather / reduce_scatter (n-1)/n S, to the next rank
        sent = sum(r.bytes * (2 if r.op == "all_reduce" else 1) * (n - 1) / n for r in calls)
        assert traffic[axis]["sent"] == sent and traffic[axis]["group_size"] == 2
    sends = [r for r in world.traffic() if r.op == "send"]
    assert traffic["pp"]["sent"] == max(
        sum(r.bytes for r in sends if r.rank == q) for q in range(8)
    )
    assert all(world.axes_of((r.rank, r.peer)) == ("pp",) for r in sends)
    view = show_world(world)
    assert view.traffic == traffic and view.memory == world.memory() and len(view.figures) == 1
    bars = view.figures[0].data
    assert [b.name for b in bars] == ["params", "grads", "optimizer"] and len(bars[0].x) == 8
    text = view.to_text()
    assert "simulated world of 8 ranks, mesh dp=2 x tp=2 x pp=2" in text
    assert "traffic per mesh axis" in text and "memory per rank" in text
    # a few ranks through the existing views: the rank x parameter map, the traffic matrix
    import labkit

    placed = labkit.show_placement(world.placement(range(4)))
    assert sorted(placed.memory) == [0, 1, 2, 3]
    matrix = labkit.show_comm(world.traffic(range(4))).matrix
    assert matrix[0][1] > 0 and matrix[0][4] > 0  # rank 0's TP peer, and its next stage


def _not_spmd(mesh):
    width = 8 * (1 + mesh["dp"].get_local_rank())  # each dp rank builds a different layer
    return torch.nn.Linear(width, 4)


def test_a_setup_that_differs_within_a_class_is_caught() -> None:
    with pytest.raises(ValueError, match="rank 3's parameters differ.*vary="):
        simulate((2, 2), ("dp", "tp"), _not_spmd)
    world = simulate((2, 2), ("dp", "tp"), _not_spmd, vary=("dp",))
    assert world.ran == [0, 2]
    assert world.memory()[3]["params"] == (16 * 4 + 4) * 4


def test_simulate_says_what_this_torch_lacks() -> None:
    torch_compat.disable("fake_world")
    try:
        with pytest.raises(RuntimeError, match="fake process group.*lacks fake_world"):
            simulate((2, 2), ("dp", "tp"), _llama)
    finally:
        torch_compat.enable("fake_world")
    with pytest.raises(ValueError, match="one per name"):
        simulate((2, 2), ("dp",), _llama)
    with pytest.raises(ValueError, match="vary must name axes"):
        simulate((2, 2), ("dp", "tp"), _llama, vary=("pp",))


def _uneven(mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Linear(10, 7))
    plan = {"0": ColwiseParallel(output_layouts=Replicate())}  # 10 rows over tp 4: 3, 3, 3, 1
    parallelize_module(model, mesh["tp"], plan)
    fully_shard(model, mesh=mesh["dp"])  # then dp 3: strided, some empty; 7 rows: 3, 3, 1
    model(torch.randn(2, 6)).sum().backward()
    adam = torch.optim.Adam(model.parameters())
    adam.step()
    return model, adam


@pytest.mark.timeout(120)
def test_uneven_and_strided_shards_derived_as_each_rank_holds_them() -> None:
    """Derived from one representative vs every one of the 12 ranks run (fake process group)."""
    derived = simulate((3, 4), ("dp", "tp"), _uneven)
    every = simulate((3, 4), ("dp", "tp"), _uneven, every_rank=True)
    assert derived.ran == [0] and len(every.ran) == 12
    assert _shards(derived.placement()) == _shards(every.placement())

    # the gradients and Adam's state torch allocated, scaled to each derived rank's shard
    def states(world):
        return sorted((x["rank"], x["qualname"], x["grad_bytes"], x["optim_bytes"])
                      for x in world.placement())  # fmt: skip

    assert states(derived) == states(every)
    assert derived.memory() == every.memory()
    assert _calls(derived.traffic()) == _calls(every.traffic())
    # 10 rows by tp: 3, 3, 3, 1; each by dp: 1 row or none (torch.chunk's sizes)
    rows = {r: x["local_shape"] for x in every.placement() if x["qualname"] == "0.weight"
            for r in [x["rank"]]}  # fmt: skip
    assert sorted({shape[0] for shape in rows.values()}) == [0, 1]
    assert sum(shape[0] for shape in rows.values()) == 10
