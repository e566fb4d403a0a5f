"""Automatic splitting: the DP against brute force on seeded random instances, bounds and
heuristics, memory caps, profiling, and a plan run as a 3-rank pipeline against the unsplit
model."""

from __future__ import annotations

import copy
import itertools
import random

import pytest
import torch
from distributed import run_ranks
from torch import nn

from labkit.parallel.auto_split import (
    LayerCost,
    Plan,
    auto_split,
    broadcast_plan,
    lower_bound,
    partition_by_params,
    partition_greedy,
    partition_optimal,
    partition_uniform,
    profile_layers,
)
from labkit.parallel.pipeline_parallel import pipeline_step

HEURISTICS = (partition_uniform, partition_by_params, partition_greedy)


def _costs(times: list[float], params: list[int] | None = None, acts: list[int] | None = None):
    n = len(times)
    params, acts = params or [0] * n, acts or [0] * n
    return [LayerCost(i, str(i), t, p, a) for i, (t, p, a) in enumerate(zip(times, params, acts))]


def _brute_force(costs: list[LayerCost], stages: int, cap: int | None) -> float | None:
    """Smallest bottleneck over all contiguous splits (None when none fits the cap)."""
    n, best = len(costs), None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        parts = [costs[a:b] for a, b in itertools.pairwise(bounds)]
        if cap is not None and any(sum(c.memory for c in p) > cap for p in parts):
            continue
        value = max(sum(c.time for c in p) for p in parts)
        best = value if best is None else min(best, value)
    return best


def _assert_valid(plan: Plan, costs: list[LayerCost], stages: int) -> None:
    b = plan.boundaries
    assert len(b) == stages + 1 and b[0] == 0 and b[-1] == len(costs)
    assert all(x < y for x, y in itertools.pairwise(b))  # every stage non-empty
    for s, (x, y) in enumerate(itertools.pairwise(b)):
        assert plan.stage_costs[s] == sum(c.time for c in costs[x:y])
        assert plan.stage_memory[s] == sum(c.memory for c in costs[x:y])
    assert plan.stage_of_layer == [s for s in range(stages) for _ in range(b[s], b[s + 1])]


def test_dp_equals_brute_force_and_beats_heuristics() -> None:
    rng = random.Random(1234)
    checked_caps = infeasible = 0
    for _ in range(300):
        n = rng.randint(1, 8)
        stages = rng.randint(1, n)
        # integer-valued times keep every sum exact, so equality is exact too
        times = [float(rng.randint(1, 20)) for _ in range(n)]
        params = [rng.randint(0, 50) for _ in range(n)]
        acts = [rng.randint(0, 50) for _ in range(n)]
        costs = _costs(times, params, acts)
        plan = partition_optimal(costs, stages)
        _assert_valid(plan, costs, stages)
        assert plan.bottleneck == _brute_force(costs, stages, None)
        assert plan.bottleneck >= lower_bound(costs, stages)
        for heuristic in HEURISTICS:
            other = heuristic(costs, stages)
            _assert_valid(other, costs, stages)
            assert plan.bottleneck <= other.bottleneck
        cap = rng.randint(0, 200)
        expected = _brute_force(costs, stages, cap)
        if expected is None:
            infeasible += 1
            with pytest.raises(ValueError, match="fits memory_cap"):
                partition_optimal(costs, stages, memory_cap=cap)
        else:
            checked_caps += 1
            capped = partition_optimal(costs, stages, memory_cap=cap)
            _assert_valid(capped, costs, stages)
            assert capped.bottleneck == expected
            assert max(capped.stage_memory) <= cap
    assert checked_caps > 50 and infeasible > 20  # both branches really exercised


def test_heuristics_on_a_known_instance() -> None:
    costs = _costs([1, 1, 1, 1, 8, 1], params=[10, 10, 0, 0, 10, 10])
    assert partition_uniform(costs, 3).boundaries == [0, 2, 4, 6]
    assert partition_by_params(costs, 3).boundaries == [0, 2, 5, 6]
    assert partition_greedy(costs, 3).boundaries == [0, 4, 5, 6]
    best = partition_optimal(costs, 3)
    assert best.bottleneck == 8 == lower_bound(costs, 3)  # the largest layer is the bound
    assert partition_uniform(costs, 3).bottleneck == 9
    assert lower_bound(_costs([2, 2, 2, 2]), 2) == 4


def test_errors_name_the_allowed_range() -> None:
    costs = _costs([1, 2, 3, 4])
    for fn in (partition_optimal, partition_uniform, partition_greedy, lower_bound):
        with pytest.raises(ValueError, match=r"stages must be in \[1, 4\], got 5"):
            fn(costs, 5)
    plan = partition_optimal(costs, 2)
    with pytest.raises(ValueError, match=r"stage must be in \[0, 2\)"):
        plan.stage_module(nn.Sequential(*[nn.Identity()] * 4), 2)


def test_profile_layers_measures_bytes_and_leaves_grads_alone() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2, bias=False))
    costs = profile_layers(model, torch.randn(5, 4), repeats=3)
    assert [c.name for c in costs] == ["0", "1", "2"]
    assert [c.param_bytes for c in costs] == [(32 + 8) * 4, 0, 16 * 4]
    assert [c.activation_bytes for c in costs] == [5 * 8 * 4, 5 * 8 * 4, 5 * 2 * 4]
    assert all(c.time > 0 for c in costs)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match=r"repeats must be in \[1, inf\)"):
        profile_layers(model, torch.randn(5, 4), repeats=0)


def _setup() -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
        nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 3),
    )  # fmt: skip
    return model, torch.randn(8, 6), torch.randn(8, 3)


def _plan_rank(rank: int, world_size: int, plan: Plan) -> dict:
    model, x, y = _setup()
    ref = copy.deepcopy(model)
    ref_loss = nn.functional.mse_loss(ref(x), y)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    plan = broadcast_plan(plan if rank == 0 else None)
    stage = plan.stage_module(model, rank)
    res = pipeline_step(stage, x, y, nn.functional.mse_loss, 2, "1f1b")
    errs = [(p.grad - ref_grads[names[id(p)]]).abs().max().item() for p in stage.parameters()]
    return {
        "boundaries": plan.boundaries,
        "loss": None if res.loss is None else res.loss.item(),
        "ref_loss": ref_loss.item(),
        "grad_err": max(errs, default=0.0),
    }


@pytest.mark.timeout(120)
def test_auto_split_plan_runs_as_a_pipeline() -> None:
    model, x, _ = _setup()
    plan = auto_split(model, x, 3, repeats=3)
    costs = profile_layers(model, x, repeats=3)  # times differ between runs; bytes do not
    b = plan.boundaries
    assert len(b) == 4 and b[0] == 0 and b[-1] == 7 and all(u < v for u, v in itertools.pairwise(b))
    assert plan.stage_memory == [
        sum(c.memory for c in costs[u:v]) for u, v in itertools.pairwise(b)
    ]
    assert plan.method == "optimal"
    results = run_ranks(_plan_rank, 3, plan)
    assert all(r["boundaries"] == plan.boundaries for r in results)
    assert all(r["grad_err"] < 1e-6 for r in results), results
    assert results[0]["loss"] is None and results[1]["loss"] is None
    assert results[2]["loss"] == pytest.approx(results[2]["ref_loss"], abs=1e-6)
