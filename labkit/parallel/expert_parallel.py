"""Expert parallelism: a mixture-of-experts layer with its experts on different ranks (runs on
ranks; the dense reference and the formulas also run in one process).

A mixture-of-experts (MoE) layer has E experts (small MLPs) and a gate. For a token x:
    p = softmax(x G^T)                     the gate's probability for each of the E experts
    (w_1..w_k, e_1..e_k) = top-k of p      the k likeliest experts, w renormalised to sum to 1
    y = sum_j w_j * expert_{e_j}(x)
so each token runs through k experts only: E times the parameters, about k/E of the compute.

Expert parallelism puts E / n experts on each of n ranks (rank r holds experts
[r*E/n, (r+1)*E/n)), while every rank keeps its own tokens (as in data parallelism) and a
replica of the gate. A token's (token, slot) pairs must travel to the ranks of their experts
and come back. One forward on rank r:
1. route: top-k per token; flatten to T*k slots and sort the slots by expert, which also
   groups them by destination rank (experts of a rank are contiguous);
2. count exchange: `counts[e]` = slots this rank sends to expert e. all_to_all_single with
   even splits (E/n counts per rank) tells every rank how many slots each source sends to each
   of its experts. Without it a rank cannot know what it will receive;
3. dispatch: all_to_all_single of the sorted slots, input_split_sizes[d] = slots to rank d
   (this rank's counts, summed per destination), output_split_sizes[s] = slots from rank s
   (the counts received in step 2). The splits are uneven: routing decides them;
4. the local experts run on what arrived (grouped by source, then by expert);
5. combine: the reverse all_to_all_single (the two split lists swapped) brings each result
   back to its token's rank, in the order it left; undo the sort and add w_j * y_j per token.
The backward of an all_to_all is the all_to_all with the splits swapped, so gradients take the
same routes backwards (`all_to_all_single` below, a small autograd Function).

Equal to one process on every rank's tokens: rank r's outputs are the dense layer's outputs of
rank r's tokens; expert e's gradient on its owner equals the dense gradient of expert e (all
the tokens routed to e came to that rank); the gate is replicated, so its gradient is a sum
over ranks (an all_reduce, as in data parallelism).

Volume (bytes; `all_to_all_volume`). C[s][d] = slots rank s sends to rank d, H the hidden size,
b the bytes per element. Every slot is sent on its own: a token whose k experts share a rank
goes there k times. Per rank r:
- dispatch buffer = sum_d C[r][d] * H * b = T_r * k * H * b: the input of the dispatch
  all_to_all_single, which labkit's trace records as its bytes (nccl-tests' S, the slots kept
  on rank r included);
- combine buffer = sum_s C[s][r] * H * b: the slots rank r's experts processed; uneven;
- off rank = the same without the diagonal C[r][r]: the bytes that really leave the rank.
  With uniform routing E[off rank] = T*k*H*b * (n-1)/n: the all_to_all busbw factor;
- count exchange = E * 8 bytes (int64 counts) per rank.
Load: what sets a step's time is the busiest *rank*, whose experts' slots add up
(`rank_loads`: slots per rank, the sum over its E/n experts), not the busiest expert. Load
imbalance = max / mean (1.0 is perfect) of the per-rank loads for the step time, of the
per-expert ones for how unevenly the gate routes; a hot expert beside a cold one on the same
rank leaves the ranks balanced. The combine buffer of the busiest rank is the largest.

Capacity: GShard/Switch-style layers cap each expert at C = ceil(factor * T*k / E) slots per
source rank and drop the slots beyond it. Which slots drop, and whether the survivors'
weights are renormalised, differs between implementations: fairscale's and DeepSpeed's top-2
gates (after GShard) serve every first choice before any second choice and renormalise over
the kept slots; Megatron-core keeps each expert's heaviest slots (drop_policy="probs", its
default) or its earliest tokens ("position") and does not renormalise. Here: GShard's order
(slot-major, `capacity_keep`), no renormalisation (`capped_moe`). A dropped slot contributes
nothing, so a token that loses one of its k slots still gets the others' weighted outputs;
only a token that loses all k keeps its residual path alone. Then every split can be exactly
C per expert, padded: all_to_all with even splits and no count exchange, at E*C*H*b bytes per
rank, and sum_e max(0, count_e - C) slots dropped. This module's layer is dropless (uneven splits,
nothing dropped); `expert_capacity`, `capacity_keep`, `dropped_slots` and `capped_moe` give
what a capped layer would do.
"""

from __future__ import annotations

import copy
import math
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = [
    "A2AVolume",
    "Dispatch",
    "Expert",
    "ExpertParallelMoE",
    "MoE",
    "Routing",
    "all_to_all_single",
    "all_to_all_volume",
    "capacity_keep",
    "dropped_slots",
    "expert_capacity",
    "capped_moe",
    "load_imbalance",
    "rank_loads",
    "route",
]

Group = dist.ProcessGroup | None


class Routing(NamedTuple):
    experts: torch.Tensor  # [T, k] expert of each (token, slot)
    weights: torch.Tensor  # [T, k] renormalised gate weights, summing to 1 per token


def route(logits: torch.Tensor, k: int, normalize: bool = True) -> Routing:
    """Top-k of softmax(logits) per token; with `normalize` the k weights are renormalised to
    sum to 1 (Mixtral), without it they stay the softmax's probabilities (Switch, k = 1)."""
    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"k must be in [1, {logits.shape[-1]}] (the number of experts), got {k}")
    probs = F.softmax(logits, dim=-1)
    weights, experts = probs.topk(k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(experts, weights)


class Expert(nn.Module):
    """One expert: fc2(gelu(fc1(x))), hidden -> ffn -> hidden."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class MoE(nn.Module):
    """The dense reference: a gate and all E experts in one process; x is [T, hidden]."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, k: int) -> None:
        super().__init__()
        if not 1 <= k <= num_experts:
            raise ValueError(f"k must be in [1, {num_experts}] (num_experts), got {k}")
        self.k, self.num_experts = k, num_experts
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden, ffn) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = route(self.gate(x), self.k)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = (experts == e).nonzero(as_tuple=True)
            if token.numel():
                out = out.index_add(0, token, weights[token, slot, None] * expert(x[token]))
        return out


class _AllToAllSingle(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list, in_splits: list, group: Group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits  # the gradient goes back the way the rows came
        return _AllToAllSingle.apply(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all_single(
    x: torch.Tensor,
    output_split_sizes: list[int],
    input_split_sizes: list[int],
    group: Group = None,
) -> torch.Tensor:
    """dist.all_to_all_single with autograd: rows x[sum(in[:d]) : sum(in[:d+1])] go to rank d;
    rank s's rows land at [sum(out[:s]), sum(out[:s+1])). Backward swaps the splits. Every rank
    of the group must call it."""
    return _AllToAllSingle.apply(x, list(output_split_sizes), list(input_split_sizes), group)


class Dispatch(NamedTuple):
    """What one forward on one rank routed (plain ints, for the kernel and the formulas)."""

    sent_per_expert: list[int]  # slots this rank sent to each of the E experts
    input_splits: list[int]  # slots sent to each rank (input_split_sizes)
    output_splits: list[int]  # slots received from each rank (output_split_sizes)
    received: list[list[int]]  # [source rank][local expert] slots received


class ExpertParallelMoE(nn.Module):
    """A MoE layer with E / n experts on each rank of `group`; tokens travel by all_to_all.

    Runs on every rank; every rank must call forward (with its own tokens, any number). After a
    forward `self.last` holds the `Dispatch` of that call.
    """

    def __init__(self, dense: MoE, group: Group = None) -> None:
        super().__init__()
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        if dense.num_experts % n:
            raise ValueError(
                f"num_experts must be a multiple of the group size {n}, got {dense.num_experts}"
            )
        self.group, self.k, self.num_experts = group, dense.k, dense.num_experts
        self.local = dense.num_experts // n
        self.first = rank * self.local  # this rank holds experts [first, first + local)
        self.gate = copy.deepcopy(dense.gate)  # replicated
        self.experts = copy.deepcopy(dense.experts[self.first : self.first + self.local])
        self.last: Dispatch | None = None

    @classmethod
    def from_dense(cls, dense: MoE, group: Group = None) -> ExpertParallelMoE:
        return cls(dense, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, local, k = dist.get_world_size(self.group), self.local, self.k
        experts, weights = route(self.gate(x), k)
        flat = experts.reshape(-1)  # slot i is token i // k
        order = torch.argsort(flat, stable=True)  # by expert, hence by destination rank
        counts = torch.bincount(flat, minlength=self.num_experts)
        # 2. the count exchange: E / n counts to each rank, even splits
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        received = received.view(n, local)  # [source rank, local expert]
        in_splits = counts.view(n, local).sum(dim=1).tolist()
        out_splits = received.sum(dim=1).tolist()
        # 3. dispatch: each slot's token to its expert's rank, uneven splits
        tokens = all_to_all_single(x[order // k], out_splits, in_splits, self.group)
        # 4. the local experts, on rows grouped [source][local expert]
        chunks = list(tokens.split(received.flatten().tolist()))
        for e, expert in enumerate(self.experts):
            ids = range(e, n * local, local)
            y = expert(torch.cat([chunks[i] for i in ids]))
            for i, part in zip(ids, y.split([len(chunks[i]) for i in ids])):
                chunks[i] = part
        # 5. combine: back the same way, undo the sort, weight and add
        back = all_to_all_single(torch.cat(chunks), in_splits, out_splits, self.group)
        slots = back[torch.argsort(order)].view(*experts.shape, -1)
        self.last = Dispatch(counts.tolist(), in_splits, out_splits, received.tolist())
        return (slots * weights.unsqueeze(-1)).sum(dim=1)


class A2AVolume(NamedTuple):
    """Bytes per rank of one expert-parallel forward (see the module docstring)."""

    counts: int  # the count exchange's input: E int64
    dispatch: int  # the dispatch's input buffer: what the trace records (self slots included)
    combine: int  # the combine's input buffer: the slots this rank's experts processed
    dispatch_off_rank: int  # bytes that leave this rank in the dispatch
    combine_off_rank: int  # bytes that leave this rank in the combine


def all_to_all_volume(
    matrix: list[list[int]], hidden: int, element_size: int, num_experts: int
) -> list[A2AVolume]:
    """Per rank r, the bytes of its all_to_alls, from matrix[s][d] = slots rank s sends to
    rank d (each rank's `Dispatch.input_splits` is its row)."""
    n, row = len(matrix), hidden * element_size
    out = []
    for r in range(n):
        sent, got, own = sum(matrix[r]), sum(matrix[s][r] for s in range(n)), matrix[r][r]
        out.append(
            A2AVolume(num_experts * 8, sent * row, got * row, (sent - own) * row, (got - own) * row)
        )
    return out


def load_imbalance(slots_per_expert: list[int]) -> float:
    """max / mean of the slots routed to each expert (1.0: every expert equally busy): how
    unevenly the gate routes. Given `rank_loads(...)` instead, the imbalance of the ranks,
    which is what sets the step's time."""
    total = sum(slots_per_expert)
    if not slots_per_expert or total == 0:
        raise ValueError("load_imbalance needs at least one expert with a routed slot")
    return max(slots_per_expert) * len(slots_per_expert) / total


def rank_loads(slots_per_expert: list[int], num_ranks: int) -> list[int]:
    """Slots each rank's experts process: rank r holds experts [r*E/n, (r+1)*E/n)."""
    num_experts = len(slots_per_expert)
    if num_ranks < 1 or num_experts % num_ranks:
        raise ValueError(
            f"num_ranks must be >= 1 and divide the {num_experts} experts, got {num_ranks}"
        )
    local = num_experts // num_ranks
    return [sum(slots_per_expert[r * local : (r + 1) * local]) for r in range(num_ranks)]


def expert_capacity(tokens: int, k: int, num_experts: int, factor: float) -> int:
    """Slots an expert may take from one rank under a capacity factor: ceil(f * T*k / E)."""
    if factor <= 0:
        raise ValueError(f"capacity factor must be > 0, got {factor}")
    return math.ceil(factor * tokens * k / num_experts)


def capacity_keep(experts: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """[T, k] bool: which slots a capped layer keeps; each expert keeps its first `capacity`
    slots in token order (slot 0 of every token before slot 1, as GShard does)."""
    flat = experts.t().reshape(-1)  # slot-major: every token's first choice goes first
    onehot = F.one_hot(flat, num_experts)
    position = (onehot.cumsum(dim=0) * onehot).sum(dim=1) - 1  # place in its expert's queue
    return (position < capacity).view(experts.shape[1], -1).t()


def capped_moe(
    moe: MoE, x: torch.Tensor, capacity: int, normalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """A capped MoE layer in one process: (output [T, hidden], kept [T, k]).

    Routes as `moe` does, keeps each expert's first `capacity` slots (`capacity_keep`) and adds
    w_j * expert_{e_j}(x) over the kept slots only; the weights are not renormalised after
    the drop. A token with every slot dropped gets 0 (its residual path alone)."""
    experts, weights = route(moe.gate(x), moe.k, normalize)
    kept = capacity_keep(experts, moe.num_experts, capacity)
    out = torch.zeros_like(x)
    for e, expert in enumerate(moe.experts):
        token, slot = ((experts == e) & kept).nonzero(as_tuple=True)
        if token.numel():
            out = out.index_add(0, token, weights[token, slot, None] * expert(x[token]))
    return out, kept


def dropped_slots(slots_per_expert: list[int], capacity: int) -> int:
    """Slots a capped layer drops: sum over experts of max(0, count - capacity)."""
    return sum(max(0, c - capacity) for c in slots_per_expert)
