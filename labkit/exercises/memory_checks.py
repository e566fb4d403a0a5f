"""Exercises of notebooks 37 (the memory of a step) and 42 (finding a configuration), kernel
side.

`check_layer_bytes` compares the learner's formula for the bytes one transformer layer saves
for backward with what autograd really saves in this process (counted by
`labkit.parallel.step_memory.SavedBytes` on a `Block`), over shapes where each term matters.
`check_config_memory` compares the learner's model-state bytes per GPU of a DP x TP x PP x ZeRO
configuration with `labkit.parallel.config_finder.model_state_bytes`, and names the usual
mistakes: optimizer state forgotten, fp16 master weights, the ZeRO degree not divided by,
everything divided by it, TP and PP forgotten, the shard rounded down.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from labkit.exercises import Verdict, reveal, right, wrong

__all__ = [
    "check_config_memory",
    "check_layer_bytes",
    "solution_config_memory",
    "solution_layer_bytes",
]

# (batch, seq, hidden, heads): seq varies against batch, so the s² term shows; hidden varies
LAYER_CASES = ((2, 8, 16, 2), (1, 32, 16, 4), (4, 8, 32, 4), (3, 12, 24, 3))


def _measured_layer_bytes(batch: int, seq: int, hidden: int, heads: int) -> int:
    import torch

    from labkit.parallel.step_memory import SavedBytes, Stack

    torch.manual_seed(0)
    model = Stack(1, hidden, heads)
    with SavedBytes(model) as saved:
        loss = model(torch.randn(batch, seq, hidden)).sum()
    saved.backward(loss)
    return saved.per_layer[0]


def _layer_mistake(case: tuple[int, int, int, int], got: Any) -> str:
    b, s, h, a = case
    e, t = 4, b * s
    if got == e * 16 * t * h + 16 * t:
        return "the attention scores are missing: softmax keeps a·b·s² numbers, one per pair"
    if got == e * (16 * t * h + a * b * s * s):
        return "the LayerNorms' statistics are missing: 2 LayerNorms x (mean, 1/std) x T x 4 B"
    if got == e * (34 * t * h + 5 * a * b * s * s) // 2:
        return "that is Korthikanti's 34sbh + 5as²b, with dropout: this layer has none"
    if got == e * (16 * t * h + a * s * s) + 16 * t:
        return "the scores grow with the batch too: a·b·s², not a·s²"
    return "count each tensor an op keeps for backward once (module doc of step_memory)"


def check_layer_bytes(fn: Callable[[int, int, int, int, int], Any]) -> Verdict:
    """`fn(batch, seq, hidden, heads, element_size)`: the bytes one `Block` saves for backward
    in float32 (element_size 4), checked against what autograd saves."""
    for case in LAYER_CASES:
        want = _measured_layer_bytes(*case)
        try:
            got = fn(*case, 4)
        except Exception as exc:  # noqa: BLE001 - the learner's error is the verdict
            return wrong(f"fn{(*case, 4)} raised {exc!r}")
        if got != want:
            b, s, h, a = case
            return wrong(
                f"batch {b}, seq {s}, hidden {h}, heads {a}: got {got!r}, autograd saved "
                f"{want:,} bytes; {_layer_mistake(case, got)}"
            )
    return right(f"equal to the bytes autograd saved, on {len(LAYER_CASES)} shapes")


def solution_layer_bytes() -> Any:
    return reveal("""
def layer_bytes(batch, seq, hidden, heads, element_size):
    tokens = batch * seq
    attention = element_size * (6 * tokens * hidden + heads * batch * seq * seq)
    mlp = element_size * 10 * tokens * hidden
    layernorm_stats = 2 * 2 * 4 * tokens          # mean and 1/std, fp32, two LayerNorms
    return attention + mlp + layernorm_stats
""")


# (num_params, dp, tp, pp, zero)
CONFIG_CASES = (
    (7_000_000_000, 8, 2, 4, 1),
    (7_000_000_000, 16, 4, 1, 3),
    (1_000_003, 4, 1, 2, 2),
    (1_000_003, 3, 1, 1, 0),
    (1_000_003, 6, 2, 1, 3),
)


def _config_mistakes(num_params: int, dp: int, tp: int, pp: int, zero: int) -> dict[str, int]:
    local = math.ceil(num_params / (tp * pp))
    shard = math.ceil(local / dp)

    def by(p: int, g: int, o: int, sh: int = shard, loc: int = local) -> int:
        return (
            p * (sh if zero >= 3 else loc)
            + g * (sh if zero >= 2 else loc)
            + o * (sh if zero >= 1 else loc)
        )

    return {
        "the optimizer state is missing: Adam keeps an fp32 master copy and two fp32 moments,"
        " 12 bytes a parameter": by(2, 2, 0),
        "the master weights are fp32 (4 bytes), not fp16: 2 + 2 + (4 + 4 + 4)": by(2, 2, 10),
        "Adam's two moments are missing: 4 bytes of master weights only": by(2, 2, 4),
        "ZeRO divides by the data-parallel degree: stage s shards the optimizer state, then"
        " the grads, then the weights over dp": 16 * local,
        "only the stage's parts are sharded: stage 1 the optimizer state, 2 the grads too,"
        " 3 the weights too": 16 * shard,
        "TP and PP split the parameters first: each GPU holds Psi / (tp·pp) before ZeRO": by(
            2, 2, 12, math.ceil(num_params / dp), num_params
        ),
        "the shard rounds up: ceil(Psi' / dp) parameters, padded": by(2, 2, 12, local // dp, local),
    }


def check_config_memory(fn: Callable[[int, int, int, int, int], Any]) -> Verdict:
    """`fn(num_params, dp, tp, pp, zero)`: bytes of weights + grads + Adam state per GPU with
    mixed precision (bf16 weights and grads, fp32 master weights and moments)."""
    from labkit.parallel.config_finder import Config, Model, model_state_bytes

    for case in CONFIG_CASES:
        num_params, dp, tp, pp, zero = case
        model = Model(num_params, 8, 64, 8, 16, global_batch=dp)
        want = model_state_bytes(model, Config(dp, tp, pp, zero))["total"]
        try:
            got = fn(*case)
        except Exception as exc:  # noqa: BLE001 - the learner's error is the verdict
            return wrong(f"fn{case} raised {exc!r}")
        if got != want:
            why = next(
                (w for w, v in _config_mistakes(*case).items() if v == got and v != want),
                "weights 2 + grads 2 + optimizer 12 bytes a parameter, split by tp·pp, then"
                " ZeRO's parts by dp",
            )
            return wrong(
                f"{num_params:,} parameters, dp {dp} tp {tp} pp {pp} ZeRO-{zero}: got "
                f"{got!r}, expected {want:,} bytes; {why}"
            )
    return right(f"model-state bytes per GPU right on {len(CONFIG_CASES)} configurations")


def solution_config_memory() -> Any:
    return reveal("""
def config_memory(num_params, dp, tp, pp, zero):
    local = -(-num_params // (tp * pp))      # this GPU's TP slice of its pipeline stage
    shard = -(-local // dp)                  # ZeRO's padded shard
    weights = 2 * (shard if zero >= 3 else local)    # bf16
    grads = 2 * (shard if zero >= 2 else local)      # bf16
    optimizer = 12 * (shard if zero >= 1 else local)  # fp32 master + two fp32 moments
    return weights + grads + optimizer
""")
