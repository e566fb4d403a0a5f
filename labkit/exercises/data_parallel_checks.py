"""Exercises of the data-parallel notebooks 20-27 (kernel side).

Each `check_*` runs the learner's function on every rank of `lab` (through `lab.run`, so the
function must only use names it imports or the kernel defines, such as `torch` and `dist`) and
compares what comes back with a single-process reference computed here. Each `solution_*`
reveals one answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from labkit.exercises import Verdict, reveal, right, wrong

GLOBAL_BATCH = 128  # rows 0..127 of the digits: equal shards for 1, 2, 4 or 8 ranks
TOL = 1e-6


def _raised(results: Any) -> Verdict | None:
    if results.errors:
        r = min(results.errors)
        err = results.errors[r]
        return wrong(f"rank {r} raised {err['type']}: {err['message']}")
    return None


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


# ------------------------------------------------------------------ 20: average_gradients


def check_average_gradients(lab: Any, fn: Callable[[Any], None]) -> Verdict:
    """`fn(model)` runs on every rank after backward on the rank's b = 128 / W samples; it must
    leave in every p.grad the gradient of the mean loss over all 128 samples (to 1e-6)."""

    def task(rank: int, world_size: int) -> list[torch.Tensor]:
        import torch.nn.functional as F

        from labkit.parallel.data_parallel import make_mlp
        from labkit.parallel.datasets import load_digits

        X, y = load_digits()
        idx = torch.arange(GLOBAL_BATCH)[rank::world_size]
        model = make_mlp(seed=0)
        F.cross_entropy(model(X[idx]), y[idx]).backward()
        fn(model)
        return [p.grad.clone() for p in model.parameters()]

    results = lab.run(task)
    if (bad := _raised(results)) is not None:
        return bad
    from labkit.parallel.data_parallel import make_mlp
    from labkit.parallel.datasets import load_digits

    X, y = load_digits()
    ref = make_mlp(seed=0)
    torch.nn.functional.cross_entropy(ref(X[:GLOBAL_BATCH]), y[:GLOBAL_BATCH]).backward()
    expected = [p.grad for p in ref.parameters()]
    grads = results.values_by_rank
    for r, g in sorted(grads.items()):
        diff = _max_diff(g, expected)
        if not diff < TOL:
            hint = " (summed but not divided by world_size?)" if diff > 0.1 else ""
            return wrong(f"rank {r}'s gradient differs from the whole batch's by {diff:.3g}{hint}")
    if any(not all(torch.equal(a, b) for a, b in zip(g, grads[0])) for g in grads.values()):
        return wrong("the ranks' gradients are close but not bit-identical")
    return right(f"every rank holds the whole-batch gradient (to {TOL:g}), bit-identical")


def solution_average_gradients() -> Any:
    return reveal("""
def average_gradients(model):
    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= world_size
""")


# ------------------------------------------------------------------ 21: max_replica_diff


def check_max_replica_diff(lab: Any, fn: Callable[[Any], Any]) -> Verdict:
    """`fn(model)` runs on every rank and must return, on every rank, the largest
    max_r(w) - min_r(w) over all weights w of the replicas (0.0 when they are identical)."""

    def task(rank: int, world_size: int) -> list[float]:
        from labkit.parallel.data_parallel import make_mlp, replica_report

        out = []
        for case in ("same", "one_rank_off", "all_apart"):
            model = make_mlp(seed=rank if case == "all_apart" else 0)
            if case == "one_rank_off" and rank == world_size - 1:
                with torch.no_grad():
                    model[2].bias[3] += 0.5
            got = fn(model)
            got = float(got.item() if isinstance(got, torch.Tensor) else got)
            out.extend([got, replica_report(model)["max_abs_diff"]])
        return out

    results = lab.run(task)
    if (bad := _raised(results)) is not None:
        return bad
    cases = ("identical replicas", "one rank's bias moved by 0.5", "replicas from different seeds")
    for r, vals in sorted(results.values_by_rank.items()):
        for i, case in enumerate(cases):
            got, expected = vals[2 * i], vals[2 * i + 1]
            if abs(got - expected) > TOL:
                return wrong(f"{case}: rank {r} returned {got:.6g}, expected {expected:.6g}")
    return right("every rank measures the same spread as replica_report, in all three cases")


def solution_max_replica_diff() -> Any:
    return reveal("""
def max_replica_diff(model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return (hi - lo).max().item()
""")


# ------------------------------------------------------------------ 22: broadcast_parameters


def check_broadcast_parameters(lab: Any, fn: Callable[[Any], None]) -> Verdict:
    """`fn(model)` runs on every rank, each with differently initialised weights, and must make
    every rank's parameters bit-identical to rank 0's (what DDP does when it is built)."""

    def task(rank: int) -> list[torch.Tensor]:
        from labkit.parallel.data_parallel import make_mlp

        model = make_mlp(seed=100 + rank)
        fn(model)
        return [p.detach().clone() for p in model.parameters()]

    results = lab.run(task)
    if (bad := _raised(results)) is not None:
        return bad
    from labkit.parallel.data_parallel import make_mlp

    expected = [p.detach() for p in make_mlp(seed=100).parameters()]
    for r, params in sorted(results.values_by_rank.items()):
        if not all(torch.equal(a, b) for a, b in zip(params, expected)):
            return wrong(f"rank {r}'s parameters are not rank 0's initial ones")
    return right("every rank now holds rank 0's weights, bit for bit")


def solution_broadcast_parameters() -> Any:
    return reveal("""
def broadcast_parameters(model):
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p, src=0)
""")


# ------------------------------------------------------------------ 23: clip by the global norm


def check_clip_global(lab: Any, fn: Callable[[list[Any], float], Any]) -> Verdict:
    """`fn(params, max_norm)` runs on every rank; rank r holds the gradients of parameter
    tensors r, r + W, ... only (a disjoint piece, as in ZeRO-2 or FSDP). Together the clipped
    pieces must equal torch.nn.utils.clip_grad_norm_ on the whole gradient in one process."""
    max_norm = 0.05

    def task(rank: int, world_size: int) -> dict[int, torch.Tensor]:
        import torch.nn.functional as F

        from labkit.parallel.data_parallel import make_mlp
        from labkit.parallel.datasets import load_digits

        X, y = load_digits()
        model = make_mlp(seed=1)
        F.cross_entropy(model(X[:GLOBAL_BATCH]), y[:GLOBAL_BATCH]).backward()
        params = list(model.parameters())
        mine = [p for i, p in enumerate(params) if i % world_size == rank]
        fn(mine, max_norm)
        return {i: p.grad.clone() for i, p in enumerate(params) if i % world_size == rank}

    results = lab.run(task)
    if (bad := _raised(results)) is not None:
        return bad
    from labkit.parallel.data_parallel import make_mlp
    from labkit.parallel.datasets import load_digits

    X, y = load_digits()
    ref = make_mlp(seed=1)
    torch.nn.functional.cross_entropy(ref(X[:GLOBAL_BATCH]), y[:GLOBAL_BATCH]).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    expected = [p.grad for p in ref.parameters()]
    for r, pieces in sorted(results.values_by_rank.items()):
        for i, g in pieces.items():
            diff = (g - expected[i]).abs().max().item()
            if not diff < TOL:
                return wrong(
                    f"rank {r}'s piece {i} differs from one-process clipping by {diff:.3g} "
                    "(not clipped, or clipped by a local norm?)"
                )
    return right("the clipped pieces equal clip_grad_norm_ on the whole gradient")


def solution_clip_global() -> Any:
    return reveal("""
def clip_global(params, max_norm):
    grads = [p.grad for p in params if p.grad is not None]
    sq = sum((g.double().pow(2).sum() for g in grads), torch.zeros((), dtype=torch.float64))
    dist.all_reduce(sq)                       # sum over ranks of ||g_r||^2
    coef = torch.clamp(max_norm / (sq.sqrt() + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
""")


# ------------------------------------------------------------------ 26: ZeRO bytes per rank


def check_zero_bytes(fn: Callable[[int, int, int], Any]) -> Verdict:
    """`fn(num_params, world_size, stage)` must return the bytes of weights + gradients + Adam
    state each rank holds under ZeRO `stage` (0-3) with mixed precision (2 + 2 + 12 bytes per
    parameter, a sharded part divided by world_size, rounded up to whole parameters)."""
    from labkit.parallel.zero_redundancy import zero_memory

    for num_params, world_size in ((7_500_000_000, 64), (1000, 4), (1001, 8)):
        for stage in range(4):
            expected = zero_memory(num_params, world_size, stage)["total"]
            try:
                got = fn(num_params, world_size, stage)
            except Exception as exc:  # noqa: BLE001 - the learner's error is the verdict
                return wrong(f"fn({num_params}, {world_size}, {stage}) raised {exc!r}")
            if got != expected:
                return wrong(
                    f"stage {stage}, {num_params:,} parameters on {world_size} ranks: "
                    f"got {got!r}, expected {expected:,} bytes"
                )
    return right("bytes per rank match the ZeRO formulas for stages 0-3")


def solution_zero_bytes() -> Any:
    return reveal("""
def zero_bytes(num_params, world_size, stage):
    shard = -(-num_params // world_size)              # ceil
    params = 2 * (shard if stage >= 3 else num_params)
    grads = 2 * (shard if stage >= 2 else num_params)
    optimizer = 12 * (shard if stage >= 1 else num_params)
    return params + grads + optimizer
""")


# ------------------------------------------------------------------ 24: save once, load everywhere

SLOW_DISK = 1.0  # seconds the checker's torch.save takes on rank 0, as a slow disk would


def check_save_and_load(lab: Any, fn: Callable[[str, Any], None]) -> Verdict:
    """`fn(path, model)` runs on every rank: rank 0 must write its model's state_dict to `path`
    and every rank must then load it, with a `map_location`, so that all ranks end with rank
    0's weights, bit for bit. Every rank starts from different weights, `path` does not exist
    yet, and rank 0's `torch.save` is slowed down by 1 s (a slow disk): a rank that reads
    before the writer has finished fails."""
    import os
    import shutil
    import tempfile

    path = os.path.join(tempfile.mkdtemp(prefix="labkit-exercise-"), "model.pt")

    def task(rank: int) -> dict[str, Any]:
        import time

        from labkit.parallel.data_parallel import make_mlp

        model = make_mlp(seed=200 + rank)
        save, load, locations = torch.save, torch.load, []

        def slow_save(*args: Any, **kwargs: Any) -> Any:
            time.sleep(SLOW_DISK)
            return save(*args, **kwargs)

        def recording_load(*args: Any, **kwargs: Any) -> Any:
            locations.append(kwargs.get("map_location", args[1] if len(args) > 1 else None))
            return load(*args, **kwargs)

        torch.save, torch.load = slow_save, recording_load
        error = None
        try:
            fn(path, model)
        except Exception as exc:  # noqa: BLE001 - reported below, after every rank is here
            error = f"{type(exc).__name__}: {exc}"
        finally:
            torch.save, torch.load = save, load
        weights = [p.detach().clone() for p in model.parameters()]
        torch.distributed.barrier()  # the checker's own: every rank is done with the file
        return {"weights": weights, "map_locations": [str(x) for x in locations], "error": error}

    try:
        results = lab.run(task)
    finally:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    if (bad := _raised(results)) is not None:
        return bad
    for r, out in sorted(results.values_by_rank.items()):
        if out["error"] is not None:
            hint = ""
            if "No such file" in out["error"] or "FileNotFound" in out["error"]:
                hint = " (it read before rank 0 had written the file: a barrier is missing)"
            return wrong(f"rank {r} raised {out['error']}{hint}")
    from labkit.parallel.data_parallel import make_mlp

    expected = [p.detach() for p in make_mlp(seed=200).parameters()]
    for r, out in sorted(results.values_by_rank.items()):
        if not all(torch.equal(a, b) for a, b in zip(out["weights"], expected)):
            return wrong(f"rank {r} does not hold rank 0's weights after loading")
        if not out["map_locations"]:
            return wrong(f"rank {r} never called torch.load")
        if "None" in out["map_locations"]:
            return wrong(
                f"rank {r} called torch.load without map_location: on GPUs every rank "
                "would load onto the device rank 0 saved from"
            )
    return right("rank 0 wrote once, everyone waited, and every rank loaded its weights bitwise")


def solution_save_and_load() -> Any:
    return reveal("""
def save_and_load(path, model):
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), path)
    dist.barrier()                                  # nobody reads a half-written file
    device = next(model.parameters()).device        # this rank's device, not rank 0's
    model.load_state_dict(torch.load(path, map_location=device, weights_only=True))
""")


# ------------------------------------------------------------------ 27: where am I?

NODES = 2  # the checker's pretend cluster: 2 nodes x world_size ranks


def check_where_am_i(lab: Any, fn: Callable[[], Any]) -> Verdict:
    """`fn()` runs on every rank and must return (rank, world_size, local_rank, node) read from
    the torchrun variables in os.environ, node being the index of this rank's machine (nodes
    of LOCAL_WORLD_SIZE ranks each). It runs twice: in the lab as it is (one node), and with
    the environment torchrun would set for this process on the second of 2 nodes."""

    def task(rank: int, world_size: int) -> list[Any]:
        import os

        real = dict(os.environ)
        out = [fn()]
        fake = {
            "RANK": str(world_size + rank),
            "WORLD_SIZE": str(NODES * world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "GROUP_RANK": "1",
        }
        os.environ.update(fake)
        try:
            out.append(fn())
        finally:
            os.environ.clear()
            os.environ.update(real)
        return [tuple(int(v) for v in o) if isinstance(o, (tuple, list)) else o for o in out]

    results = lab.run(task)
    if (bad := _raised(results)) is not None:
        return bad
    n = lab.world_size
    for r, (one_node, two_nodes) in sorted(results.values_by_rank.items()):
        cases = (
            ("in the lab", one_node, (r, n, r, 0)),
            (f"as rank {n + r} on node 1 of {NODES}", two_nodes, (n + r, NODES * n, r, 1)),
        )
        for where, got, expected in cases:
            if got != expected:
                return wrong(f"rank {r}, {where}: got {got!r}, expected {expected}")
    return right("rank, world size, local rank and node agree with torchrun's variables")


def solution_where_am_i() -> Any:
    return reveal("""
def where_am_i():
    rank = int(os.environ["RANK"])
    local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
    return (rank, int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]),
            rank // local_world_size)
""")


# ------------------------------------------------------------------ 25: the server's update rule


def check_server_update(lab: Any, fn: Callable[..., Any]) -> Verdict:
    """`fn(w, grad, version, pulled, lr)` is the parameter server's rule for one push: it must
    return (new weights w - lr * grad, version + 1, staleness = version - pulled), leaving `w`
    itself unchanged. The checker replays the same 6 pushes on every rank and compares."""
    pushes = [(0, 0), (1, 0), (2, 1), (3, 3), (4, 1), (5, 5)]  # (server version, pulled version)

    def task() -> list[Any]:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(10, generator=g)
        out = []
        for version, pulled in pushes:
            grad = torch.randn(10, generator=g)
            before = w.clone()
            new_w, new_version, staleness = fn(w, grad, version, pulled, 0.1)
            out.append((new_w.clone(), int(new_version), int(staleness), torch.equal(w, before)))
            w = new_w
        return out

    results = lab.run(task)
    if (bad := _raised(results)) is not None:
        return bad
    g = torch.Generator().manual_seed(0)
    w = torch.randn(10, generator=g)
    for i, (version, pulled) in enumerate(pushes):
        w = w - 0.1 * torch.randn(10, generator=g)
        for r, out in sorted(results.values_by_rank.items()):
            got_w, got_version, got_staleness, untouched = out[i]
            if not untouched:
                return wrong(f"push {i}: fn changed w in place; return a new tensor")
            if got_version != version + 1:
                return wrong(f"push {i}: version {got_version}, expected {version + 1}")
            if got_staleness != version - pulled:
                return wrong(
                    f"push {i} (server at {version}, gradient from {pulled}): staleness "
                    f"{got_staleness}, expected {version - pulled} on rank {r}"
                )
            if (got_w - w).abs().max().item() > TOL:
                return wrong(f"push {i}: weights differ from w - lr * grad on rank {r}")
    return right("new weights, version and staleness follow the server's rule for all 6 pushes")


def solution_server_update() -> Any:
    return reveal("""
def server_update(w, grad, version, pulled, lr):
    return w - lr * grad, version + 1, version - pulled
""")
