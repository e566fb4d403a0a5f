"""A configuration finder: DP x TP x PP x ZeRO choices, their memory and traffic (pure functions).

Imported by the ranks and the kernel alike; nothing here talks to other processes. Every
formula is one a notebook checks on the ranks:

- model states, ZeRO stages 0-3 (notebook 26, `zero_redundancy.zero_memory`): per GPU the
  Psi / (tp·pp) parameters of its TP slice of its pipeline stage, 2 + 2 + 12 bytes each in
  mixed precision (4 + 4 + 8 in fp32), stage s sharding optimizer state, then grads, then
  weights over the dp ranks (padded shards of ceil(Psi' / dp));
- activations (notebook 37, `step_memory.layer_activation_bytes`): per layer and micro-batch
  e·(2·T·h + (4·T·h + a·b·s²)/tp) for attention, e·(2·T·h + 8·T·h/tp) for the MLP, 16·T for
  the LayerNorms' fp32 statistics; with recomputation a layer keeps only its input e·T·h, plus
  one layer's full activations while it is recomputed. A pipeline stage holds L/pp layers and,
  under 1F1B, min(pp, m) micro-batches in flight (notebook 31);
- the pipeline bubble (p-1)/(m+p-1) of the step (notebook 31), and the idle time it adds
  relative to the ideal step, (p-1)/m;
- tensor parallelism (notebook 32): per layer and micro-batch two all_reduces in forward (after
  attention and after the MLP) and two in backward, each of the layer's whole output
  b·s·h·e bytes; a ring all_reduce sends 2(t-1)/t of its buffer;
- data parallelism (notebook 26): ZeRO-0 all_reduces the grads once per step; ZeRO-1
  reduce-scatters them once and all-gathers the weights once (the same bytes); ZeRO-2 must
  reduce-scatter every micro-batch's grads (it keeps no whole gradient to accumulate into);
  ZeRO-3 also all-gathers the weights before every micro-batch's forward and backward.
  Reduce-scatter and all-gather send (d-1)/d of the whole buffer;
- pipeline point-to-point: a stage sends each micro-batch's activation forward and its
  gradient back, b·s·h·e bytes each (2·m of them for a middle stage, m for the ends).

Recomputation costs about one more forward per layer: a third of forward + backward (the
backward is about twice the forward), the figure notebook 37 measures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from labkit.parallel.step_memory import layer_activation_bytes

__all__ = [
    "Config",
    "Model",
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


@dataclass(frozen=True)
class Model:
    """A transformer: `num_params` Psi, `num_layers` L, `hidden` h, `num_heads` a, sequence
    `seq_len` s, `global_batch` sequences per step, `micro_batch` b sequences per replica and
    micro-batch; `mixed_precision`: bf16 weights/grads/activations with fp32 master weights."""

    num_params: int
    num_layers: int
    hidden: int
    num_heads: int
    seq_len: int
    global_batch: int
    micro_batch: int = 1
    mixed_precision: bool = True

    def __post_init__(self) -> None:
        for name in ("num_params", "num_layers", "hidden", "num_heads", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden={self.hidden} must be a multiple of num_heads")
        if self.micro_batch < 1 or self.global_batch % self.micro_batch:
            raise ValueError(
                f"micro_batch={self.micro_batch} must be >= 1 and divide "
                f"global_batch={self.global_batch}"
            )

    @property
    def element_size(self) -> int:
        return 2 if self.mixed_precision else 4


@dataclass(frozen=True)
class Config:
    """dp·tp·pp GPUs; ZeRO `zero` (0-3) over the dp ranks; `recompute` every layer."""

    dp: int
    tp: int
    pp: int
    zero: int = 0
    recompute: bool = False

    def __post_init__(self) -> None:
        if min(self.dp, self.tp, self.pp) < 1:
            raise ValueError(f"dp, tp and pp must be >= 1, got {self.dp}, {self.tp}, {self.pp}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero must be 0, 1, 2 or 3, got {self.zero}")

    @property
    def num_gpus(self) -> int:
        return self.dp * self.tp * self.pp

    def label(self) -> str:
        return f"dp{self.dp} tp{self.tp} pp{self.pp} zero{self.zero}" + (
            " recompute" if self.recompute else ""
        )


def num_microbatches(model: Model, config: Config) -> int:
    """Micro-batches each replica runs per step: global_batch / (dp · micro_batch)."""
    per_replica, left = divmod(model.global_batch, config.dp * model.micro_batch)
    if left or per_replica < 1:
        raise ValueError(
            f"global_batch={model.global_batch} is not a multiple of dp·micro_batch="
            f"{config.dp * model.micro_batch}"
        )
    return per_replica


def model_state_bytes(model: Model, config: Config) -> dict[str, int]:
    """Bytes per GPU of weights, grads and optimizer state (fp32 master weights included)."""
    local = math.ceil(model.num_params / (config.tp * config.pp))
    shard = math.ceil(local / config.dp)
    per = (2, 2, 12) if model.mixed_precision else (4, 4, 8)
    out = {
        "params": per[0] * (shard if config.zero >= 3 else local),
        "grads": per[1] * (shard if config.zero >= 2 else local),
        "optimizer": per[2] * (shard if config.zero >= 1 else local),
    }
    out["total"] = sum(out.values())
    return out


def activation_bytes(model: Model, config: Config) -> int:
    """Activation bytes the busiest pipeline stage holds (its first, under 1F1B)."""
    layers = math.ceil(model.num_layers / config.pp)
    in_flight = min(config.pp, num_microbatches(model, config))
    b, s, h, a, e = (model.micro_batch, model.seq_len, model.hidden, model.num_heads,
                     model.element_size)  # fmt: skip
    full = layer_activation_bytes(b, s, h, a, e, tp=config.tp)["total"]
    if not config.recompute:
        return layers * in_flight * full
    kept = model.element_size * model.micro_batch * model.seq_len * model.hidden
    return layers * in_flight * kept + full


SENT_FACTOR = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0}  # x (n-1)/n


def collective_calls(model: Model, config: Config) -> dict[str, list[tuple[str, int, int]]]:
    """The collectives of one step on one GPU, by kind (dp, tp, pp): (op, calls, buffer
    bytes) as labkit's trace records them (the whole buffer; padded to a multiple of dp)."""
    m = num_microbatches(model, config)
    e = model.element_size
    d, t, p = config.dp, config.tp, config.pp
    local = math.ceil(model.num_params / (t * p))
    flat = math.ceil(local / d) * d * e
    by_stage = {
        0: [("all_reduce", 1, flat)],
        1: [("reduce_scatter", 1, flat), ("all_gather", 1, flat)],
        2: [("reduce_scatter", m, flat), ("all_gather", 1, flat)],
        3: [("all_gather", 2 * m, flat), ("reduce_scatter", m, flat)],
    }
    act = model.micro_batch * model.seq_len * model.hidden * e
    layers = math.ceil(model.num_layers / p)
    return {
        "dp": by_stage[config.zero] if d > 1 else [],
        "tp": [("all_reduce", 4 * layers * m, act)] if t > 1 else [],
        "pp": [("send", 2 * m, act)] if p > 1 else [],
    }


def communication(model: Model, config: Config) -> dict[str, float]:
    """Bytes one GPU sends per step, by kind (dp, tp, pp), and their total: a collective over
    n ranks sends (n-1)/n of its buffer (twice that for all_reduce), a send all of it."""
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
    config: Config
    model_states: int
    activations: int
    memory: int
    comm: dict[str, float] = field(compare=False)
    bubble: float
    overhead: float  # extra compute time relative to the ideal step: bubble + recomputation
    fits: bool


def plan(model: Model, config: Config, gpu_memory: float) -> Plan:
    """Memory per GPU, bytes sent per GPU and step, and compute overhead of one choice."""
    m = num_microbatches(model, config)
    states = model_state_bytes(model, config)["total"]
    acts = activation_bytes(model, config)
    p = config.pp
    overhead = (p - 1) / m + (RECOMPUTE_OVERHEAD if config.recompute else 0.0)
    return Plan(
        config=config,
        model_states=states,
        activations=acts,
        memory=states + acts,
        comm=communication(model, config),
        bubble=(p - 1) / (m + p - 1),
        overhead=overhead,
        fits=states + acts <= gpu_memory,
    )


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def enumerate_configs(model: Model, num_gpus: int) -> list[Config]:
    """Every dp·tp·pp = num_gpus with tp dividing the heads, pp at most the layers, the
    global batch divisible by dp·micro_batch; ZeRO 1-3 only with dp > 1; with and without
    recomputation."""
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
    out = []
    for tp in _divisors(num_gpus):
        for pp in _divisors(num_gpus // tp):
            dp = num_gpus // (tp * pp)
            if model.num_heads % tp or pp > model.num_layers:
                continue
            if model.global_batch % (dp * model.micro_batch):
                continue
            for zero in range(4) if dp > 1 else (0,):
                for recompute in (False, True):
                    out.append(Config(dp, tp, pp, zero, recompute))
    return out


def find_configs(
    model: Model, gpu_memory: float, num_gpus: int, keep_all: bool = False
) -> list[Plan]:
    """The configurations that fit `gpu_memory` bytes per GPU, best first: least compute
    overhead (bubble + recomputation), then fewest bytes sent per GPU, then least memory.
    `keep_all=True` keeps those that do not fit too (after the ones that do)."""
    plans = [plan(model, c, gpu_memory) for c in enumerate_configs(model, num_gpus)]
    if not keep_all:
        plans = [p for p in plans if p.fits]
    return sorted(plans, key=lambda p: (not p.fits, p.overhead, p.comm["total"], p.memory))


def format_table(plans: list[Plan], limit: int = 10) -> str:
    """Plans as a text table (GB = 1e9 bytes), `limit` rows at most."""
    head = (
        f"{'configuration':30} {'states GB':>9} {'acts GB':>8} {'total GB':>8} "
        f"{'sent GB/step':>12} {'bubble':>6} {'overhead':>8} fits"
    )
    rows = [head]
    for p in plans[:limit]:
        rows.append(
            f"{p.config.label():30} {p.model_states / 1e9:9.2f} {p.activations / 1e9:8.2f} "
            f"{p.memory / 1e9:8.2f} {p.comm['total'] / 1e9:12.2f} {p.bubble:6.2f} "
            f"{p.overhead:8.2f} {'yes' if p.fits else 'no'}"
        )
    return "\n".join(rows)
