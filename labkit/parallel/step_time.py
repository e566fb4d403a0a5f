"""Where the time of a training step goes: FLOPs, MFU and a step-time model (pure functions).

Imported by the ranks and the kernel alike (notebook 46); nothing here talks to other processes.

- FLOPs of a matmul y = x @ W (x: t x k, W: k x n): 2·t·k·n (a multiply and an add each).
  Training a Linear layer runs three such matmuls: the forward, the gradient of the input and
  the gradient of the weight, so 6·t·k·n; the first layer of a network skips the gradient of
  its input (nothing upstream needs it): 4·t·k·n. Over a model of N matmul weights that is the
  classic 6·N·tokens per training step (2·N forward + 4·N backward); biases, norms and
  activations add O(N/k) more and are left out, as `torch.utils.flop_counter` leaves them out.
- Attention adds two matmuls per layer that have no weights: scores q·kᵀ and probabilities·v,
  2·s·d each per token and layer in forward (s the sequence, d = hidden): 4·s·d forward,
  12·s·d training per token and layer. The convention for MFU (PaLM's appendix B, Megatron-LM,
  torchtitan) counts the full s x s square even for a causal model; a causal kernel that skips
  the masked half does about half of it. torch's `FlopCounterMode` formulas for the flash /
  memory-efficient / cuDNN SDPA kernels (GPU) ignore the mask too, and count 5 matmuls in
  their backward (the scores recomputed, as FlashAttention does): 14·s·d per token and layer,
  hardware FLOPs, not the model's 12·s·d. The fused CPU kernel has no formula: it counts 0.
- MFU (model FLOPs utilisation) = the model's FLOPs per second over the hardware's peak: the
  FLOPs are the model's (6·N·tokens + attention, not recomputation), the tokens are the global
  batch's, and the peak is all GPUs' dense peak for the dtype used (datasheets quote sparse
  figures too: twice the dense ones, for 2:4 structured sparsity, which training does not use).
  HFU (hardware FLOPs utilisation) counts the recomputed forward too (8·N per token with full
  activation recomputation): HFU >= MFU, and only MFU compares runs that recompute differently.
- The step-time model: time = FLOPs per GPU · (1 + overhead) / (peak · efficiency)
  + each group's exposed bytes sent per GPU / the bandwidth of the slowest link that group
  crosses, with `overhead` the configuration finder's (pipeline bubble + recomputation) and the
  bytes its `communication`. Ranks are placed tensor-parallel innermost, then data, then
  pipeline (Megatron-LM's and torchtitan's order), `gpus_per_node` to a node: a group whose
  ranks span more than one node runs at the network's speed (NCCL's ring crosses the NICs),
  one inside a node at NVLink's. Every speed is an assumption the caller states in `Speeds`.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.parallel.config_finder import Plan, find_configs
from labkit.parallel.config_model import Model

__all__ = [
    "PEAKS",
    "Speeds",
    "attention_flops",
    "group_bandwidth",
    "linear_flops",
    "mfu",
    "rank_by_step_time",
    "step_time",
    "training_flops",
]

# Dense bf16 tensor-core peaks in FLOP/s. H100 SXM5: NVIDIA's H100 whitepaper (Hopper
# architecture, table "NVIDIA H100 SXM5"), BF16 tensor 989.4 dense / 1978.9 with sparsity (the
# datasheet rounds them to 989 / 1,979 TFLOPS). H200 SXM: the same GH100 compute (the H200
# datasheet's BF16 1,979 TFLOPS is the sparse figure); only its memory differs (141 GB HBM3e,
# 4.8 TB/s). The PCIe / NVL boards are slower (H100 PCIe 756 dense). Edit for your part.
PEAKS = {
    "H100 SXM bf16 dense": 989.4e12,
    "H100 SXM bf16 sparse": 1978.9e12,
    "H200 SXM bf16 dense": 989.4e12,
    "H200 SXM bf16 sparse": 1978.9e12,
}


def linear_flops(tokens: int, sizes: list[tuple[int, int]], first_needs_grad: bool = False) -> int:
    """FLOPs of forward + backward through Linear layers of (in, out) `sizes` on `tokens` rows:
    6·t·k·n each, except 4·t·k·n for the first unless its input needs a gradient."""
    total = 0
    for i, (k, n) in enumerate(sizes):
        total += (6 if i or first_needs_grad else 4) * tokens * k * n
    return total


def attention_flops(tokens: int, seq_len: int, hidden: int, num_layers: int = 1) -> int:
    """Forward + backward FLOPs of the scores and the weighted sum, the model's (no
    recomputation, the full square even when causal, by convention): 12·s·d per token and
    layer."""
    return 12 * tokens * seq_len * hidden * num_layers


def training_flops(num_params: int, tokens: int) -> int:
    """The 6·N·tokens rule: forward (2·N) plus backward (4·N) per token."""
    return 6 * num_params * tokens


def mfu(model_flops: float, seconds: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: `model_flops` done in `seconds` over `peak_flops` (FLOP/s of
    all the devices that did them, dense)."""
    if not seconds > 0 or not peak_flops > 0:
        raise ValueError(f"seconds and peak_flops must be > 0, got {seconds}, {peak_flops}")
    return model_flops / seconds / peak_flops


@dataclass(frozen=True)
class Speeds:
    """Assumed speeds: `peak_flops` per GPU (dense, the dtype used); the `efficiency` the
    step's kernels reach of it while busy (the bubble and recomputation come on top, through
    the plan's `overhead`: this is the MFU of a step with neither); `link_bandwidth`, bytes/s
    one GPU sends inside a node; `network_bandwidth`, bytes/s it sends to other nodes;
    `gpus_per_node`; and `dp_exposed`, the share of the data parallel bytes left exposed (1.0
    when no all-reduce hides under the backward). Tensor and pipeline parallel bytes are
    counted exposed: the next op waits on them. Defaults: an H100 SXM in bf16 at 40%, 8 to a
    node on NVLink 4 (900 GB/s both ways, 450 GB/s one way, the datasheet's figure; NCCL's bus
    bandwidth reaches less), one 400 Gb/s InfiniBand NDR NIC per GPU between nodes (50 GB/s
    one way, as in a DGX H100); expectations, not measurements."""

    peak_flops: float = PEAKS["H100 SXM bf16 dense"]
    efficiency: float = 0.4
    link_bandwidth: float = 450e9
    dp_exposed: float = 1.0
    network_bandwidth: float = 50e9
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        speeds = (self.peak_flops, self.link_bandwidth, self.network_bandwidth)
        if not all(v > 0 for v in speeds) or not self.gpus_per_node >= 1:
            raise ValueError(
                "peak_flops, link_bandwidth, network_bandwidth and gpus_per_node must be > 0, "
                f"got {speeds}, {self.gpus_per_node}"
            )
        if not 0 < self.efficiency <= 1 or not 0 <= self.dp_exposed <= 1:
            raise ValueError(
                f"efficiency must be in (0, 1] and dp_exposed in [0, 1], got "
                f"{self.efficiency}, {self.dp_exposed}"
            )


def model_step_flops(model: Model) -> int:
    """FLOPs of one training step of the whole global batch: 6·N·tokens + attention."""
    tokens = model.global_batch * model.seq_len
    attention = attention_flops(tokens, model.seq_len, model.hidden, model.num_layers)
    return training_flops(model.num_params, tokens) + attention


def group_bandwidth(plan: Plan, speeds: Speeds) -> dict[str, float]:
    """Bytes/s of each group (dp, tp, pp) of `plan`: the link inside a node when the group's
    ranks all sit in one, else the network. Ranks are laid out tp innermost, then dp, then pp,
    so a tp group spans tp consecutive ranks, a dp group tp·dp, a pp group all of them."""
    c = plan.config
    span = {"tp": c.tp, "dp": c.tp * c.dp, "pp": c.tp * c.dp * c.pp}
    return {
        kind: speeds.link_bandwidth if n <= speeds.gpus_per_node else speeds.network_bandwidth
        for kind, n in span.items()
    }


def step_time(model: Model, plan: Plan, speeds: Speeds) -> dict[str, float]:
    """Estimated seconds of one step under `plan`: compute (this GPU's share of the FLOPs,
    times 1 + the plan's bubble and recomputation overhead) and exposed communication, each
    group's bytes at its own bandwidth (`group_bandwidth`)."""
    gpus = plan.config.dp * plan.config.tp * plan.config.pp
    flops = model_step_flops(model) / gpus * (1 + plan.overhead)
    compute = flops / (speeds.peak_flops * speeds.efficiency)
    bandwidth = group_bandwidth(plan, speeds)
    share = {"dp": speeds.dp_exposed, "tp": 1.0, "pp": 1.0}
    comm = sum(share[k] * plan.comm.get(k, 0.0) / bandwidth[k] for k in share)
    return {"compute": compute, "comm": comm, "total": compute + comm}


def rank_by_step_time(
    model: Model, gpu_memory: float, num_gpus: int, speeds: Speeds | None = None
) -> list[tuple[Plan, dict[str, float]]]:
    """The configuration finder's plans that fit (`find_configs`), fastest estimated step
    first (ties: the finder's own order)."""
    speeds = Speeds() if speeds is None else speeds
    plans = find_configs(model, gpu_memory, num_gpus)
    timed = [(p, step_time(model, p, speeds)) for p in plans]
    return sorted(timed, key=lambda pt: pt[1]["total"])  # stable: keeps the finder's order
