"""Parameter-server asynchronous SGD on 3 gloo CPU ranks: it ends, learns, and records staleness."""

from __future__ import annotations

import pytest
import torch

from labkit.parallel import data_parallel
from labkit.parallel.async_sgd import run_parameter_server
from labkit.parallel.datasets import load_digits

try:
    from tests.distributed import run_ranks
except ImportError:  # tests/ itself on sys.path (pytest's default rootdir-less import)
    from distributed import run_ranks

STEPS, STRAGGLER, DELAY = 12, 2, 0.1


def _async_rank(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    X, y = load_digits()
    try:  # a bad argument fails on every rank before any message is sent
        run_parameter_server(data_parallel.make_mlp(0), X, y, STEPS, 32, 0.5, 0, delays={0: 1.0})
        bad = "no error"
    except ValueError as e:
        bad = str(e)
    model = data_parallel.make_mlp(seed=rank)  # different on purpose: the server's weights win
    out = run_parameter_server(model, X, y, STEPS, 32, 0.5, seed=4, delays={STRAGGLER: DELAY})
    out["bad"] = bad
    out["checksums"] = data_parallel.param_checksums(model)
    return out


@pytest.mark.timeout(120)
def test_async_sgd_terminates_learns_and_straggler_is_stale():
    server, *workers = run_ranks(_async_rank, 3)
    num_workers = len(workers)
    assert "delays keys must be worker ranks in [1, 3)" in server["bad"]
    assert server["num_updates"] == STEPS * num_workers  # every push applied, then all ended
    assert len(server["staleness"]) == len(server["worker"]) == STEPS * num_workers
    assert len(server["loss"]) == STEPS * num_workers + 1
    assert sorted(server["worker"]) == [1] * STEPS + [2] * STEPS
    assert all(s >= 0 for s in server["staleness"])
    stale = {
        k: [s for s, w in zip(server["staleness"], server["worker"]) if w == k] for k in (1, 2)
    }
    # While the straggler sleeps, the fast worker keeps updating: its pushes arrive stale.
    assert max(stale[STRAGGLER]) >= 1
    assert sum(stale[STRAGGLER]) > sum(stale[1])
    assert server["loss"][-1] < 0.8 * server["loss"][0]
    assert all(w["pushes"] == STEPS for w in workers)
    # Every rank ends with the server's weights.
    assert server["checksums"] == workers[0]["checksums"] == workers[1]["checksums"]
