"""Small offline data and seeded sharding for the data-parallel demos (runs on a rank or anywhere).

Data parallelism splits one global batch of B samples over W ranks, b = B / W each. Every rank
averages its b per-sample gradients, then the ranks average their W means:

    (1/W) * sum_r (1/b) * sum_{i in shard r} g_i  =  (1/B) * sum_i g_i

which is the whole-batch gradient only because every shard is the same size b. `partition`
therefore drops the remainder (`equal=True`), and `equal=False` gives a lopsided split that
shows what happens otherwise. Every function here is pure: the same (n, world_size, seed)
gives every rank the same permutation, so ranks agree on who owns what without talking.
"""

from __future__ import annotations

import torch

__all__ = ["batches", "load_digits", "partition", "shard_sizes"]


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """The 1,797 8x8 handwritten digits bundled with scikit-learn (no download).

    Returns X, float32 of shape (1797, 64) scaled from 0..16 to [0, 1], and y, int64 labels 0..9.
    """
    try:
        from sklearn.datasets import load_digits as _sk_load_digits
    except ImportError:
        raise ImportError(
            "load_digits needs scikit-learn, which a rank-only install (labkit[rank]) leaves "
            "out: pip install scikit-learn on this node, or labkit[lab]"
        ) from None

    data = _sk_load_digits()
    X = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    return X, y


def _check(n: int, world_size: int, rank: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if n < world_size:
        raise ValueError(f"n must be >= world_size ({world_size}) so no shard is empty, got {n}")


def shard_sizes(n: int, world_size: int, equal: bool = True) -> list[int]:
    """Sizes of the shards `partition` hands out, rank by rank.

    equal=True: n // world_size each (the remainder is dropped). equal=False: rank r gets about
    (r + 1) / (1 + 2 + ... + W) of all n samples, so the last rank holds W times the first.
    """
    _check(n, world_size, 0)
    if equal:
        return [n // world_size] * world_size
    total = world_size * (world_size + 1) // 2
    if n < total:
        raise ValueError(f"n must be >= {total} for equal=False on {world_size} ranks, got {n}")
    bounds = [round(n * (k * (k + 1) // 2) / total) for k in range(world_size + 1)]
    return [bounds[r + 1] - bounds[r] for r in range(world_size)]


def partition(n: int, world_size: int, rank: int, seed: int, equal: bool = True) -> torch.Tensor:
    """Indices (int64) of the samples this rank owns, out of range(n).

    The samples are shuffled once with `seed` and cut into contiguous shards of the sizes
    `shard_sizes` gives; shards of different ranks are disjoint. Same arguments, same shard.
    """
    _check(n, world_size, rank)
    sizes = shard_sizes(n, world_size, equal)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    start = sum(sizes[:rank])
    return perm[start : start + sizes[rank]].clone()


def batches(indices: torch.Tensor, batch_size: int, seed: int, epoch: int) -> list[torch.Tensor]:
    """This epoch's mini-batches of `indices`: reshuffled with (seed, epoch), last partial batch
    dropped so every rank with an equal shard runs the same number of steps (a rank that runs
    one step more than its peers waits forever in its extra all_reduce).
    """
    if not 1 <= batch_size <= len(indices):
        raise ValueError(f"batch_size must be in [1, {len(indices)}], got {batch_size}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    shuffled = indices[torch.randperm(len(indices), generator=g)]
    num_batches = len(indices) // batch_size
    return [shuffled[i * batch_size : (i + 1) * batch_size] for i in range(num_batches)]
