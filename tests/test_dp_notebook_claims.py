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


def _profiled_backward(rank: int, world_size: int) -> dict:
    """Notebook 22's overlap cell: one DDP step per hook kind under torch.profiler; the
    intervals (ms) torch recorded for backward's matmuls and the buckets' all_reduces."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)

    def hook_for(wait: bool):
        def hook(state, bucket):
            t = bucket.buffer().div_(world_size)
            fut = dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])
            if wait:
                fut.wait()
            return fut

        return hook

    torch.manual_seed(rank)
    xb = torch.randn(256, 512)
    out = {}
    for wait in (True, False):
        torch.manual_seed(0)
        layers = [torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU()) for _ in range(4)]
        ddp = DDP(torch.nn.Sequential(*layers), bucket_cap_mb=1)
        ddp.register_comm_hook(None, hook_for(wait))
        ddp(xb).square().mean().backward()  # DDP rebuilds its buckets after the first step
        ddp.zero_grad()
        loss = ddp(xb).square().mean()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss.backward()
        events = [(e.name, e.time_range.start / 1e3, e.time_range.end / 1e3) for e in prof.events()]
        out["waits" if wait else "async"] = {
            name: sorted((s, e) for n, s, e in events if n == name)
            for name in ("AddmmBackward0", "gloo:all_reduce")
        }
    return out


def _inside_ms(t: dict) -> float:
    return sum(
        max(0.0, min(a_end, m_end) - max(a_start, m_start))
        for a_start, a_end in t["gloo:all_reduce"]
        for m_start, m_end in t["AddmmBackward0"]
    )


@pytest.mark.timeout(300)
def test_an_async_comm_hook_lets_backward_matmuls_run_inside_the_all_reduce():
    """Notebook 22's claim, on torch's own records: with a hook that returns its future at once,
    matmuls of earlier layers run while a bucket's gloo all_reduce is in flight; a hook that
    waits keeps them (nearly) apart. The old check (hook returned before the all_reduce ended)
    said nothing about what backward did meanwhile."""
    rows = run_ranks(_profiled_backward, 4)
    for t in rows:
        for kind in ("waits", "async"):
            assert len(t[kind]["AddmmBackward0"]) == 4 and len(t[kind]["gloo:all_reduce"]) == 4
    inside = {k: sum(_inside_ms(t[k]) for t in rows) for k in ("waits", "async")}
    assert inside["async"] > 0 and inside["async"] > 2 * inside["waits"], inside
