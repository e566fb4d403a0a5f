"""The schedule, plan, partition and grid figures from plain data (no ranks, no browser)."""

from __future__ import annotations

import pytest

from labkit.parallel.auto_split import (
    LayerCost,
    lower_bound,
    partition_optimal,
    partition_uniform,
)
from labkit.parallel.pipeline_parallel import StageEvent, make_schedule
from labkit.views.schedule_view import (
    grid_figure,
    ideal_events,
    in_flight,
    partition_figure,
    plan_figure,
    schedule_figure,
    stage_busy,
)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_in_flight_of_the_ideal_schedules(schedule: str) -> None:
    for p in range(1, 5):
        for m in range(1, 7):
            held = in_flight(ideal_events(make_schedule(p, m, schedule)))
            want = {s: m if schedule == "gpipe" else min(p - s, m) for s in range(p)}
            assert held == want


def test_schedule_figure_draws_every_event_and_the_bubble() -> None:
    events = ideal_events(make_schedule(4, 4, "gpipe"))
    fig = schedule_figure(events, "gpipe", unit="step")
    forward, backward, idle = fig.data
    assert len(forward.x) == len(backward.x) == 16
    assert set(forward.text) == {f"F{j}" for j in range(4)}
    # idle per stage is 2(m+p-1) - 2m = 2(p-1) steps; over 4 stages 24 steps
    assert sum(idle.x) == pytest.approx(4 * 2 * 3)
    assert list(fig.layout.yaxis.ticktext) == [f"stage {s}" for s in range(4)]


def test_schedule_figure_takes_stage_events_in_seconds() -> None:
    events = [
        StageEvent(0, 0, "F", 0, 10.000, 10.001),
        StageEvent(1, 1, "F", 0, 10.002, 10.003),
        StageEvent(1, 1, "B", 0, 10.003, 10.005),
        StageEvent(0, 0, "B", 0, 10.006, 10.008),
    ]
    fig = schedule_figure(events)
    assert list(fig.data[0].base) == pytest.approx([0.0, 2.0])  # ms since the first event
    assert sum(fig.data[2].x) == pytest.approx(2 * 8.0 - 3.0 - 3.0)  # window x stages - busy
    assert stage_busy(events) == pytest.approx({0: 0.003, 1: 0.003})
    assert in_flight(events) == {0: 1, 1: 1}


def test_bad_events_are_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        schedule_figure([])
    with pytest.raises(ValueError, match="kind"):
        in_flight([{"stage": 0, "kind": "X", "microbatch": 0, "start": 0, "end": 1}])
    with pytest.raises(ValueError, match="missing"):
        in_flight([{"stage": 0}])
    with pytest.raises(ValueError, match="unit"):
        schedule_figure(ideal_events(make_schedule(2, 2)), unit="s")


def _costs() -> list[LayerCost]:
    times = [0.004, 0.001, 0.001, 0.001, 0.001, 0.004]
    return [LayerCost(i, f"l{i}", t, 100 * i) for i, t in enumerate(times)]


def test_plan_figure_has_a_bar_group_per_plan_and_the_bound() -> None:
    costs = _costs()
    plans = [partition_uniform(costs, 3), partition_optimal(costs, 3)]
    bound = lower_bound(costs, 3)
    fig = plan_figure(plans, bound, measured={"optimal": [0.004, 0.004, 0.004]})
    bars = [t for t in fig.data if t.type == "bar"]
    assert [list(b.y) for b in bars] == [
        pytest.approx([c * 1e3 for c in p.stage_costs]) for p in plans
    ]
    assert fig.layout.shapes[0].y0 == pytest.approx(bound * 1e3)
    assert any(t.type == "scatter" for t in fig.data)
    with pytest.raises(ValueError):
        plan_figure([])


def test_partition_figure_colours_layers_by_stage() -> None:
    costs = _costs()
    plans = [partition_uniform(costs, 3), partition_optimal(costs, 3)]
    fig = partition_figure(costs, plans)
    assert [t.name for t in fig.data] == ["stage 0", "stage 1", "stage 2"]
    opt = plans[1].boundaries
    stage0 = fig.data[0]
    mine = [name for y, name in zip(stage0.y, stage0.text) if y == "optimal"]
    assert mine == [f"l{i}" for i in range(opt[0], opt[1])]
    with pytest.raises(ValueError, match="covers"):
        partition_figure(costs[:3], plans)


def test_grid_figure_draws_one_outline_per_group() -> None:
    groups = {"dp": [[0, 2], [1, 3]], "mp": [[0, 1], [2, 3]]}
    fig = grid_figure((2, 2), groups)
    outlines = [t for t in fig.data if t.mode == "lines"]
    assert len(outlines) == 4
    assert sum(bool(t.showlegend) for t in outlines) == 2
    with pytest.raises(ValueError, match="ranks must be"):
        grid_figure((2, 2), {"dp": [[0, 4]]})
