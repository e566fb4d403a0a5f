"""Exercise of notebook 24, checkpoints: save once, load everywhere (kernel side).

`check_save_and_load` runs the learner's function on every rank of `lab` (through `lab.run`)
with a slowed-down `torch.save`, and checks that every rank ends with rank 0's weights, bit for
bit, having loaded with a `map_location`. `solution_save_and_load` reveals one answer.

The race (a rank reading the file before rank 0 has finished writing it) must be prevented,
not avoided by timing: each rank that loads must, before its torch.load, have completed a
collective (or a recv) that rank 0 entered only after its torch.save returned. That is read
from the calls each rank made (in its own clock) and matched across ranks by their order on
the group, so a sleep, however long, does not pass, and neither does a barrier before the
save or an async barrier never waited for.

Classic wrong answers it rejects (tests/test_checkers_data.py): no barrier; a barrier before
the save; a sleep instead of a barrier; every rank saving to the same file; torch.load
without map_location (on GPUs every rank would load onto the device rank 0 saved from) or
with a fixed cuda:0; the loaded state never put into the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from labkit.exercises import Verdict, reveal, right, run_on_ranks, watching_factory, wrong

SLOW_DISK = 0.5  # seconds the checker's torch.save takes on rank 0, as a slow disk would
# ops after which a rank has heard from every member of the group (the root's own broadcast
# or scatter, and a non-root's reduce or gather, may return before the others arrive)
_MEETS_ALL = {
    "barrier",
    "monitored_barrier",
    "all_reduce",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
}


def _ordered_after_save(
    calls: dict[int, list[dict[str, Any]]], save_end: float, r: int, load_start: float
) -> bool:
    """Whether rank r completed, before `load_start` (its clock), a call that rank 0 began
    after `save_end` (rank 0's clock) and that r cannot complete before rank 0 begins it.
    Collectives are matched by their order on the group; a recv from 0 by its order among
    rank 0's sends to r."""

    def key(rank: int, i: int) -> tuple[Any, ...] | None:
        c = calls[rank][i]
        if c["op"] in ("send", "isend", "recv", "irecv"):
            sender, receiver = (rank, c["peer"]) if "send" in c["op"] else (c["peer"], rank)
            n = sum(
                1
                for d in calls[rank][:i]
                if d["op"] in (("send", "isend") if "send" in c["op"] else ("recv", "irecv"))
                and d["peer"] == c["peer"]
            )
            return ("p2p", sender, receiver, n)
        group = tuple(c["group"])
        n = sum(
            1
            for d in calls[rank][:i]
            if tuple(d["group"]) == group and "send" not in d["op"] and "recv" not in d["op"]
        )
        return ("coll", group, n)

    after = {key(0, i) for i, c in enumerate(calls[0]) if c["start"] >= save_end}
    for i, c in enumerate(calls[r]):
        if c["done"] is None or c["done"] > load_start or 0 not in c["group"]:
            continue
        op, peer = c["op"], c["peer"]
        hears_from_0 = (
            op in _MEETS_ALL
            or (op in ("broadcast", "scatter") and peer == 0)
            or (op in ("reduce", "gather") and peer == r)
            or (op in ("recv", "irecv") and peer == 0)
        )
        if hears_from_0 and key(r, i) in after:
            return True
    return False


def check_save_and_load(lab: Any, fn: Callable[[str, Any], None]) -> Verdict:
    """`fn(path, model)` runs on every rank: rank 0 must write its model's state_dict to `path`
    and every rank must then load it, with a `map_location`, so that all ranks end with rank
    0's weights, bit for bit. Every rank starts from different weights, `path` does not exist
    yet, and rank 0's `torch.save` is slowed down by SLOW_DISK s (a slow disk): a rank that
    reads before the writer has finished fails, and so does a rank other than 0 that writes.
    A rank that reads after the save only by luck of timing (a sleep) fails too: a call that
    rank 0 made after saving must order its load (see the module's docstring). Rank 0 may
    skip its own load (it holds the weights it saved)."""
    import os
    import shutil
    import tempfile

    path = os.path.join(tempfile.mkdtemp(prefix="labkit-exercise-"), "model.pt")

    watch = watching_factory()

    def task(rank: int, device: Any) -> dict[str, Any]:
        import time

        from labkit.parallel.data_parallel import make_mlp

        model = make_mlp(seed=200 + rank, device=device)
        save, load, locations, saves, loads, failed = torch.save, torch.load, [], [], [], []

        def slow_save(*args: Any, **kwargs: Any) -> Any:
            if rank == 0:
                time.sleep(SLOW_DISK)
            try:
                return save(*args, **kwargs)
            finally:
                saves.append(time.time())  # when the file is whole

        def recording_load(*args: Any, **kwargs: Any) -> Any:
            loads.append(time.time())
            locations.append(kwargs.get("map_location", args[1] if len(args) > 1 else None))
            try:
                return load(*args, **kwargs)
            except Exception:
                failed.append(time.time())  # e.g. a file read while rank 0 was writing it
                raise

        torch.save, torch.load = slow_save, recording_load
        error, calls = None, []
        try:
            calls = watch(fn)(path, model)["calls"]
        except Exception as exc:  # noqa: BLE001 - reported below, after every rank is here
            error = f"{type(exc).__name__}: {exc}"
        finally:
            torch.save, torch.load = save, load
        weights = [p.detach().cpu() for p in model.parameters()]
        torch.distributed.barrier()  # the checker's own: every rank is done with the file
        return {
            "weights": weights,
            "map_locations": [str(x) for x in locations],
            "saves": saves,
            "loads": loads,
            "load_failed": bool(failed),
            "calls": calls,
            "device": str(device),
            "error": error,
        }

    try:
        results, bad = run_on_ranks(lab, task)
    finally:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    if bad is not None:
        return bad
    outs = results.values_by_rank
    if not outs[0]["saves"]:
        return wrong("rank 0 never called torch.save")
    if writers := [r for r, out in sorted(outs.items()) if r != 0 and out["saves"]]:
        return wrong(f"ranks {writers} called torch.save too: only rank 0 writes the file")
    for r, out in sorted(outs.items()):
        if out["error"] is not None:
            hint = ""
            if "No such file" in out["error"] or "FileNotFound" in out["error"]:
                hint = " (it read before rank 0 had written the file: a barrier is missing)"
            elif out["load_failed"]:  # a half-written file: a truncated zip, an empty pickle
                hint = (
                    " (in torch.load: if it read while rank 0 was still writing the file, a "
                    "barrier is missing)"
                )
            return wrong(f"rank {r} raised {out['error']}{hint}")
    calls = {r: out["calls"] for r, out in outs.items()}
    for r, out in sorted(outs.items()):
        if r == 0 or not out["loads"]:
            continue
        if not _ordered_after_save(calls, outs[0]["saves"][-1], r, out["loads"][0]):
            return wrong(
                f"rank {r} called torch.load with nothing ordering it after rank 0's "
                "torch.save: no collective that rank 0 entered after saving had completed on "
                f"rank {r} before it read, so it may read a missing or half-written file (a "
                "sleep only makes that rare): a barrier is missing, after the save and before "
                "the load"
            )
    from labkit.parallel.data_parallel import make_mlp

    expected = [p.detach() for p in make_mlp(seed=200).parameters()]
    for r, out in sorted(outs.items()):
        if not all(torch.equal(a, b) for a, b in zip(out["weights"], expected)):
            return wrong(f"rank {r} does not hold rank 0's weights after loading")
        if not out["map_locations"] and r != 0:  # rank 0 may keep the weights it saved
            return wrong(f"rank {r} never called torch.load")
        if "None" in out["map_locations"]:
            return wrong(
                f"rank {r} called torch.load without map_location: on GPUs every rank "
                "would load onto the device rank 0 saved from"
            )
        fixed = [x for x in out["map_locations"] if x.startswith("cuda:")]
        if r and any(x != out["device"] for x in fixed):
            return wrong(
                f"rank {r} loaded with map_location={fixed[0]}, not its own device "
                f"({out['device']}): use next(model.parameters()).device"
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
