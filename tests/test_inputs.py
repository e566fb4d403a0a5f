"""Bad input gets a clear error that says what is allowed (no ranks needed for most)."""

import pytest

from labkit.kernel.cell.rank_spec import parse_ranks
from labkit.kernel.launch.policy import check_world_size, choose


@pytest.mark.parametrize("n", [0, -1, 10_000, "4", 2.0, True])
def test_world_size_out_of_range(n):
    with pytest.raises(ValueError, match=r"world_size must be"):
        check_world_size(n)


@pytest.mark.parametrize(
    "spec,expected",
    [
        (None, [0, 1, 2, 3]),
        ("all", [0, 1, 2, 3]),
        ("0,2", [0, 2]),
        ("1-3", [1, 2, 3]),
        ("0, 2-3", [0, 2, 3]),
        (1, [1]),
        ([3, 0, 3], [0, 3]),
    ],
)
def test_parse_ranks(spec, expected):
    assert parse_ranks(spec, 4) == expected


@pytest.mark.parametrize(
    "spec,match",
    [
        ("5", "out of range"),
        ("0,9", "out of range"),
        ("a", "cannot read"),
        ("3-1", "cannot read"),
        ([], "at least one"),
        (-1, "out of range"),
        ("1-", "cannot read"),
    ],
)
def test_bad_ranks(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_ranks(spec, 4)


def facts(gpus: int, nccl: bool = True, cpus: int = 16) -> dict:
    return {"gpus": gpus, "nccl": nccl and gpus > 0, "cpus": cpus, "torch": "2.x", "cuda": None}


@pytest.mark.parametrize(
    "n,backend,device,gpus,want",
    [
        # no GPU: CPU ranks with gloo
        (4, "auto", "auto", 0, ("gloo", "cpu")),
        (4, "gloo", "cpu", 0, ("gloo", "cpu")),
        # one GPU per rank: NCCL for CUDA tensors, gloo for CPU tensors and objects
        (1, "auto", "auto", 1, ("cpu:gloo,cuda:nccl", "cuda")),
        (2, "auto", "auto", 2, ("cpu:gloo,cuda:nccl", "cuda")),
        (4, "auto", "auto", 8, ("cpu:gloo,cuda:nccl", "cuda")),
        (2, "nccl", "cuda", 2, ("cpu:gloo,cuda:nccl", "cuda")),
        (2, "auto", "cpu", 2, ("gloo", "cpu")),  # asked for the CPU: gets it
        (2, "gloo", "auto", 2, ("gloo", "cpu")),  # gloo asked: CPU tensors, every op works
        # more ranks than GPUs (4 on 1: the workshop case): CPU ranks unless CUDA is asked for
        (4, "auto", "auto", 1, ("gloo", "cpu")),
        (2, "auto", "auto", 1, ("gloo", "cpu")),
        (4, "auto", "cuda", 1, ("gloo", "cuda")),
        (4, "gloo", "cuda", 2, ("gloo", "cuda")),
    ],
)
def test_choose_for_every_case(n, backend, device, gpus, want):
    c = choose(n, backend, device, facts(gpus))
    assert (c.backend, c.device, c.gpus, c.world_size) == (*want, gpus, n)
    assert c.reason.startswith(f"{want[0]} on {want[1]}: ")
    assert c == choose(n, backend, device, facts(gpus))  # a pure function


def test_choose_says_why_ranks_share_or_stay_on_the_cpu():
    shared = choose(4, "auto", "cuda", facts(1))
    assert "4 ranks sharing 1 GPU(s)" in shared.reason
    assert "through host memory" in shared.reason and "point-to-point" in shared.reason
    stay = choose(4, "auto", "auto", facts(1))
    assert "NCCL needs one per rank" in stay.reason and "device='cuda'" in stay.reason
    assert "not yet passed whole" in stay.reason
    assert "one GPU per rank" in choose(2, "auto", "auto", facts(2)).reason
    assert "GPU" not in choose(4, "auto", "auto", facts(0)).reason
    # a GPU per rank but a torch without NCCL: the CPU, not CUDA tensors gloo cannot send
    no_nccl = choose(2, "auto", "auto", facts(2, nccl=False))
    assert no_nccl.device == "cpu" and "this torch has no NCCL" in no_nccl.reason
    assert choose(None, "auto", "auto", facts(2)).world_size == 2  # a rank per GPU by default
    assert choose(None, "auto", "auto", facts(0)).world_size == 4


@pytest.mark.parametrize(
    "n,backend,device,gpus,match",
    [
        (2, "auto", "cuda", 0, r"needs a GPU, but torch sees none.*available: device='cpu'"),
        (2, "nccl", "cuda", 0, r"needs a GPU, but torch sees none"),
        (2, "nccl", "auto", 1, r"one GPU per rank: 2 ranks per host, GPUs 1"),
        (4, "nccl", "cuda", 2, r"one GPU per rank: 4 ranks per host, GPUs 2"),
        (2, "nccl", "cpu", 0, r"one GPU per rank"),
        (2, "nccl", "cpu", 2, r"one GPU per rank"),
        (2, "mpi2", "auto", 0, r"backend must be one of auto, gloo, nccl; got 'mpi2'"),
        (2, "auto", "tpu", 0, r"device must be one of auto, cpu, cuda; got 'tpu'"),
    ],
)
def test_choose_refuses_what_cannot_be_honoured(n, backend, device, gpus, match):
    with pytest.raises(ValueError, match=match):
        choose(n, backend, device, facts(gpus))


def test_choose_nccl_needs_nccl_built():
    with pytest.raises(ValueError, match="NCCL missing"):
        choose(2, "nccl", "cuda", facts(2, nccl=False))


@pytest.mark.timeout(60)
def test_lab_rejects_bad_arguments_before_starting():
    import labkit

    with pytest.raises(ValueError, match="world_size"):
        labkit.Lab(0)
    with pytest.raises(ValueError, match="backend"):
        labkit.Lab(2, backend="foo")
    with pytest.raises(ValueError, match="one GPU per rank"):
        labkit.Lab(2, backend="nccl")
    if not __import__("torch").cuda.is_available():  # on a GPU machine this Lab would start
        with pytest.raises(ValueError, match=r"needs a GPU, but torch sees none.*device='cpu'"):
            labkit.Lab(2, device="cuda")


def test_labkit_device_env_sets_the_default_device_only():
    from labkit.kernel.launch.policy import default_device

    assert default_device("auto", {}) == "auto"
    assert default_device("auto", {"LABKIT_DEVICE": "cuda"}) == "cuda"
    assert default_device("cpu", {"LABKIT_DEVICE": "cuda"}) == "cpu"  # an explicit ask wins
    with pytest.raises(ValueError, match="LABKIT_DEVICE must be one of auto, cpu, cuda; got 'gpu'"):
        default_device("auto", {"LABKIT_DEVICE": "gpu"})


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks the refusal where there is no GPU"
)
def test_check_on_cuda_without_a_gpu_says_so(capsys, tmp_path):
    from labkit.tools.cli import main

    nb = tmp_path / "x.ipynb"
    nb.write_text("{}")
    assert main(["check", "--device", "cuda", str(nb)]) == 2
    err = capsys.readouterr().err
    assert "--device cuda: torch" in err and "sees no GPU here" in err
