"""The memory of one training step, by formula and counted from the tensors (rank side).

A training step holds four kinds of bytes (Rajbhandari et al., ZeRO, 2020; Korthikanti et al.,
Reducing Activation Recomputation, 2022; the Ultra-Scale Playbook's memory chapter):

- weights and gradients: Psi parameters, 4 + 4 bytes each in fp32, 2 + 2 in mixed precision
  as Megatron/DeepSpeed lay it out (`mixed_precision` module doc: torch.autocast differs);
- Adam's state: two moments, 8 bytes per parameter in fp32; under mixed precision also an fp32
  master copy of the weights, 4 more (2 + 2 + 12 = 16 bytes, as in plain fp32: 4 + 4 + 8);
- activations: what autograd saves in forward for backward, per layer.

`Block` is a pre-norm transformer layer built from plain ops (no dropout, like Llama), so that
what each op saves is known: with T = b·s tokens, hidden h, a heads, e bytes per element, one
layer saves

    attention: LN1 input, LN1 output (the q/k/v input), q, k, v, the softmax output, the
               context (the output projection's input)       e·(6·T·h + a·b·s²)
    MLP:       LN2 input, LN2 output, fc1 output (GELU's input), GELU output (fc2's input)
                                                             e·(10·T·h)
    LayerNorm: mean and 1/std per token, two LayerNorms, fp32 for fp32 input   4·4·T

so e·(16·T·h + a·b·s²) + 16·T bytes: Korthikanti's 34·s·b·h + 5·a·s²·b (16-bit, with dropout)
less the dropout masks and the dropout output (2·s·b·h + 3·a·s²·b). With
`Block(attention="sdpa")` the layer calls `F.scaled_dot_product_attention` (FlashAttention on
GPUs, a flash kernel on CPU: `fused_attention` module doc), which keeps no s x s matrix: its
output is the context, and it saves the log-sum-exp of each query row in fp32, so attention
saves e·6·T·h + 4·a·b·s. Under Megatron tensor parallelism over t ranks (no sequence
parallelism; `Block.split_tensor_parallel`) the LayerNorms' inputs and outputs stay whole and
everything between the column and row splits divides by t: e·(4·T·h + (12·T·h + a·b·s²)/t) +
16·T. torch's SequenceParallel divides the LayerNorms' inputs and statistics by t too, but not
their outputs (`layer_activation_bytes`).

Activation recomputation (`torch.utils.checkpoint`) keeps only each layer's input, e·T·h,
and runs the layer's forward again during backward: fewer saved bytes, the same gradients,
one extra forward per layer (4 units of matmul FLOPs instead of 3, `layer_forward_flops`).

`SavedBytes` counts what autograd keeps: a `torch.autograd.graph.saved_tensors_hooks` pack
hook sees every tensor saved for backward; it adds up each distinct storage once (views of
one tensor share it) and leaves out the parameters' storages. It counts the same on every
device. On CUDA, `torch.cuda.memory_allocated` shows the allocator's view: each new tensor
rounded up to 512 bytes (`allocator_bytes`), and only tensors made after it was read (the
model's input, saved by the first LayerNorm, was there before).
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from labkit.parallel.mixed_precision import (  # re-exported: notebook 37 imports them here
    layernorm_stats_size,
    mixed_precision_adam,
    mixed_precision_bytes,
    mixed_precision_step,
)
from labkit.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_parallel,
)

__all__ = [
    "Block",
    "SavedBytes",
    "Stack",
    "ATTENTION",
    "CUDA_BLOCK",
    "adam_state_bytes",
    "allocator_bytes",
    "layer_forward_flops",
    "layer_activation_bytes",
    "layernorm_stats_size",
    "mixed_precision_adam",
    "mixed_precision_bytes",
    "mixed_precision_step",
    "recompute_activation_bytes",
]

STATS_BYTES = 4  # LayerNorm keeps its mean and 1/std in fp32 whatever the input's dtype


ATTENTION = ("eager", "sdpa")
LSE_BYTES = 4  # SDPA keeps its log-sum-exp in fp32 whatever q's dtype (CPU and CUDA kernels)


def layer_activation_bytes(
    batch: int,
    seq: int,
    hidden: int,
    heads: int,
    element_size: int,
    tp: int = 1,
    stats_size: int = STATS_BYTES,
    *,
    attention: str = "eager",
    sequence_parallel: bool = False,
) -> dict[str, int]:
    """Bytes one `Block` saves for backward (module doc), per part; `tp` ranks of Megatron TP.

    attention="eager" keeps the a·b·s² softmax probabilities; "sdpa"
    (`F.scaled_dot_product_attention`, FlashAttention) keeps no s² term: its output (which
    is the output projection's input) and the log-sum-exp, b·a·s fp32 numbers.
    sequence_parallel=True (torch's `SequenceParallel` on the LayerNorms, the q/k/v and fc1
    inputs gathered once per sub-layer, the row-parallel outputs reduce-scattered) also
    divides by `tp` what plain TP keeps whole: the LayerNorms' inputs (the residual stream)
    and their statistics. The LayerNorms' outputs stay whole: the column-parallel linear
    saves its all-gathered input (Megatron's own layers save the shard and all-gather it
    again in backward, dividing those too).

    Keys: attention, mlp, layernorm (the statistics, `stats_size` bytes each), total.
    """
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r}: must be one of {ATTENTION}")
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"sequence_parallel={sequence_parallel!r}: must be True or False")
    if tp < 1 or heads % tp or hidden % tp:
        raise ValueError(f"tp={tp} must be >= 1 and divide heads={heads} and hidden={hidden}")
    if sequence_parallel and seq % tp:
        raise ValueError(f"sequence_parallel shards seq={seq}: tp={tp} must divide it")
    tokens = batch * seq
    th = tokens * hidden
    # per sub-layer: the LayerNorm's input (whole, or 1/tp of the sequence) and its output
    # (whole either way: what the column-parallel linear saves)
    ln = th // tp + th if sequence_parallel else 2 * th
    if attention == "eager":  # q, k, v, the context and the probabilities, heads split
        core = element_size * (4 * th + heads * batch * seq * seq) // tp
    else:  # q, k, v, the output (= the context) and the log-sum-exp
        core = (element_size * 4 * th + LSE_BYTES * batch * heads * seq) // tp
    out = {
        "attention": element_size * ln + core,
        "mlp": element_size * (ln + 8 * th // tp),
        "layernorm": 2 * 2 * stats_size * tokens // (tp if sequence_parallel else 1),
    }
    out["total"] = sum(out.values())
    return out


CUDA_BLOCK = 512  # the CUDA caching allocator hands out multiples of 512 bytes


def allocator_bytes(sizes: list[int], block: int = CUDA_BLOCK) -> int:
    """How much `torch.cuda.memory_allocated` grows for new tensors of `sizes` bytes: each
    rounded up to a multiple of `block` (at least one block; an empty tensor allocates
    nothing). Exact for requests up to 1 MiB (the small pool splits its blocks to the rounded
    size); a larger request may be handed a cached block up to 1 MiB bigger. The CPU allocator
    has no such count to compare with."""
    return sum(-(-n // block) * block for n in sizes)


def layer_forward_flops(batch: int, seq: int, hidden: int) -> int:
    """Matmul FLOPs (2 per multiply-add) of one `Block`'s forward: q, k, v, o (4·h² a token),
    fc1 and fc2 (8·h² a token), and Q·K^T and P·V (2·b·s²·h each). Backward does twice that
    (the gradients of both operands of every matmul)."""
    tokens = batch * seq
    return 2 * tokens * 12 * hidden * hidden + 2 * 2 * batch * seq * seq * hidden


def recompute_activation_bytes(batch: int, seq: int, hidden: int, element_size: int) -> int:
    """Bytes one checkpointed layer keeps between forward and backward: its input."""
    return element_size * batch * seq * hidden


def adam_state_bytes(num_params: int, mixed_precision: bool) -> dict[str, int]:
    """Bytes of weights, grads and Adam state (master weights counted under optimizer)."""
    if mixed_precision:
        parts = {"params": 2, "grads": 2, "master": 4, "moments": 8}
    else:
        parts = {"params": 4, "grads": 4, "master": 0, "moments": 8}
    out = {k: v * num_params for k, v in parts.items()}
    out["total"] = sum(out.values())
    return out


class Block(nn.Module):
    """A pre-norm transformer layer from plain ops: x + attn(LN1(x)), then + MLP(LN2(x))."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        device: torch.device | str | None = None,
        attention: str = "eager",
    ):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden={hidden} must be a multiple of heads={heads}")
        if attention not in ATTENTION:
            raise ValueError(f"attention={attention!r}: must be one of {ATTENTION}")
        self.heads, self.head_dim = heads, hidden // heads
        self.attention = attention
        self.recompute = False
        self.tp_group: object = None  # set by split_tensor_parallel
        self.ln1 = nn.LayerNorm(hidden, device=device)
        self.q, self.k, self.v, self.o = (
            nn.Linear(hidden, hidden, device=device) for _ in range(4)
        )
        self.ln2 = nn.LayerNorm(hidden, device=device)
        self.fc1 = nn.Linear(hidden, 4 * hidden, device=device)
        self.fc2 = nn.Linear(4 * hidden, hidden, device=device)

    def split_tensor_parallel(self, group: dist.ProcessGroup | None = None) -> Block:
        """Megatron's split over `group` (every rank calls it, with the same weights): Q, K, V
        and fc1 by columns (heads / t a rank), the output projection and fc2 by rows; the
        LayerNorms stay whole. Forward then all_reduces twice, backward twice."""
        t = dist.get_world_size(group)
        if self.heads % t:
            raise ValueError(f"heads={self.heads} must be a multiple of the group size {t}")
        self.heads //= t
        self.q, self.k, self.v = (
            ColumnParallelLinear(m, group, copy_input=False) for m in (self.q, self.k, self.v)
        )
        self.o = RowParallelLinear(self.o, group)
        self.fc1 = ColumnParallelLinear(self.fc1, group)
        self.fc2 = RowParallelLinear(self.fc2, group)
        self.tp_group = group if group is not None else dist.group.WORLD
        return self

    def _split(self, t: torch.Tensor) -> torch.Tensor:
        b, s, _ = t.shape  # [b, s, heads·d] -> [b, heads, s, d], contiguous
        return t.view(b, s, self.heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute:  # keep only x; run _layer again in backward, all of it (no early
            with set_checkpoint_early_stop(False):  # stop), so its whole time is measured
                return checkpoint(self._layer, x, use_reentrant=False)
        return self._layer(x)

    def _layer(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        y = self.ln1(x)
        if self.tp_group is not None:  # once for Q, K and V: their input's gradient summed
            y = copy_to_parallel(y, self.tp_group)
        if self.attention == "sdpa":  # head views of the projections, as models write it: the
            # kernel's output is laid out [b, s, heads, d], so the context below is a view of it
            q, k, v = (m(y).view(b, s, self.heads, self.head_dim).transpose(1, 2)
                       for m in (self.q, self.k, self.v))  # fmt: skip
            context = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, -1)
        else:
            q, k, v = self._split(self.q(y)), self._split(self.k(y)), self._split(self.v(y))
            scores = (q @ k.transpose(-2, -1)) * (1 / math.sqrt(self.head_dim))
            context = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, s, -1)
        x = x + self.o(context)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Stack(nn.Module):
    """`num_layers` Blocks; `stack.recompute = True` runs each under `torch.utils.checkpoint`."""

    def __init__(
        self,
        num_layers: int,
        hidden: int,
        heads: int,
        device: torch.device | str | None = None,
        attention: str = "eager",
    ):
        super().__init__()
        self.layers = nn.ModuleList(
            Block(hidden, heads, device, attention) for _ in range(num_layers)
        )

    @property
    def recompute(self) -> bool:
        return all(layer.recompute for layer in self.layers)

    @recompute.setter
    def recompute(self, on: bool) -> None:
        for layer in self.layers:
            layer.recompute = on

    def split_tensor_parallel(self, group: dist.ProcessGroup | None = None) -> Stack:
        """Every layer split over `group` (`Block.split_tensor_parallel`); every rank calls it."""
        for layer in self.layers:
            layer.split_tensor_parallel(group)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class SavedBytes:
    """Counts the bytes autograd saves for backward, per layer of `model.layers` (Blocks).

    Use as `with SavedBytes(model) as saved: loss = ...`, then `saved.backward(loss)`;
    `saved.per_layer` has one int per layer (each storage counted once, where first saved) and
    `saved.total` their sum; `saved.records` has (layer, dtype, bytes, data_ptr) for each
    storage counted. It also times the layers' forwards (from LN1's start to fc2's
    end): `forwards` counts them, `forward_s` is their time in forward and `recompute_s`
    their time inside backward, where only recomputation runs them.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.per_layer = [0] * len(model.layers)
        self.storages = 0  # distinct storages counted (the allocator rounds each one up)
        self.records: list[tuple[int, torch.dtype, int, int]] = []  # layer, dtype, bytes, ptr
        self.forwards = 0
        self.forward_s = 0.0
        self.recompute_s = 0.0
        self._layer = -1
        self._seen: set[int] = set()
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._handles: list = []
        self._started = 0.0
        self._in_backward = False

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._params and ptr not in self._seen and self._layer >= 0:
            self._seen.add(ptr)
            self.per_layer[self._layer] += storage.nbytes()
            self.storages += 1
            self.records.append((self._layer, t.dtype, storage.nbytes(), ptr))
        return t

    def _enter(self, i: int):
        def hook(module, args):
            self._layer = i

        return hook

    def _leave(self, module, args, output):
        self._layer = -1

    def _start(self, module, args):
        self.forwards += 1
        self._started = time.perf_counter()

    def _stop(self, module, args, output):
        spent = time.perf_counter() - self._started
        if self._in_backward:
            self.recompute_s += spent
        else:
            self.forward_s += spent

    @property
    def total(self) -> int:
        return sum(self.per_layer)

    def __enter__(self) -> SavedBytes:
        for i, layer in enumerate(self.model.layers):
            self._handles += [
                layer.register_forward_pre_hook(self._enter(i)),
                layer.register_forward_hook(self._leave),
                layer.ln1.register_forward_pre_hook(self._start),
                layer.fc2.register_forward_hook(self._stop),
            ]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, timing the forwards recomputation runs inside it."""
        self._in_backward = True
        try:
            loss.backward()
        finally:
            self._in_backward = False
            for h in self._handles:
                h.remove()
