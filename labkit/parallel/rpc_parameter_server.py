"""A parameter server built on torch.distributed.rpc, synchronous and asynchronous (rank side).

The send/recv server of `labkit.parallel.async_sgd` needs a wire format: a header tensor, a
loop on `dist.recv` from any rank, and every rank running its half of the protocol in its main
code. With RPC the server is an ordinary object on rank 0 and the trainers call its methods:

    ps = rpc.RRef(Server(...))                       # owned by rank 0
    rpc.rpc_async("worker1", train, args=(ps, ...))  # rank 0 starts each trainer's loop
    w, v = ps.rpc_sync().pull()                      # inside a trainer: a method call on rank 0
    ps.rpc_sync().push(grad, v)

Only rank 0 runs code (`run_rpc_parameter_server`); each trainer's loop runs in an RPC thread
of its own rank, and the server's methods run in RPC threads of rank 0, several at once, so
the server guards its state with a lock.

Asynchronous (`mode="async"`), the rule of notebook 25: each push is applied as it arrives,

    w <- w - lr * g(w_pulled),   staleness = version - pulled,   version <- version + 1

Synchronous (`mode="sync"`): the server waits for one gradient from each of the T trainers,
then takes one step with their mean and answers all T with the new weights. A push returns a
future (`@rpc.functions.async_execution`), so a waiting trainer holds no server thread. With
equal batches the mean of the T batch means is the mean over the union of the batches, so the
run equals single-process SGD on that union (`labkit.parallel.data_parallel.train_reference`).

`replay_async` is the single-process reference for an asynchronous run: given the arrival log
(which worker pushed, from which version), it recomputes every gradient on the weights that
worker pulled and applies them in that order. It reproduces the send/recv server's run too
(its log has the worker and the staleness: pulled = update index - staleness).
"""

from __future__ import annotations

import threading
from typing import Any, Literal

import torch
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from labkit.parallel.data_parallel import make_mlp, step_batches
from labkit.parallel.datasets import batches, load_digits, partition

__all__ = ["Server", "replay_async", "run_rpc_parameter_server", "trainer_batches"]

Mode = Literal["sync", "async"]


class Server:
    """The weights, a version counter and the log of updates; lives on rank 0 (the owner)."""

    def __init__(self, seed: int, lr: float, num_trainers: int):
        self.model = make_mlp(seed)
        self.w = parameters_to_vector(self.model.parameters()).detach().clone()
        self.lr, self.num_trainers = lr, num_trainers
        self.version = 0
        self.lock = threading.Lock()
        self.X, self.y = load_digits()
        self.log: dict[str, list[Any]] = {"worker": [], "pulled": [], "loss": [self._loss()]}
        # synchronous rounds: the sum of this round's gradients, who sent one, and the future
        # every trainer of the round waits on
        self.grad_sum = torch.zeros_like(self.w)
        self.round_workers: list[int] = []
        self.round = torch.futures.Future()

    def _loss(self) -> float:
        with torch.no_grad():
            vector_to_parameters(self.w, self.model.parameters())
            return F.cross_entropy(self.model(self.X), self.y).item()

    def pull(self) -> tuple[torch.Tensor, int]:
        """The current weights (a copy) and their version."""
        with self.lock:
            return self.w.clone(), self.version

    def push(self, grad: torch.Tensor, pulled: int, worker: int) -> int:
        """Asynchronous: apply one gradient now; returns the staleness it had."""
        with self.lock:
            self.w.sub_(grad, alpha=self.lr)
            self.log["worker"].append(worker)
            self.log["pulled"].append(pulled)
            staleness = self.version - pulled
            self.version += 1
            self.log["loss"].append(self._loss())
            return staleness

    @staticmethod
    @rpc.functions.async_execution
    def push_and_wait(ps: Any, grad: torch.Tensor, worker: int) -> torch.futures.Future:
        """Synchronous: add one trainer's gradient to this round; the round's last gradient
        takes the step. Runs on the owner (call it with `rpc.rpc_sync(ps.owner(), ...)`); the
        future it returns completes with the new weights for every trainer of the round."""
        self = ps.local_value()
        with self.lock:
            if worker in self.round_workers:
                raise RuntimeError(f"worker {worker} pushed twice in round {self.version}")
            self.grad_sum += grad
            self.round_workers.append(worker)
            answer = self.round
            if len(self.round_workers) == self.num_trainers:
                self.w.sub_(self.grad_sum / self.num_trainers, alpha=self.lr)
                self.log["worker"].append(sorted(self.round_workers))
                self.log["pulled"].append(self.version)
                self.version += 1
                self.log["loss"].append(self._loss())
                self.grad_sum.zero_()
                self.round_workers = []
                self.round = torch.futures.Future()
                answer.set_result(self.w.clone())
        return answer

    def state(self) -> dict[str, Any]:
        with self.lock:
            return {"weights": self.w.clone(), "num_updates": self.version, **self.log}


def trainer_batches(
    n: int, num_trainers: int, worker: int, mode: Mode, batch_size: int, steps: int, seed: int
) -> list[torch.Tensor]:
    """The index batches worker `worker` (rank 1..T) trains on, in order (pure).

    async: its shard of T equal shards, reshuffled each epoch, `batch_size` per push, as the
    send/recv server's workers take them. sync: its part of each global batch of
    T * batch_size samples (`step_batches`), the first `steps`.
    """
    if mode == "sync":
        return step_batches(n, num_trainers, worker - 1, num_trainers * batch_size, seed, 0)[:steps]
    shard = partition(n, num_trainers, worker - 1, seed)
    out: list[torch.Tensor] = []
    epoch = 0
    while len(out) < steps:
        out += batches(shard, batch_size, seed, epoch)
        epoch += 1
    return out[:steps]


def _gradient(model: Any, w: torch.Tensor, X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    vector_to_parameters(w, model.parameters())
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(X), y).backward()
    return parameters_to_vector(p.grad for p in model.parameters()).detach()


def _train(
    ps: Any, worker: int, num_trainers: int, mode: Mode, batch_size: int, steps: int, seed: int
) -> int:
    """One trainer's loop; runs on rank `worker`, in an RPC thread (rank 0 calls it)."""
    X, y = load_digits()
    model = make_mlp(seed)
    idx_list = trainer_batches(len(X), num_trainers, worker, mode, batch_size, steps, seed)
    if mode == "sync":
        w, _ = ps.rpc_sync().pull()
        for idx in idx_list:
            g = _gradient(model, w, X[idx], y[idx])
            w = rpc.rpc_sync(ps.owner(), Server.push_and_wait, args=(ps, g, worker))
    else:
        for idx in idx_list:
            w, pulled = ps.rpc_sync().pull()
            ps.rpc_sync().push(_gradient(model, w, X[idx], y[idx]), pulled, worker)
    return len(idx_list)


def run_rpc_parameter_server(
    mode: Mode, num_trainers: int, steps_per_worker: int, batch_size: int, lr: float, seed: int
) -> dict[str, Any]:
    """Train the digits MLP (`make_mlp(seed)`) with a parameter server on RPC.

    Call it on rank 0 only, with RPC initialised on every rank as `worker{rank}`; ranks
    1..num_trainers are the trainers (their loops run in their RPC threads, started from
    here). Returns the server's state: the final `weights` (a flat vector), `num_updates`,
    and per update `worker` (async: who pushed; sync: the round's trainers), `pulled` (the
    version the gradient was computed on) and `loss` (full-data loss, before the first
    update and after each), plus `pushes` per trainer.
    """
    if mode not in ("sync", "async"):
        raise ValueError(f"mode must be 'sync' or 'async', got {mode!r}")
    if num_trainers < 1:
        raise ValueError(f"num_trainers must be >= 1, got {num_trainers}")
    ps = rpc.RRef(Server(seed, lr, num_trainers))
    futures = {
        k: rpc.rpc_async(
            f"worker{k}",
            _train,
            args=(ps, k, num_trainers, mode, batch_size, steps_per_worker, seed),
        )
        for k in range(1, num_trainers + 1)
    }
    pushes = {k: fut.wait() for k, fut in futures.items()}
    return {**ps.local_value().state(), "pushes": pushes}


def replay_async(
    worker: list[int],
    pulled: list[int],
    num_trainers: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> torch.Tensor:
    """The final weights of an asynchronous run, recomputed in one process from its log.

    Update i applies worker[i]'s next gradient, computed on the weights of version pulled[i]
    with that worker's next batch (`trainer_batches`). Returns the flat weight vector.
    """
    if len(worker) != len(pulled):
        raise ValueError(f"worker and pulled differ in length: {len(worker)} != {len(pulled)}")
    X, y = load_digits()
    model = make_mlp(seed)
    versions = [parameters_to_vector(model.parameters()).detach().clone()]
    counts = {k: worker.count(k) for k in set(worker)}
    queues = {
        k: trainer_batches(len(X), num_trainers, k, "async", batch_size, c, seed)
        for k, c in counts.items()
    }
    for i, (k, v) in enumerate(zip(worker, pulled)):
        if not 0 <= v <= i:
            raise ValueError(f"update {i}: pulled version {v} is not in [0, {i}]")
        idx = queues[k].pop(0)
        versions.append(versions[-1] - lr * _gradient(model, versions[v], X[idx], y[idx]))
    return versions[-1]
