"""Vocab parallelism, GQA under TP and the overlapped all-gather + matmul on 4 gloo ranks,
against one process: nn.Embedding, F.cross_entropy on the full logits (loss and gradient),
SDPA's own grouped-query attention, and all_gather then matmul."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_ranks

from labkit.parallel.vocab_parallel import (
    VocabParallelEmbedding,
    gqa_kv_heads,
    gqa_tp_attention,
    overlapped_all_gather_matmul,
    vocab_parallel_cross_entropy,
)

V, D, N = 32, 8, 12


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(V, D, generator=g), torch.randint(0, V, (N,), generator=g)


def _embedding(rank, world):
    torch.set_num_threads(1)
    weight, ids = _inputs()
    emb = VocabParallelEmbedding(weight)
    out = emb(ids)
    (out * torch.arange(D)).sum().backward()
    return out.detach(), emb.weight.grad


@pytest.mark.timeout(120)
def test_vocab_parallel_embedding_equals_nn_embedding():
    weight, ids = _inputs()
    ref = torch.nn.Embedding.from_pretrained(weight.clone(), freeze=False)
    (ref(ids) * torch.arange(D)).sum().backward()
    got = run_ranks(_embedding, 4)
    for out, _ in got:
        assert torch.allclose(out, ref(ids).detach(), atol=1e-6)
    assert torch.allclose(torch.cat([g for _, g in got]), ref.weight.grad, atol=1e-6)


def _cross_entropy(rank, world):
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    logits, target = 50 * torch.randn(N, V, generator=g), torch.randint(0, V, (N,), generator=g)
    c = V // world
    local = logits[:, rank * c : (rank + 1) * c].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target)
    loss.backward()
    wrong = vocab_parallel_cross_entropy(local.detach(), target, local_max=True)
    return loss.detach(), local.grad, wrong


@pytest.mark.timeout(120)
def test_vocab_parallel_cross_entropy_equals_full():
    g = torch.Generator().manual_seed(1)
    logits, target = 50 * torch.randn(N, V, generator=g), torch.randint(0, V, (N,), generator=g)
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full, target)
    ref.backward()
    got = run_ranks(_cross_entropy, 4)
    for loss, _, wrong in got:
        assert abs(loss.item() - ref.item()) < 1e-4
        assert abs(wrong.item() - ref.item()) > 1e-2  # each rank's own max: wrong
    assert torch.allclose(torch.cat([gr for _, gr, _ in got], dim=1), full.grad, atol=1e-6)


def _gqa(rank, world, kv):
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(2)
    S, H, d, Dm = 10, 8, 4, 16
    x, wq = torch.randn(S, Dm, generator=g), torch.randn(H * d, Dm, generator=g)
    wk, wv = torch.randn(kv * d, Dm, generator=g), torch.randn(kv * d, Dm, generator=g)
    wo = torch.randn(Dm, H * d, generator=g)
    return gqa_tp_attention(x, wq, wk, wv, wo, H, kv), (x, wq, wk, wv, wo)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kv", [2, 4])
def test_gqa_under_tp_equals_one_process(kv):
    got = run_ranks(_gqa, 4, kv)
    x, wq, wk, wv, wo = got[0][1]
    S, H, d = 10, 8, 4
    q, k, v = ((x @ w.T).view(S, -1, d).transpose(0, 1) for w in (wq, wk, wv))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref = o.transpose(0, 1).reshape(S, H * d) @ wo.T
    for out, _ in got:
        assert (out - ref).abs().max() < 1e-4


def test_gqa_kv_heads_by_hand():
    assert [gqa_kv_heads(8, 2, 4, r) for r in range(4)] == [[0], [0], [1], [1]]
    assert [gqa_kv_heads(8, 4, 4, r) for r in range(4)] == [[0], [1], [2], [3]]
    assert [gqa_kv_heads(8, 8, 2, r) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="multiple"):
        gqa_kv_heads(12, 4, 6, 0)


def _overlap(rank, world):
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(4 * world, 6, generator=g), torch.randn(6, 5, generator=g)
    mine = x[rank * 4 : (rank + 1) * 4]
    got, order = overlapped_all_gather_matmul(mine, w)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    return got, torch.cat(gathered) @ w, x @ w, order


@pytest.mark.timeout(120)
def test_overlapped_all_gather_matmul_equals_plain():
    for rank, (got, plain, ref, order) in enumerate(run_ranks(_overlap, 4)):
        assert torch.allclose(got, plain, atol=1e-6) and torch.allclose(got, ref, atol=1e-5)
        assert order == [(rank - i) % 4 for i in range(4)]


def _gqa_grads(rank, world):
    torch.set_num_threads(1)
    _, (x, wq, wk, wv, wo) = _gqa(rank, world, 2)
    wk = wk.clone().requires_grad_()
    out = gqa_tp_attention(x, wq, wk, wv, wo, 8, 2)
    (out * torch.arange(16)).sum().backward()
    return wk.grad, (x, wq, wk.detach(), wv, wo)


@pytest.mark.timeout(120)
def test_replicated_kv_heads_gradients_are_partial_sums():
    got = run_ranks(_gqa_grads, 4)
    x, wq, wk, wv, wo = got[0][1]
    wk = wk.clone().requires_grad_()
    S, H, d = 10, 8, 4
    q = (x @ wq.T).view(S, H, d).transpose(0, 1)
    k, v = ((x @ w.T).view(S, 2, d).transpose(0, 1) for w in (wk, wv))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ((o.transpose(0, 1).reshape(S, H * d) @ wo.T) * torch.arange(16)).sum().backward()
    summed = sum(g for g, _ in got)
    assert torch.allclose(summed, wk.grad, atol=1e-3)  # ranks 0+1 hold head 0, 2+3 head 1
    assert (got[0][0] - wk.grad).abs().max() > 1e-1  # one copy's gradient is only a part
