"""The benchmark's comparisons outside labkit (runs in a shell, from `labkit.tools.bench`).

- `RawAllreduce`: the same all_reduce in plain torch.distributed processes
  (gloo, the thread budget labkit gives its ranks), timed inside the processes: the floor of a
  collective cell, measured in blocks interleaved with labkit's (`bench_labkit.collective`);
- `EchoGroup`, `raw_roundtrip`: an empty message to `n` idle plain Python processes and back,
  over the same sockets as a forked lab's ctrl links (labkit.kernel.channel.direct and
  labkit.rank.link, with no signing, no pickling and no torch): the floor of a no-op cell once
  the processes have gone idle (`bench_kernel` also times it from a kernel cell);
- `ipyparallel_cells`: ipyparallel's engines doing the same work from the same process
  (start, a no-op cell, the collective cell, a pull), when ipyparallel is installed
  (`pip install labkit[bench]`); None when it is not.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any

from labkit.kernel.launch.policy import threads_per_rank

NUMEL = 1 << 20  # a 1M-float (4 MiB) all_reduce

RAW = textwrap.dedent("""
    import json, sys, time, torch, torch.distributed as dist
    rank, n, port, threads = (int(a) for a in sys.argv[1:5])
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=n)
    t = torch.randn(NUMEL)
    for _ in range(5):
        dist.all_reduce(t)
    for line in sys.stdin:  # a number of repeats to time, or 0 to leave
        reps = int(line)
        if reps == 0:
            break
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        # the op ends when its slowest rank's ends: take each rep's maximum over the ranks
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(json.dumps(slowest.tolist()), flush=True)
    dist.destroy_process_group()
""").replace("NUMEL", str(NUMEL))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reap(procs: list[subprocess.Popen[Any]], timeout: float) -> None:
    """Wait for our own children, each for up to `timeout` s, then kill it by its handle."""
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class RawAllreduce:
    """`n` plain torch.distributed processes (gloo, the thread budget labkit gives its ranks)
    that time the same 1M-float all_reduce when asked, so its floor can be measured in blocks
    interleaved with labkit's cells: both then see the same machine. Use with `with`."""

    def __init__(self, n: int):
        threads = threads_per_rank(os.cpu_count(), n) or 1
        port = free_port()
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-c", RAW, *map(str, (r, n, port, threads))],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for r in range(n)
        ]

    def times(self, reps: int) -> list[float]:
        """Seconds of `reps` all_reduces, each its slowest rank's."""
        for p in self.procs:
            p.stdin.write(f"{reps}\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        line = self.procs[0].stdout.readline()  # type: ignore[union-attr]
        if not line:
            codes = [p.poll() for p in self.procs]
            raise RuntimeError(f"the raw torch.distributed processes failed (exit codes {codes})")
        return json.loads(line)

    def __enter__(self) -> RawAllreduce:
        return self

    def __exit__(self, *exc: Any) -> None:
        for p in self.procs:
            try:
                p.stdin.write("0\n")  # type: ignore[union-attr]
                p.stdin.close()  # type: ignore[union-attr]
            except OSError:
                pass
        reap(self.procs, 30)
        for p in self.procs:
            p.stdout.close()  # type: ignore[union-attr]


ECHO = textwrap.dedent("""
    import sys
    from labkit.rank.link import CtrlLink
    sock = CtrlLink(sys.argv[1])
    sock.send_multipart([b"hello"])
    while (msg := sock.recv_multipart()) != [b"exit"]:
        sock.send_multipart(msg)
""")


class EchoGroup:
    """`n` idle plain Python processes that echo each message over the same sockets as a
    forked lab's ctrl links (labkit.kernel.channel.direct and labkit.rank.link): no torch, no
    signing, no pickling, no Python work per message beyond the framing's. `roundtrip()` sends an
    empty message to each and waits for every echo: the floor of a no-op cell on `n` processes.
    `close()` (or `with`) ends them and waits for them; a process whose link closes (the
    process that holds the group died) leaves by itself."""

    def __init__(self, n: int):
        from labkit.kernel.channel.direct import DirectRouter

        self.tmp = tempfile.mkdtemp(prefix="labkit-bench-")
        self.router = DirectRouter(os.path.join(self.tmp, "echo"))
        self.procs: list[subprocess.Popen[bytes]] = []
        self.ids: list[bytes] = []
        self.trips = 0
        try:
            for _ in range(n):
                self.procs.append(
                    subprocess.Popen([sys.executable, "-c", ECHO, self.router.endpoint])
                )
            for _ in range(n):
                if not self.router.poll(120_000):
                    raise RuntimeError("the echo processes did not start in 120 s")
                self.ids.append(self.router.recv_multipart()[0])
        except BaseException:
            self.close()
            raise

    def roundtrip(self) -> None:
        for ident in self.ids:
            self.router.send_multipart([ident, b""])
        for _ in self.ids:
            self.router.recv_multipart()
        self.trips += 1

    def close(self) -> None:
        for ident in self.ids:
            self.router.send_multipart([ident, b"exit"])
        reap(self.procs, 10)
        self.router.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> EchoGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def raw_roundtrip(n: int, reps: int, idle: float) -> float:
    """Median seconds of an `EchoGroup` round trip to `n` processes, each time after `idle`
    seconds of quiet."""
    with EchoGroup(n) as group:
        times = []
        for _ in range(reps):
            time.sleep(idle)
            t0 = time.perf_counter()
            group.roundtrip()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ipyparallel_cells(n: int, reps: int, pull_mb: int) -> dict[str, Any] | None:
    """Start `n` ipyparallel engines and time what labkit's table times, or None."""
    try:
        import ipyparallel as ipp
    except ImportError:
        return None
    threads = threads_per_rank(os.cpu_count(), n) or 1
    t0 = time.perf_counter()
    cluster = ipp.Cluster(n=n, log_level=40)
    rc = cluster.start_and_connect_sync()
    try:
        rc.wait_for_engines(n, timeout=300)
        view = rc[:]
        view.execute("import torch", block=True)
        start = time.perf_counter() - t0
        port = free_port()
        view.scatter("rank", list(range(n)), flatten=True, block=True)
        view.execute(
            f"import torch.distributed as dist; torch.set_num_threads({threads})\n"
            f"dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{port}', "
            f"rank=rank, world_size={n})\n"
            f"t = torch.randn({NUMEL}); big = torch.randn({pull_mb} * 2**18)",
            block=True,
        )

        def median(code: str, k: int) -> float:
            view.execute(code, block=True)
            times = []
            for _ in range(k):
                t1 = time.perf_counter()
                view.execute(code, block=True)
                times.append(time.perf_counter() - t1)
            return statistics.median(times)

        noop = median("pass", reps)
        allreduce = median("dist.all_reduce(t)", reps)
        view.pull("big", block=True)
        pulls = []
        for _ in range(max(3, reps // 6)):
            t1 = time.perf_counter()
            view.pull("big", block=True)
            pulls.append(time.perf_counter() - t1)
        view.execute("dist.destroy_process_group()", block=True)
        return {
            "version": ipp.__version__,
            "start_s": start,
            "noop_s": noop,
            "allreduce_s": allreduce,
            "pull_s": statistics.median(pulls),
        }
    finally:
        rc.close()
        cluster.stop_cluster_sync()
