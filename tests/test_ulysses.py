"""Ulysses attention and ring attention's backward (labkit.parallel.ulysses) on 4 gloo ranks
against attention computed in one process by autograd: outputs and gradients, with multi-head
and grouped-query attention; the head-count limit; the bytes formulas. The ranks are spawned
once for the module (`ranks`): each rank runs every case in turn and returns all the answers,
which the tests then check one case each."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from labkit.parallel import ulysses as uly
from labkit.parallel.context_parallel import attention
from tests.distributed import run_ranks

S, H, D = 32, 8, 4
ULYSSES_CASES = [(8, False), (4, False), (2, True)]  # (KV heads, replicate them first)


def _inputs(kv_heads):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(S, H, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(S, kv_heads, D, generator=g, dtype=torch.float64) for _ in range(2))
    w = torch.randn(S, H, D, generator=g, dtype=torch.float64)
    return q, k, v, w


def _ring_inputs():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(S, D, generator=g, dtype=torch.float64) for _ in range(4)]


def _ulysses_case(rank, world_size, kv_heads, replicate):
    q, k, v, w = _inputs(kv_heads)
    rows = slice(rank * S // world_size, (rank + 1) * S // world_size)
    q, k, v = (t[rows].clone().requires_grad_() for t in (q, k, v))
    kk, vv = (uly.replicate_kv(t, world_size) for t in (k, v)) if replicate else (k, v)
    out = uly.ulysses_attention(q, kk, vv, causal=True)
    (out * w[rows]).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _too_few_heads():
    q = torch.randn(4, 8, 2)
    try:
        uly.ulysses_attention(q, q[:, :2], q[:, :2])
    except ValueError as e:
        return str(e)
    return "no error"


def _ring_case(rank, world_size, causal):
    q, k, v, w = _ring_inputs()
    rows = slice(rank * S // world_size, (rank + 1) * S // world_size)
    q, k, v = (t[rows].clone().requires_grad_() for t in (q, k, v))
    (uly.RingAttention.apply(q, k, v, causal) * w[rows]).sum().backward()
    return q.grad, k.grad, v.grad


def _short_case(rank, world_size):
    q, k, v, w = _ring_inputs()
    rows = slice(rank * S // world_size, (rank + 1) * S // world_size)
    fwd = uly.ring_attention(q[rows], k[rows], v[rows], "contiguous")
    return uly.ring_attention_backward(
        q[rows], k[rows], v[rows], fwd.out, fwd.lse, w[rows], last_hop=False
    )


def _every_case(rank, world_size):
    """One rank's answers to every case, in one process group (the spawn is the slow part)."""
    return {
        "ulysses": {case: _ulysses_case(rank, world_size, *case) for case in ULYSSES_CASES},
        "too_few_heads": _too_few_heads(),
        "ring": {causal: _ring_case(rank, world_size, causal) for causal in (True, False)},
        "short": _short_case(rank, world_size),
    }


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_every_case, 4, timeout=150)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("kv_heads", "replicate"), ULYSSES_CASES)
def test_ulysses_equals_one_process(ranks, kv_heads, replicate):
    q, k, v, w = _inputs(kv_heads)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    ).transpose(0, 1)
    (ref * w).sum().backward()
    got = [r["ulysses"][(kv_heads, replicate)] for r in ranks]
    for name, want, i in (("out", ref.detach(), 0), ("dq", q.grad, 1), ("dk", k.grad, 2)):
        torch.testing.assert_close(torch.cat([g[i] for g in got]), want, msg=name)
    torch.testing.assert_close(torch.cat([g[3] for g in got]), v.grad)


@pytest.mark.timeout(180)
def test_kv_heads_must_divide(ranks):
    assert all("KV heads 2 must both divide by 4" in r["too_few_heads"] for r in ranks)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("causal", [True, False])
def test_ring_backward_equals_autograd(ranks, causal):
    q, k, v, w = _ring_inputs()
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    (attention(q, k, v, causal) * w).sum().backward()
    for i, want in enumerate((q.grad, k.grad, v.grad)):
        torch.testing.assert_close(torch.cat([r["ring"][causal][i] for r in ranks]), want)


def test_bytes_by_hand():
    # S=64, P=4, H=8, H_kv=8, d=16, float32: 3/4 of four [16, 8, 16] tensors, 2048 floats each
    assert uly.ulysses_bytes(64, 4, 8, 8, 16, 4) == 4 * 3 * 512 * 4
    assert uly.ring_backward_bytes(64, 4, 16, 16, 4) == 7 * 16 * 32 * 4
    assert math.lcm(2, 4) == uly.replicate_kv(torch.zeros(1, 2, 1), 4).shape[1]


@pytest.mark.timeout(180)
def test_one_hop_short_returns_the_next_ranks_gradient(ranks):
    q, k, v, w = _ring_inputs()
    k, v = k.clone().requires_grad_(), v.clone().requires_grad_()
    (attention(q, k, v, True) * w).sum().backward()
    c = S // 4
    for r in range(4):
        nxt = slice((r + 1) % 4 * c, ((r + 1) % 4 + 1) * c)
        torch.testing.assert_close(ranks[r]["short"][1], k.grad[nxt])
        torch.testing.assert_close(ranks[r]["short"][2], v.grad[nxt])
        assert not torch.allclose(ranks[r]["short"][1], k.grad[r * c : (r + 1) * c])
