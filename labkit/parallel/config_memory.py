"""Every term of a training step's peak memory per GPU, for the configuration finder (pure).

Imported by the ranks and the kernel alike. `model_state_bytes` of the finder (and ZeRO's
16 Psi / N) is what a GPU holds *after* `step()`. Its peak holds more, and a plan that "fits"
with none of it fails with an out-of-memory error on the first step. Per GPU, on the busiest
pipeline stage (the first under 1F1B, or the last when its logits weigh more):

- `params`, `grads`, `optimizer`: the sharded model states (ZeRO stages, notebook 26);
- `activations`: L/pp layers x micro-batches in flight (`step_memory.layer_activation_bytes`);
- `logits`: 3 · b·s·V·4 bytes on the last stage, divided by tp (a vocabulary-parallel loss:
  Megatron's, torch's `loss_parallel`): `F.cross_entropy(logits.float(), y)` saves its fp32
  log-softmax for backward, and backward holds it beside the fp32 gradients of the
  log-probabilities and of the logits: three fp32 b·s·V tensors at once (measured from the
  allocator's records in tests/test_config_finder.py and notebook 42; a fused or chunked
  cross-entropy holds less);
- `zero3_gathered` (ZeRO-3 / FSDP2): the unit being computed and the one prefetched, 2 layers'
  TP-local weights in the working dtype; every layer of the stage with
  `reshard_after_forward=False`;
- `zero3_unsharded_grads`: a unit's whole gradient before its reduce-scatter; every unit's
  with gradient sync turned off for m-1 micro-batches;
- `comm_buffers`: ZeRO-3's reduce-scatter input (a copy of one unit's gradient); for ZeRO 0-2
  an allowance of two gradient buckets (one in flight, one filling; DDP's `bucket_cap_mb`
  = 25 MB) for a reducer that copies gradients into its own buckets chunk by chunk. DDP
  itself does not: with `gradient_as_bucket_view=True` the gradients *are* its buckets and
  are reduced in place (nothing more), with its default False it keeps a second copy of
  every gradient in its buckets (add `grads` again); DeepSpeed's ZeRO-1/2 buckets are
  `reduce_bucket_size` elements (set `Overheads.bucket_bytes`); a pipeline's send and
  receive buffers (one activation each);
- `cuda_context`: the CUDA context, cuBLAS workspaces and NCCL's own buffers, outside the
  caching allocator (`Overheads.cuda_context`, assumed 1 GB: 0.5-1 GB is typical for the
  context; each NCCL communicator adds buffers of `NCCL_BUFFSIZE` (4 MB) per channel and
  peer, so DP, TP and PP groups together can need more; measure yours as
  `torch.cuda.mem_get_info()` lost after the first CUDA call and the groups' first
  collectives);
- `fragmentation`: the caching allocator's blocks it cannot reuse, a fraction of the tensors'
  bytes (`Overheads.fragmentation`, assumed 5 %; `torch.cuda.memory_reserved() -
  memory_allocated()` shows yours).

A plan fits when the total is at most the GPU's memory less `Overheads.headroom` (10 %).
Notebook 26 measures ZeRO-3's peak terms on CPU ranks (the profiler's allocation records);
the CUDA context and fragmentation are GPU-only figures, stated as assumptions to edit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from labkit.parallel.config_model import Config, Model, num_microbatches
from labkit.parallel.step_memory import layer_activation_bytes

__all__ = ["DDP_BUCKET_BYTES", "Memory", "Overheads", "memory_breakdown"]

DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel(bucket_cap_mb=25), its default
LOGIT_BYTES = 4  # logits upcast to fp32 for the loss
LOGIT_COPIES = 3  # the saved log-softmax + the gradients of the log-probs and of the logits


@dataclass(frozen=True)
class Overheads:
    """What a real GPU run holds beyond its tensors, and the headroom kept: each an editable
    assumption. `cuda_context` bytes; `fragmentation` and `headroom` fractions in [0, 1);
    `bucket_bytes` of a gradient bucket (ZeRO 0-2)."""

    cuda_context: float = 1.0e9
    fragmentation: float = 0.05
    headroom: float = 0.10
    bucket_bytes: int = DDP_BUCKET_BYTES

    def __post_init__(self) -> None:
        if not self.cuda_context >= 0:
            raise ValueError(f"cuda_context must be >= 0 bytes, got {self.cuda_context}")
        for name in ("fragmentation", "headroom"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ValueError(f"{name} must be a fraction in [0, 1), got {value}")
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be an int >= 0, got {self.bucket_bytes!r}")

    @classmethod
    def none(cls) -> Overheads:
        """No context, fragmentation, headroom or buckets: the tensors' formulas alone."""
        return cls(cuda_context=0, fragmentation=0.0, headroom=0.0, bucket_bytes=0)


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU at a step's peak, one field per term (module doc)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    logits: int
    zero3_gathered: int
    zero3_unsharded_grads: int
    comm_buffers: int
    cuda_context: int
    fragmentation: int

    @property
    def model_states(self) -> int:
        """What ZeRO's formula counts: the state after `step()`."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    @property
    def other(self) -> int:
        """Everything but the model states and the activations."""
        return self.total - self.model_states - self.activations

    def as_dict(self) -> dict[str, int]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["total"] = self.total
        return out


def memory_breakdown(model: Model, config: Config, overheads: Overheads) -> Memory:
    """Every term of the peak bytes per GPU of `config` (module doc), on its busiest stage."""
    t, p, d = config.tp, config.pp, config.dp
    e = model.element_size
    b, s, h = model.micro_batch, model.seq_len, model.hidden
    m = num_microbatches(model, config)
    local = math.ceil(model.num_params / (t * p))
    shard = math.ceil(local / d)
    per = (2, 2, 12) if model.mixed_precision else (4, 4, 8)
    states = {
        "params": per[0] * (shard if config.zero >= 3 else local),
        "grads": per[1] * (shard if config.zero >= 2 else local),
        "optimizer": per[2] * (shard if config.zero >= 1 else local),
    }
    layers = math.ceil(model.num_layers / p)
    sp = config.sequence_parallel
    full = layer_activation_bytes(
        b, s, h, model.num_heads, e, tp=t, attention=model.attention, sequence_parallel=sp
    )["total"]
    kept = e * b * s * h // (t if sp else 1)  # a checkpointed layer's input

    def stage_activations(in_flight: int) -> int:
        if config.recompute:
            return layers * in_flight * kept + full
        return layers * in_flight * full

    logits = LOGIT_COPIES * b * s * model.vocab * LOGIT_BYTES // t  # the loss's fp32 peak
    first, last = stage_activations(min(p, m)), stage_activations(1) + logits
    acts, logits = (first, 0) if p > 1 and first > last else (last - logits, logits)

    unit = math.ceil(model.params_per_layer / t) * e  # one layer's TP-local weights
    gathered = unsharded = 0
    buffers = 2 * b * s * h * e if p > 1 else 0  # a pipeline's send and receive buffers
    if config.zero == 3 and d > 1:
        gathered = (min(2, layers) if config.reshard_after_forward else layers) * unit
        unsharded = (1 if config.sync_every_microbatch else layers) * unit
        buffers += unit  # the reduce-scatter's input, a copy of the unit's gradient
    elif d > 1:
        buffers += min(2 * overheads.bucket_bytes, per[1] * local)
    tensors = sum(states.values()) + acts + logits + gathered + unsharded + buffers
    return Memory(
        **states,
        activations=acts,
        logits=logits,
        zero3_gathered=gathered,
        zero3_unsharded_grads=unsharded,
        comm_buffers=buffers,
        cuda_context=int(overheads.cuda_context),
        fragmentation=int(overheads.fragmentation * tensors),
    )
