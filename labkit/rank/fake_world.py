"""A simulated world of up to thousands of ranks, run in this one process (it plays the ranks).

`simulate(world=(8, 8, 16), names=("dp", "tp", "pp"), setup=fn)` calls `fn(mesh)` the way
every rank of a real job would, on torch's fake process group (`dist.init_process_group("fake",
...)`: collectives return at once, nothing is sent, no GPU is needed; torchtitan estimates
memory the same way). `fn` builds and parallelises a model with the real APIs (`fully_shard`,
`parallelize_module`, DTensor) on a real `DeviceMesh` of that shape, may run a forward and
backward (the collectives it makes are recorded by labkit's tracer, `labkit.rank.trace`), and
returns the model, or `(model, optimizer)`.

One rank per class: `fn` takes ~0.3 s a rank for a small model (5 min for 1,024 ranks), so it
runs once per *representative*, the rank at coordinate 0 on every axis but the `vary` axes
(default: one named "pp", whose stages build different layers); the others are derived:

- a DTensor's local shard is computed for the rank's coordinate by DTensor's own rule
  (`compute_local_shape_and_global_offset`, uneven and strided shards included), and the
  gradient and optimizer-state bytes measured on the representative scaled to that shard;
- a plain tensor is held whole, as on the representative;
- a collective on a group that spans mesh axes A is the same call on the rank's own group
  along A (the group's ranks with the rank's coordinates on the other axes); a send goes to
  the peer at the same offset.

That holds when `fn` is SPMD within a class (every rank runs the same code, and only DTensor's
placements make shards differ: FSDP2, TP, DTensor ops), which is how those APIs are used.
`simulate` also runs the last rank and checks it against what is derived for it (a ValueError
if they differ: name more axes in `vary`); `every_rank=True` runs `fn` on every rank instead.
DDP's bucket all-reduces, issued from C++, are not recorded.

This process's `torch.distributed` state is used: it must have no process group (not a lab's
rank); the fake one is destroyed after each representative, and DTensor's sharding caches
cleared (torch keys them by mesh shape: a stale entry would name a destroyed group).
`torch_compat`'s `fake_world` feature says what this torch lacks, if anything. Imports only
torch and labkit's rank side.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from labkit.rank import torch_compat
from labkit.rank.fake_rank import Run, install_tracer, run_one
from labkit.wire.records import P2P_OPS, CommRecord

__all__ = ["SimulatedWorld", "simulate"]

MAX_WORLD = 65_536


def _require() -> Any:
    parts = torch_compat.get("fake_world")
    if parts is None:
        reason = torch_compat.missing("fake_world")
        raise RuntimeError(f"labkit.simulate needs torch's fake process group: {reason}")
    return parts


@dataclass
class SimulatedWorld:
    """A simulated world: `shape`, `names` (mesh axes), the representatives that ran
    (`ran`), `seconds` of wall time; `placement()`, `traffic()` and `memory()` for views."""

    shape: tuple[int, ...]
    names: tuple[str, ...]
    vary: tuple[str, ...]
    runs: dict[int, Run]
    seconds: float
    _rows: dict[int, list[dict[str, Any]]] = field(default_factory=dict, repr=False)
    _records: dict[int, list[CommRecord]] = field(default_factory=dict, repr=False)
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    @property
    def ran(self) -> list[int]:
        return sorted(self.runs)

    def coords(self, rank: int) -> tuple[int, ...]:
        """The rank's coordinate on each mesh axis (row-major, as `init_device_mesh`)."""
        out = []
        for size in reversed(self.shape):
            rank, c = divmod(rank, size)
            out.append(c)
        return tuple(reversed(out))

    def rank_at(self, coords: Sequence[int]) -> int:
        rank = 0
        for c, size in zip(coords, self.shape, strict=True):
            rank = rank * size + c
        return rank

    def representative(self, rank: int) -> int:
        """The rank that ran `setup` for `rank`'s class (itself when every rank ran)."""
        if rank in self.runs:
            return rank
        c = self.coords(rank)
        return self.rank_at([c[i] if n in self.vary else 0 for i, n in enumerate(self.names)])

    def axes_of(self, ranks: Sequence[int]) -> tuple[str, ...]:
        """The mesh axes along which `ranks` differ: a group's axes ("tp"; ("dp", "tp"))."""
        cs = [self.coords(r) for r in ranks]
        return tuple(n for i, n in enumerate(self.names) if len({c[i] for c in cs}) > 1)

    def _move(self, q: int, axes: set[int], target: tuple[int, ...]) -> int:
        """`q` moved to `target`'s coordinates on every axis outside `axes`."""
        c = self.coords(q)
        return self.rank_at([c[i] if i in axes else target[i] for i in range(len(c))])

    def _varying(self, ranks: Sequence[int]) -> set[int]:
        cs = [self.coords(r) for r in ranks]
        return {i for i in range(len(self.shape)) if len({c[i] for c in cs}) > 1}

    def _moved(self, ranks: tuple[int, ...], target: tuple[int, ...]) -> tuple[int, ...]:
        """The ranks of group `ranks` (which spans some axes) moved to the group along the
        same axes through `target` (cached: every rank of one group asks for the same)."""
        axes = self._cache.get(ranks)
        if axes is None:
            axes = self._cache[ranks] = self._varying(ranks)
        key = (ranks, tuple(c for i, c in enumerate(target) if i not in axes))
        moved = self._cache.get(key)
        if moved is None:
            moved = self._cache[key] = tuple(self._move(q, axes, target) for q in ranks)
        return moved

    def placement(self, ranks: Sequence[int] | None = None) -> list[dict[str, Any]]:
        """Rows of `labkit.rank.placement_probe.describe_model` for every rank (or `ranks`):
        what `labkit.show_placement(rows)` draws."""
        out = []
        for r in range(self.world_size) if ranks is None else ranks:
            out.extend(self._rows_of(r))
        return out

    def _rows_of(self, rank: int) -> list[dict[str, Any]]:
        if rank not in self._rows:
            if not 0 <= rank < self.world_size:
                raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
            self._rows[rank] = self._derive_rows(rank)
        return self._rows[rank]

    def _derive_rows(self, rank: int) -> list[dict[str, Any]]:
        run = self.runs[self.representative(rank)]
        if run.rank == rank:
            return run.rows
        local_shape = torch_compat.get("fake_world")["local_shape"]
        target, out = self.coords(rank), []
        for row, spec in zip(run.rows, run.specs, strict=True):
            row = dict(row, rank=rank)
            if spec is not None:
                shape, placements, flat, dims, size = spec
                moved = self._moved(flat, target)
                pos = _unravel(moved.index(rank), dims)
                key = (shape, placements, tuple(dims), pos)  # q, k, v of every layer alike
                if key not in self._cache:
                    self._cache[key] = local_shape(shape, dims, list(pos), placements)
                local, offset = self._cache[key]
                numel = math.prod(local)
                dims_sharded = sorted({s[0] for s in row["shard"]})
                row.update(_states_for(row, numel * size))
                row.update(
                    local_shape=tuple(local),
                    numel=numel,
                    bytes=numel * size,
                    mesh=_regroup(list(moved), dims),
                    shard=[(d, int(offset[d]), int(offset[d] + local[d])) for d in dims_sharded],
                )
            out.append(row)
        return out

    def traffic(self, ranks: Sequence[int] | None = None) -> list[CommRecord]:
        """Every rank's (or `ranks`') CommRecords of the collectives `setup` made: what
        `labkit.show_comm(records)` draws (bytes per link) and `labkit.show_world` sums per
        mesh axis."""
        out = []
        for r in range(self.world_size) if ranks is None else ranks:
            if r not in self._records:
                self._records[r] = self._derive_records(r)
            out.extend(self._records[r])
        return out

    def _derive_records(self, rank: int) -> list[CommRecord]:
        run = self.runs[self.representative(rank)]
        if run.rank == rank:
            return run.records
        target, out = self.coords(rank), []
        for rec in run.records:
            # the group moves along the axes it spans; a peer (p2p, or a root outside the
            # group's axes) keeps its offset from the representative
            group = self._moved(rec.group, target)
            peer = rec.peer
            if peer is not None:
                if rec.op not in P2P_OPS and peer in rec.group:
                    peer = group[rec.group.index(peer)]
                else:
                    peer = self._move(peer, self._varying([run.rank, peer]), target)
            out.append(replace(rec, rank=rank, group=group, peer=peer))
        return out

    def memory(self) -> dict[int, dict[str, int]]:
        """Per rank, once gradients and optimizer state exist: bytes of `params` (and
        buffers), `grads` (one per trainable parameter, sharded alike), `optimizer`
        (`optim_slots` parameter-sized tensors each: Adam 2) and `total`."""
        out = {}
        for r in range(self.world_size):
            rows = [x for x in self._rows_of(r) if x["kind"] in ("param", "buffer")]
            params = [x for x in rows if x["kind"] == "param"]
            m = {
                "params": sum(x["bytes"] for x in rows),
                "grads": sum(x["bytes"] for x in params if x["requires_grad"]),
                "optimizer": sum(x["bytes"] * (x.get("optim_slots") or 0) for x in params),
            }
            m["total"] = sum(m.values())
            out[r] = m
        return out


def _states_for(row: dict[str, Any], nbytes: int) -> dict[str, int]:
    """The representative's measured gradient and optimizer-state bytes for a shard of
    `nbytes` instead of its own (uneven shards differ): a gradient sharded as its parameter,
    `optim_slots` parameter-sized state tensors, and what is not parameter-sized (Adam's step
    counter) as it is."""
    mine = row.get("bytes", 0)
    if not mine:
        return {}
    out = {}
    grad = row.get("grad_bytes", 0)
    if grad == mine:
        out["grad_bytes"] = nbytes
    state, slots = row.get("optim_bytes", 0), row.get("optim_slots") or 0
    if state >= slots * mine > 0:
        out["optim_bytes"] = state - slots * (mine - nbytes)
    return out


def _unravel(index: int, dims: list[int]) -> tuple[int, ...]:
    out = []
    for size in reversed(dims):
        index, c = divmod(index, size)
        out.append(c)
    return tuple(reversed(out))


def _regroup(flat: list[int], dims: list[int]) -> Any:
    if len(dims) <= 1:
        return list(flat)
    step = len(flat) // dims[0]
    return [_regroup(flat[i * step : (i + 1) * step], dims[1:]) for i in range(dims[0])]


def simulate(
    world: Sequence[int],
    names: Sequence[str],
    setup: Callable[[Any], Any],
    *,
    vary: Sequence[str] | None = None,
    every_rank: bool = False,
) -> SimulatedWorld:
    """Run `setup(mesh)` on a fake process group for a `world`-shaped mesh (module doc).

    Runs in this process (the notebook's kernel, or a script), which must have no process
    group. `vary`: the axes whose coordinate changes what `setup` builds (default: "pp" if
    named); `every_rank`: run every rank instead of one per class. Example::

        def setup(mesh):
            model = parallelize_module(MLP(), mesh["tp"], plan)
            fully_shard(model, mesh=mesh["dp"])
            model(torch.randn(8, 64)).sum().backward()
            return model, torch.optim.Adam(model.parameters())

        world = labkit.simulate((32, 8), ("dp", "tp"), setup)
        labkit.show_world(world)
    """
    import torch.distributed as dist

    shape, names = tuple(int(s) for s in world), tuple(names)
    if not shape or any(s < 1 for s in shape) or len(names) != len(shape):
        raise ValueError(f"world must be sizes >= 1, one per name in {names}, got {tuple(world)}")
    if len(set(names)) != len(names):
        raise ValueError(f"names must differ, got {names}")
    if not 1 <= math.prod(shape) <= MAX_WORLD:
        raise ValueError(f"the world must have 1 to {MAX_WORLD} ranks, got {math.prod(shape)}")
    vary = tuple(vary) if vary is not None else tuple(n for n in names if n == "pp")
    if set(vary) - set(names):
        raise ValueError(f"vary must name axes of {names}, got {vary}")
    parts = _require()
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "labkit.simulate runs in a process without a process group (the notebook's "
            "kernel, a script): this one has one (a lab's rank?)"
        )
    from labkit.rank.trace_state import STATE

    install_tracer()
    saved = (STATE.cell, STATE.rank, dict(STATE.seq), dict(STATE.p2p))
    start = time.perf_counter()
    sim = SimulatedWorld(shape, names, vary, {}, 0.0)
    if every_rank:
        ranks = range(sim.world_size)
    else:
        ranks = sorted({sim.representative(r) for r in range(sim.world_size)})
    try:
        for r in ranks:
            sim.runs[r] = run_one(r, shape, names, setup, parts)
        last = sim.world_size - 1
        if last not in sim.runs:  # the derivation checked on the rank farthest from its own
            _check_derived(sim, run_one(last, shape, names, setup, parts))
    finally:
        STATE.cell, STATE.rank = saved[0], saved[1]
        STATE.seq, STATE.p2p = saved[2], saved[3]
    sim.seconds = time.perf_counter() - start
    return sim


def _check_derived(sim: SimulatedWorld, run: Run) -> None:
    """`run` (a rank that really ran) against what its representative says it holds and calls."""
    rep = sim.representative(run.rank)
    keys = ("qualname", "local_shape", "bytes", "shard", "grad_bytes", "optim_bytes")
    got = [tuple(r[k] for k in keys) for r in run.rows]
    derived = [tuple(r[k] for k in keys) for r in sim._derive_rows(run.rank)]
    calls = [(r.op, r.group, r.peer, r.bytes) for r in run.records]
    derived_calls = [(r.op, r.group, r.peer, r.bytes) for r in sim._derive_records(run.rank)]
    if got != derived or calls != derived_calls:
        what = "parameters" if got != derived else "collectives"
        raise ValueError(
            f"setup is not the same code on every rank of a class: rank {run.rank}'s "
            f"{what} differ from those derived from rank {rep} (vary={sim.vary}); name every "
            "axis whose coordinate changes what setup builds in vary=, or pass every_rank=True"
        )
