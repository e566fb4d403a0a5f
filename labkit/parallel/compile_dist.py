"""torch.compile under DDP and FSDP2: what compiles, where the graph splits (runs on the ranks;
the bucket rule is a plain function, usable anywhere).

Notebook 49 compiles a model that DDP or FSDP2 trains and reads what torch.compile handed its
backend. This module carries the three things it needs:

- **a recording backend** (`GraphRecorder`): a `torch.compile` backend that keeps every FX
  graph dynamo gives it and runs it as it is (no code generation: the same aten ops as eager,
  so the gradients can be compared to the bit). Counting what it received is how the notebook
  counts graphs and graph breaks, independently of `torch._dynamo.explain`.
- **DDP's bucket rule** (`buckets_by_size`): DDP puts the gradients into buckets in the order
  they become ready in backward (for a chain of layers: the reverse of the order the
  parameters were registered), adding tensors to the open bucket until its bytes reach the
  cap; the tensor that crosses the cap stays in it and the next one opens a new bucket. The
  first bucket has its own cap (`first_cap`) so that the first all-reduce starts early.
  DDP's reducer applies it per tensor; dynamo's DDPOptimizer applies it per op of the graph
  (all of a layer's parameters at once) and splits the graph where a bucket closes, so each
  bucket's all-reduce can start while backward goes on through the next subgraph.
- **what DDP actually made** (`ddp_buckets`): the reducer's buckets, read from DDP itself
  after its first step (DDP rebuilds its buckets in the order the first backward produced
  the gradients).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import fx, nn

__all__ = ["GraphRecorder", "buckets_by_size", "ddp_buckets", "layers_per_graph"]

MIB = 1024 * 1024


class GraphRecorder:
    """A `torch.compile` backend that records the FX graphs it is given and runs them
    unchanged (on the rank; any process). `len(recorder.graphs)` is the number of graphs
    dynamo compiled: one per graph break + 1, times DDPOptimizer's splits.

    >>> rec = GraphRecorder()
    >>> f = torch.compile(lambda x: x.sin() + 1, backend=rec)
    >>> _ = f(torch.ones(2))
    >>> len(rec.graphs)
    1
    """

    def __init__(self) -> None:
        self.graphs: list[fx.GraphModule] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        self.graphs.append(gm)
        return gm.forward

    def ops(self) -> list[list[str]]:
        """The functions each recorded graph calls, by name, in order."""
        return [
            [
                getattr(n.target, "__name__", str(n.target))
                for n in g.graph.nodes
                if n.op == "call_function"
            ]
            for g in self.graphs
        ]


def layers_per_graph(recorder: GraphRecorder) -> list[int]:
    """How many `linear` calls each recorded graph holds, in the order the graphs were
    compiled (the forward's order)."""
    return [sum(name == "linear" for name in ops) for ops in recorder.ops()]


def buckets_by_size(
    sizes: Sequence[int], cap: int, first_cap: int | None = None
) -> list[list[int]]:
    """DDP's bucket rule. `sizes`: bytes of each item (a tensor, or a layer's parameters), in
    the order the gradients become ready. Returns the items' indices, bucket by bucket, in the
    order the buckets are reduced. A bucket closes once its bytes reach its cap (`first_cap`
    for the first one, `cap` after it); the item that crosses the cap stays in it.

    >>> buckets_by_size([3, 3, 3, 3], cap=6, first_cap=3)
    [[0], [1, 2], [3]]
    """
    if cap < 1:
        raise ValueError(f"cap must be >= 1 byte, got {cap}")
    first_cap = cap if first_cap is None else first_cap
    buckets: list[list[int]] = [[]]
    filled = 0
    for i, size in enumerate(sizes):
        limit = first_cap if len(buckets) == 1 else cap
        if buckets[-1] and filled >= limit:
            buckets.append([])
            filled = 0
        buckets[-1].append(i)
        filled += size
    return buckets


def ddp_buckets(ddp: nn.parallel.DistributedDataParallel) -> list[tuple[int, list[str]]]:
    """(bytes, parameter names) of each bucket of `ddp`'s reducer, in the order they are
    reduced. Read it after the first backward: DDP starts with every gradient in one bucket
    and rebuilds them once it has seen the order the gradients became ready."""
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    out = []
    for bucket in ddp.reducer._get_zeros_like_grad_buckets():
        buffer = bucket.buffer()
        params = [names.get(id(p), "?") for p in bucket.parameters()]
        out.append((buffer.numel() * buffer.element_size(), params))
    return out
