"""FlashAttention / SDPA beside eager attention: what each keeps, what each costs, and the
tiling that lets a fused kernel skip the s x s matrix (runs on ranks, or in any process).

Eager attention, softmax(Q·K^T / sqrt(d))·V written as three ops, materialises the scores and
the probabilities, a·b·s² numbers, in memory: each op reads its input from memory and writes its
output back, and autograd keeps the probabilities for backward. A fused kernel
(`F.scaled_dot_product_attention` picks one: FlashAttention-2, memory-efficient, cuDNN on CUDA;
a flash-style kernel on CPU) walks K and V in tiles, keeping for each query row only a running
maximum m, a running sum l of exp(score - m) and a running output (the *online softmax*,
`tiled_attention` below): the s x s matrix never exists, only a tile of it in fast memory
(SRAM/registers on a GPU). It saves for backward its inputs, its output and the log-sum-exp
m + log(l) per row (fp32, b·a·s numbers; on CUDA also an RNG seed and offset), and backward
**recomputes** each tile of probabilities from Q, K and the log-sum-exp: more FLOPs, far fewer
bytes moved and kept. A mask passed as a tensor is saved too (on CPU a boolean mask becomes an
fp32 s x s bias): causal attention should pass `is_causal=True` instead.

`sdpa_ops` names the kernel SDPA ran (from torch.profiler); `time_attention` times forward
and backward of both.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

__all__ = ["eager_attention", "sdpa_ops", "tiled_attention", "time_attention"]

KINDS = ("eager", "sdpa")


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q·k^T / sqrt(d))·v on [b, heads, s, d], op by op (what `Block` runs eagerly)."""
    scores = (q @ k.transpose(-2, -1)) * (1 / math.sqrt(q.shape[-1]))
    return torch.softmax(scores, dim=-1) @ v


def tiled_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Attention over K/V tiles of `block` keys with the online softmax, as FlashAttention's
    forward does (in plain torch, so slow: the point is what it never holds).

    Returns the output, the log-sum-exp of each query row's scores (fp32) and the largest
    score tile it held, in elements: b·heads·s·block, never b·heads·s².
    """
    if block < 1:
        raise ValueError(f"block={block} must be >= 1")
    scale = 1 / math.sqrt(q.shape[-1])
    qf = q.float()
    m = torch.full(q.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
    l = torch.zeros_like(m)  # noqa: E741 - the paper's name for the running sum
    acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    largest = 0
    for start in range(0, k.shape[-2], block):
        kt, vt = k[..., start : start + block, :].float(), v[..., start : start + block, :].float()
        s = (qf @ kt.transpose(-2, -1)) * scale  # one tile of scores: [b, heads, s, block]
        largest = max(largest, s.numel())
        m_new = torch.maximum(m, s.amax(dim=-1))
        correction = torch.exp(m - m_new)  # rescale what was summed under the old maximum
        p = torch.exp(s - m_new.unsqueeze(-1))
        l = l * correction + p.sum(dim=-1)  # noqa: E741
        acc = acc * correction.unsqueeze(-1) + p @ vt
        m = m_new
    return (acc / l.unsqueeze(-1)).to(q.dtype), m + torch.log(l), largest


def sdpa_ops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[str]:
    """The attention ops `F.scaled_dot_product_attention(q, k, v)` dispatched to here, in
    order, as torch.profiler records them (e.g. `aten::_scaled_dot_product_flash_attention_for_cpu`
    on CPU, `aten::_scaled_dot_product_flash_attention` or `..._efficient_attention` on CUDA;
    the math fallback shows `aten::_scaled_dot_product_attention_math`)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        F.scaled_dot_product_attention(q, k, v)
    names = [e.name for e in prof.events()]
    return list(dict.fromkeys(n for n in names if "attention" in n))


def time_attention(
    kind: str, batch: int, heads: int, seq: int, head_dim: int, repeats: int = 3, **like
) -> tuple[float, float]:
    """Seconds of one forward and one backward of `kind` attention ("eager" or "sdpa") on
    random [batch, heads, seq, head_dim] q, k, v (`like`: dtype, device), the quickest of
    `repeats` runs each."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: must be one of {KINDS}")
    fn = eager_attention if kind == "eager" else F.scaled_dot_product_attention
    q, k, v = (torch.randn(batch, heads, seq, head_dim, **like, requires_grad=True)
               for _ in range(3))  # fmt: skip
    sync = torch.cuda.synchronize if q.is_cuda else (lambda: None)
    fwd = bwd = math.inf
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        out = fn(q, k, v)
        sync()
        t1 = time.perf_counter()
        out.sum().backward()
        sync()
        t2 = time.perf_counter()
        fwd, bwd = min(fwd, t1 - t0), min(bwd, t2 - t1)
        q.grad = k.grad = v.grad = None
    return fwd, bwd
