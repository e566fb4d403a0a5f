"""Collectives and the links they run on: a tree all-reduce and a hierarchical all-reduce built
from torch.distributed calls (rank side; every rank of the group calls them), and the pure
arithmetic beside them: an `nvidia-smi topo -m` parser, nominal link speeds, and the
alpha-beta model per link (runs anywhere; no ranks).

**Tree all-reduce** (`tree_all_reduce`): a binomial tree rooted at rank 0. Reduce, level
k = 0, 1, ...: a rank whose lowest set bit is k sends its partial sum to rank - 2^k, which adds
it; after ceil(log2 p) levels rank 0 holds the sum. Broadcast runs the same edges backwards.
2·ceil(log2 p) sequential messages of the whole buffer, where a ring takes 2(p-1) messages of
1/p of it: fewer latencies, more bytes per step. Bytes are uneven: every rank but the root sends
n once upwards; on the way down a rank sends n to each of its children (the root has
ceil(log2 p) of them, a leaf none). NCCL's tree is a *double binary* tree, pipelined in chunks,
so its bandwidth term is close to the ring's; this one is the plain, unpipelined tree.

**Hierarchical all-reduce** (`hierarchical_all_reduce`): ranks in `nodes` groups of `per_node`
consecutive ranks. Reduce-scatter inside each node (each local rank ends with the node's sum
of 1/per_node of the buffer), all-reduce of that 1/per_node between the ranks with the same
local rank on every node (the only traffic between nodes), all-gather inside the node. Each
rank sends 2(nodes-1)/nodes · n/per_node bytes between nodes, where a flat ring sends
2(p-1)/p · n across each node boundary it crosses. NCCL runs its flat ring as several rings at
once (channels), one per NIC, so each NIC carries 2(p-1)/p · n/per_node: `channel_rings_time`
models that, and beats the unpipelined hierarchical model on large buffers.

**Alpha-beta per link**: a message of m bytes over a link costs alpha + m / bandwidth, with
bandwidth in bytes per second *per direction* (NVIDIA quotes NVLink "900 GB/s" for an H100 as
both directions together; InfiniBand NDR "400 Gb/s" is bits, per direction). A ring step is as
slow as its slowest link.

This module never imports IPython, ipywidgets or plotly.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "LEGEND",
    "LINKS",
    "Link",
    "channel_rings_time",
    "hierarchical_all_reduce",
    "hierarchical_inter_bytes",
    "hierarchical_time",
    "link_for",
    "node_groups",
    "parse_topo",
    "ring_time",
    "tree_all_reduce",
    "tree_bytes_per_rank",
    "tree_crossover_bytes",
    "tree_time",
]

# nvidia-smi topo -m's legend: what connects a pair of devices, fastest first
LEGEND = {
    "X": "the device itself",
    "NV#": "a bonded set of # NVLinks (through NVSwitch on an HGX board)",
    "PIX": "at most one PCIe bridge (one PCIe switch)",
    "PXB": "several PCIe bridges, without crossing a CPU's host bridge",
    "PHB": "PCIe and a PCIe host bridge (through the CPU)",
    "NODE": "PCIe, host bridges inside one NUMA node",
    "SYS": "PCIe and the link between NUMA nodes (QPI/UPI, Infinity Fabric): another socket",
}


@dataclass(frozen=True)
class Link:
    """A link's nominal speed, one direction, and where the number comes from."""

    name: str
    gbytes_per_s: float  # GB/s (1e9 bytes), one direction
    source: str


# nominal rates per direction, from the vendors' published figures (not measured here)
LINKS = {
    "nvlink4": Link(
        "NVLink 4 (H100/H200), per link", 25.0, "NVIDIA: 18 links, 900 GB/s both ways together"
    ),
    "nvlink3": Link("NVLink 3 (A100), per link", 25.0, "NVIDIA: 12 links, 600 GB/s both ways"),
    "pcie5": Link(
        "PCIe Gen5 x16", 64.0, "PCI-SIG: 32 GT/s x 16 lanes / 8 each way (63 after 128b/130b)"
    ),
    "pcie4": Link(
        "PCIe Gen4 x16", 32.0, "PCI-SIG: 16 GT/s x 16 lanes / 8 each way (31.5 after 128b/130b)"
    ),
    "ib_ndr": Link("InfiniBand NDR, one port", 50.0, "NVIDIA/IBTA: 400 Gb/s per direction"),
    "ib_hdr": Link("InfiniBand HDR, one port", 25.0, "NVIDIA/IBTA: 200 Gb/s per direction"),
}
_CODE = re.compile(r"^(X|NV\d+|PIX|PXB|PHB|NODE|SYS)$")


def parse_topo(text: str) -> dict[tuple[str, str], str]:
    """The GPU-to-GPU part of `nvidia-smi topo -m`'s matrix: {(GPUi, GPUj): code}, both orders.

    Pure. Columns after the devices (CPU Affinity, NUMA Affinity, GPU NUMA ID) and NIC rows and
    columns are left out; the legend below the matrix is ignored. Raises ValueError when there
    is no GPU header or a cell is not a code of the legend (X, NV#, PIX, PXB, PHB, NODE, SYS).

        parse_topo("        GPU0  GPU1  CPU Affinity\\nGPU0  X  NV18  0-55\\nGPU1  NV18  X  0-55")
        # {('GPU0', 'GPU0'): 'X', ('GPU0', 'GPU1'): 'NV18', ...}
    """
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    header = next((ln for ln in lines if ln.split() and ln.split()[0].startswith("GPU")), None)
    if header is None or not header.startswith((" ", "\t")):
        header = next((ln for ln in lines if re.match(r"^\s+GPU0\b", ln)), None)
    if header is None:
        raise ValueError("no matrix header (a line starting with spaces, then GPU0 ...)")
    columns = []
    for word in header.split():
        if not re.match(r"^(GPU|NIC|mlx)\w*$", word):
            break
        columns.append(word)
    out: dict[tuple[str, str], str] = {}
    for ln in lines:
        cells = ln.split()
        if ln is header or not cells or not re.match(r"^GPU\d+$", cells[0]):
            continue
        row, values = cells[0], cells[1 : 1 + len(columns)]
        if len(values) < len(columns):
            raise ValueError(f"row {row} has {len(values)} cells for {len(columns)} columns")
        for col, code in zip(columns, values):
            if not col.startswith("GPU"):
                continue
            if not _CODE.match(code):
                raise ValueError(f"({row}, {col}): {code!r} is not a code of the legend")
            out[(row, col)] = code
    for (a, b), code in out.items():
        if out.get((b, a), code) != code:
            raise ValueError(f"the matrix is not symmetric at ({a}, {b})")
    return out


def link_for(code: str, nvlink: Link = LINKS["nvlink4"], pcie: Link = LINKS["pcie5"]) -> float:
    """Nominal GB/s, one direction, between two GPUs joined by `code` (pure): NV# gives # times
    one NVLink's rate; anything else goes over PCIe, at best at the slot's rate (through a
    host bridge or another socket it is often less, which nominal rates cannot tell)."""
    if code == "X":
        raise ValueError("X is the device itself: no link")
    if m := re.match(r"^NV(\d+)$", code):
        return int(m.group(1)) * nvlink.gbytes_per_s
    if code in ("PIX", "PXB", "PHB", "NODE", "SYS"):
        return pcie.gbytes_per_s
    raise ValueError(f"{code!r} is not a code of the legend")


# ------------------------------------------------------------------ the alpha-beta model


def ring_time(nbytes: float, p: int, alpha: float, gbytes_per_s: float) -> float:
    """Seconds of a ring all-reduce: 2(p-1) steps of nbytes/p each, every step over the
    slowest link of the ring (alpha in s, its bandwidth in GB/s one direction)."""
    return 2 * (p - 1) * (alpha + nbytes / p / (gbytes_per_s * 1e9))


def tree_time(nbytes: float, p: int, alpha: float, gbytes_per_s: float) -> float:
    """Seconds of the unpipelined binomial tree of `tree_all_reduce`: 2·ceil(log2 p) levels,
    and in each level every receiving rank gets one message of the whole buffer, all pairs of
    the level at once (a binomial tree's root hears from its children at different levels)."""
    return 2 * math.ceil(math.log2(p)) * (alpha + nbytes / (gbytes_per_s * 1e9))


def tree_crossover_bytes(p: int, alpha: float, gbytes_per_s: float) -> float:
    """The message size where `ring_time` equals `tree_time`: below it the tree is faster.
    From 2(p-1)(a + n/(pB)) = 2L(a + n/B), L = ceil(log2 p): n = (p-1-L)·a·B / (L - (p-1)/p)."""
    levels = math.ceil(math.log2(p))
    return (p - 1 - levels) * alpha * gbytes_per_s * 1e9 / (levels - (p - 1) / p)


def hierarchical_time(
    nbytes: float, nodes: int, per_node: int, intra: tuple[float, float], inter: tuple[float, float]
) -> float:
    """Seconds of `hierarchical_all_reduce` in the model; `intra` and `inter` are (alpha s,
    GB/s one direction) of a link inside a node and of each rank's own network port. Ring
    reduce-scatter and all-gather inside the node (per_node-1 steps of n/per_node each), and a
    ring all-reduce of n/per_node between nodes, every local rank on its own port at once."""
    (a_in, b_in), (a_out, b_out) = intra, inter
    inside = 2 * (per_node - 1) * (a_in + nbytes / per_node / (b_in * 1e9))
    return inside + ring_time(nbytes / per_node, nodes, a_out, b_out)


def channel_rings_time(
    nbytes: float, nodes: int, per_node: int, intra: tuple[float, float], inter: tuple[float, float]
) -> float:
    """Seconds of a flat ring all-reduce over all nodes·per_node ranks run as per_node rings at
    once (NCCL's channels, simplified), each carrying nbytes/per_node and leaving the node
    through its own network port, so the node's NICs all work. Inside the node the rings share
    each GPU's link: each gets b_in/per_node. Every step of a ring (2(p-1) of them, n/(k·p)
    bytes each) waits for its slower hop. No pipelining across steps, no trees, no SHARP."""
    (a_in, b_in), (a_out, b_out) = intra, inter
    p, msg = nodes * per_node, nbytes / (per_node * nodes * per_node)
    step = max(a_in + msg / (b_in / per_node * 1e9), a_out + msg / (b_out * 1e9))
    return 2 * (p - 1) * step


def hierarchical_inter_bytes(nbytes: int, nodes: int, per_node: int) -> float:
    """Bytes each rank sends to other nodes in `hierarchical_all_reduce` with a ring between
    nodes: 2(nodes-1)/nodes of its 1/per_node share."""
    return 2 * (nodes - 1) / nodes * nbytes / per_node


def tree_bytes_per_rank(nbytes: int, p: int) -> dict[int, int]:
    """{rank: bytes sent} in `tree_all_reduce` of an nbytes buffer: n up (all but rank 0),
    plus n down to each child."""
    sent = {r: 0 if r == 0 else nbytes for r in range(p)}
    for child in range(1, p):
        sent[_parent(child)] += nbytes
    return sent


# ------------------------------------------------------------------ rank side


def _lowbit(r: int) -> int:
    return r & -r


def _parent(r: int) -> int:
    return r - _lowbit(r)


def tree_all_reduce(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum `tensor` over the group in place with a binomial tree (rank side; every rank of the
    group calls it). Blocking send/recv: in a tree no two ranks wait on each other."""
    ranks = dist.get_process_group_ranks(group) if group is not None else None
    p = dist.get_world_size(group)
    me = dist.get_rank(group)
    peer = (lambda i: ranks[i]) if ranks is not None else (lambda i: i)
    inbox = torch.empty_like(tensor)
    levels = math.ceil(math.log2(p)) if p > 1 else 0
    for k in range(levels):  # reduce towards position 0
        step = 1 << k
        if me % (2 * step) == step:  # lowest set bit is k: send up, then done
            dist.send(tensor, peer(me - step), group=group)
        elif me % (2 * step) == 0 and me + step < p:
            dist.recv(inbox, peer(me + step), group=group)
            tensor += inbox
    for k in reversed(range(levels)):  # broadcast, the same edges backwards
        step = 1 << k
        if me % (2 * step) == step:
            dist.recv(tensor, peer(me - step), group=group)
        elif me % (2 * step) == 0 and me + step < p:
            dist.send(tensor, peer(me + step), group=group)
    return tensor


def node_groups(nodes: int, per_node: int) -> tuple[Any, Any]:
    """(this rank's intra-node group, its inter-node group) for ranks numbered node-major
    (rank = node·per_node + local). Every rank calls it: new_group is collective and every rank
    must make every group, in the same order, even those it is not in."""
    mine = dist.get_rank()
    intra = inter = None
    for node in range(nodes):
        g = dist.new_group([node * per_node + i for i in range(per_node)])
        if mine // per_node == node:
            intra = g
    for local in range(per_node):
        g = dist.new_group([node * per_node + local for node in range(nodes)])
        if mine % per_node == local:
            inter = g
    return intra, inter


def hierarchical_all_reduce(
    tensor: torch.Tensor, intra: Any, inter: Any, *, wire: dict[str, Any] | None = None
) -> torch.Tensor:
    """Sum `tensor` over every rank in place: reduce-scatter in `intra`, all-reduce of this
    rank's 1/per_node share in `inter`, all-gather in `intra` (rank side; every rank calls it
    with its groups from `node_groups`). `tensor.numel()` must divide by the node's size.
    With `wire` (a dict) the OS's byte counters (labkit.rank.socket_bytes) are read around the
    inter-node phase alone, between barriers, into wire["inter"] = (bytes sent, received)."""
    k = dist.get_world_size(intra)
    if tensor.numel() % k:
        raise ValueError(f"numel {tensor.numel()} does not divide by the node's {k} ranks")
    flat = tensor.view(-1)
    share = torch.empty(flat.numel() // k, dtype=flat.dtype, device=flat.device)
    dist.reduce_scatter_single(share, flat, group=intra)
    if wire is None:
        dist.all_reduce(share, group=inter)
    else:
        from labkit.rank.socket_bytes import measure

        dist.barrier()  # the other phases' bytes stay out of the count
        with measure() as counted:
            dist.all_reduce(share, group=inter)
        dist.barrier()
        wire["inter"] = (counted.sent, counted.received)
    dist.all_gather_single(flat, share, group=intra)
    return tensor
