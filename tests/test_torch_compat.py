"""The torch range: every private torch hook found in one place, each made unavailable in turn.

labkit.rank.torch_compat probes each private or version-specific torch API labkit uses; on every
torch of the tested range (CI runs this file on the oldest and the newest, scripts/dev.py
range) each one must be there. Where one is missing (made so with `disable`, as an older or
newer torch would), the feature that needs it says so and the lab keeps working: 2 CPU ranks run
the cells that use each hook with it gone. The renames (torch 2.13's all_gather_single and
reduce_scatter_single on an older torch) are checked by provide_renames on a torch made to lack
them, and, on a torch that lacks them, by tests/test_trace.py's records of those names.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

import labkit
from labkit.rank import torch_compat
from labkit.tools.cli import torch_support


def test_every_hook_is_there_on_this_torch() -> None:
    """On a torch inside the tested range, no feature is missing (else CI says which)."""
    assert torch_compat.in_range(torch.__version__), torch.__version__
    assert torch_compat.unavailable() == {}


@pytest.mark.parametrize(
    "version, inside",
    [
        ("2.11.0+cu130", True),
        ("2.11.0", True),
        ("2.13.0+cpu", True),
        ("2.14.1", True),
        ("2.14.2", True),  # a patch of the newest tested minor release
        ("2.10.1", False),
        ("2.15.0", False),
        ("2.15.0.dev20261101+cpu", False),
        ("3.0.0", False),
    ],
)
def test_in_range(version: str, inside: bool) -> None:
    assert torch_compat.in_range(version) is inside


def test_disable_says_what_is_missing_and_enable_undoes_it() -> None:
    try:
        torch_compat.disable("flight_recorder")
        assert torch_compat.get("flight_recorder") is None
        assert set(torch_compat.unavailable()) == {"flight_recorder"}
        text = torch_compat.missing("flight_recorder")
        assert f"torch {torch.__version__} lacks flight_recorder (made unavailable" in text
        assert "lab.flight_recorder" in text
        support = torch_support(torch.__version__)
        assert set(support["unavailable"]) == {"flight_recorder"}
        assert "inside" in support["tested range"]
    finally:
        torch_compat.enable()
    assert torch_compat.get("flight_recorder") is not None
    with pytest.raises(KeyError, match="no torch feature 'nope'; the features are"):
        torch_compat.disable("nope")


def test_the_environment_variable_disables_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(torch_compat.OFF_ENV, "join_hook, group_registry")
    assert set(torch_compat.unavailable()) == {"join_hook", "group_registry"}
    assert "LABKIT_TORCH_OFF" in torch_compat.missing("join_hook")


@pytest.mark.timeout(120)
def test_doctor_prints_the_range_and_what_is_missing(monkeypatch, capsys) -> None:
    from labkit.tools import cli

    monkeypatch.setenv(torch_compat.OFF_ENV, "join_hook")
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    low, high = torch_compat.TESTED
    assert f"tested range: torch {low} to {high}: {torch.__version__} is inside" in out
    assert "unavailable: join_hook\n" in out
    assert "join_hook: made unavailable (LABKIT_TORCH_OFF): no end time" in out
    renamed = torch_compat.renames_needed()
    assert ("renamed by labkit: all_gather_single" in out) is bool(renamed)


def test_renames_provide_only_the_two_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a torch without torch 2.13's names, provide_renames adds exactly those two to
    torch.distributed, bound to the functions they replaced, with their signatures."""
    for new in torch_compat.RENAMES:
        monkeypatch.delattr(dist, new, raising=False)
    before = set(dir(dist))
    assert torch_compat.renames_needed() == list(torch_compat.RENAMES)
    added = torch_compat.provide_renames()
    assert added == list(torch_compat.RENAMES)
    assert set(dir(dist)) - before == set(torch_compat.RENAMES)
    for new, old in torch_compat.RENAMES.items():
        fn = getattr(dist, new)
        assert fn.__name__ == new and fn.__labkit_renamed__ is getattr(dist, old)
        assert inspect.signature(fn) == inspect.signature(getattr(dist, old))
        assert getattr(c10d, new) is not None  # distributed_c10d has the name too
    assert torch_compat.provide_renames() == []  # idempotent
    note = torch_compat.renames_note()
    assert "dist.all_gather_single (torch's all_gather_into_tensor)" in note
    assert "dist.reduce_scatter_single (torch's reduce_scatter_tensor)" in note


@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events:UserWarning")  # torch 2.11's
def test_the_profiler_event_tree_missing_is_said() -> None:
    from labkit.parallel import zero_redundancy

    try:
        torch_compat.disable("profiler_event_tree")
        with torch.profiler.profile(profile_memory=True) as prof:
            torch.ones(4) * 2
        with pytest.raises(RuntimeError, match="lacks profiler_event_tree"):
            zero_redundancy._allocations(prof, "cpu")
    finally:
        torch_compat.enable()


@pytest.fixture(scope="module")
def lab():
    lab = labkit.Lab(2, device="cpu")
    yield lab
    lab.stop()


def _off(lab, name: str) -> None:
    lab.run(f"from labkit.rank import torch_compat; torch_compat.disable({name!r})")


@pytest.mark.timeout(180)
def test_without_the_flight_recorder(lab) -> None:
    """No dump: labkit.flight_recorder says why, DDP trains, its buckets are not recorded."""
    try:
        _off(lab, "flight_recorder")
        got = labkit.flight_recorder(lab)
        assert all("lacks flight_recorder" in str(got[r]) for r in (0, 1)), got
        lab.run(
            """
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
model(torch.ones(3, 4)).sum().backward()
w = model.module.weight.grad.clone()
"""
        ).raise_for_errors()
        ops = {r.op for r in lab.trace() if r.kind == "comm"}
        assert not {r.recorded_by for r in lab.trace() if r.kind == "comm"} - {None, ""}, ops
        grads = lab.pull("w")
        assert torch.equal(grads[0], grads[1])  # DDP averaged them: the lab works
    finally:
        lab.run("torch_compat.enable()")


@pytest.mark.timeout(180)
def test_without_the_group_registry(lab) -> None:
    """destroy_process_group() keeps the cell's groups and says why; the lab goes on."""
    try:
        _off(lab, "group_registry")
        out = lab.run(
            """
g = dist.new_group([0, 1])
dist.destroy_process_group()
x = torch.ones(1)
dist.all_reduce(x, group=g)
x.item()
"""
        )
        out.raise_for_errors()
        assert [out[r].value for r in (0, 1)] == [2.0, 2.0]
        assert "lacks group_registry" in out[0].output
        assert lab.run("dist.is_initialized()")[0].value is True
    finally:
        lab.run("torch_compat.enable()")


@pytest.mark.timeout(180)
def test_without_the_join_hook(lab) -> None:
    """Join with uneven inputs still runs (DDP gets torch's own Work); an async all_reduce's
    record then ends when it is issued."""
    try:
        _off(lab, "join_hook")
        out = lab.run(
            """
from torch.distributed.algorithms.join import Join
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
with Join([model]):
    for _ in range(1 + rank):  # rank 1 has one batch more
        model(torch.ones(1, 2)).sum().backward()
x = torch.ones(1)
dist.all_reduce(x, async_op=True).wait()
x.item()
"""
        )
        out.raise_for_errors()
        assert [out[r].value for r in (0, 1)] == [2.0, 2.0]
        last = [r for r in lab.trace() if r.kind == "comm" and r.rank == 0][-1]
        assert last.op == "all_reduce" and last.async_op
    finally:
        lab.run("torch_compat.enable()")


@pytest.mark.timeout(180)
def test_without_the_functional_collectives_and_dtensor_slices(lab) -> None:
    """DTensor still communicates, unrecorded, and the rank says why; the placement rows keep
    their placements without slices; labkit.parallel.two_d.local_piece says what is missing."""
    try:
        _off(lab, "functional_collectives")
        _off(lab, "dtensor_local_shape")
        out = lab.run(
            """
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from labkit.rank.placement_probe import _sharding
mesh = init_device_mesh("cpu", (2,))
d = distribute_tensor(torch.arange(4.), mesh, [Shard(0)])
whole = d.full_tensor()
try:
    from labkit.parallel.two_d import local_piece
    local_piece(d, whole)
    said = ""
except RuntimeError as e:
    said = str(e)
(whole, _sharding(d), said)
"""
        )
        out.raise_for_errors()
        whole, sharding, said = out[0].value
        assert torch.equal(whole, torch.arange(4.0))
        assert sharding["placement"] == "sharded" and sharding["shard"] == []
        assert "lacks dtensor_local_shape" in said
        assert "lacks functional_collectives" in out[0].output
    finally:
        lab.run("torch_compat.enable()")


@pytest.mark.timeout(180)
def test_the_renames_are_said_once_and_recorded_as_called(lab) -> None:
    """On a torch older than 2.13 (the oldest of the range): rank 0 says once that the ranks
    provide the two names; each call is recorded under the name it was called by."""
    provided = lab.run(
        "from labkit.rank import torch_compat; torch_compat.provided('all_gather_single')"
    )
    if not provided[0].value:
        pytest.skip(f"torch {torch.__version__} has torch 2.13's names: none to provide")
    out = lab.run(
        """
mine, out, half = torch.arange(2.) + rank, torch.empty(4), torch.empty(2)
dist.all_gather_single(out, mine)
dist.reduce_scatter_single(half, out)
dist.all_gather_single(out, mine, async_op=True).wait()
dist.all_gather_into_tensor(out, mine)
(out, half)
"""
    )
    out.raise_for_errors()
    for r in (0, 1):
        gathered, half = out[r].value
        assert torch.equal(gathered, torch.tensor([0.0, 1.0, 1.0, 2.0]))
        assert torch.equal(half, 2 * torch.tensor([0.0, 1.0, 1.0, 2.0]).chunk(2)[r])
    assert out[0].output.count("predates torch 2.13's names; the ranks provide") == 1
    assert "predates" not in out[1].output
    ops = [(r.op, r.bytes) for r in lab.trace() if r.rank == 0 and r.kind == "comm"]
    assert ops == [
        ("all_gather_single", 16),
        ("reduce_scatter_single", 16),
        ("all_gather_single", 16),
        ("all_gather_into_tensor", 16),
    ], ops
