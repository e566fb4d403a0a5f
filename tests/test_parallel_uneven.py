"""Uneven inputs: DDP under Join on 3 gloo ranks against one process trained by Join's formula
(both divisors), the hang without Join shown by a short group timeout, and torchrun's elastic
restart resuming from a checkpoint, against one process that never failed."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from distributed import run_ranks

from labkit.parallel.data_parallel import make_mlp
from labkit.parallel.datasets import load_digits
from labkit.parallel.uneven_inputs import (
    join_reference,
    shadow_steps,
    train_ddp,
    train_one_process,
    uneven_batches,
)

ROOT = Path(__file__).resolve().parents[1]
COUNTS, BATCH, LR = [2, 4, 3], 16, 0.5


def test_batches_are_disjoint_and_shadow_steps() -> None:
    seen = torch.cat([b for r in range(3) for b in uneven_batches(r, COUNTS, BATCH)])
    assert seen.tolist() == list(range(sum(COUNTS) * BATCH))
    assert [len(uneven_batches(r, COUNTS, BATCH)) for r in range(3)] == COUNTS
    assert shadow_steps(COUNTS) == [2, 0, 1]
    with pytest.raises(ValueError, match=r"rank must be in \[0, 3\)"):
        uneven_batches(3, COUNTS, BATCH)
    with pytest.raises(ValueError, match="batch counts >= 0"):
        shadow_steps([2, -1])


def _join_rank(rank: int, world_size: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    X, y = load_digits()
    out = {}
    for initial in (True, False):
        ddp = DDP(make_mlp(seed=0))
        batches = uneven_batches(rank, COUNTS, BATCH)
        out[initial] = (
            train_ddp(ddp, X, y, batches, LR, True, initial),
            [p.detach().clone() for p in ddp.module.parameters()],
        )
    return out


@pytest.mark.timeout(180)
def test_join_equals_its_formula_in_one_process() -> None:
    ranks = run_ranks(_join_rank, 3)
    X, y = load_digits()
    for initial in (True, False):
        ref = join_reference(make_mlp(seed=0), X, y, COUNTS, BATCH, LR, initial)
        other = join_reference(make_mlp(seed=0), X, y, COUNTS, BATCH, LR, not initial)
        for rank, res in enumerate(ranks):
            steps, weights = res[initial]
            assert steps == COUNTS[rank]
            err = max((a - b).abs().max().item() for a, b in zip(weights, ref.parameters()))
            assert err < 1e-6, (initial, rank, err)
            # the divisor matters: the other one gives other weights
            off = max((a - b).abs().max().item() for a, b in zip(weights, other.parameters()))
            assert off > 1e-4, (initial, rank, off)


def _hang_rank(rank: int, world_size: int) -> str:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    X, y = load_digits()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=2))
    ddp = DDP(make_mlp(seed=0), process_group=group)
    try:
        train_ddp(ddp, X, y, uneven_batches(rank, [1, 2], BATCH), LR, join=False)
        answer = "finished"
    except RuntimeError as e:
        answer = f"raised: {e}"
    dist.barrier()  # on the default group: rank 0 stays alive until rank 1 gave up
    return answer


@pytest.mark.timeout(120)
def test_without_join_the_rank_with_more_batches_waits_until_the_timeout() -> None:
    r0, r1 = run_ranks(_hang_rank, 2)
    assert r0 == "finished"
    assert r1.startswith("raised:") and "imed out" in r1, r1


@pytest.mark.timeout(300)
def test_torchrun_restarts_the_group_and_resumes_from_the_checkpoint(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    script = ROOT / "examples" / "elastic_restart.py"
    proc = subprocess.run(
        [*cmd, "--max-restarts=1", str(script), "--checkpoint-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "rank 1 attempt 0: failing at step 3" in lines
    assert {"rank 0 attempt 1: starting at step 3", "rank 1 attempt 1: starting at step 3"} <= set(
        lines
    )
    assert lines[-1] == "final attempt 1 resumed_from 3 steps 6"
    # the same weights as one process that trained the 6 steps without failing
    model = train_one_process(6)
    final = torch.load(tmp_path / "final.pt")
    err = max((final[k] - v).abs().max().item() for k, v in model.state_dict().items())
    assert err < 1e-6, err

    # without restarts left the same failure ends the job
    (tmp_path / "checkpoint.pt").unlink()
    proc = subprocess.run(
        [*cmd, "--max-restarts=0", str(script), "--checkpoint-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert proc.returncode != 0 and "final attempt" not in proc.stdout
