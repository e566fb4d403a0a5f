"""torch.compile under DDP on 2 gloo ranks against labkit.parallel.compile_dist: the buckets
DDP's reducer made equal the bucket rule's, DDPOptimizer hands the backend one graph per
bucket (one with optimize_ddp off), and the compiled gradients equal eager DDP's to the bit.
Then the exercise checker of notebook 49 against the right answer and classic wrong ones."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks

from labkit.exercises import compile_checks as cc
from labkit.parallel.compile_dist import GraphRecorder, buckets_by_size, layers_per_graph

LAYER = 4 * (256 * 256 + 256)  # one Linear(256, 256) in fp32


def _ddp_rank(rank: int, world_size: int) -> dict:
    import torch._dynamo as dynamo
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from labkit.parallel.compile_dist import ddp_buckets
    from labkit.parallel.fsdp2_depth import make_stack

    torch.set_num_threads(1)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(rank))
    out: dict = {}
    for name, optimize in (("eager", None), ("split", True), ("whole", False)):
        dynamo.reset()
        dynamo.config.optimize_ddp = True if optimize is None else optimize
        rec = GraphRecorder()
        model = make_stack(12, 256)
        ddp = DDP(model if optimize is None else torch.compile(model, backend=rec), bucket_cap_mb=1)
        for _ in range(2):  # DDP rebuilds its buckets after the first step
            ddp.zero_grad()
            F.mse_loss(ddp(x), torch.zeros_like(x)).backward()
        out[name] = {
            "graphs": layers_per_graph(rec),
            "buckets": ddp_buckets(ddp),
            "grads": [p.grad.clone() for p in ddp.parameters()],
        }
    dynamo.config.optimize_ddp = True
    return out


@pytest.mark.timeout(240)
def test_ddp_optimizer_cuts_one_graph_per_bucket() -> None:
    for out in run_ranks(_ddp_rank, 2, timeout=220):
        want = [[11, 10, 9, 8], [7, 6, 5, 4], [3, 2, 1, 0]]  # by hand: 4 layers cross 1 MiB
        assert buckets_by_size([LAYER] * 12, 2**20) == [
            [i for i in range(12)][4 * k : 4 * k + 4] for k in range(3)
        ]
        for name in ("eager", "split", "whole"):
            buckets = out[name]["buckets"]
            assert [b for b, _ in buckets] == [4 * LAYER] * 3, buckets
            layers = [sorted({int(n.split(".")[-2]) // 2 for n in names}) for _, names in buckets]
            assert layers == [sorted(w) for w in want], layers
        assert out["eager"]["graphs"] == []
        assert out["split"]["graphs"] == [4, 4, 4]  # one graph per bucket
        assert out["whole"]["graphs"] == [12]
        for name in ("split", "whole"):
            for a, b in zip(out["eager"]["grads"], out[name]["grads"]):
                assert torch.equal(a, b), name  # the recording backend runs the same ops


@pytest.mark.timeout(30)
def test_bucket_rule_by_hand() -> None:
    assert buckets_by_size([3, 3, 3, 3], cap=6, first_cap=3) == [[0], [1, 2], [3]]
    assert buckets_by_size([5, 1, 5], cap=5) == [[0], [1, 2]]  # the crossing item stays in
    assert buckets_by_size([], cap=5) == [[]]
    with pytest.raises(ValueError):
        buckets_by_size([1], cap=0)


@pytest.mark.timeout(30)
def test_recorder_counts_a_graph_break() -> None:
    rec = GraphRecorder()

    def f(x):
        y = x.sin()
        if y.sum().item() > 0:  # a graph break
            y = y + 1
        return y.cos()

    torch.compile(f, backend=rec)(torch.ones(3))
    assert len(rec.graphs) == 2


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def right_answer(shapes, element_size, cap, first_cap):
    out, filled = [[]], 0
    for i in reversed(range(len(shapes))):
        limit = first_cap if len(out) == 1 else cap
        if out[-1] and filled >= limit:
            out.append([])
            filled = 0
        out[-1].append(i)
        filled += _numel(shapes[i]) * element_size
    return out


def forward_order(shapes, element_size, cap, first_cap):
    out, filled = [[]], 0
    for i in range(len(shapes)):  # registration order
        limit = first_cap if len(out) == 1 else cap
        if out[-1] and filled >= limit:
            out.append([])
            filled = 0
        out[-1].append(i)
        filled += _numel(shapes[i]) * element_size
    return out


def one_cap(shapes, element_size, cap, first_cap):
    return right_answer(shapes, element_size, cap, cap)  # the first bucket's cap ignored


def counts_elements(shapes, element_size, cap, first_cap):
    return right_answer(shapes, 1, cap, first_cap)  # elements taken for bytes


def closes_before_crossing(shapes, element_size, cap, first_cap):
    out, filled = [[]], 0
    for i in reversed(range(len(shapes))):
        size = _numel(shapes[i]) * element_size
        limit = first_cap if len(out) == 1 else cap
        if out[-1] and filled + size > limit:  # never let a bucket pass its cap
            out.append([])
            filled = 0
        out[-1].append(i)
        filled += size
    return out


def closes_past_the_cap(shapes, element_size, cap, first_cap):
    out, filled = [[]], 0
    for i in reversed(range(len(shapes))):
        limit = first_cap if len(out) == 1 else cap
        if out[-1] and filled > limit:  # `>` where DDP has `>=`
            out.append([])
            filled = 0
        out[-1].append(i)
        filled += _numel(shapes[i]) * element_size
    return out


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (right_answer, True, "every bucket matches"),
        (forward_order, False, "forward order"),
        (one_cap, False, "its own cap"),
        (counts_elements, False, "in bytes"),
        (closes_before_crossing, False, "add the tensor first"),
        (closes_past_the_cap, False, "not only once they pass it"),
        (lambda *case: 3, False, "raised TypeError"),
    ],
)
def test_buckets_checker(fn, ok: bool, says: str) -> None:
    verdict = cc.check_buckets(fn)
    assert bool(verdict) is ok, verdict
    assert says in verdict.message, verdict


@pytest.mark.timeout(30)
def test_buckets_solution() -> None:
    ns: dict = {}
    exec(cc.solution_buckets().code, ns)
    assert cc.check_buckets(ns["buckets"])
