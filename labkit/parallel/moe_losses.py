"""Mixture of experts, continued: the balancing losses, the loss-free bias, shared experts and
the two gradient groups of an expert-parallel model (runs on ranks; the single-process
references also run in one process). The layer itself is `expert_parallel.py`'s.

Load-balancing loss (Switch Transformer, GShard; Megatron-core's `switch_load_balancing_loss_func`
normalises it the same way). T tokens, E experts, top-k routing, p_t = softmax(z_t):
    f_i = c_i / (T * k)      c_i = slots routed to expert i by the hard top-k: a count, no gradient
    P_i = (1/T) sum_t p_ti   the mean router probability of expert i: differentiable
    L_aux = E * sum_i f_i * P_i
Both f and P sum to 1. Perfect balance (f_i = 1/E) gives L_aux = E * sum_i P_i / E = 1 whatever
P is; all slots on one expert with probability 1 gives E. Hugging Face's Mixtral loss counts f
per slot (each of the k rows sums to 1), which is k * L_aux; GShard's top-2 gate (fairscale's,
DeepSpeed's) counts each token's first choice only, another loss. Since f is a count, the
gradient flows through P alone:
    dL_aux / dz_tj = (E / T) * p_tj * (f_j - sum_i f_i p_ti)
so a token's logit of an expert that is loaded above the token's f-weighted average goes down.

Router z-loss (ST-MoE): L_z = (1/T) sum_t logsumexp(z_t)^2, with dL_z/dz_tj = (2/T) lse_t p_tj.
It keeps the logits small (routing only sees their differences, and the larger the logits the
coarser the differences a format keeps: bf16 steps are 0.5 near 64), and it is a mean over
tokens.

Over data-parallel ranks both are statistics of the whole batch: c_i, T and S_i = sum_t p_ti
are sums over the ranks (an all_reduce of E + 1 numbers and of the E probability sums), and
L_aux is a product of two such means, so the mean of per-rank L_aux is another number whenever
the ranks route differently. With DDP's convention (every rank's loss is averaged, and so are
its gradients), rank r's share of the global loss is
    l_r = (n * E / T) * sum_i f_i * S_ri            f_i and T global, S_ri over rank r's tokens
whose mean over the n ranks is L_aux exactly, and whose averaged gradients are dL_aux exactly
(`dp_aux_loss`); the same for the z-loss, l_r = (n / T) * sum_{t in r} lse_t^2 (`dp_z_loss`),
which matters only where ranks hold different numbers of tokens.

Loss-free balancing (DeepSeek-V3, after Wang et al. 2024, "Auxiliary-loss-free load balancing"):
scores s_t = sigmoid(z_t); a per-expert bias b chooses the experts, top-k of s_t + b, but the
weights stay the scores' own, s_tj / sum of the chosen s_t (`route_biased`). After each step
b_i += rate * sign(mean(c) - c_i) from the counts c of the whole batch (`update_bias`): an
overloaded expert becomes less attractive, without a gradient; every step is exactly rate (0.001
in DeepSeek-V3, Megatron-core and torchtitan), however far off the load. Megatron-core and
torchtitan all-reduce the counts over the data- (and context-, tensor-) parallel ranks first
(torchtitan also subtracts the mean of the update); from local counts the ranks' biases drift
apart.

Shared experts (DeepSeek-MoE, DeepSeek-V3): y = shared(x) + sum_j w_j expert_{e_j}(x); the shared
expert runs on every token, beside the routed ones (`SharedMoE`).

Gradient groups. With expert parallelism over an `ep` axis and data parallelism over a `dp`
axis (4 ranks: 2 x 2), every rank holds its own tokens, a replica of the dense parameters (gate,
shared expert) and E / ep of the routed experts; rank (d, e) holds the same experts as (d', e).
Expert j's gradient on its holder already sums the tokens of its whole ep group (they came
by all_to_all), so:
- dense parameters: averaged over all n = dp * ep ranks (every rank saw other tokens);
- expert parameters: summed over the dp ranks that hold a replica of the same experts, and
  divided by the same n (Megatron-core reduces them over its expert data-parallel group and
  scales them by 1 / the dense data-parallel size; torchtitan set the experts' FSDP gradient
  divide factor to the dense one in 2025 (#1551), and since 2026 divides no gradient at all,
  the loss by the whole batch's token count). Divided by the dp group's size instead (FSDP2's
  default on the experts' smaller mesh), they are ep times too large.
DDP around the whole model treats every parameter as a replica: when built it broadcasts rank
0's parameters (so the other ep ranks' experts are overwritten), and in backward it averages
each expert's gradient with those of the different experts that sit in the same place on the
other ep ranks: expert j gets the sum of its own gradient and theirs. `reduce_gradients` does
it right.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit.parallel.expert_parallel import Expert, ExpertParallelMoE, MoE, Routing, route

__all__ = [
    "AuxStats",
    "ExpertParallelSharedMoE",
    "SharedMoE",
    "aux_loss",
    "aux_loss_grad",
    "aux_stats",
    "dp_aux_loss",
    "dp_z_loss",
    "expert_fractions",
    "reduce_gradients",
    "route_biased",
    "update_bias",
    "z_loss",
]

Group = dist.ProcessGroup | None


def expert_fractions(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """f: the share of the T*k slots routed to each expert, from the hard top-k indices."""
    counts = torch.bincount(experts.reshape(-1), minlength=num_experts)
    return counts.float() / experts.numel()


def aux_loss(logits: torch.Tensor, k: int) -> torch.Tensor:
    """E * sum_i f_i P_i of one batch of router logits [T, E] (one process, or one rank alone)."""
    num_experts = logits.shape[-1]
    experts, _ = route(logits, k)
    f = expert_fractions(experts, num_experts)
    return num_experts * (f * F.softmax(logits, dim=-1).mean(dim=0)).sum()


def aux_loss_grad(logits: torch.Tensor, k: int) -> torch.Tensor:
    """dL_aux/dlogits from the closed form (E/T) p_tj (f_j - sum_i f_i p_ti), no autograd."""
    num_experts, tokens = logits.shape[-1], logits.shape[0]
    f = expert_fractions(route(logits, k).experts, num_experts)
    p = F.softmax(logits, dim=-1)
    return num_experts / tokens * p * (f - (p * f).sum(dim=-1, keepdim=True))


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Router z-loss: the mean over tokens of logsumexp(logits)^2."""
    return torch.logsumexp(logits, dim=-1).square().mean()


class AuxStats(NamedTuple):
    """The whole batch's routing statistics, the same on every rank."""

    counts: torch.Tensor  # [E] slots per expert, summed over the ranks
    tokens: int  # T, summed over the ranks


def aux_stats(logits: torch.Tensor, k: int, group: Group = None) -> AuxStats:
    """All-reduce this rank's slot counts and token count (one call of E + 1 numbers). Every
    rank of `group` must call it."""
    num_experts = logits.shape[-1]
    experts, _ = route(logits.detach(), k)
    local = torch.bincount(experts.reshape(-1), minlength=num_experts)
    both = torch.cat([local, local.new_tensor([len(logits)])])
    dist.all_reduce(both, group=group)
    return AuxStats(both[:-1], int(both[-1]))


def dp_aux_loss(logits: torch.Tensor, k: int, group: Group = None) -> torch.Tensor:
    """This rank's share l_r = (n E / T) sum_i f_i S_ri of the whole batch's aux loss: its mean
    over the ranks is L_aux of all their tokens together and DDP's averaged gradients are
    dL_aux (see the module docstring). Every rank of `group` must call it."""
    n, num_experts = dist.get_world_size(group), logits.shape[-1]
    counts, tokens = aux_stats(logits, k, group)
    f = counts.float() / (tokens * k)
    prob_sums = F.softmax(logits, dim=-1).sum(dim=0)  # S_r: this rank's tokens only
    return n * num_experts / tokens * (f * prob_sums).sum()


def dp_z_loss(logits: torch.Tensor, group: Group = None) -> torch.Tensor:
    """This rank's share (n / T) sum_{t in r} lse_t^2 of the whole batch's z-loss (T over all
    ranks). Every rank of `group` must call it."""
    tokens = torch.tensor([len(logits)], device=logits.device)
    dist.all_reduce(tokens, group=group)
    n = dist.get_world_size(group)
    return n / int(tokens) * torch.logsumexp(logits, dim=-1).square().sum()


def route_biased(logits: torch.Tensor, bias: torch.Tensor, k: int) -> Routing:
    """DeepSeek-V3's routing: scores sigmoid(logits); experts = top-k of scores + bias; weights =
    the chosen scores (bias not added), normalised to sum to 1 per token."""
    scores = torch.sigmoid(logits)
    experts = (scores + bias).topk(k, dim=-1).indices
    weights = scores.gather(-1, experts)
    return Routing(experts, weights / weights.sum(dim=-1, keepdim=True))


def update_bias(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> torch.Tensor:
    """b + rate * sign(mean(c) - c): overloaded experts down, underloaded up, by `rate` each."""
    counts = counts.float()
    return bias + rate * torch.sign(counts.mean() - counts)


def _combine(x: torch.Tensor, experts: nn.ModuleList, routing: Routing) -> torch.Tensor:
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        token, slot = (routing.experts == e).nonzero(as_tuple=True)
        if token.numel():
            out = out.index_add(0, token, routing.weights[token, slot, None] * expert(x[token]))
    return out


class SharedMoE(nn.Module):
    """The dense reference: a shared expert beside a top-k MoE (`routed`, expert_parallel's
    MoE) in one process. forward(x) -> (y, router logits), y = shared(x) + routed(x)."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, k: int) -> None:
        super().__init__()
        self.routed = MoE(hidden, ffn, num_experts, k)
        self.shared = Expert(hidden, ffn)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.routed.gate(x)
        routed = _combine(x, self.routed.experts, route(logits, self.routed.k))
        return self.shared(x) + routed, logits


class ExpertParallelSharedMoE(nn.Module):
    """`SharedMoE` with its routed experts spread over `ep_group` (expert_parallel's layer) and
    the gate and shared expert replicated. Runs on every rank of the ep group, each with its own
    tokens. forward(x) -> (y, router logits)."""

    def __init__(self, dense: SharedMoE, ep_group: Group = None) -> None:
        super().__init__()
        self.routed = ExpertParallelMoE(dense.routed, ep_group)
        self.shared = copy.deepcopy(dense.shared)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the gate runs twice, here for the losses and inside the layer for the routing: the
        # same numbers, and autograd adds both paths' gradients into the gate's weight
        logits = self.routed.gate(x)
        return self.shared(x) + self.routed(x), logits

    def expert_parameters(self) -> list[nn.Parameter]:
        return list(self.routed.experts.parameters())

    def dense_parameters(self) -> list[nn.Parameter]:
        experts = {id(p) for p in self.expert_parameters()}
        return [p for p in self.parameters() if id(p) not in experts]


def reduce_gradients(
    model: ExpertParallelSharedMoE, expert_group: Group, dense_group: Group = None
) -> None:
    """After backward of each rank's mean loss: dense gradients averaged over `dense_group` (all
    n ranks that hold other tokens), expert gradients summed over `expert_group` (the ranks
    holding the same experts) and divided by the same n. Every rank must call it."""
    n = dist.get_world_size(dense_group)
    for p in model.dense_parameters():
        dist.all_reduce(p.grad, group=dense_group)
        p.grad.div_(n)
    for p in model.expert_parameters():
        dist.all_reduce(p.grad, group=expert_group)
        p.grad.div_(n)  # not by the expert group's size: see the module docstring
