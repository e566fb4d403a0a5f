"""Pipeline schedules beyond 1F1B: torch's orders simulated against the bubble formulas (pure),
and torch's GPipe, 1F1B, interleaved 1F1B and zero-bubble schedules on 3 gloo ranks checked
against the unsplit model (loss and every gradient), then their bubbles measured on 2 ranks
with sleep-timed chunks, on a quiet and on a saturated CPU."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from distributed import run_ranks
from torch import nn

from labkit.parallel.pipeline_parallel import bubble_fraction
from labkit.parallel.pipeline_schedules import (
    TORCH_SCHEDULES,
    ChunkEvent,
    TorchPipeline,
    build_chunks,
    measured_bubble,
    replayed_bubble,
    simulate,
    simulated_bubble,
    tick_bubble,
    torch_orders,
    torch_tick_table,
    zero_bubble_fraction,
)

SLEEP_S = 0.08  # a rank's F, B and W of one micro-batch each sleep this long (split over chunks)
HIGH = {"idle": 0.12, "loaded": 0.25}  # measured <= formula + HIGH: time between ops is idle
# replayed and measured >= formula - LOW: an off-path op stretched more than the rest lowers
# them; with every core busy the ops' lengths spread further (a loaded run in random order
# replayed 1F1B's steps at 0.283, 0.274 and 0.336 against a formula of 0.333)
LOW = {"idle": 0.05, "loaded": 0.1}
CHUNKS_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 2}

# ---------------------------------------------------------------- pure


@pytest.mark.parametrize("schedule", TORCH_SCHEDULES)
def test_orders_run_every_op_once_after_what_it_needs(schedule: str) -> None:
    for p, m in ((2, 2), (3, 6), (4, 4)):
        v = CHUNKS_PER_RANK[schedule]
        orders = torch_orders(schedule, p, m, v)
        ops = simulate(orders, p * v, (1.0, 1.0, 1.0))
        kinds = {"B", "W"} if schedule == "zero_bubble" else {"BW"}
        assert {k for _, _, k, _, _, _ in ops} == {"F"} | kinds
        seen = [(c, k, j) for _, c, k, j, _, _ in ops]
        assert len(seen) == len(set(seen)) == p * v * m * (1 + len(kinds))
        for r, c, *_ in ops:
            assert c % p == r  # chunk c lives on rank c mod p
        end = {(c, k, j): e for _, c, k, j, _, e in ops}
        start = {(c, k, j): s for _, c, k, j, s, _ in ops}
        for c, k, j in seen:
            if k == "F" and c > 0:
                assert end[c - 1, "F", j] <= start[c, k, j]
            if k == "W":
                assert end[c, "B", j] <= start[c, k, j]
            if k in ("B", "BW") and c < p * v - 1:
                back = (c + 1, "B" if k == "B" else "BW", j)
                assert end[back] <= start[c, k, j]
        for r in range(p):  # one op at a time per rank
            mine = sorted((s, e) for rr, _, _, _, s, e in ops if rr == r)
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(mine))


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [1, 2])
def test_simulated_bubbles_equal_the_formulas(p: int, v: int) -> None:
    for m in (p, 2 * p):
        for times in ((1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (1.0, 1.0, 0.5)):
            chunk = tuple(t / v for t in times)
            for schedule in ("gpipe", "1f1b"):
                got = simulated_bubble(torch_orders(schedule, p, m), p, times)
                assert got == pytest.approx(bubble_fraction(p, m))
            got = simulated_bubble(torch_orders("interleaved_1f1b", p, m, v), p * v, chunk)
            assert got == pytest.approx(bubble_fraction(p, m, v))
            got = simulated_bubble(torch_orders("zero_bubble", p, m, v), p * v, chunk)
            assert got == pytest.approx(zero_bubble_fraction(p, m, v, times))
            assert got < bubble_fraction(p, m, v)  # the W's fill part of the bubble


@pytest.mark.parametrize("p, m", [(2, 2), (2, 4), (3, 6), (4, 4), (4, 8)])
def test_torchs_own_ticks_agree_and_zero_bubble_still_idles(p: int, m: int) -> None:
    """torch's planned tick tables (None = an idle tick) against the formula with one tick per
    chunk's F, B or W, and against `simulate` of the same actions: three routes, one number."""
    tables = {"zero_bubble": torch_tick_table("zero_bubble", p, m)}
    if m >= 2 * p - 1:
        tables["zbv"] = torch_tick_table("zbv", p, m)
    for schedule, table in tables.items():
        ops = {r: [a for a in ticks if a is not None] for r, ticks in table.items()}
        want = zero_bubble_fraction(p, m, 2, (2, 2, 2))
        assert tick_bubble(table) == pytest.approx(want), schedule
        assert simulated_bubble(ops, 2 * p, (1, 1, 1)) == pytest.approx(want), schedule
        # idle: (p-1) ticks per rank on average, so never zero, and below interleaved 1F1B's
        span = max(len(t) for t in table.values())
        assert p * span - sum(len(o) for o in ops.values()) == p * (p - 1)
        assert 0 < tick_bubble(table) < bubble_fraction(p, m, 2)
    # the old text's "1F1B idles (p-1)(tf+tb+tw)/v" is interleaved 1F1B's: plain 1F1B idles v
    # times longer
    run = simulate(torch_orders("1f1b", p, m), p, (1.0, 1.0, 1.0))
    idle = max(o[5] for o in run) - m * 3.0
    assert idle == pytest.approx((p - 1) * 3.0) and idle != pytest.approx((p - 1) * 3.0 / 2)


def test_tick_table_errors() -> None:
    with pytest.raises(ValueError, match="schedule must be one of"):
        torch_tick_table("1f1b", 2, 4)
    with pytest.raises(ValueError, match="at least 2p-1 = 3"):
        torch_tick_table("zbv", 2, 2)
    assert tick_bubble({0: ["F", None], 1: ["F"]}) == 0.5


def test_zero_bubble_gains_nothing_without_a_weight_gradient() -> None:
    for p, m, v in ((2, 4, 2), (4, 8, 1), (3, 6, 2)):
        no_w = (1.0 / v, 2.0 / v, 0.0)  # the whole backward is B: nothing to move into the bubble
        zb = simulated_bubble(torch_orders("zero_bubble", p, m, v), p * v, no_w)
        assert zb == pytest.approx(bubble_fraction(p, m, v))


def test_formulas_and_errors() -> None:
    assert zero_bubble_fraction(2, 4, 2, (1, 1, 1)) == pytest.approx(0.5 / 12.5)
    assert zero_bubble_fraction(1, 4, 1, (1, 1, 1)) == 0.0
    with pytest.raises(ValueError, match="tw <= tf"):
        zero_bubble_fraction(2, 4, 1, (1, 1, 2))
    with pytest.raises(ValueError, match=r"\[1, inf\)"):
        zero_bubble_fraction(2, 0, 1, (1, 1, 1))
    with pytest.raises(ValueError, match="schedule must be one of"):
        torch_orders("zigzag", 2, 2)
    with pytest.raises(ValueError, match="runs 1 chunk per rank, got v=2"):
        torch_orders("1f1b", 2, 2, 2)
    with pytest.raises(ValueError, match="deadlock"):  # rank 0 waits for B of chunk 1 first
        simulate({0: [("BW", 0, 0), ("F", 0, 0)], 1: [("F", 1, 0), ("BW", 1, 0)]}, 2, (1, 1, 1))
    with pytest.raises(ValueError, match="must be non-empty"):
        measured_bubble([])


def test_replay_takes_out_the_time_lost_between_ops_worked_by_hand() -> None:
    """Rank 0 runs chunk 0, rank 1 chunk 1, one micro-batch, each op 1 s; the forward reaches
    rank 1 0.2 s late and the backward rank 0 0.3 s late. Busy 4 s of 2 x 4.5 s: 5/9 idle.
    Replayed with free messages the step takes 4 s: 1/2 idle."""
    events = [
        ChunkEvent(0, 0, "F", 0, 0.0, 1.0),
        ChunkEvent(1, 1, "F", 0, 1.2, 2.2),
        ChunkEvent(1, 1, "B", 0, 2.2, 3.2),
        ChunkEvent(0, 0, "B", 0, 3.5, 4.5),
    ]
    assert measured_bubble(events) == pytest.approx(5 / 9)
    assert replayed_bubble(events) == pytest.approx(1 / 2)
    # split: B's gradient leaves at once (zero bubble); whole: only with its W (5 s of idle)
    whole = events[:3] + [ChunkEvent(1, 1, "W", 0, 3.2, 4.2), ChunkEvent(0, 0, "B", 0, 4.5, 5.5)]
    assert replayed_bubble(whole, split_backward=True) == pytest.approx(1 - 5 / 8)
    assert replayed_bubble(whole) == pytest.approx(1 - 5 / 10)
    with pytest.raises(ValueError, match="must be non-empty"):
        replayed_bubble([])
    with pytest.raises(ValueError, match="cannot be replayed"):  # F of chunk 0 never ran
        replayed_bubble([ChunkEvent(1, 1, "F", 0, 0.0, 1.0)])


@pytest.mark.parametrize("schedule", TORCH_SCHEDULES)
def test_replay_of_a_planned_step_is_its_simulation_and_gaps_only_add_to_the_measurement(
    schedule: str,
) -> None:
    """Events made from `simulate` of torch's orders replay to `simulated_bubble`; the same
    events with every op on rank 1 started later (a late message) measure more idle time but
    replay to the same bubble."""
    tf, tb, tw = 1.0, 1.5, 0.5
    for p, m in ((2, 2), (3, 3)):
        v = CHUNKS_PER_RANK[schedule]
        orders = torch_orders(schedule, p, m, v)
        events = []
        for r, c, kind, j, start, end in simulate(orders, p * v, (tf, tb, tw)):
            if kind == "BW":  # a full backward records B, then W
                events += [ChunkEvent(r, c, "B", j, start, start + tb)]
                events += [ChunkEvent(r, c, "W", j, start + tb, end)]
            else:
                events.append(ChunkEvent(r, c, kind, j, start, end))
        want = simulated_bubble(orders, p * v, (tf, tb, tw))
        split = schedule == "zero_bubble"
        assert replayed_bubble(events, split) == pytest.approx(want)
        assert measured_bubble(events) == pytest.approx(want)
        stall = sorted(e.start for e in events)[len(events) // 2]  # a late message: all after
        late = [
            ChunkEvent(e.rank, e.chunk, e.kind, e.microbatch, e.start + 0.7, e.end + 0.7)
            if e.start >= stall
            else e
            for e in events
        ]
        assert replayed_bubble(late, split) == pytest.approx(want)
        assert measured_bubble(late) > want + 0.01


def _step_with_latency(orders, num_chunks, seconds, latency, late, seed):
    """Events of a step run by the rules of torch's runtime, written out here (not via
    `replayed_bubble`): each op waits for its rank and its inputs; a message between ranks
    takes `latency` (a full backward's input gradient leaves after its W, a split B's at
    once); a rank starts each op up to `late` late; each op's duration is drawn at random."""
    import random

    rng = random.Random(seed)
    tf, tb, tw = seconds
    cost = {(r, i): rng.uniform(0.5, 1.5) for r, order in orders.items() for i in range(len(order))}
    ends: dict = {}
    free = dict.fromkeys(orders, 0.0)
    pos = dict.fromkeys(orders, 0)
    events = []
    while any(pos[r] < len(orders[r]) for r in orders):
        for r in orders:
            while pos[r] < len(orders[r]):
                kind, c, j = orders[r][pos[r]]
                if kind == "F":  # from the previous chunk, on another rank (p >= 2)
                    needs = [(("F", c - 1, j), latency)] if c > 0 else []
                elif kind == "W":
                    needs = [(("B", c, j), 0.0)]
                else:  # its own F; the gradient of the next chunk, from another rank
                    up = [(("sent", c + 1, j), latency)] if c < num_chunks - 1 else []
                    needs = [(("F", c, j), 0.0)] + up
                if any(k not in ends for k, _ in needs):
                    break
                deps = [ends[k] + wait for k, wait in needs]
                start = max([free[r]] + deps) + rng.uniform(0.0, late)
                scale = cost[(r, pos[r])]
                parts = (
                    [("B", tb), ("W", tw)]
                    if kind == "BW"
                    else [(kind, dict(zip("FBW", seconds))[kind])]
                )
                for k, t in parts:
                    events.append(ChunkEvent(r, c, k, j, start, start + t * scale))
                    start = ends[(k, c, j)] = start + t * scale
                if kind in ("B", "BW"):
                    ends[("sent", c, j)] = start
                free[r] = start
                pos[r] += 1
    return events


@pytest.mark.parametrize("schedule", TORCH_SCHEDULES)
def test_replay_is_the_same_step_with_free_messages_and_never_above_the_measurement(
    schedule: str,
) -> None:
    """Random op lengths, message latencies and late wake-ups: the replay of the step equals
    the measurement of the same step (same op lengths) run with free messages and no delays,
    and the measurement never falls below it."""
    v, split = CHUNKS_PER_RANK[schedule], schedule == "zero_bubble"
    for p, m in ((2, 2), (2, 4), (3, 3)):
        orders = torch_orders(schedule, p, m, v)
        for seed in range(5):
            args = (orders, p * v, (1.0, 1.5, 0.5))
            free = _step_with_latency(*args, latency=0.0, late=0.0, seed=seed)
            slow = _step_with_latency(*args, latency=0.3, late=0.2, seed=seed)
            assert replayed_bubble(free, split) == pytest.approx(measured_bubble(free))
            assert replayed_bubble(slow, split) == pytest.approx(measured_bubble(free))
            assert measured_bubble(slow) > replayed_bubble(slow, split)


# ---------------------------------------------------------------- on ranks


def _expand(order: list) -> list:
    return [(k, c, j) for kind, c, j in order for k in (("B", "W") if kind == "BW" else (kind,))]


def _schedules_rank(rank: int, world_size: int, m: int, seconds: float, repeats: int) -> dict:
    from torch.distributed import pipelining  # noqa: F401 - its first import is slow

    torch.set_num_threads(1)
    out = {}
    for schedule, v in CHUNKS_PER_RANK.items():
        n = v * world_size
        model = build_chunks(8, n, (seconds / v,) * 3, seed=0)
        reference = copy.deepcopy(model)
        for chunk in reference:
            chunk.seconds = (0.0, 0.0, 0.0)
        torch.manual_seed(1)
        x, y = torch.randn(12, 8), torch.randn(12, 8)
        ref_loss = nn.functional.mse_loss(reference(x), y)
        ref_loss.backward()
        mine = [model[c] for c in range(rank, n, world_size)]
        pipe = TorchPipeline(mine, n, nn.functional.mse_loss, m, schedule)
        pipe.step(x, y)  # torch's set-up step
        runs = []
        for _ in range(repeats):
            model.zero_grad()
            loss, events = pipe.step(x, y)
            runs.append(events)
        err = max(
            (p.grad - reference.get_parameter(f"{c.chunk}.{name}").grad).abs().max().item()
            for c in mine
            for name, p in c.named_parameters()
        )
        out[schedule] = {
            "loss_err": None if loss is None else abs(loss.item() - ref_loss.item()),
            "grad_err": err,
            "runs": runs,
        }
    try:
        TorchPipeline(mine[:1], 2 * world_size, nn.functional.mse_loss, m, "zero_bubble")
    except ValueError as e:
        out["error"] = str(e)
    return out


@pytest.fixture(scope="module")
def three_ranks() -> list[dict]:
    return run_ranks(_schedules_rank, 3, 3, 0.0, 1)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule", TORCH_SCHEDULES)
def test_schedule_equals_unsplit_model_and_runs_torchs_order(
    three_ranks: list[dict], schedule: str
) -> None:
    v = CHUNKS_PER_RANK[schedule]
    orders = torch_orders(schedule, 3, 3, v)
    for rank, res in enumerate(three_ranks):
        r = res[schedule]
        assert r["grad_err"] < 1e-6, (rank, r["grad_err"])
        assert (r["loss_err"] is None) == (rank != 2)
        if rank == 2:
            assert r["loss_err"] < 1e-6
        events = r["runs"][0]
        assert [(e.kind, e.chunk, e.microbatch) for e in events] == _expand(orders[rank])
        assert all(e.rank == rank for e in events)
    assert "rank 0 must hold chunks [0, 3]" in three_ranks[0]["error"]


def _bubbles_rank(rank: int, world_size: int) -> dict:
    res = _schedules_rank(rank, world_size, 2, SLEEP_S, 3)
    return {s: res[s]["runs"] for s in CHUNKS_PER_RANK}


@pytest.mark.timeout(240)
def test_measured_bubbles_follow_the_formulas(load: list) -> None:
    """2 ranks, m = 2, sleeps of 80 ms per rank's F, B and W. The time between ops (torch's
    bookkeeping, messages, waiting for a core) counts as idle, so the best of three runs lies
    in [formula - LOW, formula + HIGH] (a sleep that overshoots stretches an op either way).
    HIGH is 0.12 on a quiet machine; with every core saturated the ops' CPU work waits for a
    core, so 0.25 (a pipeline that did not overlap its stages would idle 0.5); LOW is 0.05,
    and 0.1 with every core saturated (a replay that ignored the dependencies would give 0).
    Interleaving and zero bubble both beat 1F1B."""
    high, low = HIGH["loaded" if load else "idle"], LOW["loaded" if load else "idle"]
    ranks = run_ranks(_bubbles_rank, 2)
    want = {
        "gpipe": bubble_fraction(2, 2),
        "1f1b": bubble_fraction(2, 2),
        "interleaved_1f1b": bubble_fraction(2, 2, 2),
        "zero_bubble": zero_bubble_fraction(2, 2, 2, (1, 1, 1)),
    }
    got = {}
    for schedule, formula in want.items():
        steps = [a + b for a, b in zip(ranks[0][schedule], ranks[1][schedule])]
        # torch's real steps: the replay never exceeds the measurement, nor (the median step)
        # falls LOW below the formula (a late wake-up after a sleep, stamped inside its op, can
        # lift the replay; an off-path op stretched more than the rest can lower it)
        replays = [replayed_bubble(events, schedule == "zero_bubble") for events in steps]
        print(schedule, "replayed", [round(r, 3) for r in replays])
        for events, replayed in zip(steps, replays):  # the bound: every step, exactly
            assert replayed <= measured_bubble(events) + 1e-9, (schedule, replays)
        # the band: one step in three may have had an off-path op stretched more than the rest
        assert formula - low <= sorted(replays)[1], (schedule, replays)
        got[schedule] = min(map(measured_bubble, steps))
        assert formula - low <= got[schedule] <= formula + high, (schedule, got, want)
    print(load or "idle", {s: round(g, 3) for s, g in got.items()})
    assert got["1f1b"] > max(got["interleaved_1f1b"], got["zero_bubble"]), got
    assert got["interleaved_1f1b"] > got["zero_bubble"], got
