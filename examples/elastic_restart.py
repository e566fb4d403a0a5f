"""A worker fails once; torchrun restarts the group and training resumes from a checkpoint.

    torchrun --standalone --nproc-per-node=2 --max-restarts=1 \\
        examples/elastic_restart.py --checkpoint-dir /tmp/elastic --fail-at 3

Each rank trains a small seeded MLP on seeded data (no data set to load: the workers start
twice) with DDP for `--steps` steps, one batch of 32 per rank and step; after every step rank 0
writes a checkpoint (model, optimizer, next step) and all ranks
pass a barrier. On the first attempt (TORCHELASTIC_RESTART_COUNT = 0) rank 1 exits with an
error at step `--fail-at`. torchrun's agent sees the failed worker, stops the others and, while
restarts are left (`--max-restarts`), starts the whole group again with the restart count one
higher. Every worker then loads the last checkpoint and goes on from its step. At the end rank 0
saves the final weights to `final.pt` in the checkpoint directory and prints one line:
`final attempt A resumed_from S steps N`.

The script ends through `exit_with(main)`: with torch 2.13 a gloo script can abort while the
interpreter shuts down, after a run that succeeded, and torchrun would take that for a failed
worker (`labkit/parallel/script_exit.py` says why).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit.parallel.script_exit import exit_with
from labkit.parallel.uneven_inputs import (
    RESTART_BATCH,
    RESTART_LR,
    restart_data,
    restart_model,
)


def batch_indices(step: int, rank: int, world_size: int) -> torch.Tensor:
    """The samples of `rank` at `step`: block step*world_size + rank of RESTART_BATCH."""
    start = (step * world_size + rank) * RESTART_BATCH
    return torch.arange(start, start + RESTART_BATCH)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--fail-at", type=int, default=3, help="step at which rank 1 fails once")
    p.add_argument("--checkpoint-dir", required=True)
    args = p.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # set by torchrun
    torch.set_num_threads(1)
    # torchrun's workers share its rendezvous store, and a restarted group can read the
    # addresses the failed attempt left there (pytorch/pytorch#135712; in torch 2.13 gloo then
    # fails with "connectFullMesh ... Connection refused"): each attempt gets its own prefix.
    store, rank, world_size = next(dist.rendezvous("env://"))
    store = dist.PrefixStore(f"attempt_{attempt}", store)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    ckpt = Path(args.checkpoint_dir) / "checkpoint.pt"
    try:
        X, y = restart_data()
        model = restart_model()
        opt = torch.optim.SGD(model.parameters(), lr=RESTART_LR)
        start = 0
        if ckpt.exists():  # a restart: go on from the last step every rank finished
            state = torch.load(ckpt)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            start = state["step"]
        print(f"rank {rank} attempt {attempt}: starting at step {start}", flush=True)
        ddp = DDP(model)
        for step in range(start, args.steps):
            if attempt == 0 and rank == 1 and step == args.fail_at:
                print(f"rank 1 attempt 0: failing at step {step}", flush=True)
                return 1  # a worker failure: torchrun restarts the whole group
            b = batch_indices(step, rank, world_size)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(X[b]), y[b]).backward()
            opt.step()
            if rank == 0:  # write then rename: a crash mid-write leaves the old checkpoint
                state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
                torch.save({**state, "step": step + 1}, ckpt.with_suffix(".tmp"))
                os.replace(ckpt.with_suffix(".tmp"), ckpt)
            dist.barrier()  # nobody starts step + 1 before its checkpoint exists
        if rank == 0:
            torch.save(model.state_dict(), Path(args.checkpoint_dir) / "final.pt")
            print(f"final attempt {attempt} resumed_from {start} steps {args.steps}", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_with(main)
