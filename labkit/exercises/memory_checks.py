"""Exercises of notebooks 37 (the memory of a step) and 42 (finding a configuration), kernel
side.

`check_layer_bytes` compares the learner's formula for the bytes one transformer layer saves
for backward with what autograd really saves in this process (counted by
`labkit.parallel.step_memory.SavedBytes` on a `Block`), over shapes where each term matters,
in fp32 and in bf16 (the LayerNorms' statistics fp32 either way, as on a GPU).
`check_attention_bytes` does the same for eager attention and SDPA/FlashAttention (the s²
probabilities against the output and its fp32 log-sum-exp), and `check_tp_activation_bytes`
for one tensor-parallel rank with and without torch's sequence parallelism (against
`step_memory.layer_activation_bytes`, itself checked against per-rank measurements in
tests/test_parallel_step_memory.py). `check_config_memory` compares the learner's model-state
bytes per GPU of a DP x TP x PP x ZeRO configuration with
`labkit.parallel.config_finder.model_state_bytes`, and names the usual mistakes: the weights
alone, fp32 sizes for bf16 weights, optimizer state forgotten, fp16 master weights, the ZeRO
degree not divided by, everything divided by it, TP and PP forgotten, the shard rounded down.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

from labkit.exercises import Verdict, reveal, right, wrong

__all__ = [
    "check_attention_bytes",
    "check_config_memory",
    "check_layer_bytes",
    "check_tp_activation_bytes",
    "solution_attention_bytes",
    "solution_config_memory",
    "solution_layer_bytes",
    "solution_tp_activation_bytes",
]

# (batch, seq, hidden, heads): seq varies against batch, so the s² term shows; hidden varies
LAYER_CASES = ((2, 8, 16, 2), (1, 32, 16, 4), (4, 8, 32, 4), (3, 12, 24, 3))


@functools.cache  # the bytes depend on the shapes alone: measure each shape once a process
def _measured_layer_bytes(
    batch: int, seq: int, hidden: int, heads: int, attention: str = "eager", element_size: int = 4
) -> int:
    """What autograd saves for one `Block` in fp32 (element_size 4) or bf16 (2). In bf16 the
    LayerNorms keep fp32 weights, so that the CPU kernel keeps fp32 statistics as CUDA's
    LayerNorm (and Megatron's fused one) does for bf16 input; everything else is bf16."""
    import torch

    from labkit.parallel.step_memory import SavedBytes, Stack

    dtype = {4: torch.float32, 2: torch.bfloat16}[element_size]
    torch.manual_seed(0)
    model = Stack(1, hidden, heads, attention=attention).to(dtype)
    for layer in model.layers:
        layer.ln1.float(), layer.ln2.float()
    with SavedBytes(model) as saved:
        loss = model(torch.randn(batch, seq, hidden, dtype=dtype)).float().sum()
    saved.backward(loss)
    return saved.per_layer[0]


def _layer_mistake(case: tuple[int, int, int, int], e: int, got: Any) -> str:
    b, s, h, a = case
    t = b * s
    if e != 4 and got == 4 * (16 * t * h + a * b * s * s) + 16 * t:
        return "the activations are element_size bytes each: a bf16 layer keeps 2, not 4"
    if e != 4 and got == e * (16 * t * h + a * b * s * s) + e * 4 * t:
        return (
            "the LayerNorm statistics stay fp32 (4 bytes) whatever the activations' dtype:"
            " 2 LayerNorms x (mean, 1/std) x T x 4 B"
        )
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
    in float32 (element_size 4) and in bfloat16 (2, the LayerNorm statistics fp32), checked
    against what autograd saves."""
    for case in LAYER_CASES:
        for e in (4, 2):
            want = _measured_layer_bytes(*case, element_size=e)
            try:
                got = fn(*case, e)
            except Exception as exc:  # noqa: BLE001 - the learner's error is the verdict
                return wrong(f"fn{(*case, e)} raised {exc!r}")
            if got != want:
                b, s, h, a = case
                return wrong(
                    f"batch {b}, seq {s}, hidden {h}, heads {a}, element_size {e}: got {got!r},"
                    f" autograd saved {want:,} bytes; {_layer_mistake(case, e, got)}"
                )
    return right(f"equal to the bytes autograd saved, fp32 and bf16, on {len(LAYER_CASES)} shapes")


def solution_layer_bytes() -> Any:
    return reveal("""
def layer_bytes(batch, seq, hidden, heads, element_size):
    tokens = batch * seq
    attention = element_size * (6 * tokens * hidden + heads * batch * seq * seq)
    mlp = element_size * 10 * tokens * hidden
    layernorm_stats = 2 * 2 * 4 * tokens          # mean and 1/std, fp32, two LayerNorms
    return attention + mlp + layernorm_stats
""")


def _attention_mistake(case: tuple[int, int, int, int], kind: str, got: Any) -> str:
    b, s, h, a = case
    t = b * s
    th, probs, lse = t * h, a * b * s * s, a * b * s
    if kind == "sdpa" and got == 4 * (16 * th + probs) + 16 * t:
        return "SDPA keeps no s x s matrix: its output and an fp32 log-sum-exp per query row"
    if kind == "eager" and got in (4 * 16 * th + 16 * t, 4 * (16 * th + lse) + 16 * t):
        return "eager attention keeps the softmax probabilities, a·b·s² numbers"
    if kind == "sdpa" and got == 4 * 16 * th + 16 * t:
        return "the log-sum-exp is missing: b·a·s fp32 numbers, what backward recomputes from"
    if kind == "sdpa" and got == 4 * (17 * th + lse) + 16 * t:
        return "SDPA's output is the context the output projection saves: one tensor, not two"
    if kind == "sdpa" and got == 4 * (16 * th + a * s) + 16 * t:
        return "the log-sum-exp has one number per query row of every sequence: b·a·s"
    if got in (
        2 * (16 * th + probs) + 16 * t,
        2 * (16 * th + probs) + 8 * t,
        2 * 16 * th + 4 * lse + 16 * t,
        2 * (16 * th + lse) + 8 * t,
    ):
        return "these are fp32 tensors: 4 bytes an element (2 is bf16/fp16)"
    return "count each tensor an op keeps for backward once (module doc of step_memory)"


def check_attention_bytes(fn: Callable[[int, int, int, int, str], Any]) -> Verdict:
    """`fn(batch, seq, hidden, heads, attention)`: the bytes one float32 `Block` saves for
    backward with attention "eager" or "sdpa" (`F.scaled_dot_product_attention`), checked
    against what autograd saves."""
    for case in LAYER_CASES:
        for kind in ("eager", "sdpa"):
            want = _measured_layer_bytes(*case, attention=kind)
            try:
                got = fn(*case, kind)
            except Exception as exc:  # noqa: BLE001 - the learner's error is the verdict
                return wrong(f"fn{(*case, kind)} raised {exc!r}")
            if got != want:
                b, s, h, a = case
                return wrong(
                    f"{kind}, batch {b}, seq {s}, hidden {h}, heads {a}: got {got!r}, autograd "
                    f"saved {want:,} bytes; {_attention_mistake(case, kind, got)}"
                )
    return right(f"equal to the bytes autograd saved, eager and SDPA, on {len(LAYER_CASES)} shapes")


def solution_attention_bytes() -> Any:
    return reveal("""
def attention_bytes(batch, seq, hidden, heads, attention):
    e, tokens = 4, batch * seq                     # float32
    kept = e * 16 * tokens * hidden + 2 * 2 * 4 * tokens   # the T·h tensors, LN statistics
    if attention == "eager":
        return kept + e * heads * batch * seq * seq    # the softmax probabilities
    return kept + 4 * batch * heads * seq              # SDPA: fp32 log-sum-exp per row
""")


# (batch, seq, hidden, heads, tp, sequence_parallel): tp 2 to 4, both with and without SP
TP_CASES = (
    (2, 8, 32, 4, 2, False),
    (2, 8, 32, 4, 2, True),
    (1, 16, 64, 8, 4, True),
    (3, 12, 24, 6, 3, False),
    (3, 12, 24, 6, 3, True),
)


def _tp_mistake(case: tuple[int, int, int, int, int, bool], got: Any) -> str:
    b, s, h, a, tp, seq_par = case
    t = b * s
    th, probs = t * h, a * b * s * s
    if got == 4 * (16 * th + probs) // tp + 16 * t // tp:
        if seq_par:
            return (
                "torch's SequenceParallel shards the LayerNorms' inputs, but the column-parallel"
                " q/k/v and fc1 save their all-gathered input whole (Megatron's re-gather in"
                " backward would divide everything)"
            )
        return (
            "without sequence parallelism the LayerNorms' inputs, outputs and statistics are"
            " whole on every TP rank"
        )
    if seq_par and got == 4 * (4 * th + (12 * th + probs) // tp) + 16 * t:
        return "sequence parallelism shards the LayerNorms' inputs and statistics over tp"
    if seq_par and got == 4 * (2 * th // tp + 2 * th + (12 * th + probs) // tp) + 16 * t:
        return "the LayerNorm statistics are per token: 1/tp of the tokens under SP"
    if got in (
        4 * (4 * th + 12 * th // tp + probs) + 16 * t,
        4 * (2 * th // tp + 2 * th + 12 * th // tp + probs) + 16 * t // tp,
    ):
        return "the probabilities are per head, and the heads are split over tp"
    return "LayerNorm inputs and outputs whole (inputs / tp with SP), the rest / tp"


def check_tp_activation_bytes(
    fn: Callable[[int, int, int, int, int, bool], Any],
) -> Verdict:
    """`fn(batch, seq, hidden, heads, tp, sequence_parallel)`: the bytes one float32 eager
    `Block` saves per rank under Megatron TP over `tp` ranks, with torch's SequenceParallel
    when `sequence_parallel`."""
    from labkit.parallel.step_memory import layer_activation_bytes

    for case in TP_CASES:
        b, s, h, a, tp, seq_par = case
        want = layer_activation_bytes(b, s, h, a, 4, tp=tp, sequence_parallel=seq_par)["total"]
        try:
            got = fn(*case)
        except Exception as exc:  # noqa: BLE001 - the learner's error is the verdict
            return wrong(f"fn{case} raised {exc!r}")
        if got != want:
            return wrong(
                f"batch {b}, seq {s}, hidden {h}, heads {a}, tp {tp}, sequence_parallel "
                f"{seq_par}: got {got!r}, expected {want:,} bytes; {_tp_mistake(case, got)}"
            )
    return right(f"per-rank bytes right on {len(TP_CASES)} TP/SP configurations")


def solution_tp_activation_bytes() -> Any:
    return reveal("""
def tp_bytes(batch, seq, hidden, heads, tp, sequence_parallel):
    e, tokens = 4, batch * seq
    th = tokens * hidden
    ln_in = th // tp if sequence_parallel else th     # the residual stream, sharded by SP
    ln_out = th                                       # the gathered q/k/v and fc1 input
    split = (12 * th + heads * batch * seq * seq) // tp   # q, k, v, context, P, fc1, GELU
    stats = 2 * 2 * 4 * tokens // (tp if sequence_parallel else 1)
    return e * (2 * ln_in + 2 * ln_out + split) + stats
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
        "the weights alone: a mixed-precision Adam step holds 16 bytes a parameter"
        " (2 weights + 2 grads + 12 optimizer)": by(2, 0, 0),
        "bf16 weights and grads are 2 bytes each, not 4 (fp32 sizes)": by(4, 4, 12),
    }


def check_config_memory(fn: Callable[[int, int, int, int, int], Any]) -> Verdict:
    """`fn(num_params, dp, tp, pp, zero)`: bytes of weights + grads + Adam state per GPU with
    mixed precision (bf16 weights and grads, fp32 master weights and moments)."""
    from labkit.parallel.config_finder import Config, Model, model_state_bytes

    answers = []
    for case in CONFIG_CASES:
        num_params, dp, tp, pp, zero = case
        model = Model(num_params, 8, 64, 8, 16, global_batch=dp)
        want = model_state_bytes(model, Config(dp, tp, pp, zero))["total"]
        try:
            answers.append((case, fn(*case), want))
        except Exception as exc:  # noqa: BLE001 - the learner's error is the verdict
            return wrong(f"fn{case} raised {exc!r}")
    failed = [(case, got, want) for case, got, want in answers if got != want]
    if failed:
        (num_params, dp, tp, pp, zero), got, want = failed[0]
        # the mistake that gives the learner's answer on every configuration, else the first
        # that gives it on this one (two mistakes can agree on one configuration)
        names = [w for w, v in _config_mistakes(*failed[0][0]).items() if v == got]
        everywhere = [w for w in names if all(_config_mistakes(*c)[w] == g for c, g, _ in answers)]
        why = next(
            iter(everywhere + names),
            "weights 2 + grads 2 + optimizer 12 bytes a parameter, split by tp·pp, then ZeRO's"
            " parts by dp",
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
