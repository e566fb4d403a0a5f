"""The MoE losses, the loss-free bias and the two gradient groups (labkit/parallel/moe_losses.py)
against single-process references: the aux loss and z-loss on cases worked out by hand and
their gradients against the closed forms; on 4 gloo ranks with uneven token counts, each rank's
share averaged equals the loss of all tokens together (value and DDP-averaged gradient), and
the per-rank losses averaged do not; the bias balances the load and stays in sync from global
counts only; on a 2 x 2 (dp, ep) mesh, `reduce_gradients` equals the dense layer's gradients
and plain DDP gives each expert the sum of two experts' gradients."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks

from labkit.exercises.moe_checks import (
    aux_cases,
    aux_mistakes,
    check_global_aux_loss,
    solution_global_aux_loss,
)
from labkit.parallel.expert_parallel import load_imbalance
from labkit.parallel.moe_losses import (
    ExpertParallelSharedMoE,
    SharedMoE,
    aux_loss,
    aux_loss_grad,
    dp_aux_loss,
    dp_z_loss,
    reduce_gradients,
    route_biased,
    update_bias,
    z_loss,
)

pytestmark = pytest.mark.timeout(180)  # each test; those on ranks say less
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the checker's ranks run its answers
E, K = 4, 2
TOKENS = [6, 10, 14, 18]  # per rank: uneven


def _logits(rank: int, tokens: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    z = torch.randn(tokens, E, generator=g)
    z[:, rank % E] += 2.0  # every rank prefers another expert
    return z


@pytest.mark.timeout(30)
def test_aux_loss_by_hand() -> None:
    one_each = torch.eye(4) * 5  # 4 tokens, each to its own expert: f = P = 1/4
    assert abs(aux_loss(one_each, 1).item() - 1.0) < 1e-6
    collapsed = torch.tensor([[50.0, 0, 0, 0]] * 4)  # every slot on expert 0 with p = 1
    assert abs(aux_loss(collapsed, 1).item() - 4.0) < 1e-5
    assert abs(z_loss(torch.zeros(3, 4)).item() - torch.log(torch.tensor(4.0)) ** 2) < 1e-6
    z = _logits(0, 12).requires_grad_()
    aux_loss(z, K).backward()
    assert torch.allclose(z.grad, aux_loss_grad(z.detach(), K), atol=1e-7)
    z.grad = None
    z_loss(z).backward()
    lse = torch.logsumexp(z.detach(), dim=-1, keepdim=True)
    assert torch.allclose(z.grad, 2 / 12 * lse * z.detach().softmax(-1), atol=1e-6)


def _dp_losses(rank: int, world_size: int) -> dict:
    z = _logits(rank, TOKENS[rank]).requires_grad_()
    (dp_aux_loss(z, K) + dp_z_loss(z)).backward()
    local = torch.stack([aux_loss(z.detach(), K), z_loss(z.detach())])
    shares = torch.stack([dp_aux_loss(z.detach(), K), dp_z_loss(z.detach())])
    dist.all_reduce(local)
    dist.all_reduce(shares)
    return {"grad": z.grad, "local_mean": local / world_size, "share_mean": shares / world_size}


@pytest.mark.timeout(120)
def test_dp_losses_equal_the_whole_batch() -> None:
    ranks = run_ranks(_dp_losses, 4)
    z = torch.cat([_logits(r, t) for r, t in enumerate(TOKENS)]).requires_grad_()
    (aux_loss(z, K) + z_loss(z)).backward()
    want = torch.stack([aux_loss(z.detach(), K), z_loss(z.detach())])
    grads = torch.cat([res["grad"] for res in ranks]) / 4  # DDP averages over the 4 ranks
    assert torch.allclose(grads, z.grad, atol=1e-6)
    for res in ranks:
        assert torch.allclose(res["share_mean"], want, atol=1e-5), (res, want)
        off = (res["local_mean"] - want).abs()
        assert off[0] > 0.05 and off[1] > 0.05, (res, want)  # per-rank losses averaged: other


@pytest.mark.timeout(30)
def test_route_biased_chooses_with_the_bias_weighs_without() -> None:
    z = _logits(1, 20)
    plain = route_biased(z, torch.zeros(E), K)
    bias = torch.tensor([0.0, -5.0, 0.0, 0.0])  # expert 1 never chosen
    biased = route_biased(z, bias, K)
    assert (plain.experts == 1).any() and not (biased.experts == 1).any()
    s = torch.sigmoid(z).gather(-1, biased.experts)
    assert torch.allclose(biased.weights, s / s.sum(-1, keepdim=True))
    assert update_bias(torch.zeros(4), torch.tensor([6, 2, 2, 2]), 0.1).tolist() == pytest.approx(
        [-0.1, 0.1, 0.1, 0.1]
    )


def _skewed_router() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 8, generator=g) * 0.5, torch.linspace(2.0, -1.5, 8)  # weight, skew


def _bias_steps(rank: int, world_size: int, steps: int, global_counts: bool) -> torch.Tensor:
    weight, skew = _skewed_router()
    bias = torch.zeros(8)
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        chosen = route_biased(torch.randn(128, 8, generator=g) @ weight + skew, bias, K).experts
        counts = torch.bincount(chosen.flatten(), minlength=8)
        if global_counts:
            dist.all_reduce(counts)
        bias = update_bias(bias, counts, 0.01)
    return bias


@pytest.mark.timeout(120)
def test_bias_balances_and_stays_in_sync_only_with_global_counts() -> None:
    weight, skew = _skewed_router()
    held_out = torch.randn(4096, 8, generator=torch.Generator().manual_seed(99)) @ weight + skew

    def imbalance(bias):
        chosen = route_biased(held_out, bias, K).experts
        return load_imbalance(torch.bincount(chosen.flatten(), minlength=8).tolist())

    biases = run_ranks(_bias_steps, 2, 80, True)
    assert imbalance(torch.zeros(8)) > 2.0 and imbalance(biases[0]) < 1.25
    assert torch.equal(biases[0], biases[1])
    local = run_ranks(_bias_steps, 2, 80, False)
    assert (local[0] - local[1]).abs().max() > 0.01


HIDDEN, FFN, EXPERTS, T = 8, 16, 4, 12


def _batch(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(world_size * T, HIDDEN, generator=g), torch.randn(
        world_size * T, HIDDEN, generator=g
    )


def _loss(y, logits, g, group=None, dp=True):
    aux = dp_aux_loss(logits, K, group) if dp else aux_loss(logits, K)
    z = dp_z_loss(logits, group) if dp else z_loss(logits)
    return (y * g).sum(dim=-1).mean() + 0.5 * aux + 0.1 * z


def _two_groups(rank: int, world_size: int, how: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    torch.manual_seed(0)
    model = ExpertParallelSharedMoE(SharedMoE(HIDDEN, FFN, EXPERTS, K), mesh["ep"].get_group())
    x_all, g_all = _batch(world_size)
    mine = slice(rank * T, (rank + 1) * T)
    if how == "ddp":
        ddp = DDP(model, init_sync=False)
        y, logits = ddp(x_all[mine])
    else:
        y, logits = model(x_all[mine])
    _loss(y, logits, g_all[mine]).backward()
    if how == "right":
        reduce_gradients(model, mesh["dp"].get_group())
    first = model.routed.first
    return {
        "experts": {
            first + e: [p.grad for p in ex.parameters()]
            for e, ex in enumerate(model.routed.experts)
        },
        "dense": [p.grad for p in model.dense_parameters()],
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["right", "ddp"])
def test_gradient_groups(how: str) -> None:
    ranks = run_ranks(_two_groups, 4, how)
    torch.manual_seed(0)
    dense = SharedMoE(HIDDEN, FFN, EXPERTS, K)
    x_all, g_all = _batch(4)
    y, logits = dense(x_all)
    _loss(y, logits, g_all, dp=False).backward()
    ref = {e: [p.grad for p in ex.parameters()] for e, ex in enumerate(dense.routed.experts)}
    ref_dense = [dense.routed.gate.weight.grad] + [p.grad for p in dense.shared.parameters()]
    half = EXPERTS // 2
    for rank, res in enumerate(ranks):
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(res["dense"], ref_dense))
        for e, grads in res["experts"].items():
            if how == "right":
                want = ref[e]
            else:  # DDP averaged expert e with the expert in its place on the other ep rank
                other = (e + half) % EXPERTS
                want = [a + b for a, b in zip(ref[e], ref[other])]
            assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads, want)), (rank, e)


# ---------------------------------------------------------------- the exercise's checker


def aux_right(logits, k):
    stats = torch.cat(
        [
            torch.bincount(logits.softmax(-1).topk(k).indices.flatten(), minlength=4).float(),
            logits.softmax(-1).sum(0),
            torch.tensor([float(len(logits))]),
        ]
    )
    dist.all_reduce(stats)
    f, p = stats[:4] / (stats[-1] * k), stats[4:8] / stats[-1]
    return 4 * (f * p).sum()


def aux_by_module(logits, k):  # labkit's shares, averaged over the ranks
    from labkit.parallel.moe_losses import dp_aux_loss

    share = dp_aux_loss(logits, k).detach()
    dist.all_reduce(share)
    return share / dist.get_world_size()


def aux_per_rank_averaged(logits, k):
    from labkit.parallel.moe_losses import aux_loss

    loss = aux_loss(logits, k).detach()
    dist.all_reduce(loss)
    return loss / dist.get_world_size()


def aux_soft_f(logits, k):
    stats = torch.cat([logits.softmax(-1).sum(0), torch.tensor([float(len(logits))])])
    dist.all_reduce(stats)
    p = stats[:4] / stats[-1]
    return 4 * (p * p).sum()


def aux_no_num_experts(logits, k):
    return aux_right(logits, k) / 4


def aux_per_token(logits, k):
    return aux_right(logits, k) * k


def aux_rank_means(logits, k):  # P as the mean of the ranks' means
    counts = torch.bincount(logits.softmax(-1).topk(k).indices.flatten(), minlength=4).float()
    stats = torch.cat([counts, torch.tensor([float(len(logits))])])
    dist.all_reduce(stats)
    p = logits.softmax(-1).mean(0)
    dist.all_reduce(p)
    return 4 * (stats[:4] / (stats[-1] * k) * p / dist.get_world_size()).sum()


def aux_first_choice(logits, k):  # GShard's top-2 gate: f from each token's first choice
    p = logits.softmax(-1)
    stats = torch.cat(
        [
            torch.bincount(p.argmax(-1), minlength=4).float(),
            p.sum(0),
            torch.tensor([float(len(logits))]),
        ]
    )
    dist.all_reduce(stats)
    return 4 * (stats[:4] / stats[-1] * stats[4:8] / stats[-1]).sum()


def aux_this_rank(logits, k):
    from labkit.parallel.moe_losses import aux_loss

    return aux_loss(logits, k)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (aux_right, True, "the whole batch's loss on every rank"),
        (aux_by_module, True, "the whole batch's loss on every rank"),
        (aux_per_rank_averaged, False, "each rank computed the loss of its own tokens"),
        (aux_soft_f, False, "f was the mean probability (soft)"),
        (aux_no_num_experts, False, "the factor num_experts is missing"),
        (aux_per_token, False, "k times the loss"),
        (aux_rank_means, False, "case 2 (tokens per rank [6, 11, 16, 21]): P was the mean"),
        (aux_this_rank, False, "every rank returned the loss of its own tokens"),
        (aux_first_choice, False, "f counted only each token's first choice"),
        (lambda logits, k: "1.0", False, "returned '1.0', expected one number"),
        (lambda logits: 1.0, False, "rank 0 raised TypeError"),
    ],
)
def test_global_aux_loss_checker(lab, fn, ok: bool, says: str) -> None:
    verdict = check_global_aux_loss(lab, fn)
    assert bool(verdict) is ok, verdict
    assert says in verdict.message, verdict


def test_global_aux_loss_solution(lab) -> None:
    ns = {"torch": torch, "dist": dist}
    exec(solution_global_aux_loss().code, ns)
    assert check_global_aux_loss(lab, ns["global_aux_loss"])


@pytest.mark.parametrize("n", [2, 4])
def test_aux_cases_tell_every_mistake_apart(n: int) -> None:
    answers = [aux_mistakes(case) for case in aux_cases(n)]
    for name in answers[0]:
        if name != "right":
            assert any(
                max(abs(a - b) for a, b in zip(m[name], m["right"])) > 1e-3 for m in answers
            ), (n, name)
