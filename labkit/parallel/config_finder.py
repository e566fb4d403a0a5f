"""A configuration finder: DP x TP x PP x ZeRO choices, their memory and traffic (pure functions).

Imported by the ranks and the kernel alike; nothing here talks to other processes. Every
formula is one a notebook checks on the ranks or by hand (notebook 42 lists which):

- model states, ZeRO stages 0-3 (notebook 26, `zero_redundancy.zero_memory`): per GPU the
  Psi / (tp·pp) parameters of its TP slice of its pipeline stage, 2 + 2 + 12 bytes each in
  mixed precision (4 + 4 + 8 in fp32), stage s sharding optimizer state, then grads, then
  weights over the dp ranks (padded shards of ceil(Psi' / dp)). That is the state *after*
  `step()`; what else a step holds at its peak is in `config_memory` (ZeRO-3's gathered
  layers, logits, buffers, the CUDA context, fragmentation) and is counted here too;
- activations (notebook 37, `step_memory.layer_activation_bytes`): per layer and micro-batch,
  with SDPA / FlashAttention by default (`Model.attention="sdpa"`: the output and an fp32
  log-sum-exp, no a·b·s² probabilities) or eager attention (`"eager"`). Tensor parallelism
  without sequence parallelism divides only what lies between the column and row splits: the
  LayerNorms' inputs and outputs (the residual stream) stay whole on every TP rank;
  `Config.sequence_parallel` also shards the LayerNorms' inputs. With recomputation a layer
  keeps only its input, plus one layer's full activations while it is recomputed. A pipeline
  stage holds L/pp layers and, under 1F1B, its first stage min(pp, m) micro-batches in flight
  (notebook 31), its last stage one, plus the logits;
- the pipeline bubble (p-1)/(m+p-1) of the step (notebook 31), and the idle time it adds
  relative to the ideal step, (p-1)/m;
- tensor parallelism (notebook 32): per layer and micro-batch two all_reduces in forward (after
  attention and after the MLP) and two in backward, each of the layer's whole output
  b·s·h·e bytes; a ring all_reduce sends 2(t-1)/t of its buffer. With sequence parallelism
  each all_reduce becomes an all_gather + a reduce_scatter of the same buffer: the same bytes.
  Recomputing a layer runs its forward again, collectives included: 6 a layer, not 4;
- data parallelism (notebook 26): ZeRO-0 all_reduces the grads once per step; ZeRO-1
  reduce-scatters them once and all-gathers the weights once (the same bytes); ZeRO-2 must
  reduce-scatter every micro-batch's grads (it keeps no whole gradient to accumulate into).
  ZeRO-3 as FSDP2 runs it, with m micro-batches a step: 2m all-gathers (each unit before every
  forward and again before every backward) + m reduce-scatters (one per backward), unless
  gradient sync is turned off for the first m-1 micro-batches
  (`set_requires_gradient_sync(False)`, `Config.sync_every_microbatch=False`: 1
  reduce-scatter, but every unit's unsharded gradient held until then) and/or the weights are
  not re-sharded after forward (`reshard_after_forward=False`, `Config.reshard_after_forward`:
  m all-gathers, but every unit's unsharded weights held from forward to backward).
  Reduce-scatter and all-gather send (d-1)/d of the whole buffer on a ring (NCCL); gloo's
  reduce-scatter sends as much as its all-reduce, 2(d-1)/d (measured in notebook 26).
  Gradients are reduced in the working dtype (e bytes); FSDP2 with
  `MixedPrecisionPolicy(reduce_dtype=torch.float32)` (torchtitan's default) reduce-scatters
  fp32, twice these bytes and twice the reduce-scatter buffer;
- pipeline point-to-point: a stage sends each micro-batch's activation forward and its
  gradient back, b·s·h·e bytes each (2·m of them for a middle stage, m for the ends; the
  busiest stage is counted: m sends with 2 stages, 2·m with more).

Recomputation costs about one more forward per layer: a third of forward + backward (the
backward is about twice the forward), the figure notebook 37 measures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from labkit.parallel.config_memory import Memory, Overheads, memory_breakdown
from labkit.parallel.config_model import Config, Model, num_microbatches

__all__ = [
    "Config",
    "Memory",
    "Model",
    "Overheads",
    "Plan",
    "activation_bytes",
    "collective_calls",
    "communication",
    "enumerate_configs",
    "find_configs",
    "format_table",
    "model_state_bytes",
    "plan",
]

RECOMPUTE_OVERHEAD = 1 / 3  # one more forward, in units of forward + backward


def model_state_bytes(model: Model, config: Config) -> dict[str, int]:
    """Bytes per GPU of weights, grads and optimizer state (fp32 master weights included)
    after `step()`: the sharded states only (`memory_breakdown` adds what a step's peak holds)."""
    b = memory_breakdown(model, config, Overheads.none())
    out = {"params": b.params, "grads": b.grads, "optimizer": b.optimizer}
    out["total"] = sum(out.values())
    return out


def activation_bytes(model: Model, config: Config) -> int:
    """Activation bytes the busiest pipeline stage holds (logits not included)."""
    return memory_breakdown(model, config, Overheads.none()).activations


SENT_FACTOR = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0}  # x (n-1)/n


def collective_calls(model: Model, config: Config) -> dict[str, list[tuple[str, int, int]]]:
    """The collectives of one step on one GPU, by kind (dp, tp, pp): (op, calls, buffer
    bytes) as labkit's trace records them (the whole buffer; padded to a multiple of dp).

    ZeRO-3 (FSDP2) with m micro-batches: 2m all-gathers + m reduce-scatters; m all-gathers
    with `reshard_after_forward=False`; 1 reduce-scatter with `sync_every_microbatch=False`
    (`set_requires_gradient_sync(False)` on the first m-1 micro-batches). TP: 4 all-reduces a
    layer and micro-batch, 6 with recomputation (its forward runs twice)."""
    m = num_microbatches(model, config)
    e = model.element_size
    d, t, p = config.dp, config.tp, config.pp
    local = math.ceil(model.num_params / (t * p))
    flat = math.ceil(local / d) * d * e
    gathers = m if not config.reshard_after_forward else 2 * m
    scatters = m if config.sync_every_microbatch else 1
    by_stage = {
        0: [("all_reduce", 1, flat)],
        1: [("reduce_scatter", 1, flat), ("all_gather", 1, flat)],
        2: [("reduce_scatter", m, flat), ("all_gather", 1, flat)],
        3: [("all_gather", gathers, flat), ("reduce_scatter", scatters, flat)],
    }
    act = model.micro_batch * model.seq_len * model.hidden * e
    layers = math.ceil(model.num_layers / p)
    per_layer = 6 if config.recompute else 4  # a recomputed forward repeats its 2 all_reduces
    tp_calls = [("all_reduce", per_layer * layers * m, act)]
    if config.sequence_parallel:  # each all_reduce split into its two halves
        n = per_layer * layers * m
        tp_calls = [("all_gather", n, act), ("reduce_scatter", n, act)]
    return {
        "dp": by_stage[config.zero] if d > 1 else [],
        "tp": tp_calls if t > 1 else [],
        # the busiest stage: a middle one sends each micro-batch's activation on and its
        # gradient back (2m); with 2 stages each sends one of the two (m)
        "pp": [("send", 2 * m if p > 2 else m, act)] if p > 1 else [],
    }


def communication(model: Model, config: Config) -> dict[str, float]:
    """Bytes one GPU sends per step, by kind (dp, tp, pp), and their total, on a ring (NCCL):
    a collective over n ranks sends (n-1)/n of its buffer (twice that for all_reduce), a send
    all of it. (gloo's reduce_scatter sends 2(n-1)/n, as its all_reduce: notebook 26.)"""
    sizes = {"dp": config.dp, "tp": config.tp, "pp": 2}
    out: dict[str, float] = {}
    for kind, calls in collective_calls(model, config).items():
        n = sizes[kind]
        out[kind] = sum(
            calls * size * (SENT_FACTOR[op] * (n - 1) / n if op in SENT_FACTOR else 1.0)
            for op, calls, size in calls
        )
    out["total"] = sum(out.values())
    return out


@dataclass(frozen=True)
class Plan:
    """One configuration's verdict. `breakdown` names every term of `memory` (bytes per GPU,
    on its busiest pipeline stage); `usable` is the GPU's memory less the kept headroom."""

    config: Config
    breakdown: Memory = field(compare=False)
    memory: int
    usable: float
    comm: dict[str, float] = field(compare=False)
    bubble: float
    overhead: float  # extra compute time relative to the ideal step: bubble + recomputation
    fits: bool

    @property
    def model_states(self) -> int:
        return self.breakdown.model_states

    @property
    def activations(self) -> int:
        return self.breakdown.activations


def plan(
    model: Model, config: Config, gpu_memory: float, overheads: Overheads | None = None
) -> Plan:
    """Memory per GPU (every term of `Memory`), bytes sent per GPU and step, and compute
    overhead of one choice; it fits when the memory is at most `gpu_memory` less the headroom."""
    if not gpu_memory > 0:
        raise ValueError(f"gpu_memory must be > 0 bytes, got {gpu_memory}")
    overheads = Overheads() if overheads is None else overheads
    m = num_microbatches(model, config)
    breakdown = memory_breakdown(model, config, overheads)
    p = config.pp
    overhead = (p - 1) / m + (RECOMPUTE_OVERHEAD if config.recompute else 0.0)
    usable = gpu_memory * (1 - overheads.headroom)
    return Plan(
        config=config,
        breakdown=breakdown,
        memory=breakdown.total,
        usable=usable,
        comm=communication(model, config),
        bubble=(p - 1) / (m + p - 1),
        overhead=overhead,
        fits=breakdown.total <= usable,
    )


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def enumerate_configs(model: Model, num_gpus: int) -> list[Config]:
    """Every dp·tp·pp = num_gpus with tp dividing the heads (and the sequence, for sequence
    parallelism), pp at most the layers, the global batch divisible by dp·micro_batch; ZeRO
    1-3 only with dp > 1; sequence parallelism on and off when tp > 1; with and without
    recomputation. FSDP2's `reshard_after_forward` and gradient sync keep their defaults."""
    if not isinstance(num_gpus, int) or num_gpus < 1:
        raise ValueError(f"num_gpus must be an int >= 1, got {num_gpus!r}")
    out = []
    for tp in _divisors(num_gpus):
        for pp in _divisors(num_gpus // tp):
            dp = num_gpus // (tp * pp)
            if model.num_heads % tp or pp > model.num_layers:
                continue
            if model.global_batch % (dp * model.micro_batch):
                continue
            sps = (False, True) if tp > 1 and model.seq_len % tp == 0 else (False,)
            for zero in range(4) if dp > 1 else (0,):
                for sp in sps:
                    for recompute in (False, True):
                        out.append(Config(dp, tp, pp, zero, recompute, sequence_parallel=sp))
    return out


def find_configs(
    model: Model,
    gpu_memory: float,
    num_gpus: int,
    keep_all: bool = False,
    overheads: Overheads | None = None,
) -> list[Plan]:
    """The configurations that fit `gpu_memory` bytes per GPU (less the headroom), best
    first: least compute overhead (bubble + recomputation), then fewest bytes sent per GPU,
    then least memory. `keep_all=True` keeps those that do not fit too (after the ones that
    do)."""
    plans = [plan(model, c, gpu_memory, overheads) for c in enumerate_configs(model, num_gpus)]
    if not keep_all:
        plans = [p for p in plans if p.fits]
    return sorted(plans, key=lambda p: (not p.fits, p.overhead, p.comm["total"], p.memory))


def format_table(plans: list[Plan], limit: int = 10) -> str:
    """Plans as a text table (GB = 1e9 bytes), `limit` rows at most: model states,
    activations, everything else a step holds (`Memory.other`), the total against the usable
    memory, bytes sent, bubble, overhead."""
    head = (
        f"{'configuration':33} {'states':>6} {'acts':>6} {'other':>6} {'total':>6} "
        f"{'usable':>6} {'sent/step':>9} {'bubble':>6} {'overhead':>8} fits"
    )
    rows = [head]
    for p in plans[:limit]:
        b = p.breakdown
        rows.append(
            f"{p.config.label():33} {b.model_states / 1e9:6.2f} {b.activations / 1e9:6.2f} "
            f"{b.other / 1e9:6.2f} {p.memory / 1e9:6.2f} {p.usable / 1e9:6.2f} "
            f"{p.comm['total'] / 1e9:9.2f} {p.bubble:6.2f} {p.overhead:8.2f} "
            f"{'yes' if p.fits else 'no'}"
        )
    return "\n".join(rows)
