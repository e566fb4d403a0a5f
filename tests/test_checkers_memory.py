"""The checkers of notebooks 37 and 42 (in this process): right answers pass, the wrong
answers learners write are rejected and named."""

from __future__ import annotations

import pytest

from labkit.exercises import memory_checks as mc


def layer_right(b, s, h, a, e):
    t = b * s
    return e * (16 * t * h + a * b * s * s) + 16 * t


def layer_by_parts(b, s, h, a, e):  # the same, written op by op
    t = b * s
    attention = e * (t * h + t * h + 3 * t * h + a * b * s * s + t * h)
    mlp = e * (t * h + t * h + 4 * t * h + 4 * t * h)
    return attention + mlp + 2 * 2 * 4 * t


def layer_no_scores(b, s, h, a, e):
    return e * 16 * b * s * h + 16 * b * s


def layer_no_stats(b, s, h, a, e):
    return e * (16 * b * s * h + a * b * s * s)


def layer_korthikanti(b, s, h, a, e):
    return e * (34 * s * b * h + 5 * a * s * s * b) // 2


def layer_scores_without_batch(b, s, h, a, e):
    return e * (16 * b * s * h + a * s * s) + 16 * b * s


def layer_mlp_unexpanded(b, s, h, a, e):  # forgets the 4x of the MLP
    t = b * s
    return e * (6 * t * h + a * b * s * s + 4 * t * h) + 16 * t


def layer_stats_in_element_size(b, s, h, a, e):  # right in fp32, wrong in bf16
    return e * (16 * b * s * h + a * b * s * s) + e * 4 * b * s


def layer_fp32_always(b, s, h, a, e):  # element_size ignored: right in fp32 only
    return layer_right(b, s, h, a, 4)


def layer_half_of_fp32(b, s, h, a, e):  # the fp32 answer scaled by e/4, statistics too
    return layer_right(b, s, h, a, 4) * e // 4


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (layer_right, True, "fp32 and bf16"),
        (layer_by_parts, True, "fp32 and bf16"),
        (layer_no_scores, False, "the attention scores are missing"),
        (layer_no_stats, False, "statistics are missing"),
        (layer_korthikanti, False, "with dropout"),
        (layer_scores_without_batch, False, "a·b·s², not a·s²"),
        (layer_mlp_unexpanded, False, "count each tensor"),
        (layer_stats_in_element_size, False, "statistics stay fp32"),
        (layer_fp32_always, False, "a bf16 layer keeps 2, not 4"),
        (layer_half_of_fp32, False, "statistics stay fp32"),
        (lambda b, s, h: 0, False, "raised TypeError"),
    ],
)
def test_check_layer_bytes(fn, ok, says):
    verdict = mc.check_layer_bytes(fn)
    assert bool(verdict) is ok and says in verdict.message, verdict.message


def test_layer_solution_passes():
    namespace: dict = {}
    exec(mc.solution_layer_bytes().code, namespace)
    assert mc.check_layer_bytes(namespace["layer_bytes"])


def attention_right(b, s, h, a, kind):
    t = b * s
    kept = 4 * 16 * t * h + 16 * t
    return kept + (4 * a * b * s * s if kind == "eager" else 4 * b * a * s)


def attention_by_parts(b, s, h, a, kind):  # op by op: LN in/out x2, q k v, context, MLP
    t = b * s
    ln = 2 * (4 * t * h + 4 * t * h + 2 * 4 * t)
    core = 4 * (3 * t * h + t * h)
    scores = 4 * a * b * s * s if kind == "eager" else 4 * b * a * s
    return ln + core + scores + 4 * 8 * t * h


def attention_s2_kept(b, s, h, a, kind):  # the eager formula for both
    return layer_right(b, s, h, a, 4)


def attention_s2_forgotten(b, s, h, a, kind):  # the SDPA answer for both
    return attention_right(b, s, h, a, "sdpa")


def attention_no_lse(b, s, h, a, kind):
    return attention_right(b, s, h, a, kind) - (4 * b * a * s if kind == "sdpa" else 0)


def attention_output_twice(b, s, h, a, kind):  # SDPA's output and the context, both
    return attention_right(b, s, h, a, kind) + (4 * b * s * h if kind == "sdpa" else 0)


def attention_16_bit(b, s, h, a, kind):  # the Playbook's 2 bytes for fp32 tensors
    t = b * s
    return 2 * (16 * t * h + (a * b * s * s if kind == "eager" else 0)) + (
        16 * t + (4 * b * a * s if kind == "sdpa" else 0)
    )


def attention_lse_without_batch(b, s, h, a, kind):
    return attention_right(b, s, h, a, kind) - (4 * (b - 1) * a * s if kind == "sdpa" else 0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (attention_right, True, "eager and SDPA"),
        (attention_by_parts, True, "eager and SDPA"),
        (attention_s2_kept, False, "SDPA keeps no s x s matrix"),
        (attention_s2_forgotten, False, "eager attention keeps the softmax probabilities"),
        (attention_no_lse, False, "the log-sum-exp is missing"),
        (attention_output_twice, False, "one tensor, not two"),
        (attention_16_bit, False, "4 bytes an element"),
        (attention_lse_without_batch, False, "b·a·s"),
        (lambda b, s, h, a: 0, False, "raised TypeError"),
    ],
)
def test_check_attention_bytes(fn, ok, says):
    verdict = mc.check_attention_bytes(fn)
    assert bool(verdict) is ok and says in verdict.message, verdict.message


def test_attention_solution_passes():
    namespace: dict = {}
    exec(mc.solution_attention_bytes().code, namespace)
    assert mc.check_attention_bytes(namespace["attention_bytes"])


def tp_right(b, s, h, a, tp, sp):
    t = b * s
    th = t * h
    ln_in = th // tp if sp else th
    return 4 * (2 * ln_in + 2 * th + (12 * th + a * b * s * s) // tp) + 16 * t // (tp if sp else 1)


def tp_all_divided(b, s, h, a, tp, sp):  # "tensor parallelism divides everything by tp"
    t = b * s
    return (4 * (16 * t * h + a * b * s * s) + 16 * t) // tp


def tp_megatron_sp(b, s, h, a, tp, sp):  # SP right without it, 34/t with it
    return tp_all_divided(b, s, h, a, tp, sp) if sp else tp_right(b, s, h, a, tp, sp)


def tp_sp_ignored(b, s, h, a, tp, sp):
    return tp_right(b, s, h, a, tp, False)


def tp_stats_whole(b, s, h, a, tp, sp):
    t = b * s
    return tp_right(b, s, h, a, tp, sp) + (16 * t - 16 * t // tp if sp else 0)


def tp_scores_whole(b, s, h, a, tp, sp):
    return tp_right(b, s, h, a, tp, sp) + 4 * a * b * s * s * (tp - 1) // tp


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (tp_right, True, "right on 5 TP/SP configurations"),
        (tp_all_divided, False, "without sequence parallelism the LayerNorms"),
        (tp_megatron_sp, False, "save their all-gathered input whole"),
        (tp_sp_ignored, False, "shards the LayerNorms' inputs and statistics"),
        (tp_stats_whole, False, "1/tp of the tokens under SP"),
        (tp_scores_whole, False, "the heads are split over tp"),
        (lambda b, s, h, a, tp: 0, False, "raised TypeError"),
    ],
)
def test_check_tp_activation_bytes(fn, ok, says):
    verdict = mc.check_tp_activation_bytes(fn)
    assert bool(verdict) is ok and says in verdict.message, verdict.message


def test_tp_solution_passes():
    namespace: dict = {}
    exec(mc.solution_tp_activation_bytes().code, namespace)
    assert mc.check_tp_activation_bytes(namespace["tp_bytes"])


def _ceil(a, b):
    return -(-a // b)


def config_right(psi, dp, tp, pp, zero):
    local = _ceil(psi, tp * pp)
    shard = _ceil(local, dp)
    return (
        2 * (shard if zero >= 3 else local)
        + 2 * (shard if zero >= 2 else local)
        + 12 * (shard if zero >= 1 else local)
    )


def config_parts(psi, dp, tp, pp, zero):  # the same, by lists of parts
    local = _ceil(psi, tp * pp)
    sizes = [local if zero < k else _ceil(local, dp) for k in (3, 2, 1)]
    return sum(b * n for b, n in zip((2, 2, 4 + 4 + 4), sizes))


def _like(p, g, o, divide_zero=True, split=True, ceil=True):
    def fn(psi, dp, tp, pp, zero):
        local = _ceil(psi, tp * pp) if split else psi
        shard = (_ceil(local, dp) if ceil else local // dp) if divide_zero else local
        return (
            p * (shard if zero >= 3 else local)
            + g * (shard if zero >= 2 else local)
            + o * (shard if zero >= 1 else local)
        )

    return fn


def config_all_divided(psi, dp, tp, pp, zero):
    return 16 * _ceil(_ceil(psi, tp * pp), dp)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (config_right, True, "right on 5 configurations"),
        (config_parts, True, "right on 5 configurations"),
        (_like(2, 2, 0), False, "the optimizer state is missing"),
        (_like(2, 2, 10), False, "master weights are fp32"),
        (_like(2, 2, 4), False, "two moments are missing"),
        (_like(2, 2, 12, divide_zero=False), False, "ZeRO divides by the data-parallel"),
        (config_all_divided, False, "only the stage's parts are sharded"),
        (_like(2, 2, 12, split=False), False, "TP and PP split the parameters first"),
        (_like(2, 2, 12, ceil=False), False, "the shard rounds up"),
        (_like(4, 4, 8), False, "weights 2 + grads 2 + optimizer 12"),
        (_like(2, 0, 0), False, "the weights alone"),
        (_like(4, 4, 12), False, "not 4 (fp32 sizes)"),
        (lambda psi: psi, False, "raised TypeError"),
    ],
)
def test_check_config_memory(fn, ok, says):
    verdict = mc.check_config_memory(fn)
    assert bool(verdict) is ok and says in verdict.message, verdict.message


def test_config_solution_passes():
    namespace: dict = {}
    exec(mc.solution_config_memory().code, namespace)
    assert mc.check_config_memory(namespace["config_memory"])
