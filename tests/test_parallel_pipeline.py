"""Pipeline parallelism: schedules and bubbles in pure Python, and the runners on 4 gloo ranks
checked against the unsplit model (loss and every gradient, seeded, float32)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from distributed import run_ranks
from torch import nn

from labkit.parallel.layer_split import split_sequential
from labkit.parallel.pipeline_parallel import (
    SCHEDULES,
    StageEvent,
    bubble_fraction,
    bubble_overhead,
    make_schedule,
    measured_bubble_fraction,
    pipeline_step,
    replayed_bubble_fraction,
    stage_order,
    torch_pipeline_step,
)

ATOL = 1e-6


# ---------------------------------------------------------------- pure: schedules and bubbles


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_is_valid_and_has_the_textbook_bubble(schedule: str) -> None:
    for p in range(1, 5):
        for m in range(1, 7):
            steps = make_schedule(p, m, schedule)
            finish = {(k, s, j): t + 1 for t, s, k, j in steps}
            assert len(steps) == 2 * p * m == len(finish)
            for t, s, k, j in steps:  # every dependency finished before the op starts
                if k == "F" and s > 0:
                    assert finish[("F", s - 1, j)] <= t
                if k == "B":
                    assert finish[("F", s, j)] <= t
                    if s < p - 1:
                        assert finish[("B", s + 1, j)] <= t
            for s in range(p):  # one op at a time per stage, in the stage's own order
                mine = [(t, k, j) for t, st, k, j in steps if st == s]
                assert len({t for t, _, _ in mine}) == 2 * m
                assert [(k, j) for _, k, j in mine] == stage_order(p, m, s, schedule)
            makespan = max(t for t, *_ in steps) + 1
            assert makespan == 2 * (m + p - 1)
            idle = 1 - 2 * m * p / (p * makespan)
            assert idle == pytest.approx(bubble_fraction(p, m))


def test_1f1b_schedule_for_two_stages_by_hand() -> None:
    assert make_schedule(2, 2, "1f1b") == [
        (0, 0, "F", 0),
        (1, 0, "F", 1),
        (1, 1, "F", 0),
        (2, 1, "B", 0),
        (3, 0, "B", 0),
        (3, 1, "F", 1),
        (4, 1, "B", 1),
        (5, 0, "B", 1),
    ]


def _peak(order: list[tuple[str, int]]) -> int:
    held = peak = 0
    for kind, _ in order:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


def test_activation_memory_gpipe_m_1f1b_at_most_p() -> None:
    for p in range(1, 6):
        for m in range(1, 9):
            for s in range(p):
                assert _peak(stage_order(p, m, s, "gpipe")) == m
                assert _peak(stage_order(p, m, s, "1f1b")) == min(p - s, m)


def test_bubble_formulas_and_errors() -> None:
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(1, 5) == 0.0
    assert bubble_overhead(4, 8) == pytest.approx(3 / 8)
    assert bubble_overhead(4, 8, 2) == pytest.approx(3 / 16)
    # the two forms agree: fraction = overhead / (1 + overhead)
    o = bubble_overhead(4, 6, 3)
    assert bubble_fraction(4, 6, 3) == pytest.approx(o / (1 + o))
    with pytest.raises(ValueError, match=r"\[1, inf\)"):
        bubble_fraction(0, 4)
    with pytest.raises(ValueError, match=r"stage must be in \[0, 2\)"):
        stage_order(2, 4, 2)
    with pytest.raises(ValueError, match="schedule must be one of"):
        make_schedule(2, 4, "zigzag")


# ---------------------------------------------------------------- on ranks


def _setup() -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
        nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3),
    )  # fmt: skip
    return model, torch.randn(8, 6), torch.randn(8, 3)


def _reference(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict]:
    ref = copy.deepcopy(model)
    loss = nn.functional.mse_loss(ref(x), y)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in ref.named_parameters()}


def _pipeline_rank(rank: int, world_size: int) -> dict:
    model, x, y = _setup()
    ref_loss, ref_grads = _reference(model, x, y)
    names = {id(p): n for n, p in model.named_parameters()}
    stage = split_sequential(model, world_size)[rank]
    out: dict = {"ref_loss": ref_loss}
    for impl, fn in (("labkit", pipeline_step), ("torch", torch_pipeline_step)):
        for schedule in SCHEDULES:
            stage.zero_grad()
            res = fn(stage, x, y, nn.functional.mse_loss, 4, schedule)
            loss = res.loss if impl == "labkit" else res
            err = max((p.grad - ref_grads[names[id(p)]]).abs().max().item()
                      for p in stage.parameters())  # fmt: skip
            out[impl, schedule] = {
                "loss": None if loss is None else loss.item(),
                "grad_err": err,
                "events": res.events if impl == "labkit" else None,
                "peak": res.peak_in_flight if impl == "labkit" else None,
            }
    try:  # a user's mistake is reported on every rank before any communication
        pipeline_step(stage, x, y, nn.functional.mse_loss, 3)
    except ValueError as e:
        out["error"] = str(e)
    return out


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_ranks(_pipeline_rank, 4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("impl", ["labkit", "torch"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_equals_unsplit_model(four_ranks: list[dict], impl: str, schedule: str) -> None:
    for rank, res in enumerate(four_ranks):
        r = res[impl, schedule]
        assert r["grad_err"] < ATOL, (rank, r["grad_err"])
        if rank == 3:
            assert r["loss"] == pytest.approx(res["ref_loss"], abs=ATOL)
        else:
            assert r["loss"] is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_records_events_and_memory(four_ranks: list[dict], schedule: str) -> None:
    events = []
    for rank, res in enumerate(four_ranks):
        r = res["labkit", schedule]
        mine = r["events"]
        assert [(e.kind, e.microbatch) for e in mine] == stage_order(4, 4, rank, schedule)
        assert all(e.stage == rank == e.rank and e.end >= e.start for e in mine)
        assert all(a.end <= b.start for a, b in itertools.pairwise(mine))  # one at a time
        assert r["peak"] == (4 if schedule == "gpipe" else 4 - rank)
        assert mine[0].to_span().name == f"{mine[0].kind}{mine[0].microbatch}"
        events += mine
    # F(s, j) cannot start before F(s-1, j) ended: the clocks of different ranks line up
    by_key = {(e.stage, e.kind, e.microbatch): e for e in events}
    for (s, k, j), e in by_key.items():
        if k == "F" and s > 0:
            assert by_key[s - 1, "F", j].end <= e.start
    assert 0.0 <= measured_bubble_fraction(events) < 1.0


@pytest.mark.timeout(120)
def test_pipeline_rejects_bad_microbatch_count(four_ranks: list[dict]) -> None:
    for res in four_ranks:
        assert "multiple of num_microbatches=3" in res["error"]


def _events(rows: list[tuple[int, str, int, float, float]]) -> list[StageEvent]:
    return [StageEvent(s, s, k, j, a, b) for s, k, j, a, b in rows]


@pytest.mark.timeout(30)
def test_replayed_bubble_matches_a_case_worked_by_hand() -> None:
    """p = 2, m = 2, 1F1B, stage 0 twice as slow as stage 1 (F and B 2 s on stage 0, 1 s on
    stage 1). By hand: S0 F0 [0,2] F1 [2,4]; S1 F0 [2,3] B0 [3,4] F1 [4,5] B1 [5,6];
    S0 B0 [4,6] B1 [6,8]: span 8, busy 12, bubble 1 - 12/16 = 0.25, below (p-1)/(m+p-1) = 1/3.
    The same ops each 0.5 s later than their inputs allow: the durations, so the replay, are
    the same; the measured bubble is larger."""
    tight = [
        (0, "F", 0, 0, 2), (0, "F", 1, 2, 4), (0, "B", 0, 4, 6), (0, "B", 1, 6, 8),
        (1, "F", 0, 2, 3), (1, "B", 0, 3, 4), (1, "F", 1, 4, 5), (1, "B", 1, 5, 6),
    ]  # fmt: skip
    assert replayed_bubble_fraction(_events(tight)) == pytest.approx(0.25)
    assert measured_bubble_fraction(_events(tight)) == pytest.approx(0.25)
    late = [
        (0, "F", 0, 0, 2), (0, "F", 1, 2, 4), (0, "B", 0, 5.5, 7.5), (0, "B", 1, 9, 11),
        (1, "F", 0, 2.5, 3.5), (1, "B", 0, 3.5, 4.5), (1, "F", 1, 4.5, 5.5), (1, "B", 1, 7, 8),
    ]  # fmt: skip
    assert replayed_bubble_fraction(_events(late)) == pytest.approx(0.25)
    assert measured_bubble_fraction(_events(late)) == pytest.approx(1 - 12 / 22)
    # equal unit durations give the formula, for both schedules
    for p, m in [(2, 1), (2, 4), (4, 4), (3, 8)]:
        for schedule in SCHEDULES:
            steps = make_schedule(p, m, schedule)
            ideal = _events([(s, k, j, t, t + 1) for t, s, k, j in steps])
            assert replayed_bubble_fraction(ideal) == pytest.approx(bubble_fraction(p, m))
    with pytest.raises(ValueError, match="input never arrives"):
        replayed_bubble_fraction(_events([(1, "F", 0, 0, 1)] + [(0, "B", 0, 1, 2)]))
