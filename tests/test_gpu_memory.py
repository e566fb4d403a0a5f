"""Each rank's CUDA memory in `%lab status` and the placement view, tested without a GPU: the
rank's reading with torch.cuda's functions faked (in this process, and on real CPU ranks through
the heartbeat), the views from that state; ranks without CUDA say "no GPU", never zeros."""

from __future__ import annotations

import time

import pytest
import torch

import labkit
from labkit.kernel import magics
from labkit.rank import cuda_memory
from labkit.rank.placement_probe import describe_model
from labkit.views.gpu_memory import rank_text, shared_gpu_notes
from labkit.views.placement_data import memory_by_rank, merge_placement
from labkit.views.placement_view import PlacementView

MiB = 2**20
FAKE = """
import torch
_fake = {"allocated": (1 + rank) * 2**20, "reserved": (2 + rank) * 2**20}
_fake["peak"] = (3 + rank) * 2**20
torch.cuda.is_initialized = lambda: True
torch.cuda.current_device = lambda: 0
torch.cuda.mem_get_info = lambda device=None: (70 * 2**30, 80 * 2**30)
torch.cuda.memory_allocated = lambda device=None: _fake["allocated"]
torch.cuda.memory_reserved = lambda device=None: _fake["reserved"]
torch.cuda.max_memory_allocated = lambda device=None: _fake["peak"]
"""


def _fake_cuda(monkeypatch, allocated=5 * MiB, reserved=8 * MiB, peak=6 * MiB):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (70 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: allocated)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: reserved)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: peak)


def test_snapshot_reads_torchs_allocator_and_the_card(monkeypatch):
    _fake_cuda(monkeypatch)
    assert cuda_memory.snapshot() == {
        "device": "cuda:1",
        "allocated": 5 * MiB,
        "reserved": 8 * MiB,
        "peak": 6 * MiB,
        "free": 70 * 2**30,
        "total": 80 * 2**30,
    }


def test_no_cuda_initialised_means_no_numbers(monkeypatch):
    assert not torch.cuda.is_initialized()  # CPU torch here: never initialised
    assert cuda_memory.snapshot() is None
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def lost(device=None):
        raise RuntimeError("CUDA error: device lost")

    monkeypatch.setattr(torch.cuda, "mem_get_info", lost)
    assert cuda_memory.snapshot() is None  # an error gives no numbers, not zeros
    assert rank_text(None) == "no GPU"


def _snap(allocated: int, reserved: int, device: str = "cuda:0") -> dict:
    return dict(
        device=device,
        allocated=allocated,
        reserved=reserved,
        peak=allocated,
        free=70 * 2**30,
        total=80 * 2**30,
    )


def test_shared_gpu_notes_add_up_the_ranks_on_each_card():
    memory = {0: _snap(MiB, 2 * MiB), 1: _snap(3 * MiB, 4 * MiB), 2: None}
    memory[3] = _snap(10 * MiB, 10 * MiB, "cuda:1")  # alone on its card: no sum
    (note,) = shared_gpu_notes(memory)
    assert note.startswith("ranks 0, 1 share cuda:0: 4.0 MiB allocated, 6.0 MiB reserved in all")
    assert "of the card's 80.0 GiB (70.0 GiB free" in note
    # the same device name on two hosts is two cards
    assert shared_gpu_notes(memory, {0: "a", 1: "b"}) == []
    assert rank_text(memory[1]) == "cuda:0: 3.0 MiB allocated, 4.0 MiB reserved, 3.0 MiB peak"


def test_placement_view_shows_gpu_memory_or_no_gpu():
    model = torch.nn.Linear(2, 2)
    rows = merge_placement([row for r in (0, 1) for row in describe_model(model, rank=r)])
    memory = memory_by_rank(rows)
    view = PlacementView(rows, memory, [], {0: "cuda:0", 1: "cuda:0"}, {0: _snap(MiB, MiB)})
    view.gpu_memory[1] = None
    assert "no GPU" in view.to_html() and "1.0 MiB allocated" in view.to_html()
    shared = PlacementView(rows, memory, [], {}, {0: _snap(MiB, MiB), 1: _snap(MiB, 3 * MiB)})
    assert any("2.0 MiB allocated, 4.0 MiB reserved in all" in n for n in shared.notes)
    assert any("GPU memory per rank" in getattr(c, "value", "") for c in shared.children)
    cpu = PlacementView(rows, memory, [], {0: "cpu", 1: "cpu"}, {0: None, 1: None})
    assert "GPU memory" not in cpu.to_html()  # CPU ranks: no table of "no GPU" rows
    assert not any("GPU memory" in getattr(c, "value", "") for c in cpu.children)


def test_lab_status_shows_gpu_memory_per_rank_and_the_sum(monkeypatch):
    shown = []
    monkeypatch.setattr(magics, "display", lambda data, raw: shown.append(data))
    ranks = [
        dict(rank=r, pid=100 + r, device="cuda:0", threads=1, alive=True, busy=False)
        for r in (0, 1, 2)
    ]
    ranks[0]["cuda_memory"], ranks[1]["cuda_memory"] = _snap(MiB, MiB), _snap(MiB, MiB)
    magics.show_status({"choice": "test", "log_dir": "/x", "ranks": ranks})
    text = shown[0]["text/plain"].splitlines()
    assert text[1].endswith("cuda:0: 1.0 MiB allocated, 1.0 MiB reserved, 1.0 MiB peak")
    assert text[3].endswith("· no GPU")
    assert text[4].startswith("ranks 0, 1 share cuda:0: 2.0 MiB allocated")
    assert "<th>GPU memory</th>" in shown[0]["text/html"]


@pytest.mark.timeout(180)
def test_cpu_ranks_say_no_gpu_and_faked_cuda_reaches_status_and_placement():
    with labkit.Lab(2, device="cpu") as lab:
        lab.run("import torch.nn as nn\nmodel = nn.Linear(4, 4)").raise_for_errors()
        view = labkit.show_placement(lab)
        assert view.gpu_memory == {0: None, 1: None}
        assert all(r["cuda_memory"] is None for r in lab.status_report()["ranks"])
        lab.run(FAKE).raise_for_errors()  # the heartbeat thread now reads these
        deadline = time.monotonic() + 60
        while any(r["cuda_memory"] is None for r in lab.status_report()["ranks"]):
            assert time.monotonic() < deadline, "no heartbeat carried the CUDA memory"
            time.sleep(0.2)
        got = {r["rank"]: r["cuda_memory"] for r in lab.status_report()["ranks"]}
        assert [got[r]["allocated"] for r in (0, 1)] == [MiB, 2 * MiB]
        view = labkit.show_placement(lab)
        assert any(
            "ranks 0, 1 share cuda:0: 3.0 MiB allocated, 5.0 MiB reserved in all" in n
            for n in view.notes
        ), view.notes
