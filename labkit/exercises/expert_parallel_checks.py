"""Exercises of the expert-parallel notebook 35 (kernel side).

`check_token_exchange` runs a learner's dispatch step on the ranks: the count exchange, then
one `all_to_all_single` with uneven splits. Every row the checker hands out is labelled with
its source rank, its destination rank and its place, so a wrong answer is diagnosed from what
arrived: input and output splits swapped, even splits, rows at the wrong rank, padding.

`check_moe_forward` runs a learner's routing and combine (in the kernel: no communication) on
cases where the classic mistakes give other numbers: top-k weights left unnormalised, or
normalised for a model that does not; a token dropped whole when one of its slots is; the
slots' outputs added in the order they were sorted by expert. Real layers differ in which slots
a full expert drops and in whether the survivors' weights are renormalised; the exercise fixes
one rule (GShard's order: first choices first, in token order; no renormalisation after the
drop, as Megatron-core) and names the others' conventions when an answer follows one of them:
token order for all slots (Megatron-core's drop_policy="position"), the heaviest slots kept
(its default "probs"), renormalised after the drop (fairscale's and DeepSpeed's top-2 gates).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from labkit.exercises import OP_FAMILY, Verdict, reveal, right, run_on_ranks, wrong

__all__ = [
    "check_moe_forward",
    "check_token_exchange",
    "moe_cases",
    "moe_mistakes",
    "solution_moe_forward",
    "solution_token_exchange",
    "token_matrices",
]

WIDTH = 4  # a row: source rank, destination rank, place in its block, a value
_SEND_FIRST = (
    "output_split_sizes[s] must be the rows rank s sends here, which only rank s knows: "
    "exchange the counts first (all_to_all_single of send_counts), then the rows"
)


def token_matrices(n: int) -> list[list[list[int]]]:
    """The cases, as matrix[s][d] = rows rank s sends to rank d (kernel side): a circulant one
    whose row sums equal its column sums, so that swapped splits run (and give wrong rows)
    where n > 2, and a seeded irregular one whose ranks send and receive different totals."""
    import random

    base = [1, 3, 0, 4, 2, 6, 5, 7, 1, 2][:n] + [1] * max(0, n - 10)
    base[0] += -sum(base) % n  # the total divisible by n: even splits run too
    circulant = [[base[(d - s) % n] for d in range(n)] for s in range(n)]
    rng = random.Random(n)
    irregular = [[rng.randint(0, 5) for _ in range(n)] for _ in range(n)]
    irregular[0][n - 1] += 3  # rank 0 sends more than it receives
    return [circulant, irregular]


def _rows(matrix: list[list[int]], s: int, d: int) -> list[list[float]]:
    """The rows rank s sends to rank d (the value: a hash of the three labels, exact in float32)."""
    return [[s, d, i, ((s * 31 + d * 7 + i * 3) % 17) / 16] for i in range(matrix[s][d])]


def _received(matrix: list[list[int]], blocks_of: Callable[[int], list[list[list[float]]]]):
    """What each rank receives when rank s's rows are cut into blocks_of(s), block d to rank d."""
    n = len(matrix)
    return [[row for s in range(n) for row in blocks_of(s)[r]] for r in range(n)]


def _sent(matrix: list[list[int]], s: int) -> list[list[float]]:
    return [row for d in range(len(matrix)) for row in _rows(matrix, s, d)]


def _cut(rows: list, sizes: list[int]) -> list[list]:
    out, at = [], 0
    for size in sizes:
        out.append(rows[at : at + size])
        at += size
    return out


def _diagnosis(matrix: list[list[int]], got: list[list[float]], r: int) -> str:
    """Why rank r's rows are wrong, as precisely as the labels allow (kernel side)."""
    n = len(matrix)
    want = [row for s in range(n) for row in _rows(matrix, s, r)]
    swapped = _received(matrix, lambda s: _cut(_sent(matrix, s), [matrix[d][s] for d in range(n)]))
    total = [sum(row) for row in matrix]
    even = None
    if all(t % n == 0 for t in total):
        even = _received(matrix, lambda s: _cut(_sent(matrix, s), [total[s] // n] * n))
    if got == swapped[r] and got != want:
        return (
            "input and output split sizes are swapped: input_split_sizes[d] is what this rank "
            "sends to rank d (send_counts), output_split_sizes[s] what it receives from rank s"
        )
    if even is not None and got == even[r] and got != want:
        return (
            "the rows were cut into equal splits: routing makes them uneven; pass "
            "input_split_sizes and output_split_sizes"
        )
    stray = sorted({int(row[1]) for row in got if int(row[1]) != r})
    if stray:
        return (
            f"it holds rows meant for rank(s) {stray}: split d of the input goes to rank d, and "
            "the rows come grouped by destination, in the order of send_counts"
        )
    if len(got) != len(want):
        return f"it received {len(got)} rows, the other ranks send it {len(want)}; " + _SEND_FIRST
    if sorted(got) == sorted(want):
        return "the right rows in the wrong order: they arrive grouped by source rank, 0 first"
    return "its rows are not the ones the other ranks sent it"


def _inputs_factory() -> Callable[..., Any]:
    """The function that builds a rank's input, made here so that it is pickled by value (a
    rank does not import this kernel-side module)."""

    def inputs(matrix: list[list[int]], rank: int, device: Any) -> tuple[Any, Any]:
        import torch

        rows = [
            [rank, d, i, ((rank * 31 + d * 7 + i * 3) % 17) / 16]
            for d in range(len(matrix))
            for i in range(matrix[rank][d])
        ]
        tokens = torch.tensor(rows, dtype=torch.float32, device=device).reshape(-1, 4)
        return tokens, torch.tensor(matrix[rank], dtype=torch.int64, device=device)

    return inputs


def check_token_exchange(lab: Any, fn: Callable[..., Any]) -> Verdict:
    """`fn(tokens, send_counts, rank, world_size)` runs on every rank. `tokens` [N, 4] float32
    are this rank's rows grouped by destination rank: the first send_counts[0] for rank 0,
    then send_counts[1] for rank 1, ...; `send_counts` is an int64 tensor of world_size counts.
    It must return the rows every rank sent to this one, grouped by source rank (rank 0's
    first), exchanging the counts first and the rows with one all_to_all_single whose splits
    are the counts themselves (no padding)."""
    import torch

    n = lab.world_size
    inputs = _inputs_factory()
    for case, matrix in enumerate(token_matrices(n)):

        def task(rank: int, world_size: int, device: Any, matrix: list = matrix) -> Any:
            tokens, counts = inputs(matrix, rank, device)
            out = fn(tokens, counts, rank, world_size)
            return out.detach().cpu() if isinstance(out, torch.Tensor) else out

        results, bad = run_on_ranks(lab, task, display=False)
        if bad is not None:
            if "died" in bad.message:
                return wrong(
                    "the cell could not finish: a rank died, as gloo aborts when a rank "
                    f"receives a different number of rows than its peer sent; {_SEND_FIRST}"
                )
            return bad
        for r, out in sorted(results.values_by_rank.items()):
            if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[1] != WIDTH:
                what = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                return wrong(f"rank {r} returned {what}, expected a tensor of shape (rows, 4)")
            got = out.float().tolist()
            want = [row for s in range(n) for row in _rows(matrix, s, r)]
            if len(got) != len(want) or not torch.allclose(out.float(), torch.tensor(want)):
                return wrong(f"case {case + 1}, rank {r}: {_diagnosis(matrix, got, r)}")
        verdict = _check_trace(lab, matrix)
        if verdict is not None:
            return verdict
    return right(
        "counts first, then the rows with uneven splits: every rank got exactly what the "
        "others sent it, and no byte more"
    )


def _check_trace(lab: Any, matrix: list[list[int]]) -> Verdict | None:
    """The rows must travel by one all_to_all whose bytes are the rows sent, after the counts."""
    for r in range(len(matrix)):
        recs = [rec for rec in lab.trace() if rec.kind == "comm" and rec.rank == r]
        moved = [rec for rec in recs if rec.dtype == "float32"]
        names = [OP_FAMILY.get(rec.op, rec.op) for rec in moved]
        if names != ["all_to_all"]:
            return wrong(
                f"rank {r} moved the rows with {names or 'nothing'}: exchange them with one "
                "all_to_all_single"
            )
        if recs.index(moved[0]) == 0:
            return wrong(f"rank {r} sent the rows before it knew the counts; {_SEND_FIRST}")
        need = sum(matrix[r]) * WIDTH * 4
        if moved[0].bytes != need:
            return wrong(
                f"rank {r}'s all_to_all carried {moved[0].bytes} bytes, its rows are {need}: "
                "padding to even splits sends more than the rows; use the counts as the splits"
            )
    return None


def solution_token_exchange() -> Any:
    return reveal("""
def exchange(tokens, send_counts, rank, world_size):
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)      # counts: one per rank, even splits
    out = tokens.new_empty((int(recv_counts.sum()), tokens.shape[1]))
    dist.all_to_all_single(
        out, tokens,
        output_split_sizes=recv_counts.tolist(),          # rows from each source rank
        input_split_sizes=send_counts.tolist(),           # rows to each destination rank
    )
    return out
""")


# ---------------------------------------------------------------- routing and combine


def moe_cases() -> list[dict[str, Any]]:
    """Seeded cases (kernel side): 12 tokens, 4 experts (distinct nonlinear maps), top-2;
    dropless and capped at 4 slots per expert, with and without renormalised weights. The capped
    cases drop first choices under token order and second choices under slot order, leave
    tokens with one slot of two and tokens with none."""
    import torch

    g = torch.Generator().manual_seed(35)
    x = torch.randn(12, 4, generator=g)
    logits = torch.randn(12, 4, generator=g) * 2
    logits[:6, 0] += 4  # expert 0 is everyone's favourite: its capacity fills with first choices
    mats = torch.randn(4, 4, 4, generator=g)
    experts = [lambda h, m=m, e=e: torch.tanh(h @ m) + e for e, m in enumerate(mats)]
    return [
        dict(x=x, logits=logits, experts=experts, k=2, capacity=c, normalize=n)
        for c in (4, None)  # capped first: its mistakes are named more precisely there
        for n in (True, False)
    ]


def _topk(logits: Any, k: int, normalize: bool) -> tuple[Any, Any]:
    weights, chosen = logits.softmax(dim=-1).topk(k, dim=-1)
    return chosen, weights / weights.sum(dim=-1, keepdim=True) if normalize else weights


def _keep(
    chosen: Any, num_experts: int, capacity: int | None, token_major: bool, weights: Any = None
) -> Any:
    """Which slots an expert with room `capacity` keeps, filled slot-major (or token-major; or,
    given `weights`, the heaviest slots first, as Megatron-core's drop_policy="probs")."""
    import torch

    keep = torch.ones_like(chosen, dtype=torch.bool)
    if capacity is None:
        return keep
    used = [0] * num_experts
    t_count, k = chosen.shape
    order = [(t, j) for t in range(t_count) for j in range(k)]
    if weights is not None:
        order.sort(key=lambda tj: -float(weights[tj]))  # per expert: the largest weights kept
    elif not token_major:
        order.sort(key=lambda tj: (tj[1], tj[0]))  # every first choice, then every second
    for t, j in order:
        e = int(chosen[t, j])
        keep[t, j] = used[e] < capacity
        used[e] += int(keep[t, j])
    return keep


def _combine(case: dict, chosen: Any, weights: Any, keep: Any, sorted_order: bool = False):
    import torch

    x, k = case["x"], case["k"]
    slot_out = torch.stack(
        [case["experts"][int(e)](x[i // k]) for i, e in enumerate(chosen.flatten())]
    )
    slot_out = slot_out * (weights * keep).flatten()[:, None]
    if sorted_order:  # grouped by expert, never put back in token order
        slot_out = slot_out[torch.argsort(chosen.flatten(), stable=True)]
    return slot_out.view(*chosen.shape, -1).sum(dim=1)


def moe_mistakes(case: dict) -> dict[str, Any]:
    """The right output ("right") and each classic mistake's output, for one case."""
    k, cap, norm, num = case["k"], case["capacity"], case["normalize"], case["logits"].shape[1]
    chosen, weights = _topk(case["logits"], k, norm)
    keep = _keep(chosen, num, cap, token_major=False)
    _, flipped = _topk(case["logits"], k, not norm)
    out = {
        "right": _combine(case, chosen, weights, keep),
        "normalisation": _combine(case, chosen, flipped, keep),
        "token order": _combine(case, chosen, weights, _keep(chosen, num, cap, token_major=True)),
        "heaviest kept": _combine(
            case, chosen, weights, _keep(chosen, num, cap, token_major=False, weights=weights)
        ),
        "renormalised after the drop": _combine(
            case, chosen, weights / (weights * keep).sum(dim=1, keepdim=True).clamp_min(1e-30), keep
        ),
        "token dropped whole": _combine(
            case, chosen, weights, keep & keep.all(dim=1, keepdim=True)
        ),
        "expert order": _combine(case, chosen, weights, keep, sorted_order=True),
    }
    return out


_WHY = {
    "normalisation": lambda c: (
        "the top-k weights were not renormalised: this model divides them by their sum"
        if c["normalize"]
        else "the top-k weights were renormalised, but with normalize=False the model uses the "
        "softmax probabilities of the chosen experts as they are (as Switch Transformer does)"
    ),
    "token order": lambda c: (
        "capacity filled token by token (as Megatron-core's drop_policy='position' does), but "
        "this exercise's rule is GShard's: every token's first choice served before any second "
        "choice, so that late tokens do not lose their favourite expert to early second choices"
    ),
    "heaviest kept": lambda c: (
        "each expert kept its slots of largest weight (Megatron-core's default "
        "drop_policy='probs', a valid policy), but this exercise's rule is GShard's: first "
        "choices before second choices, each in token order"
    ),
    "renormalised after the drop": lambda c: (
        "the weights were renormalised over the slots that survived (fairscale's and "
        "DeepSpeed's top-2 gates do that), but this exercise's model, as Megatron-core, keeps "
        "the weights as routed: a dropped slot just contributes nothing"
    ),
    "token dropped whole": lambda c: (
        "a token lost all its slots when one was dropped: with top-k it keeps the others' "
        "weighted outputs; only a token whose k slots all drop is left with its residual alone"
    ),
    "expert order": lambda c: (
        "the slots' outputs were added in the order they were sorted by expert: put them back "
        "in token order (undo the sort) before adding each token's k slots"
    ),
}


def check_moe_forward(fn: Callable[..., Any]) -> Verdict:
    """`fn(x, logits, experts, k, capacity, normalize)` runs in the kernel and returns y
    [tokens, hidden]: the top-k experts of softmax(logits) per token (weights renormalised to
    sum to 1 when `normalize`), each expert keeping at most `capacity` slots (None: no limit)
    with every token's first choice served before any second choice, and y the sum over a
    token's kept slots of weight * experts[e](x[token])."""
    import torch

    for i, case in enumerate(moe_cases()):
        what = f"case {i + 1} (capacity {case['capacity']}, normalize={case['normalize']})"
        args = {n: case[n] for n in ("logits", "k", "capacity", "normalize")}
        try:
            got = fn(case["x"].clone(), experts=case["experts"], **args)
        except Exception as err:  # the learner's code: any error is an answer to explain
            return wrong(f"{what}: it raised {type(err).__name__}: {err}")
        answers = moe_mistakes(case)
        want = answers.pop("right")
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            return wrong(
                f"{what}: returned {shape}, expected a tensor of shape {tuple(want.shape)}"
            )
        if torch.allclose(got.float(), want, atol=1e-5):
            continue
        for name, out in answers.items():
            if torch.allclose(got.float(), out, atol=1e-5):
                return wrong(f"{what}: {_WHY[name](case)}")
        bad = int((got.float() - want).abs().amax(dim=1).argmax())
        return wrong(f"{what}: token {bad}'s output is not the weighted sum of its kept slots")
    return right(
        "top-k, the weights as the model defines them, first choices served first, and each "
        "token's kept slots added in token order"
    )


def solution_moe_forward() -> Any:
    return reveal("""
def moe_forward(x, logits, experts, k, capacity, normalize):
    weights, chosen = logits.softmax(dim=-1).topk(k, dim=-1)   # [T, k] each
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    keep = torch.ones_like(chosen, dtype=torch.bool)
    if capacity is not None:
        used = [0] * logits.shape[1]
        for j in range(k):                     # every first choice, then every second
            for t in range(len(x)):
                e = int(chosen[t, j])
                keep[t, j] = used[e] < capacity
                used[e] += int(keep[t, j])
    y = torch.zeros_like(x)
    for t in range(len(x)):                    # a dropped slot adds nothing; no renormalising
        for j in range(k):
            if keep[t, j]:
                y[t] += weights[t, j] * experts[int(chosen[t, j])](x[t])
    return y
""")
