"""The data side of parallel training: seeds that must match, and a loss over uneven tokens
(rank side; notebook 43).

Seeds. A random draw must be the same on two ranks exactly when the two ranks hold the same
tensor, and different when they hold different pieces of one:

- same: `DistributedSampler`'s seed (every rank permutes the whole data set with it and takes
  every W-th index; with seed + rank the shards overlap), the initial weights of replicated
  parameters (DP replicas; under TP the row-parallel bias and everything after the
  all_reduce), dropout on an activation that TP replicates (after a row-parallel layer);
- different: augmentation and dropout on a data-parallel rank's own samples, dropout inside
  the TP-sharded region (each rank's slice of the hidden features, and with sequence
  parallelism each rank's slice of the sequence after the reduce-scatter).

`TPDropoutNet` is a Megatron MLP (fc1 column-split, fc2 row-split: one all_reduce) followed by
dropout on its replicated output and a replicated head: the mask must be one mask on every
rank, or the replicated weights are pulled apart (`train_tp`).

Tokens. With sequences of uneven length, the loss one process computes on the whole batch is
the mean over all N = sum_r n_r tokens:

    L = (1/N) * sum_r S_r,   S_r = sum of rank r's token losses

Each rank taking its own mean S_r / n_r and the ranks averaging those (what DDP does with a
per-rank mean loss) gives (1/W) * sum_r S_r / n_r: a token on a rank with few tokens weighs
more. The fix weighs every token by 1/N: all_reduce the count before backward, backward on
S_r / N, and SUM the gradients (with DDP, which divides by W, backward on W * S_r / N); or
backward on S_r, SUM the gradients and divide them by N after backward (Megatron-LM's
per-token loss), which lets the count's all_reduce wait until backward is done.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit.parallel.tensor_parallel import ParallelMLP

__all__ = [
    "IGNORE",
    "VOCAB",
    "TPDropoutNet",
    "dense_forward",
    "make_dense_net",
    "make_token_model",
    "mean_of_means_grads",
    "rank_sequences",
    "replicated_spread",
    "token_batch",
    "token_loss_sum",
    "token_weighted_grads",
    "train_tokens",
    "train_tokens_reference",
    "train_tp",
    "train_tp_reference",
    "tp_batch",
]

IGNORE = -100  # F.cross_entropy's default ignore_index: padded positions carry it
VOCAB = 16
SeedMode = Literal["same", "per_rank"]
Weighting = Literal["token", "mean_of_means"]


# ------------------------------------------------------------------ seeds under TP


def make_dense_net(seed: int, dim: int = 8, hidden: int = 32, device: Any = None) -> nn.ModuleDict:
    """fc1 (dim -> hidden), fc2 (hidden -> dim), head (dim -> 1), initialised from `seed`
    (global RNG untouched): the dense model `TPDropoutNet` splits, and the one-process reference."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = nn.ModuleDict(
            {
                "fc1": nn.Linear(dim, hidden),
                "fc2": nn.Linear(hidden, dim),
                "head": nn.Linear(dim, 1),
            }
        )
    return net.to(device)


def dense_forward(net: nn.ModuleDict, x: torch.Tensor, p: float) -> torch.Tensor:
    """head(dropout(fc2(gelu(fc1(x))))): the one-process model."""
    h = net["fc2"](F.gelu(net["fc1"](x)))
    return net["head"](F.dropout(h, p, training=True))


class TPDropoutNet(nn.Module):
    """`ParallelMLP` over the default group, dropout on its output (replicated: every rank
    holds the whole of it after the all_reduce), then a replicated head. Every rank must call
    forward. fc2's bias and the head are replicated parameters: TP keeps them equal only if
    every rank computes the same thing after the all_reduce, the same dropout mask included."""

    def __init__(self, dense: nn.ModuleDict, p: float) -> None:
        super().__init__()
        self.mlp = ParallelMLP(dense["fc1"], dense["fc2"], nn.GELU())
        self.head = nn.Linear(dense["head"].in_features, 1, device=dense["head"].weight.device)
        self.head.load_state_dict(dense["head"].state_dict())
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.dropout(self.mlp(x), self.p, training=True))

    def replicated(self) -> list[torch.Tensor]:
        return [self.mlp.fc2.bias, self.head.weight, self.head.bias]


def replicated_spread(net: TPDropoutNet) -> float:
    """max over the replicated weights of max_r(w) - min_r(w); the same on every rank.
    Every rank must call it (one all_gather)."""
    flat = torch.cat([t.detach().reshape(-1) for t in net.replicated()])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    stacked = torch.stack(every)
    return (stacked.amax(0) - stacked.amin(0)).max().item()


def tp_batch(step: int, batch: int = 16, dim: int = 8, device: Any = None) -> tuple[Any, Any]:
    """The step's inputs and targets, from their own generator (the global RNG is left to
    dropout): the same on every rank, as TP needs."""
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(batch, dim, generator=g)
    y = x.sum(1, keepdim=True).sin()
    return x.to(device), y.to(device)


def train_tp(
    steps: int,
    init: SeedMode = "same",
    dropout: SeedMode = "same",
    seed: int = 0,
    p: float = 0.3,
    lr: float = 0.1,
    device: Any = None,
) -> dict[str, Any]:
    """SGD on `TPDropoutNet` over the default group; every rank must call it alike.

    init="same": every rank builds the dense model from `seed` and keeps its slices;
    "per_rank": from seed + rank (so the replicated weights differ from the start).
    dropout="same": torch.manual_seed(seed) on every rank before training; "per_rank":
    seed + rank (the mistake: every rank drops different units of the one replicated tensor).
    Returns spread (after each step, and before the first), the loss per step, and the full
    weights (the shards all-gathered, the replicated ones as this rank holds them).
    """
    for name, mode in (("init", init), ("dropout", dropout)):
        if mode not in ("same", "per_rank"):
            raise ValueError(f"{name} must be 'same' or 'per_rank', got {mode!r}")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dense = make_dense_net(seed + (rank if init == "per_rank" else 0), device=device)
    net = TPDropoutNet(dense, p)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    torch.manual_seed(seed + (rank if dropout == "per_rank" else 0))  # CPU and every GPU
    spread, losses = [replicated_spread(net)], []
    for step in range(steps):
        x, y = tp_batch(step, device=device)
        loss = F.mse_loss(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        spread.append(replicated_spread(net))
        losses.append(loss.item())

    def gather(t: torch.Tensor, dim: int) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(world_size)]
        dist.all_gather(parts, t.detach().contiguous())
        return torch.cat(parts, dim).cpu()

    fc1, fc2 = net.mlp.fc1, net.mlp.fc2
    weights = {
        "fc1.weight": gather(fc1.weight, 0),
        "fc1.bias": gather(fc1.bias, 0),
        "fc2.weight": gather(fc2.weight, 1),
        "fc2.bias": fc2.bias.detach().cpu(),
        "head.weight": net.head.weight.detach().cpu(),
        "head.bias": net.head.bias.detach().cpu(),
    }
    return {"spread": spread, "loss": losses, "weights": weights}


def train_tp_reference(
    steps: int, seed: int = 0, p: float = 0.3, lr: float = 0.1, device: Any = None
) -> dict[str, Any]:
    """One process, the dense model, the same batches and torch.manual_seed(seed) before
    training: what `train_tp` with both seeds "same" must equal. Run it on the ranks' device
    type: a GPU draws dropout masks from its own generator, not the CPU's."""
    net = make_dense_net(seed, device=device)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    torch.manual_seed(seed)
    losses = []
    for step in range(steps):
        x, y = tp_batch(step, device=device)
        loss = F.mse_loss(dense_forward(net, x, p), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    weights = {k: v.detach().cpu() for k, v in net.state_dict().items()}
    return {"loss": losses, "weights": weights}


# ------------------------------------------------------------------ a loss over uneven tokens


def make_token_model(seed: int, dim: int = 8, device: Any = None) -> nn.Sequential:
    """A bigram language model, Embedding(VOCAB, dim) then Linear(dim, VOCAB), from `seed`
    (global RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Embedding(VOCAB, dim), nn.Linear(dim, VOCAB))
    return model.to(device)


def rank_sequences(rank: int, world_size: int, seed: int = 0) -> list[torch.Tensor]:
    """Rank `rank`'s sequences of tokens for data seed `seed`: 3 of them, lengths drawn from
    [2, 6 * (rank + 1)], so a later rank tends to hold many more tokens (uneven on purpose)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    g = torch.Generator().manual_seed(seed * 1_000 + rank)
    lengths = torch.randint(2, 6 * (rank + 1) + 1, (3,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def token_batch(sequences: list[torch.Tensor], device: Any = None) -> tuple[Any, Any]:
    """(inputs, targets) of shape (len(sequences), longest - 1): each sequence predicts its
    next token; past a sequence's end the input is token 0 and the target IGNORE."""
    width = max(len(s) for s in sequences) - 1
    inputs = torch.zeros(len(sequences), width, dtype=torch.int64)
    targets = torch.full((len(sequences), width), IGNORE, dtype=torch.int64)
    for i, s in enumerate(sequences):
        inputs[i, : len(s) - 1] = s[:-1]
        targets[i, : len(s) - 1] = s[1:]
    return inputs.to(device), targets.to(device)


def token_loss_sum(model: nn.Module, inputs: Any, targets: Any) -> tuple[Any, Any]:
    """(sum of the token losses, number of real tokens) of this batch; padding counts for
    neither (IGNORE)."""
    logits = model(inputs)
    total = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    return total, (targets != IGNORE).sum()


def mean_of_means_grads(model: nn.Module, inputs: Any, targets: Any) -> None:
    """The mistake: backward on this rank's token mean, then average the gradients over the
    ranks (all_reduce SUM, / W), which is DDP with a per-rank mean loss. Every rank must call it."""
    logits = model(inputs)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()  # mean over n_r tokens
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def token_weighted_grads(model: nn.Module, inputs: Any, targets: Any) -> float:
    """The fix: N = all_reduce of the token counts, backward on S_r / N, gradients SUMMED (the
    division by N is already in the loss). Leaves the gradient of the mean over all N tokens in
    every p.grad and returns that mean loss (the same on every rank). Every rank must call it."""
    loss_sum, count = token_loss_sum(model, inputs, targets)
    total = count.to(loss_sum.dtype)
    dist.all_reduce(total)  # N, before backward: the loss needs it
    (loss_sum / total).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)  # SUM: each rank's part is already over N
    mean = loss_sum.detach() / total
    dist.all_reduce(mean)
    return mean.item()


def train_tokens(
    steps: int, weighting: Weighting, lr: float = 0.5, seed: int = 0, device: Any = None
) -> dict[str, Any]:
    """SGD on `make_token_model(seed)` over the default group, step s on data seed s; every
    rank must call it alike. Returns the weights after each step (on the CPU)."""
    if weighting not in ("token", "mean_of_means"):
        raise ValueError(f"weighting must be 'token' or 'mean_of_means', got {weighting!r}")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = make_token_model(seed, device=device)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    weights = []
    for step in range(steps):
        inputs, targets = token_batch(rank_sequences(rank, world_size, step), device)
        opt.zero_grad(set_to_none=True)
        if weighting == "token":
            token_weighted_grads(model, inputs, targets)
        else:
            mean_of_means_grads(model, inputs, targets)
        opt.step()
        weights.append([p.detach().cpu().clone() for p in model.parameters()])
    return {"weights": weights}


def train_tokens_reference(
    steps: int, world_size: int, lr: float = 0.5, seed: int = 0
) -> dict[str, Any]:
    """One process on every rank's sequences of each step padded into one batch, with
    F.cross_entropy's own mean (over the targets that are not IGNORE)."""
    model = make_token_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    weights = []
    for step in range(steps):
        seqs = [s for r in range(world_size) for s in rank_sequences(r, world_size, step)]
        inputs, targets = token_batch(seqs)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
        opt.step()
        weights.append([p.detach().clone() for p in model.parameters()])
    return {"weights": weights}
