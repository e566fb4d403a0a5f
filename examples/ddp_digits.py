"""Notebook 20's synchronous data-parallel training as a torchrun script (one process per rank).

    torchrun --standalone --nproc-per-node=2 examples/ddp_digits.py           # one host
    torchrun --nnodes=2 --nproc-per-node=4 --node-rank=N \\
        --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 --rdzv-id=digits \\
        examples/ddp_digits.py                                                   # two hosts
    %lab run examples/ddp_digits.py --epochs 1 --check        # on a notebook's lab, unchanged

The training lines are the notebook cell's, unchanged: `train_sync_sgd` on every rank, each
rank on its own shard of the 8x8 digits. What the notebook's lab did for you is written out
here: read the torchrun variables, pick the backend and device, form the process group, and
take it down at the end (run on a lab, `init_process_group` finds the lab's group already up
and uses it, and `destroy_process_group` leaves it for the next cell). Rank 0 prints the final
global loss; `--check` also trains the single-process reference (`train_reference`) and exits
non-zero unless the two agree to 1e-5. The script ends through `exit_with(main)`: with torch
2.13 a gloo script can abort while the interpreter shuts down, after a run that succeeded
(`labkit/parallel/script_exit.py` says why); on a lab it ends as any script does.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from labkit.parallel.checkpoint import save_checkpoint
from labkit.parallel.data_parallel import make_mlp, replica_report, train_reference, train_sync_sgd
from labkit.parallel.datasets import load_digits
from labkit.parallel.script_exit import exit_with


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", default=None, help="path rank 0 writes at the end (shared FS)")
    p.add_argument("--check", action="store_true", help="compare with one process (rank 0)")
    return p.parse_args()


def choose_device(local_rank: int, local_world_size: int, gpus: int) -> tuple[str, str]:
    """(device, backend) for this rank, by a rule every rank reaches alike: a GPU each (NCCL)
    only when this host has one for every local rank, else all on the CPU (gloo). Deciding by
    "is there a GPU for *my* local rank" would put rank 0 on cuda+nccl and rank 1 on cpu+gloo
    on a 1-GPU machine, and the two would wait for each other in different backends forever."""
    if gpus >= local_world_size:
        return f"cuda:{local_rank}", "nccl"
    return "cpu", "gloo"


def setup() -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes in the environment; returns rank, size, device."""
    local_rank = int(os.environ["LOCAL_RANK"])  # set by torchrun, like RANK and WORLD_SIZE
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    name, backend = choose_device(local_rank, local_world_size, gpus)
    device = torch.device(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # several processes share the cores
    dist.init_process_group(backend)  # reads MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    return dist.get_rank(), dist.get_world_size(), device


def main() -> int:
    args = parse_args()
    rank, world_size, device = setup()
    try:
        X, y = load_digits()
        X, y = X.to(device), y.to(device)
        # --- the notebook's cell ---------------------------------------------------------------
        model = make_mlp(seed=args.seed).to(device)
        history = train_sync_sgd(model, X, y, args.epochs, args.global_batch, args.lr, args.seed)
        report = replica_report(model)
        # -----------------------------------------------------------------------------------------
        if args.checkpoint:
            save_checkpoint(args.checkpoint, model, extra={"steps": len(history)})
        if rank == 0:
            loss = history[-1]["loss"]
            print(f"world_size {world_size} steps {len(history)} identical {report['identical']}")
            print(f"final loss {loss:.8f}")
            if args.check:
                ref = train_reference(
                    make_mlp(seed=args.seed),
                    X.cpu(),
                    y.cpu(),
                    args.epochs,
                    args.global_batch,
                    args.lr,
                    args.seed,
                    world_size,
                )
                ok = abs(ref[-1]["loss"] - loss) < 1e-5 and report["identical"]
                print(f"reference loss {ref[-1]['loss']:.8f} {'ok' if ok else 'MISMATCH'}")
                return 0 if ok else 1
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    exit_with(main)
