"""Exercise of notebook 24, checkpoints: save once, load everywhere (kernel side).

`check_save_and_load` runs the learner's function on every rank of `lab` (through `lab.run`)
with a slowed-down `torch.save`, and checks that every rank ends with rank 0's weights, bit for
bit, having loaded with a `map_location`. `solution_save_and_load` reveals one answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from labkit.exercises import Verdict, reveal, right, run_on_ranks, wrong

SLOW_DISK = 1.0  # seconds the checker's torch.save takes on rank 0, as a slow disk would


def check_save_and_load(lab: Any, fn: Callable[[str, Any], None]) -> Verdict:
    """`fn(path, model)` runs on every rank: rank 0 must write its model's state_dict to `path`
    and every rank must then load it, with a `map_location`, so that all ranks end with rank
    0's weights, bit for bit. Every rank starts from different weights, `path` does not exist
    yet, and rank 0's `torch.save` is slowed down by 1 s (a slow disk): a rank that reads
    before the writer has finished fails, and so does a rank other than 0 that writes. Rank 0
    may skip its own load (it holds the weights it saved)."""
    import os
    import shutil
    import tempfile

    path = os.path.join(tempfile.mkdtemp(prefix="labkit-exercise-"), "model.pt")

    def task(rank: int, device: Any) -> dict[str, Any]:
        import time

        from labkit.parallel.data_parallel import make_mlp

        model = make_mlp(seed=200 + rank, device=device)
        save, load, locations, saves = torch.save, torch.load, [], []

        def slow_save(*args: Any, **kwargs: Any) -> Any:
            saves.append(1)
            if rank == 0:
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
        weights = [p.detach().cpu() for p in model.parameters()]
        torch.distributed.barrier()  # the checker's own: every rank is done with the file
        return {
            "weights": weights,
            "map_locations": [str(x) for x in locations],
            "saves": len(saves),
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
            return wrong(f"rank {r} raised {out['error']}{hint}")
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
