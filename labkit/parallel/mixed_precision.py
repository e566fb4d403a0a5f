"""Mixed precision two ways, with what each holds and saves (rank side).

**By hand, as Megatron-LM and DeepSpeed lay it out** (`mixed_precision_adam`,
`mixed_precision_step`): the model itself is cast to bf16/fp16, so weights and gradients are 2
bytes a parameter, and the optimizer steps an fp32 master copy with fp32 moments: 2 + 2 + 12 =
16 bytes (the ZeRO paper's count). Every activation is 2 bytes, except what their fused kernels
keep in fp32 (LayerNorm statistics); `step_memory.layer_activation_bytes(..., element_size=2)`
is this layout.

**`torch.autocast`** (what a plain torch training loop uses): the model stays fp32, so weights
and gradients are 4 + 4 bytes and the fp32 weights are the master copy (Adam's moments 8 more:
16 again, split differently). Inside the autocast region each matmul casts its inputs to the
low dtype; the casts of the weights (leaves that require grad) are cached for the region, and
each linear saves its cast weight for backward, so a forward keeps a low-precision copy of the
weights, 2 bytes a parameter, until backward. Activations are mixed: the residual stream (the
LayerNorms' inputs) stays fp32, LayerNorm runs in fp32 (its statistics fp32), and a LayerNorm's
output is cast again by every projection that reads it (three casts for separate q, k, v; a
fused QKV projection would cast once). Softmax differs by device: CPU autocast runs it in bf16,
CUDA autocast lists softmax among the ops it runs in fp32, so on CUDA the probabilities are
saved in fp32 by softmax and again in bf16 by the P·V matmul that casts them.
`autocast_activation_bytes` is that count, per `step_memory.Block`; its CPU figures are
measured in notebook 37 and tests/test_parallel_step_memory.py, its CUDA ones are what the
autocast op lists imply (not measured in this repository).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "autocast_activation_bytes",
    "layernorm_stats_size",
    "mixed_precision_adam",
    "mixed_precision_bytes",
    "mixed_precision_step",
]

AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_activation_bytes(
    batch: int,
    seq: int,
    hidden: int,
    heads: int,
    *,
    attention: str = "eager",
    device_type: str = "cpu",
    low_size: int = 2,
) -> dict[str, int]:
    """Bytes one fp32 `step_memory.Block` saves for backward under `torch.autocast`
    (low-precision dtype of `low_size` bytes), per kind (module doc).

    Keys: fp32_stream (the LayerNorms' fp32 inputs), stats (their fp32 mean and 1/std),
    casts (the LayerNorm outputs cast once per projection: q, k, v and fc1), attention (q, k,
    v, the context, and the probabilities (eager) or the fp32 log-sum-exp (sdpa)), mlp (fc1's
    output, GELU's output), weights (the cast weights the linears save), total.
    """
    if attention not in ("eager", "sdpa"):
        raise ValueError(f"attention={attention!r}: must be one of ('eager', 'sdpa')")
    if device_type not in AUTOCAST_DEVICES:
        raise ValueError(f"device_type={device_type!r}: must be one of {AUTOCAST_DEVICES}")
    tokens, lo = batch * seq, low_size
    th = tokens * hidden
    if attention == "sdpa":  # the output is the context; the log-sum-exp is fp32
        core = lo * 4 * th + 4 * batch * heads * seq
    else:  # CPU: bf16 probabilities; CUDA: fp32 ones (softmax) and their bf16 cast (P·V)
        probs = heads * batch * seq * seq
        core = lo * 4 * th + (lo if device_type == "cpu" else 4 + lo) * probs
    out = {
        "fp32_stream": 2 * 4 * th,
        "stats": 2 * 2 * 4 * tokens,
        "casts": lo * 4 * th,
        "attention": core,
        "mlp": lo * 8 * th,
        "weights": lo * 12 * hidden * hidden,
    }
    out["total"] = sum(out.values())
    return out


def layernorm_stats_size(dtype: torch.dtype, device: torch.device | str) -> int:
    """Bytes per element of the mean and 1/std LayerNorm keeps for `dtype` input on `device`.

    fp32 for fp32 input everywhere; for bf16/fp16 CUDA keeps fp32 statistics and the CPU
    kernel keeps them in the input's dtype (with weights of that dtype too: fp32 weights give
    fp32 statistics), so this asks the device's kernel.
    """
    x = torch.ones(1, 2, dtype=dtype, device=device)
    w = torch.ones(2, dtype=dtype, device=device)
    return torch.native_layer_norm(x, [2], w, w, 1e-5)[1].element_size()


def mixed_precision_adam(
    model: nn.Module, dtype: torch.dtype = torch.bfloat16, lr: float = 1e-3
) -> tuple[list[torch.Tensor], torch.optim.Adam]:
    """Mixed precision by hand: casts `model` to `dtype` in place and returns fp32 master
    copies of its weights with an Adam over them (its two moments are fp32 too)."""
    masters = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    model.to(dtype)
    return masters, torch.optim.Adam(masters, lr=lr)


def mixed_precision_step(
    model: nn.Module, masters: list[torch.Tensor], optimizer: torch.optim.Optimizer
) -> None:
    """After backward: the low-precision grads go to the masters (as fp32), Adam steps the
    masters, and the model's weights become the masters rounded to its dtype."""
    with torch.no_grad():
        for p, m in zip(model.parameters(), masters):
            m.grad = p.grad.float()
        optimizer.step()
        for p, m in zip(model.parameters(), masters):
            p.copy_(m)
            m.grad = None  # fp32 grads kept across steps would add 4 bytes per parameter


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def mixed_precision_bytes(
    model: nn.Module, masters: list[torch.Tensor], optimizer: torch.optim.Optimizer
) -> dict[str, int]:
    """Bytes held after `mixed_precision_step`, counted from the tensors themselves.

    Keys: params and grads (the model's, low precision), master (fp32 weights), moments
    (Adam's exp_avg and exp_avg_sq), steps (Adam's per-tensor step counters), total.
    """
    state = [optimizer.state[m] for m in masters if m in optimizer.state]
    out = {
        "params": _nbytes(model.parameters()),
        "grads": _nbytes(p.grad for p in model.parameters() if p.grad is not None),
        "master": _nbytes(masters),
        "moments": _nbytes(s[k] for s in state for k in ("exp_avg", "exp_avg_sq")),
        "steps": _nbytes(s["step"] for s in state if torch.is_tensor(s.get("step"))),
    }
    out["total"] = sum(out.values())
    return out
