"""Asynchronous SGD with a parameter server, from point-to-point messages (rank side).

Rank 0 (the server) holds the weights w and a version counter v. Each worker k = 1..W-1
repeats: pull (w, v_k) from the server, compute the gradient g on a batch of its shard, push
(g, v_k). The server applies pushes in arrival order, without waiting for anyone:

    w <- w - lr * g,   staleness = v - v_k,   v <- v + 1

so a gradient may have been computed on weights that are `staleness` updates old. A slow
worker (a straggler) never holds the others up, but its gradients arrive stale. Synchronous
SGD (labkit.parallel.data_parallel) is the opposite trade: no staleness, everyone waits for the
slowest.

Wire format (all on the default group, tag 0), every message starts with an int64 header
[kind, version]:
    worker -> server  [PULL, 0]            server answers [PARAMS, v] then w (float32, P)
    worker -> server  [PUSH, v_k] then g (float32, P)
    worker -> server  [DONE, 0]            after its last push; the server ends once all are done
Each worker makes exactly `steps_per_worker` pushes, so the run is finite and no rank waits
on a message that never comes (unless a rank raises: then its peers wait for the group timeout).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from labkit.parallel.data_parallel import broadcast_parameters
from labkit.parallel.datasets import batches, partition

__all__ = ["DONE", "PARAMS", "PULL", "PUSH", "run_parameter_server"]

PULL, PUSH, DONE, PARAMS = 0, 1, 2, 3
SERVER = 0


# Headers stay on the CPU whatever the lab's device: the server receives them from any source,
# which gloo does and NCCL does not ("cpu:gloo,cuda:nccl" sends CPU tensors through gloo);
# the weights and gradients travel on the model's device.
HEADER_DEVICE = torch.device("cpu")


def _header(kind: int, version: int) -> torch.Tensor:
    return torch.tensor([kind, version], dtype=torch.int64, device=HEADER_DEVICE)


def _serve(
    model: nn.Module, X: torch.Tensor, y: torch.Tensor, lr: float, num_workers: int
) -> dict[str, Any]:
    w = parameters_to_vector(model.parameters()).detach().clone()
    version, done = 0, 0
    record: dict[str, Any] = {"loss": [], "staleness": [], "worker": [], "arrival_time": []}

    def evaluate() -> None:
        with torch.no_grad():
            vector_to_parameters(w, model.parameters())
            record["loss"].append(F.cross_entropy(model(X), y).item())

    evaluate()
    start = time.perf_counter()
    header = torch.empty(2, dtype=torch.int64, device=HEADER_DEVICE)
    grad = torch.empty_like(w)
    while done < num_workers:
        src = dist.recv(header)  # from any worker: arrival order decides
        kind, pulled = header.tolist()
        if kind == PULL:
            dist.send(_header(PARAMS, version), dst=src)
            dist.send(w, dst=src)
        elif kind == PUSH:
            dist.recv(grad, src=src)
            w.sub_(grad, alpha=lr)
            record["staleness"].append(version - pulled)
            record["worker"].append(src)
            record["arrival_time"].append(time.perf_counter() - start)
            version += 1
            evaluate()
        elif kind == DONE:
            done += 1
        else:
            raise AssertionError(f"unknown message kind {kind} from rank {src}")
    record["num_updates"] = version
    return record


def _work(
    model: nn.Module,
    X: torch.Tensor,
    y: torch.Tensor,
    steps: int,
    batch_size: int,
    seed: int,
    delay: float,
) -> dict[str, Any]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    shard = partition(len(X), world_size - 1, rank - 1, seed)
    w = parameters_to_vector(model.parameters()).detach().clone()
    reply = torch.empty(2, dtype=torch.int64, device=HEADER_DEVICE)
    losses: list[float] = []
    epoch, queue = 0, []
    for _ in range(steps):
        if not queue:
            queue = batches(shard, batch_size, seed, epoch)
            epoch += 1
        idx = queue.pop(0)
        dist.send(_header(PULL, 0), dst=SERVER)
        dist.recv(reply, src=SERVER)
        dist.recv(w, src=SERVER)
        pulled = int(reply[1])
        vector_to_parameters(w, model.parameters())
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(X[idx]), y[idx])
        loss.backward()
        losses.append(loss.item())
        time.sleep(delay)  # the straggler: slow compute, slow node, busy neighbour
        g = parameters_to_vector(p.grad for p in model.parameters())
        dist.send(_header(PUSH, pulled), dst=SERVER)
        dist.send(g.detach().contiguous(), dst=SERVER)
    dist.send(_header(DONE, 0), dst=SERVER)
    return {"rank": rank, "pushes": steps, "batch_loss": losses}


def run_parameter_server(
    model: nn.Module,
    X: torch.Tensor,
    y: torch.Tensor,
    steps_per_worker: int,
    batch_size: int,
    lr: float,
    seed: int,
    delays: dict[int, float] | None = None,
) -> dict[str, Any]:
    """Train `model` with asynchronous SGD: rank 0 serves the weights, ranks 1.. compute grads.

    Runs on every rank; every rank must call it with the same arguments (world size >= 2).
    Every rank starts from rank 0's weights and ends with the server's final weights (a
    broadcast). `delays` maps a worker rank to seconds it sleeps before each push (a
    straggler). Rank 0 returns loss (full-data loss before and after each update), staleness
    and worker (per update, in arrival order), arrival_time and num_updates
    (= steps_per_worker * (W - 1)); a worker returns its rank, pushes and batch_loss.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size < 2:
        raise ValueError(f"world size must be >= 2 (one server, >= 1 worker), got {world_size}")
    if steps_per_worker < 0:
        raise ValueError(f"steps_per_worker must be >= 0, got {steps_per_worker}")
    delays = delays or {}
    for r, d in delays.items():
        if not 1 <= r < world_size:
            raise ValueError(f"delays keys must be worker ranks in [1, {world_size}), got {r}")
        if d < 0:
            raise ValueError(f"delays must be >= 0 seconds, got {d} for rank {r}")
    broadcast_parameters(model, src=SERVER)
    if rank == SERVER:
        result = _serve(model, X, y, lr, world_size - 1)
    else:
        result = _work(model, X, y, steps_per_worker, batch_size, seed, delays.get(rank, 0.0))
    broadcast_parameters(model, src=SERVER)
    return result
