"""Notebook 46's teaching code and checker: the FLOP formulas against torch's flop counter,
the step-time ranking against its limits, and the MFU checker against the classic mistakes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from labkit.exercises import step_time_checks as sc
from labkit.parallel.config_finder import Model, find_configs
from labkit.parallel.step_time import (
    Speeds,
    attention_flops,
    group_bandwidth,
    linear_flops,
    rank_by_step_time,
    step_time,
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("first_needs_grad", [False, True])
def test_linear_flops_match_the_flop_counter(first_needs_grad):
    sizes = [(12, 20), (20, 8), (8, 3)]
    net = torch.nn.Sequential(*(torch.nn.Linear(k, n) for k, n in sizes))
    x = torch.randn(5, 12, requires_grad=first_needs_grad)
    with FlopCounterMode(display=False) as counter:
        net(x).sum().backward()
    assert counter.get_total_flops() == linear_flops(5, sizes, first_needs_grad)


@pytest.mark.timeout(60)
def test_attention_flops_match_the_flop_counter():
    b, h, s, dh = 2, 3, 10, 4
    q, k, v = (torch.randn(b, h, s, dh, requires_grad=True) for _ in range(3))
    with FlopCounterMode(display=False) as counter:
        (torch.softmax(q @ k.transpose(-1, -2), -1) @ v).sum().backward()
    assert counter.get_total_flops() == attention_flops(b * s, s, h * dh)


LLM = Model(7_000_000_000, 32, 4096, 32, 4096, global_batch=256, micro_batch=1)


@pytest.mark.timeout(60)
def test_ranking_limits():
    speeds = Speeds()
    endless = dataclasses.replace(speeds, link_bandwidth=1e30, network_bandwidth=1e30)
    link = rank_by_step_time(LLM, 80e9, 64, endless)
    assert [p.overhead for p, _ in link] == sorted(p.overhead for p, _ in link)
    chip = rank_by_step_time(LLM, 80e9, 64, dataclasses.replace(speeds, peak_flops=1e30))
    assert [t["comm"] for _, t in chip] == sorted(t["comm"] for _, t in chip)
    # all links alike: exposed time is bytes / one speed, so it orders by bytes
    flat = dataclasses.replace(speeds, peak_flops=1e30, network_bandwidth=speeds.link_bandwidth)
    same = rank_by_step_time(LLM, 80e9, 64, flat)
    assert [p.comm["total"] for p, _ in same] == sorted(p.comm["total"] for p, _ in same)
    best = find_configs(LLM, 80e9, 64)[0]
    tokens = 256 * 4096
    flops = 6 * 7e9 * tokens + 12 * 32 * 4096 * 4096 * tokens
    want = flops / 64 / (989.4e12 * 0.4)  # no bubble, no recomputation
    assert abs(step_time(LLM, best, speeds)["compute"] - want) < 1e-9 * want


@pytest.mark.timeout(60)
def test_groups_wider_than_a_node_use_the_network():
    speeds = Speeds(link_bandwidth=400e9, network_bandwidth=40e9, gpus_per_node=8)
    plans = {p.config.label(): p for p in find_configs(LLM, 80e9, 64)}
    # tp innermost, then dp, then pp: tp2 x dp16 spans 32 ranks (4 nodes), tp2 alone one node
    p = plans["dp16 tp2 pp2 zero1"]
    assert group_bandwidth(p, speeds) == {"tp": 400e9, "dp": 40e9, "pp": 40e9}
    want = p.comm["tp"] / 400e9 + (p.comm["dp"] + p.comm["pp"]) / 40e9
    assert abs(step_time(LLM, p, speeds)["comm"] - want) < 1e-12
    # a whole job inside one node: every group on the link
    small = Model(1_000_000_000, 16, 2048, 16, 2048, global_batch=16, micro_batch=1)
    for q in find_configs(small, 80e9, 8):
        assert set(group_bandwidth(q, speeds).values()) == {400e9}
    # plain dp64: half the exposed share, half the time on the network
    dp = plans["dp64 tp1 pp1 zero1"]
    half = dataclasses.replace(speeds, dp_exposed=0.5)
    assert abs(step_time(LLM, dp, half)["comm"] - 0.5 * dp.comm["dp"] / 40e9) < 1e-12


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "kw",
    [
        {"efficiency": 0},
        {"peak_flops": -1},
        {"dp_exposed": 2},
        {"network_bandwidth": 0},
        {"gpus_per_node": 0},
    ],
)
def test_speeds_reject_nonsense(kw):
    with pytest.raises(ValueError):
        Speeds(**kw)


def mfu_right(n, t, w, s, gpu):
    return 6 * n * t * w / s / (w * gpu["bf16 dense"])


def mfu_per_rank(n, t, w, s, gpu):  # one rank's tokens over one GPU: the same, and right
    return 6 * n * t / s / gpu["bf16 dense"]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (mfu_right, True, "right"),
        (mfu_per_rank, True, "right"),
        (lambda n, t, w, s, g: 2 * n * t / s / g["bf16 dense"], False, "forward only"),
        (lambda n, t, w, s, g: 4 * n * t / s / g["bf16 dense"], False, "not one"),
        (lambda n, t, w, s, g: 6 * n * t * w / s / g["bf16 dense"], False, "one GPU's peak"),
        (lambda n, t, w, s, g: 6 * n * t / s / (w * g["bf16 dense"]), False, "global batch"),
        (lambda n, t, w, s, g: 6 * n * t / s / g["bf16 sparse"], False, "sparse"),
        (lambda n, t, w, s, g: 600 * n * t / s / g["bf16 dense"], False, "percentage"),
        (lambda n, t, w, s: 0.0, False, "raised TypeError"),
    ],
)
def test_check_mfu(fn, ok, says):
    verdict = sc.check_mfu(fn)
    assert bool(verdict) is ok and says in verdict.message, verdict.message


@pytest.mark.timeout(10)
def test_mfu_solution_passes():
    namespace: dict = {}
    exec(sc.solution_mfu().code, namespace)
    assert sc.check_mfu(namespace["mfu_of_step"])
