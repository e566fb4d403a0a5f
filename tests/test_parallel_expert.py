"""Expert parallelism on 2 and 4 gloo ranks against the dense MoE in one process: outputs, the
input gradient, every expert's gradient on its owner and the gate's summed gradient, seeded,
float32; the splits are uneven and the bytes labkit's tracer records equal the formulas; each
rank's expert FLOPs (torch's FlopCounterMode) follow its load; a capped layer against the dense
one and a routing worked out by hand."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks

from labkit.parallel.expert_parallel import (
    ExpertParallelMoE,
    MoE,
    all_to_all_volume,
    capacity_keep,
    capped_moe,
    dropped_slots,
    expert_capacity,
    load_imbalance,
    rank_loads,
    route,
)
from labkit.rank import trace

ATOL = 1e-5
HIDDEN, FFN, EXPERTS, K, TOKENS = 8, 16, 8, 2, 24  # TOKENS per rank


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _comm(cell: int) -> list[tuple[str, int, str]]:
    return [(r.op, r.bytes, r.dtype) for r in trace.records(cell) if r.kind == "comm"]


def _ep_rank(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    dense = MoE(HIDDEN, FFN, EXPERTS, K)
    x_all = torch.randn(world_size * TOKENS, HIDDEN)
    w_all = torch.randn(world_size * TOKENS, HIDDEN)  # dL/dy, not uniform
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)

    x_ref = x_all.clone().requires_grad_()
    y_ref = dense(x_ref)
    (y_ref * w_all).sum().backward()

    ep = ExpertParallelMoE.from_dense(dense)
    x = x_all[mine].clone().requires_grad_()
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        ep(x)
    expert_flops = sum(
        sum(ops.values())
        for name, ops in counter.get_flop_counts().items()
        if name.rpartition(".")[0].endswith("experts")  # a local expert's module, whole
    )
    trace.install()
    trace.begin_cell(1, rank)
    y = ep(x)
    trace.begin_cell(2, rank)
    (y * w_all[mine]).sum().backward()
    trace.begin_cell(3, rank)
    gate_grad = ep.gate.weight.grad.clone()
    dist.all_reduce(gate_grad)  # replicated: the dense gradient is the sum over ranks
    out = {
        "out_err": _max_err(y.detach(), y_ref.detach()[mine]),
        "x_grad_err": _max_err(x.grad, x_ref.grad[mine]),
        "gate_grad_err": _max_err(gate_grad, dense.gate.weight.grad),
        "expert_grad_err": max(
            _max_err(p.grad, q.grad)
            for e, expert in enumerate(ep.experts)
            for p, q in zip(expert.parameters(), dense.experts[ep.first + e].parameters())
        ),
        "expert_flops": expert_flops,
        "first": ep.first,
        "num_local": len(ep.experts),
        "dispatch": ep.last,
        "forward_comm": _comm(1),
        "backward_comm": _comm(2),
    }
    return out


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request) -> list[dict]:
    return run_ranks(_ep_rank, request.param)


@pytest.mark.timeout(120)
def test_expert_parallel_equals_dense(ranks: list[dict]) -> None:
    n = len(ranks)
    for r, res in enumerate(ranks):
        assert res["out_err"] < ATOL and res["x_grad_err"] < ATOL, res
        assert res["expert_grad_err"] < ATOL and res["gate_grad_err"] < ATOL, res
        assert res["first"] == r * EXPERTS // n and res["num_local"] == EXPERTS // n


@pytest.mark.timeout(120)
def test_splits_are_uneven_and_consistent(ranks: list[dict]) -> None:
    n = len(ranks)
    matrix = [res["dispatch"].input_splits for res in ranks]
    for r, res in enumerate(ranks):
        d = res["dispatch"]
        assert sum(d.input_splits) == TOKENS * K  # every slot leaves, none dropped
        assert d.output_splits == [matrix[s][r] for s in range(n)]  # what the others sent
        assert d.received == [
            ranks[s]["dispatch"].sent_per_expert[res["first"] : res["first"] + EXPERTS // n]
            for s in range(n)
        ]
    assert len({split for row in matrix for split in row}) > 1, matrix  # really uneven


@pytest.mark.timeout(120)
def test_traced_bytes_equal_the_formula(ranks: list[dict]) -> None:
    matrix = [res["dispatch"].input_splits for res in ranks]
    volume = all_to_all_volume(matrix, HIDDEN, 4, EXPERTS)
    combine = [v.combine for v in volume]
    assert len(set(combine)) > 1, combine  # the busier rank sends more back
    for r, res in enumerate(ranks):
        v = volume[r]
        assert res["forward_comm"] == [
            ("all_to_all_single", v.counts, "int64"),
            ("all_to_all_single", v.dispatch, "float32"),
            ("all_to_all_single", v.combine, "float32"),
        ]
        assert v.counts == EXPERTS * 8 and v.dispatch == TOKENS * K * HIDDEN * 4
        own = matrix[r][r] * HIDDEN * 4
        assert v.dispatch_off_rank == v.dispatch - own and v.combine_off_rank == v.combine - own
        # backward: the gradients of the combine, then of the dispatch, splits swapped
        assert res["backward_comm"] == [
            ("all_to_all_single", v.dispatch, "float32"),
            ("all_to_all_single", v.combine, "float32"),
        ]
    assert sum(v.dispatch_off_rank for v in volume) == sum(v.combine_off_rank for v in volume)


def test_formulas_by_hand() -> None:
    v = all_to_all_volume([[3, 1], [2, 4]], hidden=2, element_size=4, num_experts=4)
    assert v[0] == (32, 32, 40, 8, 16) and v[1] == (32, 48, 40, 16, 8)
    assert load_imbalance([2, 2, 2, 2]) == 1.0 and load_imbalance([4, 0, 2, 2]) == 2.0
    assert expert_capacity(tokens=24, k=2, num_experts=8, factor=1.0) == 6
    assert expert_capacity(tokens=24, k=2, num_experts=8, factor=1.25) == 8
    assert dropped_slots([9, 6, 3, 0], capacity=6) == 3
    with pytest.raises(ValueError, match="at least one expert"):
        load_imbalance([0, 0])
    with pytest.raises(ValueError, match="capacity factor must be > 0"):
        expert_capacity(4, 1, 2, 0)


def test_capacity_keep_matches_dropped_slots() -> None:
    torch.manual_seed(1)
    experts, _ = route(torch.randn(50, 4) + torch.tensor([2.0, 0, 0, 0]), k=2)
    counts = torch.bincount(experts.flatten(), minlength=4).tolist()
    for cap in (3, 10, 25, 50):
        keep = capacity_keep(experts, 4, cap)
        assert (~keep).sum().item() == dropped_slots(counts, cap)
        kept = torch.bincount(experts[keep], minlength=4)
        assert kept.tolist() == [min(c, cap) for c in counts]
    # first choices are served before second choices
    keep = capacity_keep(experts, 4, 10)
    first = torch.bincount(experts[:, 0], minlength=4)
    assert all(keep[:, 0][experts[:, 0] == e].all() for e in range(4) if first[e] <= 10)


def test_route_and_errors() -> None:
    torch.manual_seed(0)
    experts, weights = route(torch.randn(5, 6), k=3)
    assert experts.shape == (5, 3) and torch.allclose(weights.sum(-1), torch.ones(5))
    assert (weights[:, :-1] >= weights[:, 1:]).all()
    with pytest.raises(ValueError, match=r"k must be in \[1, 6\]"):
        route(torch.randn(5, 6), k=7)
    with pytest.raises(ValueError, match=r"k must be in \[1, 4\]"):
        MoE(4, 4, 4, 0)


@pytest.mark.timeout(120)
def test_each_rank_computes_its_load(ranks: list[dict]) -> None:
    """What a rank's experts compute follows the sum of their slots: the step waits for it."""
    n = len(ranks)
    per_expert = [sum(res["dispatch"].sent_per_expert[e] for res in ranks) for e in range(EXPERTS)]
    loads = rank_loads(per_expert, n)
    assert loads == [sum(res["dispatch"].output_splits) for res in ranks]
    for load, res in zip(loads, ranks):
        assert res["expert_flops"] == load * (2 * HIDDEN * FFN + 2 * FFN * HIDDEN), (load, res)


def test_rank_loads_by_hand() -> None:
    # a hot expert beside a cold one: the experts are uneven, the ranks even
    assert load_imbalance([6, 0, 3, 3]) == 2.0
    assert rank_loads([6, 0, 3, 3], 2) == [6, 6] and load_imbalance([6, 6]) == 1.0
    assert rank_loads([4, 4, 2, 2], 2) == [8, 4] and load_imbalance([8, 4]) == pytest.approx(4 / 3)
    with pytest.raises(ValueError, match="divide the 4 experts, got 3"):
        rank_loads([1, 2, 3, 4], 3)


def test_capped_moe_drops_slots_not_tokens() -> None:
    # by hand: choices (first, second) t0 (0, 1), t1 (0, 2), t2 (0, 1), t3 (3, 0), capacity 1
    chosen = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])
    assert capacity_keep(chosen, 4, 1).tolist() == [
        [True, True],
        [False, True],
        [False, False],
        [True, False],
    ]
    torch.manual_seed(3)
    dense = MoE(HIDDEN, FFN, EXPERTS, K)
    x = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad():
        full = dense(x)
        capped, kept = capped_moe(dense, x, expert_capacity(TOKENS, K, EXPERTS, 1.0))
        experts, weights = route(dense.gate(x), K)
        n_kept = kept.sum(dim=1)
        assert {0, 1, 2} <= set(n_kept.tolist()), n_kept
        for t in range(TOKENS):
            slots = [j for j in range(K) if kept[t, j]]
            want = sum(
                (weights[t, j] * dense.experts[int(experts[t, j])](x[t]) for j in slots),
                torch.zeros(HIDDEN),
            )
            assert torch.allclose(capped[t], want, atol=1e-6)
            if len(slots) == K:
                assert torch.allclose(capped[t], full[t], atol=1e-6)
            elif slots:  # one slot of two: the other expert's weighted output, not zero
                assert capped[t].abs().max() > 1e-3 and not torch.allclose(capped[t], full[t])
            else:
                assert capped[t].abs().max() == 0


def test_route_without_normalising_keeps_the_probabilities() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 6)
    experts, weights = route(logits, k=2, normalize=False)
    assert torch.allclose(weights, logits.softmax(-1).gather(1, experts))
    assert (weights.sum(-1) < 1).all()
