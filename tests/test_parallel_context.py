"""Ring attention on 2 and 4 gloo ranks against full attention in one process (outputs, lse and
the gradient of each rank's queries), both layouts, causal and not, seeded, float32 (and bfloat16
blocks, merged in float32); what each rank computed, counted by torch's FLOP counter and timed,
against cases worked out by hand; the bytes it sent (from labkit's trace); the K/V buffers alive
at once, from torch's profiler; the merge of partial results against one softmax."""

from __future__ import annotations

import math

import pytest
import torch
from distributed import run_ranks
from torch.utils.flop_counter import FlopCounterMode

from labkit.parallel.context_parallel import (
    attention,
    block_attention,
    computed_per_rank,
    live_peak,
    merge,
    plan,
    positions,
    ring_attention,
    ring_bytes,
    work_per_rank,
)
from labkit.rank import trace

ATOL = 1e-5
SEQ, D = 32, 8
CASES = [("contiguous", True), ("zigzag", True), ("contiguous", False), ("zigzag", False)]


def _cp_rank(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    q, k, v, g = (torch.randn(SEQ, D) for _ in range(4))
    trace.install()
    out = {}
    for cell, (layout, causal) in enumerate(CASES, start=1):
        q_ref = q.clone().requires_grad_()
        full = attention(q_ref, k, v, causal)
        (full * g).sum().backward()
        s = q @ k.T / math.sqrt(D)
        if causal:
            s = s.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), -math.inf)
        mine = positions(SEQ, world_size, rank, layout)
        trace.begin_cell(cell, rank)
        q_mine = q[mine].clone().requires_grad_()
        with FlopCounterMode(display=False) as flops:  # every matmul the ring ran
            res = ring_attention(q_mine, k[mine], v[mine], layout, causal)
        (res.out * g[mine]).sum().backward()  # dQ needs only this rank's rows and all K/V
        recs = [(r.op, r.bytes, r.peer) for r in trace.records(cell) if r.kind == "comm"]
        out[(layout, causal)] = {
            "err": (res.out - full[mine]).abs().max().item(),
            "lse_err": (res.lse - torch.logsumexp(s, -1)[mine]).abs().max().item(),
            "grad_err": (q_mine.grad - q_ref.grad[mine]).abs().max().item(),
            "visible": res.visible,
            "computed": res.computed,
            "flops": flops.get_total_flops(),
            "comm": recs,
            "positions": mine.tolist(),
        }
    # the K/V buffers alive at once: blocks of c x 2D floats; nothing else here has that size
    block = SEQ // world_size * 2 * D * 4
    out["kv_peak"] = live_peak(lambda: ring_attention(q[mine], k[mine], v[mine], "zigzag"), block)
    # bfloat16 blocks, scores in the hundreds: lse and the running output stay float32
    big = [(t * 12).bfloat16().double() for t in (q, k, v)]  # the reference sees bf16 inputs
    res = ring_attention(*(t[mine].bfloat16() for t in big), "zigzag")
    want = attention(*big, causal=True)[mine]
    s = big[0] @ big[1].T / math.sqrt(D)
    lse = torch.logsumexp(s.masked_fill(torch.ones(SEQ, SEQ).bool().triu(1), -math.inf), -1)
    out["bf16"] = {
        "dtypes": (res.out.dtype, res.lse.dtype),
        "err": ((res.out.double() - want).abs() / want.abs().max()).max().item(),
        "lse_err": (res.lse.double() - lse[mine]).abs().max().item(),
        "lse_max": lse.abs().max().item(),
    }
    if world_size == 4:  # compute time per rank (see test_compute_time_balances_under_zigzag)
        out["seconds"] = _timed(rank, world_size, 1024, 256)
    return out


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request) -> list[dict]:
    return run_ranks(_cp_rank, request.param, timeout=240)


@pytest.mark.timeout(300)
def test_ring_attention_equals_full(ranks: list[dict]) -> None:
    for res in ranks:
        for key in CASES:
            r = res[key]
            assert r["err"] < ATOL and r["lse_err"] < ATOL and r["grad_err"] < ATOL, (key, r)


@pytest.mark.timeout(300)
def test_layouts_cover_the_sequence_once(ranks: list[dict]) -> None:
    n = len(ranks)
    for layout in ("contiguous", "zigzag"):
        held = [p for res in ranks for p in res[(layout, True)]["positions"]]
        assert sorted(held) == list(range(SEQ))
    assert ranks[0][("zigzag", True)]["positions"][-1] == SEQ - 1  # rank 0: first and last
    assert ranks[-1][("contiguous", True)]["positions"][0] == SEQ - SEQ // n


# FLOPs each rank's matmuls ran (torch's counter: 2 per multiply-add, q @ k.T and p @ v), worked
# out by hand: pairs computed x 2 x (d_k + d_v) = pairs x 32 for D = 8.
#   contiguous, c = S/n: rank r computes r + 1 blocks of c x c (the diagonal one whole).
#   zig-zag, h = S/(2n): step 0 3 h^2 (early vs early, late vs both), each later step 2 h^2.
#   not causal: every rank S/n x S.
HAND_FLOPS = {
    2: {
        ("contiguous", True): [256 * 32, 512 * 32],  # c = 16
        ("zigzag", True): [320 * 32] * 2,  # h = 8: 3*64 + 2*64
        ("contiguous", False): [512 * 32] * 2,
        ("zigzag", False): [512 * 32] * 2,
    },
    4: {
        ("contiguous", True): [64 * 32, 128 * 32, 192 * 32, 256 * 32],  # c = 8
        ("zigzag", True): [144 * 32] * 4,  # h = 4: 3*16 + 3 * 2*16
        ("contiguous", False): [256 * 32] * 4,
        ("zigzag", False): [256 * 32] * 4,
    },
}


@pytest.mark.timeout(300)
def test_executed_flops_by_hand(ranks: list[dict]) -> None:
    n = len(ranks)
    for key in CASES:
        flops = [res[key]["flops"] for res in ranks]
        assert flops == HAND_FLOPS[n][key], (key, flops)
        assert [2 * sum(res[key]["computed"]) * 2 * D for res in ranks] == flops
        assert [sum(res[key]["computed"]) for res in ranks] == computed_per_rank(SEQ, n, *key)
    contiguous = [res[("contiguous", True)]["flops"] for res in ranks]
    zigzag = [res[("zigzag", True)]["flops"] for res in ranks]
    assert max(contiguous) / min(contiguous) == n  # the diagonal block computed whole
    assert max(zigzag) == min(zigzag)
    # the ring waits for its busiest rank: zig-zag's is (2n + 1) / (4n) of contiguous's
    assert max(zigzag) / max(contiguous) == (2 * n + 1) / (4 * n)
    # zig-zag computes only half of every block after step 0, not whole blocks
    for res in ranks:
        assert res[("zigzag", True)]["computed"][1:] == [2 * (SEQ // (2 * n)) ** 2] * (n - 1)


@pytest.mark.timeout(300)
def test_visible_pairs_and_bytes(ranks: list[dict]) -> None:
    n = len(ranks)
    for layout, causal in CASES:
        want = work_per_rank(SEQ, n, layout, causal)
        got = [sum(res[(layout, causal)]["visible"]) for res in ranks]
        assert got == want, (layout, causal)
        for rank, res in enumerate(ranks):
            comm = res[(layout, causal)]["comm"]
            block = SEQ // n * 2 * D * 4
            assert [c for c in comm if c[0] == "isend"] == [("isend", block, (rank + 1) % n)] * (
                n - 1
            )
            assert [c for c in comm if c[0] == "irecv"] == [("irecv", block, (rank - 1) % n)] * (
                n - 1
            )
            assert sum(b for op, b, _ in comm if op == "isend") == ring_bytes(SEQ, n, D, D, 4)
    assert sum(work_per_rank(SEQ, n, "zigzag")) == SEQ * (SEQ + 1) // 2
    # rank 0's contiguous queries see nothing in the blocks it receives: nothing computed
    assert ranks[0][("contiguous", True)]["visible"][1:] == [0] * (n - 1)
    assert ranks[0][("contiguous", True)]["computed"][1:] == [0] * (n - 1)


@pytest.mark.timeout(300)
def test_ring_holds_two_kv_blocks(ranks: list[dict]) -> None:
    # the block it computes with and the one arriving, beside the rank's own K and V
    assert [res["kv_peak"] for res in ranks] == [2] * len(ranks)


def _timed(rank: int, world_size: int, seq: int, dim: int) -> dict:
    torch.set_num_threads(1)  # then the clock is the computing thread's CPU time
    torch.manual_seed(0)
    q, k, v = (torch.randn(seq, dim) for _ in range(3))
    runs: dict[str, list[float]] = {"contiguous": [], "zigzag": []}
    for _ in range(15):  # the layouts in turn, so both meet the same load on a busy machine
        for layout, times in runs.items():
            mine = positions(seq, world_size, rank, layout)
            times.append(sum(ring_attention(q[mine], k[mine], v[mine], layout).compute_s))
    return {layout: min(times) for layout, times in runs.items()}  # the least disturbed run


@pytest.mark.timeout(300)
def test_bfloat16_blocks_merge_in_float32(ranks: list[dict]) -> None:
    # lse in bfloat16 would be off by up to 1 at these magnitudes, and each merge rounded to
    # bfloat16 would add its error to the output; float32 keeps both to bfloat16's last digit
    for res in ranks:
        bf = res["bf16"]
        assert bf["dtypes"] == (torch.bfloat16, torch.float32), bf
        assert bf["lse_max"] > 100 and bf["lse_err"] < 1e-3 and bf["err"] < 1e-2, bf


@pytest.mark.timeout(300)
def test_compute_time_balances_under_zigzag(ranks: list[dict]) -> None:
    # CPU time of each rank's compute (S = 1024, d = 256, 4 ranks), against the FLOPs: contiguous
    # 1:2:3:4, zig-zag 9:9:9:9 at 9/16 of contiguous's busiest. Time is above 9/16 (about 0.6 to
    # 0.8 here): the step-0 pieces are masked, which costs more per pair, and zig-zag runs more,
    # smaller pieces. Whole blocks at every step (what the plan avoids) ran 0.9 to 1.0 times
    # contiguous's busiest (4 ranks, busy machine): too close for a clock to reject, which
    # test_executed_flops_by_hand's exact count does. Loose bounds, for a busy machine.
    if len(ranks) != 4:
        pytest.skip("timed on 4 ranks")
    contiguous = [res["seconds"]["contiguous"] for res in ranks]
    zigzag = [res["seconds"]["zigzag"] for res in ranks]
    assert 2 < max(contiguous) / min(contiguous) < 6, contiguous
    assert max(zigzag) / min(zigzag) < 1.75, zigzag
    assert max(zigzag) < 1.15 * max(contiguous), (zigzag, contiguous)  # as notebook 36


def test_plans_by_hand() -> None:
    # 4 ranks, S = 16: zig-zag chunks of 2, rank 1 holds chunks 1 and 6 (rows 0-1, 2-3)
    s = slice
    assert plan(16, 4, 1, 0, "zigzag") == [(s(0, 2), s(0, 2), True), (s(2, 4), s(0, 4), True)]
    # step 1: the block of rank 0 (chunks 0, 7): both query chunks against chunk 0
    assert plan(16, 4, 1, 1, "zigzag") == [(s(0, 4), s(0, 2), False)]
    # step 2: the block of rank 3 (chunks 3, 4): the late query chunk against all of it
    assert plan(16, 4, 1, 2, "zigzag") == [(s(2, 4), s(0, 4), False)]
    assert plan(16, 4, 1, 1, "contiguous") == [(s(0, 4), s(0, 4), False)]
    assert plan(16, 4, 1, 2, "contiguous") == []
    assert plan(16, 4, 1, 2, "zigzag", causal=False) == [(s(0, 4), s(0, 4), False)]


def test_formulas_by_counting() -> None:
    for n in (1, 2, 3, 4):
        for layout in ("contiguous", "zigzag"):
            seq = 2 * n * 3
            visible, computed = [], []
            for r in range(n):
                q = positions(seq, n, r, layout)
                visible.append(int((torch.arange(seq)[None, :] <= q[:, None]).sum()))
                pieces = [p for i in range(n) for p in plan(seq, n, r, i, layout)]
                computed.append(
                    sum((p.queries.stop - p.queries.start) * p.keys.stop for p in pieces)
                )
            assert work_per_rank(seq, n, layout) == visible, (n, layout)
            assert computed_per_rank(seq, n, layout) == computed, (n, layout)


def test_merge_is_one_softmax() -> None:
    torch.manual_seed(1)
    q, k, v = torch.randn(5, 4), torch.randn(9, 4), torch.randn(9, 3)
    qp, kp = torch.tensor([0, 2, 4, 6, 8]), torch.arange(9)
    whole, lse = block_attention(q, k, v, qp, kp)
    a, b = (
        block_attention(q, k[:4], v[:4], qp, kp[:4]),
        block_attention(q, k[4:], v[4:], qp, kp[4:]),
    )
    assert torch.isinf(b[1][:2]).all() and (b[0][:2] == 0).all()  # rows 0, 2 see nothing in b
    for first, second in ((a, b), (b, a)):
        o, lse_m = merge(*first, *second)
        assert torch.allclose(o, whole, atol=1e-6) and torch.allclose(lse_m, lse, atol=1e-6)
    empty = (torch.zeros(5, 3), torch.full((5,), -math.inf))
    o, lse_m = merge(*empty, *empty)
    assert (o == 0).all() and torch.isinf(lse_m).all()


def test_bad_layouts() -> None:
    with pytest.raises(ValueError, match="layout must be one of"):
        positions(8, 2, 0, "striped")
    with pytest.raises(ValueError, match="seq_len must be a multiple of 4 for the zigzag"):
        positions(6, 2, 0, "zigzag")


def test_live_peak_counts_the_device_asked_for():
    """Two 4 KiB buffers alive at once, then one: 2 on the CPU (the device they are on), the same
    with no device named; an unknown device type is refused."""

    def two_then_one():
        a = torch.empty(1024)
        b = torch.empty(1024)
        del a
        c = torch.empty(1024)
        return b, c

    assert live_peak(two_then_one, 4096) == 2
    assert live_peak(two_then_one, 4096, "cpu") == 2
    assert live_peak(two_then_one, 4096, torch.device("cpu")) == 2
    with pytest.raises(ValueError, match="device must be one of"):
        live_peak(two_then_one, 4096, "meta")
