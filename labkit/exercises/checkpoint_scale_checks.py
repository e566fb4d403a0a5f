"""Exercise of notebook 44, checkpoints at scale: what an exact resume saves (kernel side).

The learner writes `save_extra(position, device)`, the dict saved with model and optimizer
(position = (epoch, batches done in it)), and `load_extra(extra, device)`, which restores from
that dict once `dcp.load` has filled it and returns the position to train from.
`check_resume_state` runs on every rank of the lab: FSDP2 training with dropout and a shuffling
DistributedSampler, stopped in the middle of epoch 1, saved with dcp.save, reloaded in a fresh
model, optimizer and RNG state, resumed; it compares the final weights bit for bit with the run
that never stopped (the independent reference), and says what was forgotten.

Classic wrong answers it rejects (tests/test_checkpoint_scale.py; the notebook's stub in
tests/test_checkers_stubs.py): the RNG not saved; the RNG seeded again at the restart instead
of restored; the RNG under one key on every rank (DCP writes one copy, every rank reads it
back); rank 0's RNG broadcast to all; the sampler's epoch forgotten; the batches done in the
epoch forgotten.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from labkit.exercises import Verdict, reveal, right, run_on_ranks, wrong

STOP, END = (1, 2), (2, 2)  # (epoch, batch) where the run is interrupted, and where it ends


def check_resume_state(
    lab: Any,
    save_extra: Callable[[tuple[int, int], Any], dict[str, Any]],
    load_extra: Callable[[dict[str, Any], Any], tuple[int, int]],
) -> Verdict:
    """Right when a run interrupted at (epoch 1, batch 2), saved with DCP together with
    `save_extra`'s dict and resumed through `load_extra`, ends bitwise equal to the run that
    never stopped, on every rank."""
    import shutil
    import tempfile

    root = tempfile.mkdtemp(prefix="labkit-exercise-")

    def task(rank: int, device: Any) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.utils.data import DistributedSampler

        from labkit.parallel import checkpoint_scale as cs
        from labkit.parallel.datasets import load_digits

        X, y = load_digits()
        X, y = X.to(device), y.to(device)
        world = torch.distributed.get_world_size()
        mesh = init_device_mesh(device.type, (world,))

        def fresh(seed: int) -> tuple[Any, Any, Any]:
            model = cs.shard_mlp(cs.make_dropout_mlp(seed=seed, device=device), mesh)
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            sampler = DistributedSampler(range(512), world, rank, shuffle=True, seed=0)
            return model, opt, sampler

        def full(model: Any) -> list[torch.Tensor]:
            return [p.full_tensor().cpu() for p in model.parameters()]

        torch.manual_seed(100 + rank)  # each rank its own dropout masks
        model, opt, sampler = fresh(0)
        cs.train(model, opt, X, y, sampler, 32, (0, 0), END)
        straight = full(model)

        torch.manual_seed(100 + rank)
        model, opt, sampler = fresh(0)
        cs.train(model, opt, X, y, sampler, 32, (0, 0), STOP)
        saved_rng = cs.rng_state(device)
        msd, osd = get_state_dict(model, opt)
        dcp.save(
            {"model": msd, "optim": osd, "extra": save_extra(STOP, device)}, checkpoint_id=root
        )

        torch.manual_seed(999)  # a new job: its own RNG state, a fresh model and optimizer
        model, opt, sampler = fresh(7)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "extra": save_extra((0, 0), device)}
        dcp.load(state, checkpoint_id=root)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        position = tuple(load_extra(state["extra"], device))
        rng_after = cs.rng_state(device)
        cs.train(model, opt, X, y, sampler, 32, position, END)
        resumed = full(model)
        return {
            "position": position,
            "saved_rng": {k: v.cpu() for k, v in saved_rng.items()},
            "rng_after": {k: v.cpu() for k, v in rng_after.items()},
            "equal": all(torch.equal(a, b) for a, b in zip(straight, resumed)),
        }

    try:
        results, bad = run_on_ranks(lab, task)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if bad is not None:
        return bad
    outs = results.values_by_rank

    def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    for r, out in sorted(outs.items()):
        epoch, index = out["position"]
        if epoch != STOP[0]:
            return wrong(
                f"rank {r} resumed in epoch {epoch}, the run stopped in epoch {STOP[0]}: the "
                "sampler's epoch seeds its permutation (set_epoch), save it"
            )
        if index != STOP[1]:
            return wrong(
                f"rank {r} resumed at batch {index} of the epoch, the run stopped after "
                f"{STOP[1]}: save the loader's position in the epoch, or it repeats batches"
            )
    for r, out in sorted(outs.items()):
        if same(out["rng_after"], out["saved_rng"]):
            continue
        donors = [s for s, o in sorted(outs.items()) if same(out["rng_after"], o["saved_rng"])]
        if donors:
            return wrong(
                f"rank {r} resumed with rank {donors[0]}'s RNG state, not its own: a key that "
                "is the same on every rank is written once by DCP (or one rank's state was "
                "broadcast); give each rank's RNG its own key"
            )
        return wrong(
            f"rank {r}'s RNG after load_extra is not the one it had at the checkpoint: save "
            "it (torch.get_rng_state(), and the CUDA generator on a GPU) and put it back"
        )
    if not all(out["equal"] for out in outs.values()):
        return wrong("the position and RNG come back, yet the resumed weights drift")
    return right("the resumed run equals the one that never stopped, bit for bit, on every rank")


def solution_resume_state() -> Any:
    return reveal("""
def save_extra(position, device):
    epoch, index = position
    rng = {"host": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return {"epoch": epoch, "index": index, f"rng_rank{dist.get_rank()}": rng}


def load_extra(extra, device):
    rng = extra[f"rng_rank{dist.get_rank()}"]
    torch.set_rng_state(rng["host"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], device)
    return extra["epoch"], extra["index"]
""")
