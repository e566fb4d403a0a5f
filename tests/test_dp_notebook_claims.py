"""Claims the data-parallel notebooks make, checked on CPU ranks against one process."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks

from labkit.parallel.sync_batch_norm import sync_batch_norm


def _bn_inputs() -> tuple[torch.Tensor, ...]:
    # well-conditioned features (the digits have constant pixels: variance 0, error x 300)
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(96, 16, generator=g) * 3 + 1,
        torch.randn(16, generator=g),
        torch.randn(16, generator=g),
    )


def _sync_bn_rank(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    X, w, b = _bn_inputs()
    x = X[rank::world_size].clone().requires_grad_(True)
    wr, br = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
    out = sync_batch_norm(x, wr, br)
    (out * torch.arange(16.0)).pow(2).mean().backward()  # a loss that needs every gradient
    for g in (wr.grad, br.grad):  # the weight's gradient is local: sum it over ranks
        torch.distributed.all_reduce(g)
    return {"out": out.detach(), "gx": x.grad, "gw": wr.grad, "gb": br.grad}


@pytest.mark.timeout(120)
def test_sync_batch_norm_equals_batch_norm_on_the_whole_batch():
    world_size = 3
    results = run_ranks(_sync_bn_rank, world_size)
    X, w, b = _bn_inputs()
    bn = torch.nn.BatchNorm1d(16)
    with torch.no_grad():
        bn.weight.copy_(w)
        bn.bias.copy_(b)
    x = X.clone().requires_grad_(True)
    out = bn(x)
    # The same loss, as each rank computes it: a mean over its own 32 rows, summed over ranks.
    per_rank = [(out[r::world_size] * torch.arange(16.0)).pow(2).mean() for r in range(3)]
    sum(per_rank).backward()
    for r, res in enumerate(results):
        assert (res["out"] - out[r::world_size].detach()).abs().max() < 1e-5
        assert (res["gx"] - x.grad[r::world_size]).abs().max() < 1e-5
        assert (res["gw"] - bn.weight.grad).abs().max() < 1e-4
        assert (res["gb"] - bn.bias.grad).abs().max() < 1e-4
    with pytest.raises(ValueError, match="2-D"):
        sync_batch_norm(torch.zeros(2, 3, 4))
