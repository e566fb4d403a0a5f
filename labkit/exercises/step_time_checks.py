"""Exercise of notebook 46, where the time goes: MFU from a measured step (kernel side).

`check_mfu` calls the learner's `mfu_of_step(num_params, tokens_per_rank, world_size,
step_seconds, gpu)` on steps of different sizes and compares it with the model FLOPs
utilisation worked out here: 6·N·tokens of the whole global batch (forward 2·N, backward 4·N
per token), done in `step_seconds`, over all the GPUs' dense peak `gpu["bf16 dense"]`.

Classic wrong answers it rejects and names (tests/test_step_time.py): 2·N per token (the
forward only), 4·N (the backward counted as one more forward), the global batch's FLOPs over
one GPU's peak, one rank's FLOPs over all the GPUs' peak, the sparse peak (`gpu["bf16
sparse"]`, twice the dense one). The cases use 4 and 8 GPUs, so no two mistakes agree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from labkit.exercises import Verdict, reveal, right, wrong

__all__ = ["check_mfu", "solution_mfu"]

H100 = {"bf16 dense": 989.4e12, "bf16 sparse": 1978.9e12}  # H100 SXM, NVIDIA's whitepaper
# (num_params, tokens_per_rank, world_size, step_seconds)
CASES = ((7_000_000_000, 16_384, 8, 2.2), (1_300_000, 64, 4, 0.05), (70_000_000_000, 4096, 4, 9.0))

# the ratio of a mistake's answer to the right one, for a world of `w` GPUs -> what went wrong
MISTAKES: tuple[tuple[Callable[[int], float], str], ...] = (
    (lambda w: 1 / 3, "2·N FLOPs per token is the forward only: training is 6·N"),
    (lambda w: 2 / 3, "4·N per token: the backward is two matmuls per weight (4·N), not one"),
    (lambda w: w, "the global batch's FLOPs over one GPU's peak: divide by all GPUs' peak"),
    (lambda w: 1 / w, "one rank's FLOPs over all GPUs' peak: use the global batch's tokens"),
    (
        lambda w: H100["bf16 dense"] / H100["bf16 sparse"],
        "that is the sparse peak (2:4 sparsity); training uses the dense one",
    ),
)


def _reference(num_params: int, tokens_per_rank: int, world: int, seconds: float) -> float:
    flops = 6 * num_params * tokens_per_rank * world  # the global batch
    return flops / seconds / (world * H100["bf16 dense"])


def check_mfu(fn: Callable[..., Any]) -> Verdict:
    """`fn(num_params, tokens_per_rank, world_size, step_seconds, gpu)` must return the step's
    MFU as a fraction (0.42, not 42), `gpu` a dict with "bf16 dense" and "bf16 sparse" FLOP/s
    of one GPU. Example: `check_mfu(mfu_of_step)`."""
    for n, t, w, s in CASES:
        try:
            got = float(fn(n, t, w, s, dict(H100)))
        except Exception as exc:  # the learner's code: any error is an answer
            return wrong(f"fn raised {type(exc).__name__}: {exc}")
        want = _reference(n, t, w, s)
        if abs(got - want) <= 1e-6 * want:
            continue
        case = f"N={n:,}, {t:,} tokens per rank, {w} GPUs, {s} s"
        for ratio, why in MISTAKES:
            if abs(got - want * ratio(w)) <= 1e-6 * want * ratio(w):
                return wrong(f"{case}: got {got:.4f}, expected {want:.4f}: {why}")
        if abs(got - 100 * want) <= 1e-6 * 100 * want:
            return wrong(f"{case}: got {got:.4f}: give a fraction, not a percentage")
        return wrong(f"{case}: got {got:.4f}, expected {want:.4f}")
    return right("MFU of all steps right")


def solution_mfu() -> Any:
    """One answer, revealed."""
    return reveal(
        """
def mfu_of_step(num_params, tokens_per_rank, world_size, step_seconds, gpu):
    flops = 6 * num_params * tokens_per_rank * world_size  # forward 2N + backward 4N, all ranks
    return flops / step_seconds / (world_size * gpu["bf16 dense"])
"""
    )
