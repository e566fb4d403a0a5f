"""Exercise of notebook 41, FSDP2 in depth: the collectives of one step (kernel side).

`check_step_counts` calls the learner's `step_counts(num_units, microbatches,
reshard_after_forward, sync_last_only, replicate)` in this process (no ranks needed) and
compares it with `labkit.parallel.fsdp2_depth.step_collectives`, whose counts notebook 41 and
tests/test_fsdp2_depth.py check against torch's own FSDP2 on 4 gloo ranks. The classic wrong
counts it names, each on cases where it differs from the right one:

- counting per step instead of per micro-batch (FSDP2 hooks every forward and backward);
- `reshard_after_forward=False` gathering once per step (a backward reshards the unit: the
  next micro-batch's forward gathers it again), or still gathering before backward;
- an int `reshard_after_forward` counted like False (it re-shards over a smaller group: the
  backward all-gather stays, inside that group);
- `set_requires_gradient_sync(False)` on the first m-1 micro-batches leaving no reduce-scatter
  at all (the last one syncs), or removing the all-gathers too;
- HSDP's all-reduce over the replicate axis forgotten, counted per micro-batch while the
  reduce-scatters are skipped (it reduces the reduce-scatter's output: one per reduce-scatter),
  or counted once per other replica (it is one collective over the whole replicate axis).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from labkit.exercises import Verdict, reveal, right, wrong

__all__ = ["check_step_counts", "solution_step_counts"]

KEYS = ("all_gather", "reduce_scatter", "all_reduce")
# (num_units, microbatches, reshard_after_forward, sync_last_only, replicate)
CASES = (
    (4, 1, True, False, 1),
    (4, 4, True, False, 1),
    (4, 4, True, True, 1),
    (3, 4, False, False, 1),
    (5, 3, False, True, 1),
    (6, 2, 2, False, 1),
    (4, 4, True, True, 2),
    (3, 2, False, False, 2),
    (2, 2, 2, True, 4),
)


def _want(units: int, m: int, raf: bool | int, last: bool, rep: int) -> dict[str, int]:
    from labkit.parallel.fsdp2_depth import step_collectives

    return step_collectives(units, m, raf, last, rep)


def _slips(units: int, m: int, raf: bool | int, last: bool, rep: int) -> dict[str, dict]:
    """The classic wrong counts that apply to this case (a slip about a setting the case does
    not use would name the wrong mistake where two wrong counts coincide)."""
    want = _want(units, m, raf, last, rep)
    gathers_twice = raf is not False

    def with_(**kw: int) -> dict[str, int]:
        return {**want, **kw}

    rs_per_step = units
    slips: dict[str, dict] = {}
    if m > 1:
        slips[
            "counted per step: FSDP2 gathers and reduce-scatters on every micro-batch's forward "
            "and backward, so each count grows with the number of micro-batches"
        ] = {
            "all_gather": units * (2 if gathers_twice else 1),
            "reduce_scatter": rs_per_step,
            "all_reduce": rs_per_step if rep > 1 else 0,
        }
    if raf is False:
        slips[
            "reshard_after_forward=False keeps a unit gathered from its forward to its backward "
            "only: the backward reshards it, so every micro-batch's forward gathers it again "
            "(m all-gathers per unit)"
        ] = with_(all_gather=units)
        slips[
            "reshard_after_forward=False skips the gather before backward: one all-gather per "
            "unit and micro-batch, not two"
        ] = with_(all_gather=2 * units * m)
    if not isinstance(raf, bool):
        slips[
            "an int reshard_after_forward re-shards to a smaller group after forward: backward "
            "still all-gathers, inside that group (2 per unit and micro-batch)"
        ] = with_(all_gather=units * m)
    if last:
        slips[
            "with set_requires_gradient_sync(False) on the first m-1 micro-batches the last one "
            "still reduce-scatters: one per unit and step, not none"
        ] = with_(reduce_scatter=0, all_reduce=0)
        slips[
            "set_requires_gradient_sync skips reductions only: every forward and backward still "
            "all-gathers"
        ] = with_(all_gather=units * (2 if gathers_twice else 1))
    if rep > 1:
        slips[
            "on an HSDP mesh each reduce-scatter over the shard axis is followed by an "
            "all-reduce of its output over the replicate axis"
        ] = with_(all_reduce=0)
    if rep > 1 and last:
        slips[
            "the all-reduce reduces the reduce-scatter's output: with the sync skipped it is "
            "skipped too (one all-reduce per reduce-scatter)"
        ] = with_(all_reduce=units * m)
    if rep > 2:
        slips[
            "the all-reduce is one collective over the whole replicate axis, whatever its size: "
            "one per reduce-scatter, not one per other replica"
        ] = with_(all_reduce=want["reduce_scatter"] * (rep - 1))
    return slips


def check_step_counts(fn: Callable[..., Any]) -> Verdict:
    """`fn(num_units, microbatches, reshard_after_forward, sync_last_only, replicate)` ->
    {"all_gather": n, "reduce_scatter": n, "all_reduce": n}: FSDP2's collectives in one step."""
    for case in CASES:
        want = _want(*case)
        try:
            got = fn(*case)
            got = {k: int(got[k]) for k in KEYS}
        except Exception as exc:  # noqa: BLE001 - a learner's error is a verdict
            return wrong(
                f"raised {type(exc).__name__}: {exc} (return a dict with keys {', '.join(KEYS)})"
            )
        if got == want:
            continue
        units, m, raf, last, rep = case
        where = (
            f"{units} units, {m} micro-batches, reshard_after_forward={raf}, "
            f"sync_last_only={last}, replicate={rep}"
        )
        for why, slip in _slips(*case).items():
            if slip != want and got == slip:
                return wrong(f"{where}: {why}")
        return wrong(f"{where}: got {got}, expected {want}")
    return right(f"every count matches on {len(CASES)} settings (int reshard and HSDP included)")


def solution_step_counts() -> Any:
    return reveal("""
def step_counts(num_units, microbatches, reshard_after_forward, sync_last_only, replicate):
    gathers = 1 if reshard_after_forward is False else 2   # before forward (+ before backward)
    syncs = 1 if sync_last_only else microbatches          # the backwards that reduce-scatter
    return {
        "all_gather": num_units * gathers * microbatches,
        "reduce_scatter": num_units * syncs,
        "all_reduce": num_units * syncs if replicate > 1 else 0,   # HSDP: replicate axis
    }
""")
