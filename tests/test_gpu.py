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
def test_more_ranks_than_gpus_stay_on_the_cpu_unless_cuda_is_asked_for() -> None:
    import labkit

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
