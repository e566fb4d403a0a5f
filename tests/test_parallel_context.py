"""Ring attention on 2 and 4 gloo ranks against full attention in one process, both layouts,
causal and not, seeded, float32; the work each rank did and the bytes it sent (from labkit's
trace) against the formulas; the merge of partial results against one softmax."""

from __future__ import annotations

import math

import pytest
import torch
from distributed import run_ranks

from labkit.parallel.context_parallel import (
    attention,
    block_attention,
    merge,
    positions,
    ring_attention,
    ring_bytes,
    work_per_rank,
)
from labkit.rank import trace

ATOL = 1e-5
SEQ, D = 32, 8


def _cp_rank(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    q, k, v = (torch.randn(SEQ, D) for _ in range(3))
    trace.install()
    out = {}
    for cell, (layout, causal) in enumerate(
        [("contiguous", True), ("zigzag", True), ("contiguous", False)], start=1
    ):
        full = attention(q, k, v, causal)
        mine = positions(SEQ, world_size, rank, layout)
        trace.begin_cell(cell, rank)
        res = ring_attention(q[mine], k[mine], v[mine], layout, causal)
        recs = [(r.op, r.bytes, r.peer) for r in trace.records(cell) if r.kind == "comm"]
        out[(layout, causal)] = {
            "err": (res.out - full[mine]).abs().max().item(),
            "work": res.work,
            "comm": recs,
            "positions": mine.tolist(),
        }
    return out


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request) -> list[dict]:
    return run_ranks(_cp_rank, request.param)


@pytest.mark.timeout(120)
def test_ring_attention_equals_full(ranks: list[dict]) -> None:
    for res in ranks:
        for key, r in res.items():
            assert r["err"] < ATOL, (key, r["err"])


@pytest.mark.timeout(120)
def test_layouts_cover_the_sequence_once(ranks: list[dict]) -> None:
    n = len(ranks)
    for layout in ("contiguous", "zigzag"):
        held = [p for res in ranks for p in res[(layout, True)]["positions"]]
        assert sorted(held) == list(range(SEQ))
    assert ranks[0][("zigzag", True)]["positions"][-1] == SEQ - 1  # rank 0: first and last
    assert ranks[-1][("contiguous", True)]["positions"][0] == SEQ - SEQ // n


@pytest.mark.timeout(120)
def test_work_and_bytes_equal_the_formulas(ranks: list[dict]) -> None:
    n = len(ranks)
    for layout, causal in [("contiguous", True), ("zigzag", True), ("contiguous", False)]:
        want = work_per_rank(SEQ, n, layout, causal)
        got = [sum(res[(layout, causal)]["work"]) for res in ranks]
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
    contiguous = work_per_rank(SEQ, n, "contiguous")
    assert contiguous == sorted(contiguous) and contiguous[0] < contiguous[-1]
    assert len(set(work_per_rank(SEQ, n, "zigzag"))) == 1
    assert sum(contiguous) == sum(work_per_rank(SEQ, n, "zigzag")) == SEQ * (SEQ + 1) // 2
    # the contiguous layout's first step is each rank's own triangle; rank 0 then skips
    assert ranks[0][("contiguous", True)]["work"][1:] == [0] * (n - 1)


def test_work_formulas_by_counting() -> None:
    for n in (1, 2, 3, 4):
        for layout in ("contiguous", "zigzag"):
            seq = 2 * n * 3
            counted = []
            for r in range(n):
                q = positions(seq, n, r, layout)
                counted.append(int((torch.arange(seq)[None, :] <= q[:, None]).sum()))
            assert work_per_rank(seq, n, layout) == counted, (n, layout)


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
