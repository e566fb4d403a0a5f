"""labkit.rank.placement_probe (rank side) and show_placement (kernel side).

Replicated, split-by-layers and DTensor-sharded models; memory bytes and the 16 B/param Adam
prediction; the shared-device note; that the rank-side module imports no notebook packages.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))  # tests/ has no __init__; spawned ranks need it
from distributed import run_ranks
from test_views_fakes import FakeLab

from labkit.rank.placement_probe import activation_bytes, describe_model, optimizer_slots
from labkit.views import memory_by_rank, merge_placement, show_placement

pytestmark = pytest.mark.filterwarnings("error::labkit.views.ViewWarning")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _trained(model: nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return opt


def test_rows_for_a_replicated_model() -> None:
    model = _mlp()
    opt = _trained(model)
    rows = describe_model(model, optimizer=opt, rank=3)
    assert [r["qualname"] for r in rows] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    w = rows[0]
    assert (w["rank"], w["module"], w["param"], w["shape"]) == (3, "0", "weight", (8, 4))
    assert (w["dtype"], w["device"], w["numel"], w["bytes"]) == ("float32", "cpu", 32, 128)
    assert (w["placement"], w["grad_bytes"], w["optim_slots"]) == ("replicated", 128, 2)
    assert w["optim_bytes"] == 2 * 128 + 4  # exp_avg, exp_avg_sq and the step counter
    assert describe_model(model, rank=0)[0]["optim_bytes"] == 0  # no optimizer passed


def test_optimizer_slots_by_kind() -> None:
    p = nn.Parameter(torch.zeros(2))
    assert optimizer_slots(torch.optim.SGD([p], lr=0.1), p) == 0
    assert optimizer_slots(torch.optim.SGD([p], lr=0.1, momentum=0.9), p) == 1
    assert optimizer_slots(torch.optim.AdamW([p]), p) == 2
    assert optimizer_slots(None, p) == 0


def test_replicated_view_classifies_and_predicts_16_bytes_per_param() -> None:
    lab = FakeLab(2)
    for ns in lab.namespaces:
        ns["model"] = _mlp()
        ns["opt"] = torch.optim.Adam(ns["model"].parameters())
    view = show_placement(lab, "model", optimizer="opt")
    assert {r["layout"] for r in view.rows} == {"replicated"}
    assert sorted({r["rank"] for r in view.rows}) == [0, 1]
    numel = sum(p.numel() for p in _mlp().parameters())
    for m in view.memory.values():  # before backward/step: only parameters are allocated
        assert (m["params"], m["grads"], m["optimizer"]) == (4 * numel, 0, 0)
        assert m["predicted"] == 16 * numel
        assert "x 16 B (4 param + 4 grad + 8 optim)" in m["formula"]
    placement, memory = view.figures
    assert [t.name for t in placement.data] == ["replicated (whole tensor on every rank)"]
    assert [t.name for t in memory.data] == [
        "parameters", "gradients", "optimizer state", "activations", "predicted"
    ]  # fmt: skip
    assert list(memory.data[-1].y) == [16 * numel, 16 * numel]
    assert "CPU ranks" in view.notes[0] and "0, 1" in view.notes[0]


def test_split_by_layers_different_rows_per_rank() -> None:
    whole = _mlp()
    rows = describe_model(whole[:2], rank=0) + describe_model(whole[2], rank=1, prefix="2")
    view = show_placement(rows)
    by_rank = {r: [x["qualname"] for x in view.rows if x["rank"] == r] for r in (0, 1)}
    assert by_rank == {0: ["0.weight", "0.bias"], 1: ["2.weight", "2.bias"]}
    assert {r["layout"] for r in view.rows} == {"split"}
    assert (
        view.memory[0]["params"] == (8 * 4 + 8) * 4 and view.memory[1]["params"] == (2 * 8 + 2) * 4
    )
    trace = view.figures[0].data[0]
    assert trace.name.startswith("split") and list(trace.x) == [0, 0, 1, 1]
    # A parameter that only one of two ranks holds is split, even if the rank did not say so.
    mixed = merge_placement(describe_model(whole, rank=0) + describe_model(whole[:1], rank=1))
    assert {r["qualname"]: r["layout"] for r in mixed} == {
        "0.weight": "replicated", "0.bias": "replicated", "2.weight": "split", "2.bias": "split"
    }  # fmt: skip


def test_activations_and_explicit_prediction() -> None:
    model = _mlp()
    acts = activation_bytes(model, torch.randn(5, 4))
    assert acts == {"0": 5 * 8 * 4, "1": 5 * 8 * 4, "2": 5 * 2 * 4}
    rows = describe_model(model, rank=0, activations=acts)
    mem = memory_by_rank(merge_placement(rows))[0]
    assert mem["activations"] == sum(acts.values())
    view = show_placement({0: rows}, predicted=123)
    assert view.memory[0]["predicted"] == 123 and "given" in view.memory[0]["formula"]


def test_shared_gpu_note_and_static_html() -> None:
    lab = FakeLab(2, device="cuda:0")
    for ns in lab.namespaces:
        ns["net"] = _mlp()
    view = show_placement(lab, "net")
    assert any("share cuda:0" in n for n in view.notes)
    page = view.to_html()
    assert "0.weight" in page and "replicated" in page and "<script" not in page
    with pytest.raises(ValueError, match="name"):
        show_placement(lab, "net; import os")


def _sharded_linear(rank: int, world_size: int) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,))
    layer = parallelize_module(nn.Linear(6, 4), mesh, ColwiseParallel())
    return describe_model(layer, name="layer")  # rank from the process group


@pytest.mark.timeout(120)
def test_dtensor_sharded_linear_on_two_gloo_ranks() -> None:
    per_rank = run_ranks(_sharded_linear, 2)
    view = show_placement({r: rows for r, rows in enumerate(per_rank)}, name="layer")
    weights = [r for r in view.rows if r["qualname"] == "weight"]
    assert [w["rank"] for w in weights] == [0, 1]
    assert [w["shard"] for w in weights] == [[(0, 0, 2)], [(0, 2, 4)]]
    assert all(w["shape"] == (4, 6) and w["local_shape"] == (2, 6) for w in weights)
    assert all(w["placements"] == ["Shard(dim=0)"] and w["mesh"] == [0, 1] for w in weights)
    assert {r["layout"] for r in view.rows} == {"sharded"}
    assert view.memory[0]["params"] == (2 * 6 + 2) * 4
    assert "dim0[2:4]" in view.figures[0].data[0].text[-1]
