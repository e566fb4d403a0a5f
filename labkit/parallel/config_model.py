"""The configuration finder's inputs: a model and a parallel configuration (pure, validated).

Imported by the ranks and the kernel alike (`config_finder`, `config_memory`). Each dataclass
checks its fields in `__post_init__` and says, in a ValueError, which field was wrong and what
it may be: a finder that takes any number silently finds configurations for models that
cannot exist.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ATTENTION", "Config", "Model", "num_microbatches"]

ATTENTION = ("sdpa", "eager")


def _positive_ints(obj: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, float) and value.is_integer():  # 7e9 parameters: a whole number
            value = int(value)
            object.__setattr__(obj, name, value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _bools(obj: object, names: tuple[str, ...]) -> None:
    for name in names:
        if not isinstance(getattr(obj, name), bool):
            raise ValueError(f"{name} must be True or False, got {getattr(obj, name)!r}")


@dataclass(frozen=True)
class Model:
    """A transformer: `num_params` Psi, `num_layers` L, `hidden` h, `num_heads` a, sequence
    `seq_len` s, `global_batch` sequences per step, `micro_batch` b sequences per replica and
    micro-batch; `mixed_precision`: bf16 weights/grads/activations with fp32 master weights;
    `vocab` V (the logits); `attention`: "sdpa" (F.scaled_dot_product_attention,
    FlashAttention: no s² term kept) or "eager" (keeps the a·b·s² probabilities);
    `layer_params`: parameters of one layer, the unit FSDP2 gathers (default 12h² + 13h: q, k,
    v, o, fc1, fc2 with biases, two LayerNorms)."""

    num_params: int
    num_layers: int
    hidden: int
    num_heads: int
    seq_len: int
    global_batch: int
    micro_batch: int = 1
    mixed_precision: bool = True
    vocab: int = 32_000
    attention: str = "sdpa"
    layer_params: int | None = None

    def __post_init__(self) -> None:
        names = ("num_params", "num_layers", "hidden", "num_heads", "seq_len", "global_batch")
        _positive_ints(self, (*names, "micro_batch", "vocab"))
        _bools(self, ("mixed_precision",))
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden={self.hidden} must be a multiple of num_heads")
        if self.global_batch % self.micro_batch:
            raise ValueError(
                f"micro_batch={self.micro_batch} must be >= 1 and divide "
                f"global_batch={self.global_batch}"
            )
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {self.attention!r}")
        if self.layer_params is not None:
            _positive_ints(self, ("layer_params",))
            if self.layer_params > self.num_params:
                raise ValueError(
                    f"layer_params={self.layer_params} must be at most num_params={self.num_params}"
                )

    @property
    def element_size(self) -> int:
        return 2 if self.mixed_precision else 4

    @property
    def params_per_layer(self) -> int:
        h = self.hidden
        return self.layer_params if self.layer_params is not None else 12 * h * h + 13 * h


@dataclass(frozen=True)
class Config:
    """dp·tp·pp GPUs; ZeRO `zero` (0-3) over the dp ranks; `recompute` every layer;
    `sequence_parallel` (tp > 1 only): the LayerNorms' inputs sharded over the TP ranks too.
    ZeRO-3 only (FSDP2's switches): `reshard_after_forward=False` keeps every unit's gathered
    weights from forward to backward (half the all-gathers); `sync_every_microbatch=False`
    turns gradient sync off for the first m-1 micro-batches (one reduce-scatter a step, every
    unit's unsharded gradient held until then)."""

    dp: int
    tp: int
    pp: int
    zero: int = 0
    recompute: bool = False
    sequence_parallel: bool = False
    reshard_after_forward: bool = True
    sync_every_microbatch: bool = True

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"dp, tp and pp must be ints >= 1, got {self.dp}, {self.tp}, {self.pp}"
                )
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise ValueError(f"zero must be 0, 1, 2 or 3, got {self.zero!r}")
        _bools(self, ("recompute", "sequence_parallel", "reshard_after_forward"))
        _bools(self, ("sync_every_microbatch",))
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1 (it shards over the TP ranks)")
        fsdp_defaults = self.reshard_after_forward and self.sync_every_microbatch
        if not fsdp_defaults and self.zero != 3:
            raise ValueError(
                f"reshard_after_forward and sync_every_microbatch are FSDP2 (zero=3) switches; "
                f"with zero={self.zero} both must stay True"
            )

    @property
    def num_gpus(self) -> int:
        return self.dp * self.tp * self.pp

    def label(self) -> str:
        flags = [
            (self.sequence_parallel, "sp"),
            (self.recompute, "recompute"),
            (not self.reshard_after_forward, "no-reshard"),
            (not self.sync_every_microbatch, "sync-last"),
        ]
        return f"dp{self.dp} tp{self.tp} pp{self.pp} zero{self.zero}" + "".join(
            f" {word}" for on, word in flags if on
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
