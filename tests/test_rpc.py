"""torch.distributed.rpc in a lab (3 CPU ranks, gloo beside TensorPipe).

`rpc.init_rpc` written as in a torchrun script works from a cell; a cell's functions and
classes can be called remotely; `rpc.shutdown()` leaves the lab's process group usable and
RPC can start again; a restart or a stop with RPC up neither hangs nor leaves processes. The
parameter server on RPC equals one process (synchronous: SGD on the union of the batches;
asynchronous: a replay of its log), and the replay reproduces notebook 25's send/recv server.
The exercise checker of notebook 28 rejects wrong answers and accepts right ones.
"""

from __future__ import annotations

import sys
import time

import cloudpickle
import pytest
import torch
from torch.nn.utils import parameters_to_vector

import labkit
from labkit.exercises.rpc_checks import check_add_on_owner
from labkit.parallel.data_parallel import make_mlp, train_reference
from labkit.parallel.datasets import load_digits
from labkit.parallel.rpc_parameter_server import replay_async

pytestmark = pytest.mark.timeout(180)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks cannot import this module

INIT = 'rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)'
UP = f"""
import torch.distributed.rpc as rpc
if not globals().get("rpc_up"):
    {INIT}
    rpc_up = True
"""
DOWN = "rpc.shutdown()\nrpc_up = False"


@pytest.fixture(scope="module")
def lab():
    lab = labkit.Lab(3, device="cpu")
    yield lab
    lab.stop()


def _ok(res):
    res.raise_for_errors()
    return res.values_by_rank


def _up(lab) -> None:
    _ok(lab.run(UP, timeout=90))


def test_init_rpc_from_a_cell_as_in_a_torchrun_script(lab):
    if any(_ok(lab.run("globals().get('rpc_up', False)")).values()):
        lab.restart()  # an earlier test of this module left RPC up: start from fresh ranks
    _ok(lab.run("import torch.distributed.rpc as rpc\n" + INIT + "\nrpc_up = True", timeout=90))
    infos = _ok(lab.run("(rpc.get_worker_info().name, rpc.get_worker_info().id)"))
    assert infos == {r: (f"worker{r}", r) for r in range(3)}


def test_a_function_and_a_class_from_a_cell_run_on_another_rank(lab):
    _up(lab)
    pids = _ok(lab.run("import os\nos.getpid()"))
    cell = """
import os
def whoami(x):
    return rpc.get_worker_info().id, os.getpid(), x * 2

class Counter:
    def __init__(self):
        self.n = 0
    def add(self, k):
        self.n += k
        return self.n

dist.barrier()  # every rank has defined whoami before any rank calls it
right = (rank + 1) % world_size
called = rpc.rpc_sync(f"worker{right}", whoami, args=(torch.tensor([rank]),))
"""
    _ok(lab.run(cell))
    called = _ok(lab.run("called"))
    for r, (callee, pid, doubled) in called.items():
        assert callee == (r + 1) % 3 and pid == pids[callee]
        assert torch.equal(doubled, torch.tensor([2 * r]))
    # one counter on worker2, incremented from every rank: only its owner holds the object
    _ok(lab.run("counter = rpc.remote('worker2', Counter)", ranks=[0]))
    owner = _ok(lab.run("counter.owner().name, counter.is_owner()", ranks=[0]))
    assert owner == {0: ("worker2", False)}
    total = _ok(lab.run("[counter.rpc_sync().add(k) for k in (1, 2, 3)][-1]", ranks=[0]))
    assert total == {0: 6}


def test_the_parameter_server_on_rpc_equals_one_process_when_synchronous(lab):
    _up(lab)
    cell = """
from labkit.parallel.rpc_parameter_server import run_rpc_parameter_server
sync = run_rpc_parameter_server("sync", 2, steps_per_worker=28, batch_size=32, lr=0.5, seed=0)
"""
    _ok(lab.run(cell, ranks=[0], timeout=120))
    got = lab.pull("sync", ranks=[0])[0]
    assert got["num_updates"] == 28 and got["pushes"] == {1: 28, 2: 28}
    assert all(w == [1, 2] for w in got["worker"]) and got["pulled"] == list(range(28))
    X, y = load_digits()
    model = make_mlp(0)
    # one epoch of global batches of 64 = 28 steps (898 samples per trainer, 32 per step)
    train_reference(model, X, y, epochs=1, global_batch=64, lr=0.5, seed=0, world_size=2)
    want = parameters_to_vector(model.parameters()).detach()
    assert (got["weights"] - want).abs().max().item() < 1e-5
    assert got["loss"][-1] < got["loss"][0]


def test_the_asynchronous_server_replays_in_one_process(lab):
    _up(lab)
    cell = """
from labkit.parallel.rpc_parameter_server import run_rpc_parameter_server
asy = run_rpc_parameter_server("async", 2, steps_per_worker=6, batch_size=32, lr=0.1, seed=0)
"""
    _ok(lab.run(cell, ranks=[0], timeout=120))
    got = lab.pull("asy", ranks=[0])[0]
    assert got["num_updates"] == 12 and sorted(got["worker"]) == [1] * 6 + [2] * 6
    want = replay_async(got["worker"], got["pulled"], 2, 32, 0.1, 0)
    assert (got["weights"] - want).abs().max().item() < 1e-5
    # a wrong log gives other weights: the replay would notice a server that misapplied one
    if any(p != i for i, p in enumerate(got["pulled"])):
        fresh = replay_async(got["worker"], list(range(12)), 2, 32, 0.1, 0)
        assert (got["weights"] - fresh).abs().max().item() > 1e-4


def test_the_replay_reproduces_the_send_recv_server_of_notebook_25(lab):
    cell = """
from labkit.parallel.async_sgd import run_parameter_server
from labkit.parallel.data_parallel import make_mlp
from labkit.parallel.datasets import load_digits
X, y = load_digits()
m = make_mlp(0)
p2p = run_parameter_server(m, X, y, steps_per_worker=6, batch_size=32, lr=0.1, seed=0)
p2p_w = torch.nn.utils.parameters_to_vector(m.parameters()).detach()
"""
    _ok(lab.run(cell, timeout=120))
    log, w = lab.pull("p2p", ranks=[0])[0], lab.pull("p2p_w", ranks=[0])[0]
    pulled = [i - s for i, s in enumerate(log["staleness"])]
    want = replay_async(log["worker"], pulled, 2, 32, 0.1, 0)
    assert (w - want).abs().max().item() < 1e-5


def test_shutdown_leaves_the_group_usable_and_rpc_can_start_again(lab):
    _up(lab)
    _ok(lab.run(DOWN, timeout=90))
    sums = _ok(lab.run("t = torch.tensor([float(rank)])\ndist.all_reduce(t)\nt.item()"))
    assert sums == {r: 3.0 for r in range(3)}
    _ok(lab.run(INIT + "\nrpc_up = True", timeout=90))
    again = _ok(lab.run("rpc.rpc_sync(f'worker{(rank + 2) % world_size}', torch.add, (rank, 1))"))
    assert again == {r: r + 1 for r in range(3)}
    # torch 2.13: after a re-init an RRef cannot be shared (docs/api.md and notebook 28 say so)
    cell = """
box = rpc.remote(f"worker{(rank + 1) % world_size}", torch.zeros, args=((3,),))
try:
    box.rpc_sync().add_(torch.ones(3))
    shared = "ok"
except RuntimeError as err:
    shared = str(err)
"""
    _ok(lab.run(cell, timeout=90))
    shared = _ok(lab.run("shared"))
    assert all("RPC is no longer running" in v for v in shared.values()), shared
    # a graceful shutdown now waits for RRef confirmations that never come: restart instead
    lab.restart()


def test_restart_with_rpc_up_gives_fresh_ranks_that_can_start_it_again(lab):
    _up(lab)
    t0 = time.monotonic()
    lab.restart()
    assert time.monotonic() - t0 < 60
    sums = _ok(lab.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()"))
    assert sums == {r: 3.0 for r in range(3)}
    _up(lab)
    ids = _ok(lab.run("rpc.rpc_sync('worker1', rpc.get_worker_info).id"))
    assert ids == {r: 1 for r in range(3)}
    cell = "box = rpc.remote('worker2', torch.zeros, args=((2,),))\nbox.rpc_sync().add_(rank + 1)"
    _ok(lab.run(cell, timeout=90))  # fresh ranks share RRefs again
    assert _ok(lab.run("box.to_here().tolist()", ranks=[0])) == {0: [1.0, 1.0]}


def test_stop_with_rpc_up_ends_every_rank():
    lab = labkit.Lab(2, device="cpu")
    try:
        _up(lab)
        pids = list(_ok(lab.run("import os\nos.getpid()")).values())
    finally:
        t0 = time.monotonic()
        lab.stop()
    assert time.monotonic() - t0 < 30
    import psutil

    def alive() -> list[int]:
        return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]

    deadline = time.monotonic() + 15  # killed ranks may take a moment to go on a busy machine
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive()


# -- the exercise's checker ---------------------------------------------------------------------
def _copy_then_add(rref, delta):  # a copy changes, the owner's tensor does not
    return rref.to_here().add_(delta)


def _out_of_place(rref, delta):  # runs on the owner, but add makes a new tensor
    return rref.rpc_sync().add(delta)


def _local_value(rref, delta):  # only the owner may call local_value
    return rref.local_value().add_(delta)


def _returns_nothing(rref, delta):
    rref.rpc_sync().add_(delta)


def _proxy(rref, delta):
    return rref.rpc_sync().add_(delta)


def _async_proxy(rref, delta):
    return rref.rpc_async().add_(delta).wait()


def _remote_then_fetch(rref, delta):
    return rref.remote().add_(delta).to_here()


@pytest.mark.parametrize(
    ("fn", "why"),
    [
        (_copy_then_add, "still zeros"),
        (_out_of_place, "still zeros"),
        (_local_value, "can't call localValue() on user"),
        (_returns_nothing, "returned no tensor"),
    ],
)
def test_the_checker_rejects_wrong_answers(lab, fn, why):
    _up(lab)
    verdict = check_add_on_owner(lab, fn)
    assert not verdict and why in verdict.message, verdict


@pytest.mark.parametrize("fn", [_proxy, _async_proxy, _remote_then_fetch])
def test_the_checker_accepts_right_answers(lab, fn):
    _up(lab)
    verdict = check_add_on_owner(lab, fn)
    assert verdict, verdict


def test_the_checker_says_when_rpc_is_down():
    lab = labkit.Lab(2, device="cpu")
    try:
        verdict = check_add_on_owner(lab, _proxy)
    finally:
        lab.stop()
    assert not verdict and "init_rpc" in verdict.message
