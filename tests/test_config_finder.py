"""The configuration finder (labkit.parallel.config_finder, config_model, config_memory)
against cases worked out by hand, one for each term, in this process; the measured cases on
the ranks are in test_parallel_step_memory.py, test_parallel_data_zero.py and notebook 42."""

from __future__ import annotations

import dataclasses
import re

import pytest

from labkit.parallel.config_finder import (
    Config,
    Model,
    Overheads,
    activation_bytes,
    collective_calls,
    communication,
    enumerate_configs,
    find_configs,
    format_table,
    model_state_bytes,
    plan,
)
from labkit.parallel.zero_redundancy import zero_memory

SEVEN_B = Model(7_000_000_000, 32, 4096, 32, 4096, global_batch=512, micro_batch=1)
LLM = dataclasses.replace(SEVEN_B, global_batch=256)  # notebook 42's model
NONE = Overheads.none()


def test_model_states_by_hand():
    # 7e9 params, tp 2 pp 2: 1.75e9 per GPU; ZeRO-1 over dp 4: 2+2 whole, 12 over 4
    got = model_state_bytes(SEVEN_B, Config(4, 2, 2, zero=1))
    assert got == {
        "params": 3_500_000_000,
        "grads": 3_500_000_000,
        "optimizer": 5_250_000_000,
        "total": 12_250_000_000,
    }
    fp32 = Model(1000, 2, 8, 2, 4, global_batch=4, mixed_precision=False)
    assert model_state_bytes(fp32, Config(1, 1, 1))["total"] == 16 * 1000  # 4 + 4 + 8
    # a padded shard: ceil(1001 / 4) = 251 parameters a rank
    odd = Model(1001, 2, 8, 2, 4, global_batch=4)
    assert model_state_bytes(odd, Config(4, 1, 1, zero=3))["total"] == 16 * 251


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_model_states_equal_notebook_26_formula(zero):
    model = Model(19_210, 2, 8, 2, 4, global_batch=4)
    got = model_state_bytes(model, Config(4, 1, 1, zero=zero))
    assert got == zero_memory(19_210, 4, zero)


def test_activations_by_hand():
    """b 1, s 4, h 8, a 2, bf16 (e 2): T = 4 tokens, T·h = 32.

    eager, per layer: attention 2·(2·32) + 2·(4·32 + a·b·s² = 2·16) = 128 + 320 = 448,
      MLP 2·(2·32 + 8·32) = 640, LayerNorm statistics 4·4·T = 64: 1152 bytes;
    SDPA: the 2·16 probabilities (64 bytes) become an fp32 log-sum-exp, 4·b·a·s = 32:
      attention 128 + 256 + 32 = 416: 1120 bytes;
    tp 2 without SP (eager): the LayerNorms' inputs and outputs stay whole: attention
      128 + 320/2 = 288, MLP 2·(64 + 256/2) = 384, + 64: 736 (not 1152/2 = 576);
    tp 2 with SP (eager): the LayerNorms' inputs and statistics halve, their outputs
      (the column-parallel input) stay whole: attention 2·(16 + 32) + 160 = 256,
      MLP 2·(48 + 128) = 352, statistics 32: 640.
    """
    eager = Model(1000, 4, 8, 2, 4, global_batch=8, vocab=8, attention="eager")
    sdpa = dataclasses.replace(eager, attention="sdpa")
    assert Model(1000, 4, 8, 2, 4, global_batch=8).attention == "sdpa"  # the default
    assert activation_bytes(eager, Config(1, 1, 1)) == 4 * 1152  # m = 8, one in flight
    assert activation_bytes(sdpa, Config(1, 1, 1)) == 4 * 1120
    # pp 2 under 1F1B: 2 layers a stage, 2 micro-batches in flight on the first stage, which
    # is the busiest: the last holds one, 2·1152, plus logits 3·b·s·V·4 = 384 bytes
    assert activation_bytes(eager, Config(1, 1, 2)) == 2 * 2 * 1152
    assert plan(eager, Config(1, 1, 2), 1e9, NONE).breakdown.logits == 0
    # with V = 32000 the last stage is the busiest: 2·1152 + 3·4·32000·4 = 1,538,304
    wide = plan(dataclasses.replace(eager, vocab=32_000), Config(1, 1, 2), 1e9, NONE)
    assert (wide.activations, wide.breakdown.logits) == (2 * 1152, 1_536_000)
    # recompute: each layer keeps its input, 2·32 bytes, plus one layer recomputed
    assert activation_bytes(eager, Config(1, 1, 1, recompute=True)) == 4 * 64 + 1152
    assert activation_bytes(eager, Config(1, 2, 1)) == 4 * 736
    assert activation_bytes(eager, Config(1, 2, 1, sequence_parallel=True)) == 4 * 640
    # SP also halves a checkpointed layer's input: 4 · 32 + one layer (640)
    sp_rc = Config(1, 2, 1, recompute=True, sequence_parallel=True)
    assert activation_bytes(eager, sp_rc) == 4 * 32 + 640


def test_every_memory_term_by_hand():
    """ZeRO-3 over dp 2, tp 2, bf16, b 1, s 4, h 8, a 2, V 100, layer_params 872 (12h²+13h),
    4 layers, m = 8 / 2 = 4, overheads: context 1000, fragmentation 10 %, headroom 20 %.

    states (Psi' = 4000/2 = 2000, shard 1000): params 2·1000, grads 2·1000, optimizer 12·1000;
    activations (SDPA, tp 2): attention 2·64 + (2·128 + 32)/2 = 272, MLP 2·(64 + 128) = 384,
      statistics 64: 720 a layer, x 4 layers = 2880;
    logits: 3 (the saved log-softmax, the gradients of the log-probs and of the logits)
      · b·s·V · 4 bytes / tp = 3·400·4/2 = 2400;
    gathered: 2 units of ceil(872/2) = 436 weights, 2 bytes: 2·872 = 1744;
    unsharded grads: one unit, 872; comm buffers: the reduce-scatter input, 872;
    tensors: 16000 + 2880 + 2400 + 1744 + 872 + 872 = 24768; fragmentation 2476;
    total 24768 + 2476 + 1000 = 28244; usable: 0.8 · 30000 = 24000: does not fit, though
    the old count (states + activations = 18880) fitted 30000 with room to spare.
    """
    model = Model(4000, 4, 8, 2, 4, global_batch=8, vocab=100)
    assert model.params_per_layer == 12 * 64 + 13 * 8 == 872
    over = Overheads(cuda_context=1000, fragmentation=0.1, headroom=0.2)
    p = plan(model, Config(2, 2, 1, zero=3), 30_000, over)
    assert p.breakdown.as_dict() == {
        "params": 2000,
        "grads": 2000,
        "optimizer": 12000,
        "activations": 2880,
        "logits": 2400,
        "zero3_gathered": 1744,
        "zero3_unsharded_grads": 872,
        "comm_buffers": 872,
        "cuda_context": 1000,
        "fragmentation": 2476,
        "total": 28244,
    }
    assert p.memory == 28244 and p.usable == 24000 and not p.fits
    assert p.model_states + p.activations == 18880 < 30_000
    # FSDP2 without resharding after forward holds all 4 units; with gradient sync off for
    # m-1 micro-batches, all 4 units' unsharded gradients
    b = plan(model, Config(2, 2, 1, 3, reshard_after_forward=False), 1e9, over).breakdown
    assert b.zero3_gathered == 4 * 872 and b.zero3_unsharded_grads == 872
    b = plan(model, Config(2, 2, 1, 3, sync_every_microbatch=False), 1e9, over).breakdown
    assert b.zero3_gathered == 2 * 872 and b.zero3_unsharded_grads == 4 * 872
    # ZeRO-1: two 25 MB buckets, capped at the whole gradient (2·2000 bytes here)
    assert plan(model, Config(2, 2, 1, 1), 1e9, over).breakdown.comm_buffers == 4000
    big = Model(10**9, 4, 8, 2, 4, global_batch=8)
    assert plan(big, Config(2, 1, 1, 1), 1e12).breakdown.comm_buffers == 2 * 25 * 2**20
    # a pipeline: each stage a send and a receive buffer of one activation, 2·b·s·h·e = 128
    assert plan(model, Config(1, 1, 2), 1e9, over).breakdown.comm_buffers == 128


def test_seven_b_recommendation_under_sdpa_by_hand():
    """64 GPUs of 80 GB (72 usable), 7B, 32 layers, h = s = 4096, 32 heads, 256 sequences.

    dp64 tp1 pp1 ZeRO-1, m = 256 / 64 = 4, one micro-batch in flight:
      states 2·7e9 + 2·7e9 + 12·ceil(7e9/64) = 14e9 + 14e9 + 1.3125e9 = 29.3125e9;
      SDPA activations a layer (T·h = 4096² = 16,777,216): attention 2·2·Th + 2·4·Th +
        4·32·4096 = 201,850,880, MLP 2·10·Th = 335,544,320, statistics 16·4096 = 65,536:
        537,460,736; x 32 layers = 17,198,743,552;
      logits 3·4096·32000·4 = 1,572,864,000; buckets 2·25 MiB = 52,428,800;
      fragmentation 5 % of the tensors' 48,136,536,352 = 2,406,826,817; context 1e9;
      total 51,543,363,169 bytes (51.5 GB): fits. It sends 2 · 63/64 · 14e9 = 27.56 GB a
      step, less than any configuration with TP. Under eager attention each layer keeps the
      a·b·s² = 32·4096² bf16 probabilities, 1,073,741,824 bytes, instead of the 524,288-byte
      log-sum-exp: 1,073,217,536 more a layer, 34.3 GB for 32 layers, 36.1 GB with its 5 %
      fragmentation: 87.6 GB, which does not fit; dp64 ZeRO-3 would (60.3 GB, 165 GB sent),
      but the finder's best splits layers over tp 2 (47.9 GB sent).
    """
    p = plan(LLM, Config(64, 1, 1, 1), 80e9)
    assert p.breakdown.activations == 32 * 537_460_736
    assert p.memory == 51_543_363_169 and p.fits
    assert p.comm["total"] == 2 * 63 / 64 * 14e9
    assert find_configs(LLM, 80e9, 64)[0].config == Config(64, 1, 1, 1)
    eager = dataclasses.replace(LLM, attention="eager")
    e = plan(eager, Config(64, 1, 1, 1), 80e9)
    assert e.breakdown.activations - p.breakdown.activations == 32 * 1_073_217_536
    assert not e.fits and round(e.memory / 1e9, 1) == 87.6
    z3 = plan(eager, Config(64, 1, 1, 3), 80e9)
    assert z3.fits and round(z3.memory / 1e9, 1) == 60.3 and z3.comm["total"] == 12 * 63 / 64 * 14e9
    assert find_configs(eager, 80e9, 64)[0].config == Config(32, 2, 1, 1, sequence_parallel=True)


def test_old_24gb_winner_no_longer_fits():
    # notebook 42's old answer, dp4 tp4 ZeRO-3 with eager attention at 23.1 GB "fitting"
    # 24 GB: its states + activations alone are now 23.1 GB, its whole peak 26.1 GB
    eager = dataclasses.replace(LLM, attention="eager")
    p = plan(eager, Config(4, 4, 1, 3), 24e9)
    assert round((p.model_states + p.activations) / 1e9, 1) == 23.1
    assert not p.fits and p.memory > 24e9


def test_communication_by_hand():
    model = Model(1000, 4, 8, 2, 4, global_batch=8, micro_batch=1)  # bf16
    # dp 4, ZeRO-0: one all_reduce of 2000 bytes, sending 2·3/4 of it
    assert collective_calls(model, Config(4, 1, 1))["dp"] == [("all_reduce", 1, 2000)]
    assert communication(model, Config(4, 1, 1))["dp"] == 3000
    # ZeRO-3 (FSDP2) with m = 2 micro-batches: 2m = 4 all_gathers, m = 2 reduce_scatters
    calls = collective_calls(model, Config(4, 1, 1, zero=3))["dp"]
    assert calls == [("all_gather", 4, 2000), ("reduce_scatter", 2, 2000)]
    assert communication(model, Config(4, 1, 1, zero=3))["dp"] == 6 * 2000 * 3 / 4
    # reshard_after_forward=False: m all_gathers; gradient sync off for m-1: 1 reduce_scatter
    no_reshard = Config(4, 1, 1, 3, reshard_after_forward=False)
    assert collective_calls(model, no_reshard)["dp"] == [
        ("all_gather", 2, 2000),
        ("reduce_scatter", 2, 2000),
    ]
    sync_last = Config(4, 1, 1, 3, sync_every_microbatch=False)
    assert collective_calls(model, sync_last)["dp"] == [
        ("all_gather", 4, 2000),
        ("reduce_scatter", 1, 2000),
    ]
    # tp 2, m = 8: 4 all_reduces a layer and micro-batch of b·s·h·2 = 64 bytes
    assert collective_calls(model, Config(1, 2, 1))["tp"] == [("all_reduce", 4 * 4 * 8, 64)]
    assert communication(model, Config(1, 2, 1))["tp"] == 128 * 64 * 2 * 1 / 2
    # recomputation runs each layer's forward again, its 2 all_reduces too: 6 a layer
    rc = Config(1, 2, 1, recompute=True)
    assert collective_calls(model, rc)["tp"] == [("all_reduce", 6 * 4 * 8, 64)]
    rc_sp = Config(1, 2, 1, recompute=True, sequence_parallel=True)
    assert collective_calls(model, rc_sp)["tp"] == [
        ("all_gather", 192, 64),
        ("reduce_scatter", 192, 64),
    ]
    # sequence parallelism: each all_reduce an all_gather + a reduce_scatter, the same bytes
    sp = Config(1, 2, 1, sequence_parallel=True)
    assert collective_calls(model, sp)["tp"] == [
        ("all_gather", 128, 64),
        ("reduce_scatter", 128, 64),
    ]
    assert communication(model, sp)["tp"] == communication(model, Config(1, 2, 1))["tp"]
    # pp 2, m = 8: the first stage sends 8 activations, the last 8 gradients; no dp or tp
    c = communication(model, Config(1, 1, 2))
    assert c == {"dp": 0, "tp": 0, "pp": 8 * 64, "total": 8 * 64}
    # pp 4, m = 8: a middle stage sends both, 16
    assert collective_calls(model, Config(1, 1, 4))["pp"] == [("send", 16, 64)]


def test_invariants():
    configs = enumerate_configs(SEVEN_B, 64)
    assert all(c.num_gpus == 64 for c in configs)
    assert len(set(configs)) == len(configs)
    assert any(c.sequence_parallel for c in configs)
    for c in configs:
        p = plan(SEVEN_B, c, 80e9)
        assert p.memory == sum(v for k, v in p.breakdown.as_dict().items() if k != "total")
        if c.zero < 3 and c.dp > 1:  # each ZeRO stage holds no more states than the one before
            nxt = plan(SEVEN_B, dataclasses.replace(c, zero=c.zero + 1), 80e9)
            assert nxt.model_states < p.model_states
        if not c.recompute:  # recomputation holds fewer activations
            rc = plan(SEVEN_B, dataclasses.replace(c, recompute=True), 80e9)
            assert rc.activations < p.activations and rc.overhead > p.overhead
        assert 0 <= p.bubble < 1 and (p.bubble == 0) == (c.pp == 1)


def test_find_configs_filters_and_ranks():
    fits = find_configs(SEVEN_B, 80e9, 64)
    assert fits and all(p.memory <= 0.9 * 80e9 for p in fits)  # the 10 % headroom kept
    # plain data parallelism of 7B does not fit in 80 GB: 112 GB of states alone
    assert Config(64, 1, 1, 0) not in {p.config for p in fits}
    table = format_table(fits, limit=3)
    assert len(table.splitlines()) == 4 and fits[0].config.label() in table


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"hidden": 10, "num_heads": 4}, "multiple of num_heads"),
        ({"global_batch": 5, "micro_batch": 2}, "divide global_batch"),
        ({"num_layers": 0}, "num_layers must be an int >= 1"),
        ({"seq_len": 4.5}, "seq_len must be an int >= 1"),
        ({"vocab": 0}, "vocab must be an int >= 1"),
        ({"attention": "flash"}, "attention must be one of ('sdpa', 'eager')"),
        ({"mixed_precision": 1}, "mixed_precision must be True or False"),
        ({"layer_params": 11}, "layer_params=11 must be at most num_params=10"),
    ],
)
def test_bad_models_say_what_is_wrong(kwargs, says):
    base = {"num_params": 10, "num_layers": 2, "hidden": 8, "num_heads": 2, "seq_len": 4}
    base.update(global_batch=4)
    base.update(kwargs)
    with pytest.raises(ValueError, match=re.escape(says)):
        Model(**base)


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"zero": 4}, "zero must be 0, 1, 2 or 3"),
        ({"dp": 0}, "dp, tp and pp must be ints >= 1"),
        ({"sequence_parallel": True}, "sequence_parallel needs tp > 1"),
        ({"zero": 2, "reshard_after_forward": False}, "FSDP2 (zero=3) switches"),
        ({"zero": 1, "sync_every_microbatch": False}, "FSDP2 (zero=3) switches"),
        ({"recompute": "yes"}, "recompute must be True or False"),
    ],
)
def test_bad_configs_say_what_is_wrong(kwargs, says):
    base = {"dp": 2, "tp": 1, "pp": 1}
    base.update(kwargs)
    with pytest.raises(ValueError, match=re.escape(says)):
        Config(**base)


def test_whole_floats_are_taken_as_ints():
    assert Model(7e9, 32, 4096, 32, 4096, global_batch=256) == LLM  # README's spelling


def test_bad_plans_and_overheads_say_what_is_wrong():
    with pytest.raises(ValueError, match="not a multiple of dp"):
        plan(Model(10, 2, 8, 2, 4, global_batch=6), Config(4, 1, 1), 1e9)
    with pytest.raises(ValueError, match="gpu_memory must be > 0"):
        plan(LLM, Config(64, 1, 1, 1), 0)
    with pytest.raises(ValueError, match=r"headroom must be a fraction in \[0, 1\)"):
        Overheads(headroom=1.0)
    with pytest.raises(ValueError, match="cuda_context must be >= 0"):
        Overheads(cuda_context=-1)
    with pytest.raises(ValueError, match="num_gpus must be an int >= 1"):
        enumerate_configs(LLM, 0)


def test_logits_term_against_the_allocator():
    """The loss of a bf16 output layer, logits upcast to fp32, F.cross_entropy, forward and
    backward, measured from torch.profiler's allocation records (this process, CPU): at its
    peak it holds 3 fp32 b·s·V tensors (the saved log-softmax, the gradients of the
    log-probabilities and of the logits), the finder's term; "the logits and their gradient"
    (2) is a third short."""
    import torch
    import torch.nn.functional as F

    from labkit.parallel.zero_redundancy import AllocationPeak

    torch.manual_seed(0)
    s, v = 256, 4000
    x = torch.randn(s, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(v, 32, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, v, (s,))
    with AllocationPeak("cpu") as fwd:
        loss = F.cross_entropy((x @ w.T).float(), y)
    with AllocationPeak("cpu") as bwd:
        loss.backward()
    term = plan(Model(10**6, 1, 32, 1, s, global_batch=1, vocab=v), Config(1, 1, 1), 1e9, NONE)
    assert term.breakdown.logits == 3 * s * v * 4
    assert abs(fwd.end + bwd.peak - term.breakdown.logits) <= 4096, (fwd.end, bwd.peak)
