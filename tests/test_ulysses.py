"""Ulysses attention and ring attention's backward (labkit.parallel.ulysses) on 4 gloo ranks
against attention computed in one process by autograd: outputs and gradients, with multi-head
and grouped-query attention; the head-count limit; the bytes formulas."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from labkit.parallel import ulysses as uly
from labkit.parallel.context_parallel import attention
from tests.distributed import run_ranks

S, H, D = 32, 8, 4


def _inputs(kv_heads):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(S, H, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(S, kv_heads, D, generator=g, dtype=torch.float64) for _ in range(2))
    w = torch.randn(S, H, D, generator=g, dtype=torch.float64)
    return q, k, v, w


def _ulysses_rank(rank, world_size, kv_heads, replicate):
    q, k, v, w = _inputs(kv_heads)
    rows = slice(rank * S // world_size, (rank + 1) * S // world_size)
    q, k, v = (t[rows].clone().requires_grad_() for t in (q, k, v))
    kk, vv = (uly.replicate_kv(t, world_size) for t in (k, v)) if replicate else (k, v)
    out = uly.ulysses_attention(q, kk, vv, causal=True)
    (out * w[rows]).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("kv_heads", "replicate"), [(8, False), (4, False), (2, True)])
def test_ulysses_equals_one_process(kv_heads, replicate):
    q, k, v, w = _inputs(kv_heads)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    ).transpose(0, 1)
    (ref * w).sum().backward()
    got = run_ranks(_ulysses_rank, 4, kv_heads, replicate)
    for name, want, i in (("out", ref.detach(), 0), ("dq", q.grad, 1), ("dk", k.grad, 2)):
        torch.testing.assert_close(torch.cat([g[i] for g in got]), want, msg=name)
    torch.testing.assert_close(torch.cat([g[3] for g in got]), v.grad)


def _too_few_heads(rank, world_size):
    q = torch.randn(4, 8, 2)
    try:
        uly.ulysses_attention(q, q[:, :2], q[:, :2])
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(60)
def test_kv_heads_must_divide():
    assert all("KV heads 2 must both divide by 4" in m for m in run_ranks(_too_few_heads, 4))


def _ring_rank(rank, world_size, causal):
    g = torch.Generator().manual_seed(1)
    q, k, v, w = (torch.randn(S, D, generator=g, dtype=torch.float64) for _ in range(4))
    rows = slice(rank * S // world_size, (rank + 1) * S // world_size)
    q, k, v = (t[rows].clone().requires_grad_() for t in (q, k, v))
    (uly.RingAttention.apply(q, k, v, causal) * w[rows]).sum().backward()
    return q.grad, k.grad, v.grad


@pytest.mark.timeout(120)
@pytest.mark.parametrize("causal", [True, False])
def test_ring_backward_equals_autograd(causal):
    g = torch.Generator().manual_seed(1)
    q, k, v, w = (torch.randn(S, D, generator=g, dtype=torch.float64) for _ in range(4))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    (attention(q, k, v, causal) * w).sum().backward()
    got = run_ranks(_ring_rank, 4, causal)
    for i, want in enumerate((q.grad, k.grad, v.grad)):
        torch.testing.assert_close(torch.cat([x[i] for x in got]), want)


def test_bytes_by_hand():
    # S=64, P=4, H=8, H_kv=8, d=16, float32: 3/4 of four [16, 8, 16] tensors, 2048 floats each
    assert uly.ulysses_bytes(64, 4, 8, 8, 16, 4) == 4 * 3 * 512 * 4
    assert uly.ring_backward_bytes(64, 4, 16, 16, 4) == 7 * 16 * 32 * 4
    assert math.lcm(2, 4) == uly.replicate_kv(torch.zeros(1, 2, 1), 4).shape[1]


def _short_rank(rank, world_size):
    g = torch.Generator().manual_seed(1)
    q, k, v, w = (torch.randn(S, D, generator=g, dtype=torch.float64) for _ in range(4))
    rows = slice(rank * S // world_size, (rank + 1) * S // world_size)
    fwd = uly.ring_attention(q[rows], k[rows], v[rows], "contiguous")
    return uly.ring_attention_backward(
        q[rows], k[rows], v[rows], fwd.out, fwd.lse, w[rows], last_hop=False
    )


@pytest.mark.timeout(120)
def test_one_hop_short_returns_the_next_ranks_gradient():
    g = torch.Generator().manual_seed(1)
    q, k, v, w = (torch.randn(S, D, generator=g, dtype=torch.float64) for _ in range(4))
    k = k.clone().requires_grad_()
    (attention(q, k, v, True) * w).sum().backward()
    got, c = run_ranks(_short_rank, 4), S // 4
    for r in range(4):
        torch.testing.assert_close(got[r][1], k.grad[(r + 1) % 4 * c : ((r + 1) % 4 + 1) * c])
