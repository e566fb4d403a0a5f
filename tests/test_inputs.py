"""Bad input gets a clear error that says what is allowed (no ranks needed for most)."""

import pytest

from labkit.kernel.policy import check_world_size, choose
from labkit.kernel.rank_spec import parse_ranks

CPU = {"gpus": 0, "nccl": False, "cpus": 2}
GPU1 = {"gpus": 1, "nccl": True, "cpus": 16}


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


def test_choose_policy():
    assert choose(4, "auto", "auto", CPU).backend == "gloo"
    assert choose(4, "auto", "auto", CPU).device == "cpu"
    gpu = choose(2, "auto", "auto", GPU1)
    assert (gpu.backend, gpu.device) == ("gloo", "cuda")  # two ranks share one GPU: gloo
    assert "sharing" in gpu.reason
    assert choose(1, "auto", "auto", GPU1).backend == "nccl"
    with pytest.raises(ValueError, match="one GPU per rank"):
        choose(2, "nccl", "auto", GPU1)
    with pytest.raises(ValueError, match="one GPU per rank"):
        choose(2, "nccl", "cpu", CPU)
    with pytest.raises(ValueError, match="needs a GPU"):
        choose(2, "auto", "cuda", CPU)
    with pytest.raises(ValueError, match="backend must be one of"):
        choose(2, "mpi2", "auto", CPU)
    with pytest.raises(ValueError, match="device must be one of"):
        choose(2, "auto", "tpu", CPU)


@pytest.mark.timeout(60)
def test_lab_rejects_bad_arguments_before_starting():
    import labkit

    with pytest.raises(ValueError, match="world_size"):
        labkit.Lab(0)
    with pytest.raises(ValueError, match="backend"):
        labkit.Lab(2, backend="foo")
    with pytest.raises(ValueError, match="one GPU per rank"):
        labkit.Lab(2, backend="nccl")
