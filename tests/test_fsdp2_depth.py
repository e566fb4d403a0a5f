"""FSDP2's options on 4 gloo ranks against the formulas of labkit.parallel.fsdp2_depth and a
single process: the collectives of a step (counted from labkit's trace, with their groups and
bytes) under reshard_after_forward True / False / 2, gradient accumulation with and without
the sync, HSDP; the bytes and dtypes of mixed precision and its gradients against the bf16
reference. What a forward leaves allocated is checked by notebook 41 alone (an allocator
measurement needs the least of several runs: gloo's threads free some buffers unrecorded).
Then the exercise checker of notebook 41 against right and classic wrong answers."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks

from labkit.exercises import fsdp2_checks as fc
from labkit.parallel.fsdp2_depth import (
    held_after_forward,
    sent_bytes,
    step_collectives,
    unit_bytes,
)

L, H = 3, 16
U = 4 * (H * H + H)  # one Linear(16, 16) in fp32: 16 rows divide by 4 and 2


def test_unit_bytes_pads_dim_0() -> None:
    assert unit_bytes([(16, 16), (16,)], 4) == U
    assert unit_bytes([(10, 256), (10,)], 4) == 4 * (12 * 256 + 12)  # notebook 26's layer 2
    assert unit_bytes([(10, 256)], 4, element_size=2) == 2 * 12 * 256
    with pytest.raises(ValueError, match="shard_size"):
        unit_bytes([(4,)], 0)


def test_step_collectives_worked_by_hand() -> None:
    assert step_collectives(4) == {"all_gather": 8, "reduce_scatter": 4, "all_reduce": 0}
    assert step_collectives(4, 1, False) == {"all_gather": 4, "reduce_scatter": 4, "all_reduce": 0}
    assert step_collectives(4, 1, 2)["all_gather"] == 8  # an int still gathers in backward
    assert step_collectives(4, 1, 1)["all_gather"] == 4  # 1 is False (torch says so too)
    assert step_collectives(4, 4, True, True) == {
        "all_gather": 32,
        "reduce_scatter": 4,
        "all_reduce": 0,
    }
    assert step_collectives(3, 2, True, False, 2)["all_reduce"] == 6
    with pytest.raises(ValueError, match="replicate"):
        step_collectives(2, 1, True, False, 0)


def test_held_after_forward_and_sent_bytes() -> None:
    assert held_after_forward([U] * 3, True, 4) == 0
    assert held_after_forward([U] * 3, False, 4) == 3 * U
    assert held_after_forward([U] * 3, 2, 4) == 3 * U // 2
    assert held_after_forward([U] * 3, 4, 4) == 0
    with pytest.raises(ValueError, match="divide"):
        held_after_forward([U], 3, 4)
    calls = [("all_gather", 400, 4), ("reduce_scatter", 400, 4), ("all_reduce", 100, 2)]
    assert sent_bytes(calls) == 300 + 300 + 100
    assert sent_bytes(calls, "gloo") == 300 + 600 + 100


def _count_rank(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from labkit.parallel.fsdp2_depth import bf16_reference_grads, make_stack, units
    from labkit.parallel.two_d import local_piece
    from labkit.rank import trace

    torch.set_num_threads(1)
    trace.install()
    flat = init_device_mesh("cpu", (world_size,))
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    gen = torch.Generator().manual_seed(3)
    X, Y = torch.randn(16, H, generator=gen), torch.randn(16, H, generator=gen)
    mine = slice(4 * rank, 4 * rank + 4)

    def shard(mesh, **options):
        model = make_stack(L, H)
        for unit in units(model):
            fully_shard(unit, mesh=mesh, **options)
        return fully_shard(model, mesh=mesh, **options)

    reference = make_stack(L, H)
    F.mse_loss(reference(X), Y).backward()
    full = [p.grad for p in reference.parameters()]
    out: dict = {"counts": {}, "errors": {}}
    settings = [  # (name, mesh, reshard_after_forward, microbatches, sync_last_only)
        ("default", flat, True, 1, False),
        ("keep", flat, False, 2, False),
        ("pairs", flat, 2, 2, False),
        ("accumulate", flat, True, 4, True),
        ("hsdp", mesh2d, True, 2, False),
        ("hsdp accumulate", mesh2d, True, 2, True),
    ]
    for cell, (name, mesh, raf, m, last) in enumerate(settings, start=1):
        model = shard(mesh, reshard_after_forward=raf)
        F.mse_loss(model(X[mine]), Y[mine]).backward()  # FSDP2's set-up
        model.zero_grad()
        trace.begin_cell(cell, rank)
        for i, (x, y) in enumerate(zip(X[mine].chunk(m), Y[mine].chunk(m))):
            if last:
                model.set_requires_gradient_sync(i == m - 1)
            (F.mse_loss(model(x), y) / m).backward()
        out["counts"][name] = [
            (r.op, r.bytes, tuple(r.group)) for r in trace.records(cell) if r.kind == "comm"
        ]
        out["errors"][name] = max(
            (p.grad.to_local() - local_piece(p, g)).abs().max().item()
            for p, g in zip(model.parameters(), full)
        )

    # mixed precision: the gathers' dtype, the gradients against the bf16 reference
    batches = [(X[i : i + 4], Y[i : i + 4]) for i in range(0, 16, 4)]
    ref_bf16 = bf16_reference_grads(make_stack(L, H), batches, F.mse_loss)
    out["mp"] = {}
    for cell, reduce_dtype in ((20, torch.float32), (21, None)):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        model = shard(flat, mp_policy=policy)
        trace.begin_cell(cell, rank)
        F.mse_loss(model(X[mine]).float(), Y[mine]).backward()
        out["mp"][reduce_dtype] = (
            sorted({(r.op, r.bytes, r.dtype) for r in trace.records(cell) if r.kind == "comm"}),
            max(
                ((p.grad.to_local() - local_piece(p, g)).abs().max() / g.abs().max()).item()
                for p, g in zip(model.parameters(), ref_bf16)
            ),
        )

    dist.barrier()
    return out


@pytest.mark.timeout(180)
def test_fsdp2_options_on_four_ranks() -> None:
    results = run_ranks(_count_rank, 4, timeout=170)
    expected = {  # name: (reshard_after_forward, microbatches, sync_last_only, replicate)
        "default": (True, 1, False, 1),
        "keep": (False, 2, False, 1),
        "pairs": (2, 2, False, 1),
        "accumulate": (True, 4, True, 1),
        "hsdp": (True, 2, False, 2),
        "hsdp accumulate": (True, 2, True, 2),
    }
    folded = {"all_gather_single": "all_gather", "reduce_scatter_single": "reduce_scatter"}
    for rank, out in enumerate(results):
        world, pair = (0, 1, 2, 3), (rank // 2 * 2, rank // 2 * 2 + 1)
        replicate = (rank % 2, rank % 2 + 2)
        for name, (raf, m, last, rep) in expected.items():
            calls = [(folded.get(op, op), b, g) for op, b, g in out["counts"][name]]
            counted = {k: sum(c[0] == k for c in calls) for k in ("all_gather", "reduce_scatter")}
            counted["all_reduce"] = sum(c[0] == "all_reduce" for c in calls)
            assert counted == step_collectives(L, m, raf, last, rep), (rank, name, calls)
            assert out["errors"][name] < 1e-6, (rank, name)  # the whole batch, one process
            if rep == 1 and raf != 2:
                assert {g for _, _, g in calls} == {world}
            if raf == 2:  # forward over all 4, backward inside the pair
                assert sorted(g for op, _, g in calls if op == "all_gather") == sorted(
                    [world] * L * m + [pair] * L * m
                )
            if rep > 1:
                assert {(op, b, g) for op, b, g in calls} == {
                    ("all_gather", 4 * (H * H + H), pair),
                    ("reduce_scatter", 4 * (H * H + H), pair),
                    ("all_reduce", 2 * (H * H + H), replicate),
                }
        (mp_calls, exact), (bf16_calls, drift) = out["mp"][torch.float32], out["mp"][None]
        assert mp_calls == [
            ("all_gather_single", U // 2, "bfloat16"),
            ("reduce_scatter_single", U, "float32"),
        ]
        assert ("reduce_scatter_single", U // 2, "bfloat16") in bf16_calls
        assert exact < 1e-5 and drift > 1e-3, (exact, drift)


# --- the exercise checker ---------------------------------------------------------------


def right_answer(units, m, raf, last, rep):
    gathers = 1 if raf is False else 2
    syncs = 1 if last else m
    return {
        "all_gather": units * gathers * m,
        "reduce_scatter": units * syncs,
        "all_reduce": units * syncs if rep > 1 else 0,
    }


def per_step(units, m, raf, last, rep):  # ignores the micro-batches
    return right_answer(units, 1, raf, False, rep)


def int_like_false(units, m, raf, last, rep):
    return right_answer(units, m, raf if raf is True else False, last, rep)


def no_reduce_when_unsynced(units, m, raf, last, rep):
    out = right_answer(units, m, raf, last, rep)
    if last:
        out["reduce_scatter"] = out["all_reduce"] = 0
    return out


def keep_gathers_once_a_step(units, m, raf, last, rep):
    out = right_answer(units, m, raf, last, rep)
    if raf is False:
        out["all_gather"] = units
    return out


def no_hsdp_all_reduce(units, m, raf, last, rep):
    return {**right_answer(units, m, raf, last, rep), "all_reduce": 0}


def all_reduce_every_microbatch(units, m, raf, last, rep):
    out = right_answer(units, m, raf, last, rep)
    out["all_reduce"] = units * m if rep > 1 else 0
    return out


def false_still_gathers_twice(units, m, raf, last, rep):
    return right_answer(units, m, True if raf is False else raf, last, rep)


def all_reduce_per_other_replica(units, m, raf, last, rep):
    out = right_answer(units, m, raf, last, rep)
    out["all_reduce"] = out["reduce_scatter"] * (rep - 1)
    return out


def true_taken_for_one(units, m, raf, last, rep):  # `raf == 1` is True for True too
    return right_answer(units, m, False if raf == 1 else raf, last, rep)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "fn, ok, says",
    [
        (right_answer, True, "every count matches"),
        (lambda *case: step_collectives(*case), True, "every count matches"),
        (per_step, False, "on every micro-batch"),
        (int_like_false, False, "backward still all-gathers, inside that group"),
        (no_reduce_when_unsynced, False, "the last one still reduce-scatters"),
        (keep_gathers_once_a_step, False, "every micro-batch's forward gathers it again"),
        (no_hsdp_all_reduce, False, "followed by an all-reduce"),
        (all_reduce_every_microbatch, False, "with the sync skipped it is skipped too"),
        (false_still_gathers_twice, False, "skips the gather before backward"),
        (all_reduce_per_other_replica, False, "not one per other replica"),
        (true_taken_for_one, False, "expected"),  # no slip of the concept: the counts shown
        (lambda *case: (1, 2, 3), False, "raised TypeError"),
    ],
)
def test_step_counts_checker(fn, ok: bool, says: str) -> None:
    verdict = fc.check_step_counts(fn)
    assert bool(verdict) is ok, verdict
    assert says in verdict.message, verdict


@pytest.mark.timeout(30)
def test_step_counts_solution_and_stub() -> None:
    ns: dict = {}
    exec(fc.solution_step_counts().code, ns)
    assert fc.check_step_counts(ns["step_counts"])

    def stub(num_units, microbatches, reshard_after_forward, sync_last_only, replicate):
        gathers = 1 if reshard_after_forward is False else 2
        return {"all_gather": gathers * num_units, "reduce_scatter": num_units, "all_reduce": 0}

    assert not fc.check_step_counts(stub)  # the notebook's stub must not pass


def test_make_stack_draws_its_weights_on_the_host_whatever_the_device():
    """Weights drawn on a GPU come from the GPU's generator, another sequence than the kernel's
    CPU one for the same seed; make_stack draws on the host and moves them. Seen from here: on
    the meta device (no values, no generator) the host's generator still advances exactly as
    for a CPU stack."""
    from labkit.parallel.fsdp2_depth import make_stack

    make_stack(2, 8)
    after_cpu = torch.randn(1)
    meta = make_stack(2, 8, device="meta")
    assert torch.equal(torch.randn(1), after_cpu)
    assert all(p.device.type == "meta" for p in meta.parameters())
