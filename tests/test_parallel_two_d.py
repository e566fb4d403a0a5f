"""FSDP2 x TP on a 2 x 2 DeviceMesh of 4 gloo ranks against one process training the same MLP
on the whole batch: every rank's pieces of the weights after two SGD steps, which piece each
rank holds (placements on both axes), and which group each collective of a step ran in, with
its bytes, against the per-axis formula."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks

from labkit.parallel.two_d import (
    axis_bytes,
    axis_groups,
    batch_rows,
    fsdp_unit_bytes,
    local_piece,
    make_2d_mesh,
    parallelize_2d,
    train_step,
)
from labkit.rank import trace

HIDDEN, BATCH, LR = 256, 128, 0.5


def _digits_model(seed: int):
    from labkit.parallel.data_parallel import make_mlp

    return make_mlp(seed, hidden=HIDDEN)


def _two_d_rank(rank: int, world_size: int) -> dict:
    import labkit.rank.placement_probe as lp
    from labkit.parallel.datasets import load_digits

    torch.set_num_threads(1)
    X, y = load_digits()
    trace.install()
    mesh = make_2d_mesh("cpu", 2, 2)
    dp_rank = mesh.get_local_rank("dp")
    model = parallelize_2d(_digits_model(0), mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref = _digits_model(0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    init = {n: p.detach().clone() for n, p in ref.named_parameters()}
    out: dict = {"comm": None, "losses": []}
    for step in range(2):
        batch = torch.arange(BATCH * step, BATCH * (step + 1))
        mine = batch[batch_rows(BATCH, dp_rank, 2)]
        trace.begin_cell(step + 1, rank)
        loss = train_step(model, opt, X[mine], y[mine])
        if step == 0:
            out["comm"] = [(r.op, r.bytes, r.group) for r in trace.records(1) if r.kind == "comm"]
        out["losses"].append((loss.item(), train_step(ref, ref_opt, X[batch], y[batch]).item()))
    full = dict(ref.named_parameters())
    out["err"] = {
        n: (p.to_local() - local_piece(p, full[n].detach())).abs().max().item()
        for n, p in model.named_parameters()
    }
    out["moved"] = min((full[n] - init[n]).abs().max().item() for n in full)
    out["place"] = {r["qualname"]: (r["placements"], r["shard"]) for r in lp.describe_model(model)}
    out["groups"] = {
        axis: tuple(torch.distributed.get_process_group_ranks(mesh.get_group(axis)))
        for axis in ("dp", "tp")
    }
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_two_d_rank, 4, timeout=240)


@pytest.mark.timeout(300)
def test_two_steps_equal_one_process(ranks: list[dict]) -> None:
    for rank, res in enumerate(ranks):
        assert res["moved"] > 1e-3  # the steps changed every tensor: the comparison means something
        assert max(res["err"].values()) < 1e-6, (rank, res["err"])
    # a dp group's two halves average to the whole batch's loss
    for step in range(2):
        halves = [ranks[r]["losses"][step][0] for r in (0, 2)]
        assert abs(sum(halves) / 2 - ranks[0]["losses"][step][1]) < 1e-5


@pytest.mark.timeout(300)
def test_each_rank_holds_one_piece_on_both_axes(ranks: list[dict]) -> None:
    for rank, res in enumerate(ranks):
        dp, tp = divmod(rank, 2)
        assert res["groups"] == {"dp": (tp, tp + 2), "tp": (2 * dp, 2 * dp + 1)}
        placements, shard = res["place"]["0.weight"]
        assert placements == ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]
        start = tp * HIDDEN // 2 + dp * HIDDEN // 4  # the tp slice, cut again by dp
        assert shard == [(0, start, start + HIDDEN // 4)]
        assert res["place"]["2.weight"] == (
            ["Shard(dim=0)", "Shard(dim=1)"],
            [(0, 5 * dp, 5 * dp + 5), (1, tp * HIDDEN // 2, (tp + 1) * HIDDEN // 2)],
        )
        assert res["place"]["2.bias"] == (
            ["Shard(dim=0)", "Replicate()"],
            [(0, 5 * dp, 5 * dp + 5)],
        )


@pytest.mark.timeout(300)
def test_per_axis_collectives_and_bytes(ranks: list[dict]) -> None:
    units = [
        fsdp_unit_bytes([(HIDDEN, 64), (HIDDEN,)], [0, 0], tp=2, dp=2),
        fsdp_unit_bytes([(10, HIDDEN), (10,)], [1, None], tp=2, dp=2),
    ]
    assert units == [(128 * 64 + 128) * 4, (10 * 128 + 10) * 4]
    activation = BATCH // 2 * 10 * 4  # the row-parallel output, [batch/dp, 10]
    want = axis_bytes(units, activation, dp=2, tp=2)
    for res in ranks:
        groups = res["groups"]
        on = {axis: [(op, b) for op, b, g in res["comm"] if g == groups[axis]] for axis in groups}
        assert len(on["dp"]) + len(on["tp"]) == len(res["comm"])  # nothing else ran
        assert on["tp"] == [("all_reduce", activation)]
        ops = sorted(op for op, _ in on["dp"])
        assert ops == ["all_gather_single"] * 4 + ["reduce_scatter_single"] * 2
        assert sum(b for _, b in on["dp"]) == want["dp"]["traced"]
        assert sum(b for _, b in on["tp"]) == want["tp"]["traced"]
    assert want["dp"]["sent"] == 0.5 * 3 * sum(units) and want["tp"]["sent"] == activation


def test_axis_groups_of_row_major_meshes() -> None:
    assert axis_groups((2, 2), 0) == [[0, 2], [1, 3]]
    assert axis_groups((2, 2), 1) == [[0, 1], [2, 3]]
    assert axis_groups((2, 3), 0) == [[0, 3], [1, 4], [2, 5]]
    assert axis_groups((2, 2, 2), 1) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    with pytest.raises(ValueError, match=r"axis must be in \[0, 2\)"):
        axis_groups((2, 2), 2)
    with pytest.raises(ValueError, match="multiple of dp=3"):
        batch_rows(128, 0, 3)
