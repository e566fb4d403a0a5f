"""The tree and hierarchical all-reduce of labkit.parallel.collective_topology against
dist.all_reduce and a sum made in one process, their bytes against the OS's counters, on 4 gloo
CPU ranks; and its pure parts (the topology parser, the alpha-beta model) against cases worked
out by hand."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from labkit.parallel import collective_topology as ct

try:
    from tests.distributed import run_ranks
except ImportError:  # tests/ itself on sys.path
    from distributed import run_ranks

N = 1 << 16  # floats: 256 KiB


def _inputs(p: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(-1000, 1000, (N,), generator=g).float() for _ in range(p)]


def _tree_and_hier(rank: int, world_size: int):
    from labkit.rank.socket_bytes import measure

    x = _inputs(world_size)[rank]
    ref = x.clone()
    dist.all_reduce(ref)
    tree = ct.tree_all_reduce(x.clone())  # warm-up: connections made outside the count
    tree = x.clone()
    dist.barrier()
    with measure() as wire:
        ct.tree_all_reduce(tree)
    dist.barrier()
    intra, inter = ct.node_groups(2, world_size // 2)
    hier, phases = x.clone(), {}
    ct.hierarchical_all_reduce(x.clone(), intra, inter)  # warm-up
    ct.hierarchical_all_reduce(hier, intra, inter, wire=phases)
    return ref, tree, hier, (wire.sent, wire.received), phases["inter"]


@pytest.mark.timeout(120)
def test_tree_and_hierarchical_equal_all_reduce_and_bytes_as_counted_by_hand():
    p = 4
    out = run_ranks(_tree_and_hier, p)
    total = torch.stack(_inputs(p)).sum(0)  # one process; integers, so exact
    nbytes = 4 * N
    # bytes sent by hand, binomial tree on 4: 0 -> {1, 2}, 2 -> 3
    by_hand = {0: 2 * nbytes, 1: nbytes, 2: 2 * nbytes, 3: nbytes}
    assert ct.tree_bytes_per_rank(nbytes, p) == by_hand
    for r, (ref, tree, hier, (sent, received), (inter_sent, _)) in enumerate(out):
        assert torch.equal(ref, total) and torch.equal(tree, total) and torch.equal(hier, total)
        # gloo adds a small header per message; a wrong tree (say a star) is off by n
        assert abs(sent - by_hand[r]) < 0.01 * nbytes, (r, sent, by_hand[r])
        assert abs(received - by_hand[r]) < 0.01 * nbytes, (r, received)
        # 2 nodes x 2: each rank sends its half (n/2) to its peer on the other node, once
        assert abs(inter_sent - nbytes / 2) < 0.01 * nbytes, (r, inter_sent)
    assert ct.hierarchical_inter_bytes(nbytes, 2, 2) == nbytes / 2


def _tree_odd(rank: int, world_size: int):
    x = torch.full((6,), float(rank + 1))
    return ct.tree_all_reduce(x)


@pytest.mark.timeout(60)
def test_tree_on_three_ranks():
    for t in run_ranks(_tree_odd, 3):
        assert torch.equal(t, torch.full((6,), 6.0))


TOPO = """\
        GPU0    GPU1    GPU2    NIC0    CPU Affinity    NUMA Affinity   GPU NUMA ID
GPU0     X      NV4     SYS     PIX     0-15            0               N/A
GPU1    NV4      X      SYS     PXB     0-15            0               N/A
GPU2    SYS     SYS      X      SYS     16-31           1               N/A
NIC0    PIX     PXB     SYS      X

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes
"""


@pytest.mark.timeout(10)
def test_parse_topo_keeps_gpu_pairs():
    m = ct.parse_topo(TOPO)
    assert m[("GPU0", "GPU1")] == m[("GPU1", "GPU0")] == "NV4"
    assert m[("GPU2", "GPU0")] == "SYS" and m[("GPU1", "GPU1")] == "X"
    assert len(m) == 9  # 3 x 3: no NIC, no affinity column
    one = ct.parse_topo("        GPU0    CPU Affinity    NUMA Affinity\nGPU0     X      0-15   0\n")
    assert one == {("GPU0", "GPU0"): "X"}
    with pytest.raises(ValueError):
        ct.parse_topo(TOPO.replace("NV4     SYS     PIX", "NVX     SYS     PIX"))
    with pytest.raises(ValueError):
        ct.parse_topo("no matrix here")
    tabs = "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV18\t0-55\nGPU1\tNV18\t X \t0-55\n"
    assert ct.parse_topo(tabs)[("GPU1", "GPU0")] == "NV18"  # nvidia-smi separates with tabs


@pytest.mark.timeout(10)
def test_link_speeds_and_model_by_hand():
    assert ct.link_for("NV18") == 450.0  # H100: 18 x 25 GB/s each way = 900 both ways
    assert ct.link_for("SYS") == 64.0
    with pytest.raises(ValueError):
        ct.link_for("X")
    with pytest.raises(ValueError):
        ct.link_for("NVX")
    # 1 GB over 16 ranks at 50 GB/s, no latency: 30 steps of 62.5 MB at 50 GB/s = 37.5 ms
    assert ct.ring_time(1e9, 16, 0.0, 50.0) == pytest.approx(0.0375)
    # the tree on 4 ranks: 4 levels of 1 MB at 1 GB/s, plus 4 alphas of 1 us
    assert ct.tree_time(1e6, 4, 1e-6, 1.0) == pytest.approx(4 * (1e-6 + 1e-3))
    # crossover on 4 ranks: (3 - 2) a B / (2 - 0.75) = 0.8 a B; with a = 1e-5 s, B = 1 GB/s
    n = ct.tree_crossover_bytes(4, 1e-5, 1.0)
    assert n == pytest.approx(8000.0)
    assert ct.ring_time(n, 4, 1e-5, 1.0) == pytest.approx(ct.tree_time(n, 4, 1e-5, 1.0))
    # hierarchical 2 nodes x 2, no latency, 1 GB: inside 2 x 0.5 GB at 100 GB/s = 10 ms,
    # between nodes a 2-rank ring of 0.5 GB at 10 GB/s: 2 steps of 0.25 GB = 50 ms
    t = ct.hierarchical_time(1e9, 2, 2, (0.0, 100.0), (0.0, 10.0))
    assert t == pytest.approx(0.06)


@pytest.mark.timeout(10)
def test_channel_rings_by_hand():
    # 2 nodes x 2, 1 GB, no latency: 2 rings of 0.5 GB over 4 ranks, 6 steps of 125 MB each;
    # inside, each ring gets 100/2 = 50 GB/s, between nodes 10 GB/s: 6 x 12.5 ms = 75 ms
    t = ct.channel_rings_time(1e9, 2, 2, (0.0, 100.0), (0.0, 10.0))
    assert t == pytest.approx(0.075)
    # against one ring through one 10 GB/s port: 6 steps of 250 MB = 150 ms, twice as long
    assert ct.ring_time(1e9, 4, 0.0, 10.0) == pytest.approx(2 * t)
    # the slower hop sets the step: with NVLink shared 8 ways below the NIC, NVLink decides
    assert ct.channel_rings_time(1.6e9, 2, 8, (0.0, 80.0), (0.0, 50.0)) == pytest.approx(
        30 * 1.6e9 / 128 / 10e9
    )
    # latency only: 2(p-1) steps, each paying the larger alpha
    assert ct.channel_rings_time(0, 2, 8, (1e-6, 450.0), (5e-6, 50.0)) == pytest.approx(30 * 5e-6)
