"""Model parallelism by hand on 4 gloo ranks: a 4-stage split and a 2x2 data x model grid,
both checked against one process running the unsplit model on the whole batch."""

from __future__ import annotations

import copy

import pytest
import torch
from distributed import run_ranks
from torch import nn

from labkit.parallel.layer_split import (
    all_reduce_gradients,
    forward_backward_step,
    grid_groups,
    split_boundaries,
    split_sequential,
    train_step,
)

ATOL = 1e-6


def test_split_boundaries_and_errors() -> None:
    assert split_boundaries(7, 3) == [0, 3, 5, 7]
    assert split_boundaries(4, 4) == [0, 1, 2, 3, 4]
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(5)])
    parts = split_sequential(model, 2, [0, 1, 5])
    assert [len(p) for p in parts] == [1, 4] and parts[0][0] is model[0]  # shares parameters
    with pytest.raises(ValueError, match=r"num_stages must be in \[1, 5\], got 6"):
        split_sequential(model, 6)
    with pytest.raises(ValueError, match="3 increasing integers from 0 to 5"):
        split_sequential(model, 2, [0, 3, 3])


def _setup() -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(5, 12), nn.ReLU(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 4),
    )  # fmt: skip
    return model, torch.randn(8, 5), torch.randn(8, 4)


def _grad_err(stage: nn.Module, model: nn.Module, ref_grads: dict) -> float:
    names = {id(p): n for n, p in model.named_parameters()}
    errs = [(p.grad - ref_grads[names[id(p)]]).abs().max().item() for p in stage.parameters()]
    return max(errs, default=0.0)  # a stage may hold only an activation (no parameters)


def _model_rank(rank: int, world_size: int) -> dict:
    model, x, y = _setup()
    ref = copy.deepcopy(model)
    ref_loss = nn.functional.mse_loss(ref(x), y)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    out: dict = {"ref_loss": ref_loss.item()}

    # 4 stages over the whole world
    stage = split_sequential(model, world_size)[rank]
    loss = forward_backward_step(stage, x, y, nn.functional.mse_loss)
    out["split"] = (None if loss is None else loss.item(), _grad_err(stage, model, ref_grads))

    # one SGD step on the split model moves every parameter as on the unsplit one
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_opt.step()
    params = list(stage.parameters())
    opt = torch.optim.SGD(params, lr=0.1) if params else None  # stage 2 is a lone Tanh
    train_step(stage, opt, x, y, nn.functional.mse_loss)
    ref_params = dict(ref.named_parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    out["step_err"] = max(
        ((p - ref_params[names[id(p)]]).abs().max().item() for p in stage.parameters()),
        default=0.0,
    )

    # 2 replicas x 2 stages: each replica sees half the batch; gradients averaged over replicas
    try:
        grid_groups(3, 2)
    except ValueError as e:
        out["error"] = str(e)
    grid = grid_groups(2, 2)
    model, x, y = _setup()  # fresh weights: the SGD step above moved them
    stage = split_sequential(model, 2)[grid.mp_rank]
    half = slice(4 * grid.dp_rank, 4 * grid.dp_rank + 4)
    loss = forward_backward_step(stage, x[half], y[half], nn.functional.mse_loss, grid.mp_group)
    before = _grad_err(stage, model, ref_grads)
    all_reduce_gradients(stage, grid.dp_group)
    out["grid"] = {
        "coords": (grid.dp_rank, grid.mp_rank),
        "loss": None if loss is None else loss.item(),
        "grad_err_before": before,
        "grad_err": _grad_err(stage, model, ref_grads),
    }
    return out


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_ranks(_model_rank, 4)


@pytest.mark.timeout(120)
def test_split_over_four_ranks_equals_unsplit(four_ranks: list[dict]) -> None:
    for rank, res in enumerate(four_ranks):
        loss, err = res["split"]
        assert err < ATOL and res["step_err"] < ATOL
        if rank == 3:
            assert loss == pytest.approx(res["ref_loss"], abs=ATOL)
        else:
            assert loss is None


@pytest.mark.timeout(120)
def test_two_by_two_grid_equals_unsplit(four_ranks: list[dict]) -> None:
    grids = [res["grid"] for res in four_ranks]
    assert [g["coords"] for g in grids] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(g["grad_err"] < ATOL for g in grids), grids
    assert all(g["grad_err_before"] > 1e-3 for g in grids)  # the all_reduce did the work
    replica_losses = [g["loss"] for g in grids if g["loss"] is not None]
    assert len(replica_losses) == 2  # the last stage of each replica
    assert sum(replica_losses) / 2 == pytest.approx(four_ranks[0]["ref_loss"], abs=ATOL)
    assert all("must equal world_size=4, got 3x2" in res["error"] for res in four_ranks)
