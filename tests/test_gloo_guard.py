"""Point-to-point calls on CUDA tensors over gloo are refused with a message instead of crashing
the rank (labkit.rank.gloo_guard): the rule alone, and wired into real gloo ranks' calls."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import labkit
from labkit.rank.gloo_guard import refuse_cuda_over_gloo


class FakeCudaTensor:  # what the guard reads of a CUDA tensor (no GPU here)
    is_cuda = True
    device = "cuda:0"


class FakeCpuTensor:
    is_cuda = False
    device = "cpu"


def test_a_cuda_tensor_over_gloo_is_refused_saying_what_to_do(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    with pytest.raises(
        RuntimeError, match=r"dist\.isend of a CUDA tensor \(cuda:0\) over gloo"
    ) as e:
        refuse_cuda_over_gloo("isend", FakeCudaTensor(), None)
    assert "t.cpu()" in str(e.value) and "a GPU of its own (NCCL)" in str(e.value)


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_a_cuda_tensor_over_nccl_goes_through(monkeypatch, backend):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    refuse_cuda_over_gloo("send", FakeCudaTensor(), None)


def test_cpu_tensors_and_unreadable_backends_go_through(monkeypatch):
    def no_backend(group=None):
        raise ValueError("Default process group has not been initialized")

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    refuse_cuda_over_gloo("send", FakeCpuTensor(), None)
    monkeypatch.setattr(dist, "get_backend", no_backend)
    refuse_cuda_over_gloo("recv", FakeCudaTensor(), None)  # torch reports the missing group


@pytest.mark.timeout(120)
def test_real_gloo_ranks_refuse_before_gloo_sees_the_call():
    cell = """
class _Cuda:
    is_cuda = True
    device = "cuda:0"

def _refusal(call):
    try:
        call()
    except RuntimeError as err:
        return str(err).split(":")[0]
    return "went through"

refusals = [
    _refusal(lambda: dist.send(_Cuda(), (rank + 1) % world_size)),
    _refusal(lambda: dist.irecv(tensor=_Cuda(), src=(rank + 1) % world_size, group=None)),
]
"""
    with labkit.Lab(2, device="cpu") as lab:
        for tracing in (True, False):  # the guard is not part of tracing
            lab.trace(enabled=tracing)
            lab.run(cell).raise_for_errors()
            got = lab.pull("refusals")
            assert (
                got[0]
                == got[1]
                == [
                    "dist.send of a CUDA tensor (cuda",
                    "dist.irecv of a CUDA tensor (cuda",
                ]
            ), got
        # a real CPU send still goes through the same wrapper
        lab.run(
            "t = torch.full((2,), float(rank))\n"
            "if rank == 0: dist.send(t, 1)\n"
            "else: dist.recv(t, 0)"
        ).raise_for_errors()
        assert [v.tolist() for v in lab.pull("t").values()] == [[0.0, 0.0], [0.0, 0.0]]
