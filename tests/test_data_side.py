"""The data side (notebook 43) on 4 gloo ranks: TP with one dropout seed equals one process
and keeps its replicated weights identical, seeds per rank pull them apart; the token-weighted
gradient equals one process on every rank's tokens, the mean of per-rank means does not."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_ranks

from labkit.exercises import data_side_checks
from labkit.parallel.data_side import (
    IGNORE,
    make_token_model,
    rank_sequences,
    token_batch,
    train_tokens_reference,
    train_tp_reference,
)

STEPS = 4
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks cannot import this module


def _rank(rank: int, world_size: int) -> dict:
    """Both parts on one set of ranks (each start of 4 ranks costs seconds on a busy machine)."""
    from labkit.parallel.data_side import train_tp

    torch.set_num_threads(1)
    tp = {
        (init, drop): train_tp(STEPS, init=init, dropout=drop)
        for init, drop in (("same", "same"), ("same", "per_rank"), ("per_rank", "same"))
    }
    return {"tp": tp, "tokens": _token_rank(rank, world_size)}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_rank, 4, timeout=100)


@pytest.mark.timeout(120)
def test_tp_dropout_seeds(ranks) -> None:
    ranks = [r["tp"] for r in ranks]
    ref = train_tp_reference(STEPS)
    good = [r[("same", "same")] for r in ranks]
    for out in good:
        assert out["spread"] == [0.0] * (STEPS + 1)
        for k, w in ref["weights"].items():
            assert (out["weights"][k] - w).abs().max().item() < 1e-5, k
    drift = ranks[0][("same", "per_rank")]["spread"]
    assert drift[0] == 0.0 and drift[1] > 0 and drift[-1] > drift[1]
    apart = ranks[0][("per_rank", "same")]["spread"]
    assert apart[0] > 0.1


def _token_rank(rank: int, world_size: int) -> dict:
    from labkit.parallel.data_side import mean_of_means_grads, token_weighted_grads, train_tokens

    torch.set_num_threads(1)
    inputs, targets = token_batch(rank_sequences(rank, world_size, 0))
    out = {}
    for name, fn in (("token", token_weighted_grads), ("means", mean_of_means_grads)):
        model = make_token_model(0)
        value = fn(model, inputs, targets)
        out[name] = ([p.grad.clone() for p in model.parameters()], value)
    out["train"] = train_tokens(STEPS, "token")["weights"][-1]
    out["train_means"] = train_tokens(STEPS, "mean_of_means")["weights"][-1]
    return out


@pytest.mark.timeout(120)
def test_token_weighted_equals_one_process(ranks) -> None:
    ranks = [r["tokens"] for r in ranks]
    seqs = [s for r in range(4) for s in rank_sequences(r, 4, 0)]
    inputs, targets = token_batch(seqs)
    counts = [int((token_batch(rank_sequences(r, 4, 0))[1] != IGNORE).sum()) for r in range(4)]
    assert len(set(counts)) > 1 and sum(counts) == sum(len(s) - 1 for s in seqs)
    model = make_token_model(0)
    loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    loss.backward()
    want = [p.grad for p in model.parameters()]
    ref = train_tokens_reference(STEPS, 4)["weights"][-1]
    for out in ranks:
        grads, value = out["token"]
        assert max((a - b).abs().max().item() for a, b in zip(grads, want)) < 1e-6
        assert abs(value - loss.item()) < 1e-5
        off = max((a - b).abs().max().item() for a, b in zip(out["means"][0], want))
        assert off > 1e-3
        assert max((a - b).abs().max().item() for a, b in zip(out["train"], ref)) < 1e-5
        assert max((a - b).abs().max().item() for a, b in zip(out["train_means"], ref)) > 1e-3


def test_token_batch_pads_with_ignore() -> None:
    inputs, targets = token_batch([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
    assert inputs.tolist() == [[1, 2], [4, 0]]
    assert targets.tolist() == [[2, 3], [5, IGNORE]]
    with pytest.raises(ValueError, match=r"rank must be in \[0, 4\)"):
        rank_sequences(4, 4)


# ---------------------------------------------------------------- the exercise's checker


def tw_reference(model, inputs, targets):
    loss_sum = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), reduction="sum")
    n = (targets != -100).sum().float()
    dist.all_reduce(n)
    (loss_sum / n).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)


def tw_ddp_form(model, inputs, targets):  # W * S_r / N, then the gradients averaged
    loss_sum = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), reduction="sum")
    n = (targets != -100).sum().float()
    dist.all_reduce(n)
    (dist.get_world_size() * loss_sum / n).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


def tw_rescale_mean_async(model, inputs, targets):  # the local mean, rescaled by n_r / N
    F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
    n = (targets != -100).sum().float()
    total = n.clone()
    dist.all_reduce(total, async_op=True).wait()
    works = []
    for p in model.parameters():
        p.grad *= n / total
        works.append(dist.all_reduce(p.grad, async_op=True))
    for work in works:
        work.wait()


def tw_sum_then_divide(model, inputs, targets):  # Megatron's per-token loss: N after backward
    loss_sum = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), reduction="sum")
    loss_sum.backward()
    n = (targets != -100).sum().float()
    dist.all_reduce(n)
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= n


def tw_mean_of_means(model, inputs, targets):
    F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


def tw_world_size_only(model, inputs, targets):
    F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), reduction="sum").backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def tw_local_count(model, inputs, targets):  # the count's all_reduce forgotten
    loss_sum = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), reduction="sum")
    (loss_sum / (targets != -100).sum()).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def tw_no_grad_reduce(model, inputs, targets):  # the gradients' all_reduce forgotten
    loss_sum = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), reduction="sum")
    n = (targets != -100).sum().float()
    dist.all_reduce(n)
    (loss_sum / n).backward()


def tw_local_mean_only(model, inputs, targets):  # the notebook's stub
    F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()


def tw_padding_counted(model, inputs, targets):
    loss_sum = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), reduction="sum")
    n = torch.tensor(float(targets.numel()), device=targets.device)
    dist.all_reduce(n)
    (loss_sum / n).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)


def tw_divided_twice(model, inputs, targets):
    tw_reference(model, inputs, targets)
    for p in model.parameters():
        p.grad /= dist.get_world_size()


def tw_ddp_form_summed(model, inputs, targets):
    loss_sum = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), reduction="sum")
    n = (targets != -100).sum().float()
    dist.all_reduce(n)
    (dist.get_world_size() * loss_sum / n).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)


def tw_no_wait(model, inputs, targets):
    loss_sum = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), reduction="sum")
    n = (targets != -100).sum().float()
    dist.all_reduce(n)
    (loss_sum / n).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, async_op=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (tw_reference, True, "mean over all ranks' tokens"),
        (tw_ddp_form, True, "mean over all ranks' tokens"),
        (tw_rescale_mean_async, True, "mean over all ranks' tokens"),
        (tw_sum_then_divide, True, "mean over all ranks' tokens"),
        (tw_mean_of_means, False, "the mean of the per-rank means"),
        (tw_world_size_only, False, "divided by the world size only"),
        (tw_local_count, False, "the mean of the per-rank means"),
        (tw_no_grad_reduce, False, "this rank's part only"),
        (tw_padding_counted, False, "padding counted as tokens"),
        (tw_divided_twice, False, "4 x too small"),
        (tw_ddp_form_summed, False, "4 x too large"),
        (tw_no_wait, False, "never waited for"),
        (tw_local_mean_only, False, "still this rank's own mean"),
        (lambda model, inputs, targets: None, False, "has no gradient"),
    ],
)
def test_check_token_weighted(lab, fn, ok: bool, says: str) -> None:
    verdict = data_side_checks.check_token_weighted(lab, fn)
    assert bool(verdict) is ok, verdict
    assert says in verdict.message, verdict


def test_the_solution_passes(lab) -> None:
    namespace = {"F": F, "dist": dist, "torch": torch}
    exec(data_side_checks.solution_token_weighted().code, namespace)
    assert data_side_checks.check_token_weighted(lab, namespace["token_weighted"])
