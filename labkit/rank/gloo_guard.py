"""A clear error where gloo would crash a rank: point-to-point calls on CUDA tensors (rank side).

gloo's `send`/`recv` (and `isend`/`irecv`, and `batch_isend_irecv`, which calls them) hand the
tensor's address to gloo's TCP transport, which reads and writes host memory only. A CUDA
tensor's address is on the GPU: the transport fails (`writev ... Bad address`), often on one of
gloo's own threads, which aborts the rank, and its peer then waits on a connection that closed.
Ranks share a GPU over gloo (labkit.kernel.launch.policy: more ranks than GPUs, `device="cuda"`), so
`refuse_cuda_over_gloo` turns that call into a RuntimeError on the rank that made it, saying what
to do, before gloo sees it. labkit.rank.dist_tracing calls it for these ops, tracing on or off.
Seen on an H200 with torch 2.11 (docs/gpu.md, "GPU runs on record").
"""

from __future__ import annotations

from typing import Any

P2P = frozenset({"send", "recv", "isend", "irecv"})


def refuse_cuda_over_gloo(op: str, tensor: Any, group: Any) -> None:
    """Raise RuntimeError if `op` would move a CUDA `tensor` over a gloo `group` (None: the
    default group); return quietly otherwise, also when the backend cannot be read."""
    if not getattr(tensor, "is_cuda", False):
        return
    import torch.distributed as dist

    try:
        backend = dist.get_backend(group)
    except Exception:  # noqa: BLE001 - no group yet, or not this rank's: torch says so itself
        return
    if str(backend).lower() != "gloo":
        return
    raise RuntimeError(
        f"dist.{op} of a CUDA tensor ({tensor.device}) over gloo: gloo's point-to-point calls "
        "move host memory only, and this one would fail inside gloo or abort the rank. These "
        "ranks share a GPU, so they talk over gloo: send `t.cpu()` and move what arrives back "
        "with `.to(device)`, or give each rank a GPU of its own (NCCL)"
    )
