"""On a GPU machine: the device policy's choices hold up on real ranks (`pytest -m gpu`).

Skipped with the reason wherever torch sees no GPU (CI, the workshop's laptops). They ran on a GPU
once, on 2026-11-26 (docs/gpu.md, "GPU runs on record"): a failure here is news, not a known state.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU (torch sees none here); run `pytest -m gpu` on a GPU machine",
    ),
]


def _gpus() -> int:
    return torch.cuda.device_count()


@pytest.mark.timeout(180)
def test_a_gpu_per_rank_gets_nccl_for_cuda_and_gloo_for_cpu() -> None:
    import labkit

    n = min(_gpus(), 2)
    lab = labkit.Lab(n, device="cuda")
    try:
        want = "cpu:gloo,cuda:nccl" if torch.distributed.is_nccl_available() else "gloo"
        assert (lab.choice.backend, lab.choice.device) == (want, "cuda")

        def body(rank: int, world_size: int, device: torch.device) -> tuple:
            t = torch.full((4,), float(rank + 1), device=device)
            torch.distributed.all_reduce(t)  # NCCL on CUDA tensors
            objects = [None] * world_size
            torch.distributed.all_gather_object(objects, str(device))  # gloo, CPU
            c = torch.tensor([rank])
            torch.distributed.all_reduce(c)  # gloo on a CPU tensor
            return t.device.type, t.sum().item(), objects, c.item()

        results = lab.run(body, display=False).values_by_rank
        total = 4 * sum(range(1, n + 1))
        for r, (kind, s, objects, c) in results.items():
            assert (kind, s, c) == ("cuda", total, sum(range(n))), (r, results)
            assert objects == [f"cuda:{k % _gpus()}" for k in range(n)], objects
    finally:
        lab.stop()


@pytest.mark.timeout(180)
def test_more_ranks_than_gpus_stay_on_the_cpu_unless_cuda_is_asked_for(monkeypatch) -> None:
    import labkit

    monkeypatch.delenv("LABKIT_DEVICE", raising=False)  # the GPU check sets it for notebooks

    n = _gpus() + 1
    lab = labkit.Lab(n)
    try:
        assert (lab.choice.backend, lab.choice.device) == ("gloo", "cpu"), lab.choice.reason
    finally:
        lab.stop()
    lab = labkit.Lab(n, device="cuda")
    try:
        assert (lab.choice.backend, lab.choice.device) == ("gloo", "cuda")

        def body(device: torch.device) -> float:
            t = torch.ones(4, device=device)
            torch.distributed.all_reduce(t)  # gloo runs all_reduce on CUDA tensors
            return t.sum().item()

        assert set(lab.run(body, display=False).values_by_rank.values()) == {4.0 * n}
    finally:
        lab.stop()


@pytest.mark.timeout(180)
def test_teaching_code_runs_on_the_gpu_and_matches_one_process() -> None:
    import labkit

    n = min(_gpus(), 2)
    lab = labkit.Lab(n, device="cuda")
    try:

        def body(device: torch.device) -> float:
            from torch import nn

            from labkit.parallel.tensor_parallel import dtensor_mlp

            torch.manual_seed(0)
            fc1, fc2 = nn.Linear(16, 32).to(device), nn.Linear(32, 16).to(device)
            x = torch.randn(8, 16, device=device)
            want = fc2(nn.functional.gelu(fc1(x)))
            got = dtensor_mlp(fc1, fc2)(x)  # a mesh of the weights' device type
            got = got.full_tensor() if hasattr(got, "full_tensor") else got
            return (got - want).abs().max().item()

        errors = lab.run(body, display=False).values_by_rank
        assert max(errors.values()) < 1e-4, errors  # TF32 off by default; reduction order differs
    finally:
        lab.stop()


@pytest.mark.timeout(180)
def test_zero1_steps_on_the_gpu_as_one_process_adam_does() -> None:
    import labkit

    n = min(_gpus(), 2)
    lab = labkit.Lab(n, device="cuda")
    try:

        def body(device: torch.device) -> tuple[float, str]:
            from torch import nn

            from labkit.parallel.zero_redundancy import Zero1Optimizer

            torch.manual_seed(0)  # the same model and batch on every rank: the mean gradient
            model, ref = nn.Linear(8, 4).to(device), nn.Linear(8, 4).to(device)
            ref.load_state_dict(model.state_dict())
            x = torch.randn(16, 8, device=device)
            opt = Zero1Optimizer(model.parameters(), torch.optim.Adam, lr=0.1)
            model(x).pow(2).mean().backward()
            opt.step()  # reduce_scatter on the GPU, Adam on this rank's slice, all_gather
            ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1)
            ref(x).pow(2).mean().backward()
            ref_opt.step()
            pairs = zip(model.parameters(), ref.parameters())
            return max((a - b).abs().max().item() for a, b in pairs), model.weight.device.type

        results = lab.run(body, display=False).values_by_rank
        assert all(err < 1e-5 and kind == "cuda" for err, kind in results.values()), results
    finally:
        lab.stop()


DDP_SRC = """
def ddp_on_gpu(device):
    import torch, torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(3)]).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.index is not None else None,
              bucket_cap_mb=1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        ddp(torch.randn(8, 512, device=device)).square().mean().backward()
        opt.step()
    torch.cuda.synchronize(device)
    return [h.__name__ for h, _ in ddp._comm_hooks], next(ddp.parameters()).device.type
"""


@pytest.mark.timeout(180)
def test_ddp_over_nccl_keeps_no_hook_and_leaves_one_record_per_bucket() -> None:
    """DDP on the GPU in a 1-GPU lab (NCCL): labkit adds no comm hook, and the Flight Recorder
    gives one all_reduce record per bucket: one of everything, then one per layer (the layout
    DDP rebuilds after its first step; tests/test_ddp_observed.py on CPU)."""
    import labkit
    from labkit.rank import ddp_tracing
    from labkit.wire.records import CommRecord

    layer = (512 * 512 + 512) * 4
    lab = labkit.Lab(1, device="cuda")
    try:
        if "nccl" not in lab.choice.backend:
            pytest.skip(f"no NCCL here ({lab.choice.backend})")
        lab.run(DDP_SRC).raise_for_errors()
        res = lab.run("ddp_on_gpu(device)")
        res.raise_for_errors()
        assert res[0].value == ([], "cuda")

        def buckets() -> list[int]:  # the last cell's all-reduces read from the Flight Recorder
            return [
                r.bytes
                for r in lab.trace()
                if isinstance(r, CommRecord)
                and r.op == "all_reduce"
                and r.recorded_by == ddp_tracing.BY
            ]

        first = buckets()
        assert first == [3 * layer] + [layer] * 3, first
        # a gloo collective (a CPU tensor) between two DDP cells: gloo's and NCCL's recorders
        # count apart, and the next cell's NCCL buckets are still found
        lab.run("dist.all_reduce(torch.ones(1))").raise_for_errors()
        lab.run("ddp_on_gpu(device)").raise_for_errors()
        again = buckets()
        assert again == [3 * layer] + [layer] * 3, again
    finally:
        lab.stop()


@pytest.mark.timeout(180)
def test_ranks_sharing_the_gpu_report_its_memory_as_the_driver_counts_it() -> None:
    """Two ranks on one GPU each hold 64 MiB more after a cell: `%lab status`'s numbers grow by
    exactly that (the caching allocator takes 64 MiB as asked: a multiple of 2 MiB), and the
    card's total is what this process's driver query says."""
    import time

    import labkit

    mib64 = 64 * 2**20
    lab = labkit.Lab(2, device="cuda")
    try:

        def memory() -> dict:
            time.sleep(2.5)  # the heartbeat carries the numbers; let one arrive
            return {r["rank"]: r.get("cuda_memory") for r in lab.status_report()["ranks"]}

        lab.run("x = torch.ones(1, device=device); torch.cuda.synchronize()").raise_for_errors()
        before = memory()
        lab.run("big = torch.empty(16 * 2**20, device=device); torch.cuda.synchronize()")
        after = memory()
        _, total = torch.cuda.mem_get_info(0)
        for r in range(2):
            assert before[r] and after[r], (before, after)
            assert after[r]["allocated"] - before[r]["allocated"] == mib64, (before, after)
            assert after[r]["peak"] >= after[r]["allocated"] and after[r]["total"] == total
    finally:
        lab.stop()
