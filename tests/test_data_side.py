"""The data side (notebook 43) on 4 gloo ranks: TP with one dropout seed equals one process
and keeps its replicated weights identical, seeds per rank pull them apart; the token-weighted
gradient equals one process on every rank's tokens, the mean of per-rank means does not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks

from labkit.parallel.data_side import (
    IGNORE,
    make_token_model,
    rank_sequences,
    token_batch,
    train_tokens_reference,
    train_tp_reference,
)

STEPS = 4


def _tp_rank(rank: int, world_size: int) -> dict:
    from labkit.parallel.data_side import train_tp

    torch.set_num_threads(1)
    return {
        (init, drop): train_tp(STEPS, init=init, dropout=drop)
        for init, drop in (("same", "same"), ("same", "per_rank"), ("per_rank", "same"))
    }


@pytest.mark.timeout(120)
def test_tp_dropout_seeds() -> None:
    ranks = run_ranks(_tp_rank, 4)
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
def test_token_weighted_equals_one_process() -> None:
    ranks = run_ranks(_token_rank, 4)
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
