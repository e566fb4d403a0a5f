"""Save on rank 0, barrier, load on every rank: a bit-identical reload that resumes exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from labkit.parallel import checkpoint, data_parallel
from labkit.parallel.datasets import load_digits

try:
    from tests.distributed import run_ranks
except ImportError:  # tests/ itself on sys.path (pytest's default rootdir-less import)
    from distributed import run_ranks


def _adam_steps(model, opt, X, y, rank, world_size, steps, first):
    for s in range(first, first + steps):
        idx = torch.arange(s * 64, (s + 1) * 64)[rank::world_size]
        opt.zero_grad()
        F.cross_entropy(model(X[idx]), y[idx]).backward()
        data_parallel.average_gradients(model)
        opt.step()


def _checkpoint_rank(rank: int, world_size: int, path: str) -> dict:
    torch.set_num_threads(1)
    X, y = load_digits()
    model = data_parallel.make_mlp(seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _adam_steps(model, opt, X, y, rank, world_size, steps=3, first=0)
    checkpoint.save_checkpoint(path, model, opt, extra={"step": 3})
    saved_ok = checkpoint.verify_reload(path, model, opt)

    # A fresh replica (different init, empty optimizer) restored from the file.
    fresh = data_parallel.make_mlp(seed=100 + rank)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    extra = checkpoint.load_checkpoint(path, fresh, fresh_opt)
    restored_ok = checkpoint.verify_reload(path, fresh, fresh_opt)

    # Resuming from the reload must continue exactly like the run that never stopped.
    _adam_steps(model, opt, X, y, rank, world_size, steps=2, first=3)
    _adam_steps(fresh, fresh_opt, X, y, rank, world_size, steps=2, first=3)
    resumed_equal = checkpoint.state_equal(model.state_dict(), fresh.state_dict())
    stale_ok = checkpoint.verify_reload(path, model, opt)  # the file is now behind: False
    return {
        "saved_ok": saved_ok,
        "restored_ok": restored_ok,
        "extra": extra,
        "resumed_equal": resumed_equal,
        "stale_ok": stale_ok,
    }


@pytest.mark.timeout(120)
def test_save_on_rank0_load_everywhere_bitwise(tmp_path):
    for r in run_ranks(_checkpoint_rank, 2, str(tmp_path / "ckpt.pt")):
        assert r["saved_ok"] and r["restored_ok"]
        assert r["extra"] == {"step": 3}
        assert r["resumed_equal"]
        assert not r["stale_ok"]


def test_state_equal_is_bitwise():
    a = {"w": torch.tensor([1.0, 2.0]), "n": [1, torch.tensor(3)]}
    assert checkpoint.state_equal(a, {"w": torch.tensor([1.0, 2.0]), "n": [1, torch.tensor(3)]})
    one_ulp = torch.nextafter(a["w"], torch.tensor(3.0))  # the smallest possible change
    assert not checkpoint.state_equal(a, {"w": one_ulp, "n": a["n"]})
    assert not checkpoint.state_equal(a, {"w": a["w"].double(), "n": a["n"]})
    assert not checkpoint.state_equal(a, {"w": a["w"]})
