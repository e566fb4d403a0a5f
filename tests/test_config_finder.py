"""The configuration finder's formulas (labkit.parallel.config_finder) against hand-computed
cases and invariants, in this process; the measured cases on the ranks are in
test_parallel_step_memory.py."""

from __future__ import annotations

import pytest

from labkit.parallel.config_finder import (
    Config,
    Model,
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
    # b 1, s 4, h 8, a 2, fp16: T·h = 32; per layer 2·(2·32 + 4·32 + 2·16) + 2·(2·32 + 8·32)
    # + 16·4 = 448 + 640 + 64 = 1152 bytes
    model = Model(1000, 4, 8, 2, 4, global_batch=8, micro_batch=1)
    assert activation_bytes(model, Config(1, 1, 1)) == 4 * 1152
    # pp 2 under 1F1B: 2 layers a stage, 2 micro-batches in flight
    assert activation_bytes(model, Config(1, 1, 2)) == 2 * 2 * 1152
    # recompute: each layer keeps its input, 2·32 bytes, plus one layer recomputed
    assert activation_bytes(model, Config(1, 1, 1, recompute=True)) == 4 * 64 + 1152
    # tp 2: the split parts halve: 2·(64 + (128 + 32) / 2) + 2·(64 + 256 / 2) + 64
    assert activation_bytes(model, Config(1, 2, 1)) == 4 * (288 + 384 + 64)


def test_communication_by_hand():
    model = Model(1000, 4, 8, 2, 4, global_batch=8, micro_batch=1)  # fp16
    # dp 4, ZeRO-0: one all_reduce of 2000 bytes, sending 2·3/4 of it
    assert collective_calls(model, Config(4, 1, 1))["dp"] == [("all_reduce", 1, 2000)]
    assert communication(model, Config(4, 1, 1))["dp"] == 3000
    # ZeRO-3 with m = 2 micro-batches: 4 all_gathers and 2 reduce_scatters of 2000 bytes
    calls = collective_calls(model, Config(4, 1, 1, zero=3))["dp"]
    assert calls == [("all_gather", 4, 2000), ("reduce_scatter", 2, 2000)]
    assert communication(model, Config(4, 1, 1, zero=3))["dp"] == 6 * 2000 * 3 / 4
    # tp 2, m = 8: 4 all_reduces a layer and micro-batch of b·s·h·2 = 64 bytes
    assert collective_calls(model, Config(1, 2, 1))["tp"] == [("all_reduce", 4 * 4 * 8, 64)]
    assert communication(model, Config(1, 2, 1))["tp"] == 128 * 64 * 2 * 1 / 2
    # pp 2, m = 8: 16 sends of 64 bytes; no dp or tp traffic
    c = communication(model, Config(1, 1, 2))
    assert c == {"dp": 0, "tp": 0, "pp": 16 * 64, "total": 16 * 64}


def test_invariants():
    configs = enumerate_configs(SEVEN_B, 64)
    assert all(c.num_gpus == 64 for c in configs)
    assert len(set(configs)) == len(configs)
    for c in configs:
        p = plan(SEVEN_B, c, 80e9)
        assert p.memory == p.model_states + p.activations
        if c.zero < 3 and c.dp > 1:  # each ZeRO stage holds no more than the one before
            nxt = plan(SEVEN_B, Config(c.dp, c.tp, c.pp, c.zero + 1, c.recompute), 80e9)
            assert nxt.model_states < p.model_states
        if not c.recompute:  # recomputation holds fewer activations
            rc = plan(SEVEN_B, Config(c.dp, c.tp, c.pp, c.zero, True), 80e9)
            assert rc.activations < p.activations and rc.overhead > p.overhead
        assert 0 <= p.bubble < 1 and (p.bubble == 0) == (c.pp == 1)


def test_find_configs_filters_and_ranks():
    fits = find_configs(SEVEN_B, 80e9, 64)
    assert fits and all(p.memory <= 80e9 for p in fits)
    keys = [(p.overhead, p.comm["total"], p.memory) for p in fits]
    assert keys == sorted(keys)
    everything = find_configs(SEVEN_B, 80e9, 64, keep_all=True)
    assert len(everything) == len(enumerate_configs(SEVEN_B, 64)) > len(fits)
    # plain data parallelism of 7B does not fit in 80 GB: 112 GB of states alone
    assert Config(64, 1, 1, 0) not in {p.config for p in fits}
    table = format_table(fits, limit=3)
    assert len(table.splitlines()) == 4 and fits[0].config.label() in table


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"hidden": 10, "num_heads": 4}, "multiple of num_heads"),
        ({"global_batch": 5, "micro_batch": 2}, "divide global_batch"),
        ({"num_layers": 0}, "num_layers must be >= 1"),
    ],
)
def test_bad_models_say_what_is_wrong(kwargs, says):
    base = {"num_params": 10, "num_layers": 2, "hidden": 8, "num_heads": 2, "seq_len": 4}
    base.update(global_batch=4)
    base.update(kwargs)
    with pytest.raises(ValueError, match=says):
        Model(**base)


def test_bad_configs_say_what_is_wrong():
    with pytest.raises(ValueError, match="zero must be 0, 1, 2 or 3"):
        Config(2, 1, 1, zero=4)
    with pytest.raises(ValueError, match="not a multiple of dp"):
        plan(Model(10, 2, 8, 2, 4, global_batch=6), Config(4, 1, 1), 1e9)
