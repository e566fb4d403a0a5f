"""labkit's own figures for the benchmark: start, cells, pull and push and tracing's cost, each
timed through labkit (runs in a shell, from `labkit.tools.bench`; cells through a real Jupyter
kernel: `labkit.tools.bench_kernel`)."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from typing import Any

from labkit.rank.side import DROWSY_AFTER_S
from labkit.tools import bench_others

IDLE_S = 0.02  # the quiet before each "after idle" no-op cell


def settled(lab: Any) -> Any:
    """`lab`, once its fork server's one-off warm-up import (torch._dynamo, 1-2 s of a core,
    soon after a start) is done: timings taken during it measure the import, not the lab."""
    if lab.server is not None:
        lab.server.wait_warm()
    return lab


COLD = """
import time, sys
t0 = time.perf_counter()
import labkit
lab = labkit.Lab({n}, device="cpu")
t1 = time.perf_counter()
lab.run("1")
print(t1 - t0)
lab.stop()
"""


def _fresh(code: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, LABKIT_PREWARM="0"),
    )
    return float(out.stdout.strip().splitlines()[-1])


def cold_start(n: int) -> tuple[float, float]:
    torch_import = min(
        _fresh("import time; t=time.perf_counter(); import torch; print(time.perf_counter()-t)")
        for _ in range(2)
    )
    lab_cold = min(_fresh(COLD.format(n=n)) for _ in range(2))
    return lab_cold, torch_import


def _median_after_idle(fn: Any, k: int, idle: float) -> float:
    """Median seconds of `fn()`, each call after `idle` s of quiet (the sleep is not timed)."""
    times = []
    for _ in range(k):
        time.sleep(idle)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _median_time(fn: Any, k: int) -> float:
    times = []
    for _ in range(k):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_floor(nbytes: int) -> float:
    """Median seconds of a plain copy of `nbytes` in this process (the pull and push floor)."""
    import torch

    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return _median_time(lambda: dst.copy_(src), 7)


def scaling(n: int, reps: int) -> dict[str, float]:
    """One lab of `n` ranks, the fork server warm: start, restart, a no-op cell (lab.run, not
    through a kernel), a 1M-float all_reduce cell, and pull / push of 16 MiB per rank."""
    import torch

    import labkit
    from labkit.kernel.launch import spawn

    spawn.prewarm()
    spawn._spare.wait_facts()  # type: ignore[union-attr]
    t0 = time.perf_counter()
    lab = labkit.Lab(n, device="cpu")
    start = time.perf_counter() - t0
    settled(lab)
    try:
        restart = _median_time(lab.restart, max(2, reps // 10))
        lab.run("pass")
        noop = _median_time(lambda: lab.run("pass"), reps)
        noop_idle = _median_after_idle(lambda: lab.run("pass"), reps, IDLE_S)
        lab.run(f"t = torch.randn({bench_others.NUMEL}); big = torch.randn(4, 1024, 1024)")
        lab.run("dist.all_reduce(t)")
        allreduce = _median_time(lambda: lab.run("dist.all_reduce(t)"), reps)
        lab.pull("big")
        pull = _median_time(lambda: lab.pull("big"), max(3, reps // 4))
        kept: list[Any] = []  # pulls whose results the kernel keeps: fresh segments each time
        pull_kept = _median_time(lambda: kept.append(lab.pull("big")), 3)
        kept.clear()
        x = torch.randn(4, 1024, 1024)
        lab.push(x=x)  # two pushes first, as pull's first one: then each push rewrites the
        lab.push(x=x)  # segment the ranks let go of when the last one replaced x (shm.Shared)
        push = _median_time(lambda: lab.push(x=x), max(3, reps // 4))
    finally:
        lab.stop()
    return {
        "start_s": start,
        "restart_s": restart,
        "noop_s": noop,
        "noop_idle_s": noop_idle,
        "allreduce_s": allreduce,
        "pull_s": pull,
        "pull_kept_s": pull_kept,
        "push_s": push,
        "copy_s": copy_floor(n * 16 * 2**20),
    }


def collective(n: int, blocks: int, reps: int) -> tuple[float, float]:
    """Medians of the 1M-float all_reduce cell (`lab.run`, back to back) and of the same
    all_reduce in plain torch.distributed processes, timed in `blocks` alternating blocks of
    `reps`, so a change in the machine's load falls on both (the idle side blocks in a read)."""
    import labkit

    cell, raw = [], []
    lab = settled(labkit.Lab(n, device="cpu"))
    try:
        with bench_others.RawAllreduce(n) as plain:
            lab.run(f"t = torch.randn({bench_others.NUMEL})\ndist.all_reduce(t)")
            for _ in range(blocks):
                raw += plain.times(reps)
                for _ in range(reps):
                    t0 = time.perf_counter()
                    lab.run("dist.all_reduce(t)")
                    cell.append(time.perf_counter() - t0)
    finally:
        lab.stop()
    return statistics.median(cell), statistics.median(raw)


TRACE_COST = """
import time, statistics, random
from labkit.rank import trace as _trace  # the switch `lab.trace(enabled=...)` sets on each rank
t = torch.randn(256 * 1024)  # 1 MiB
for _ in range(20):
    dist.all_reduce(t)
def timed(seed):
    was, times, order = _trace.STATE.enabled, {True: [], False: []}, random.Random(seed)
    for i in range({reps}):  # traced and untraced in turn, which first drawn by a seed all share
        first = order.random() < 0.5
        for on in (first, not first):
            _trace.set_enabled(on)
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times[on].append(time.perf_counter() - t0)
    _trace.set_enabled(was)
    off = times[False]
    return (statistics.median(times[True]), statistics.median(off),
            statistics.median(off[0::2]) / statistics.median(off[1::2]))
"""

WRAPPER_COST = """
import statistics, threading, time, torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from labkit.rank import trace
from labkit.rank.trace_state import STATE
trace.install()
STATE.main, STATE.rank, STATE.cell = threading.get_ident(), 0, 1
t = torch.randn(256 * 1024)
def block(on, k=200):
    trace.set_enabled(on)
    t0 = time.perf_counter()
    for _ in range(k):
        dist.all_reduce(t)
    took = (time.perf_counter() - t0) / k
    STATE.records.clear()
    return took
block(True), block(False)
print(statistics.median(block(True) - block(False) for _ in range({blocks})))
dist.destroy_process_group()
"""


def trace_overhead(n: int, reps: int) -> dict[str, float]:
    """What tracing costs a 1 MiB all_reduce on `n` ranks: `traced_s` and `untraced_s`, the
    medians (over ranks, then over 3 cells of `reps` pairs, traced and untraced in an order
    drawn per pair, so a drift in load falls on both); `noise`, how far apart the medians of
    two halves of the untraced ops alone came (interleaved: even and odd pairs); and
    `wrapper_s`, the time the traced call adds, in one process alone (no peers to wait for:
    the wrapper's own cost, alternating blocks of 200 calls)."""
    import labkit

    lab = settled(labkit.Lab(n, device="cpu"))
    try:
        lab.run(TRACE_COST.replace("{reps}", str(reps)))
        cells = [lab.run(f"timed({seed})").values_by_rank.values() for seed in range(3)]
    finally:
        lab.stop()
    per_cell = [[statistics.median(v[i] for v in cell) for cell in cells] for i in range(3)]
    wrapper = _fresh(WRAPPER_COST.replace("{blocks}", str(max(5, reps // 10))))
    return {
        "traced_s": statistics.median(per_cell[0]),
        "untraced_s": statistics.median(per_cell[1]),
        "noise": statistics.median(per_cell[2]) - 1,
        "wrapper_s": wrapper,
    }


STAMPED = {  # a cell that returns when it began and ended on the rank (one clock per machine)
    "no-op": "_began = time.monotonic()\n(_began, time.monotonic())",
    "all_reduce": "_began = time.monotonic()\ndist.all_reduce(t)\n(_began, time.monotonic())",
}


def idle_cpu(lab: Any, seconds: float) -> float:
    """CPU seconds per second a rank of `lab` uses with no cell running (its threads'
    wake-ups: gloo's transport loop, labkit's heartbeat; median of the ranks)."""
    before = lab.run("time.process_time()").values_by_rank
    t0 = time.monotonic()
    time.sleep(seconds)
    after = lab.run("time.process_time()").values_by_rank
    wall = time.monotonic() - t0
    return statistics.median((after[r] - before[r]) / wall for r in before)


def dispatch(n: int, reps: int) -> dict[str, dict[str, float]]:
    """Where a cell's time goes, on `n` ranks: for a no-op cell (back to back, and after
    IDLE_S of quiet) and the all_reduce cell (after quiet), medians over `reps` cells of: when
    the first and the last rank began the cell (after the kernel began `lab.run`), how long the
    op ran after the last rank began it, the reply (last rank's end to `lab.run` returning), the
    CPU each cell cost the kernel's thread and each rank's process (all its threads), and the
    least wall time that CPU allows on this machine's cores (`cpu_bound_s`: a cell slower than
    it is waiting, one close to it is short of cores). Two more rows, with `rank_cpu_s` only:
    what a rank spends in IDLE_S with no cell, soon after one and once the lab is left alone."""
    import labkit

    lab = settled(labkit.Lab(n, device="cpu"))
    out: dict[str, dict[str, float]] = {}
    try:
        lab.run(f"import time\nt = torch.randn({bench_others.NUMEL})\ndist.all_reduce(t)")
        quiet = idle_cpu(lab, reps * IDLE_S)
        out["no cell (the ranks idle)"] = {"rank_cpu_s": quiet * IDLE_S}
        for name, idle, what in (
            ("no-op, back to back", 0.0, "no-op"),
            (f"no-op, after {IDLE_S * 1e3:.0f} ms idle", IDLE_S, "no-op"),
            (f"all_reduce, after {IDLE_S * 1e3:.0f} ms idle", IDLE_S, "all_reduce"),
        ):
            rows, cpu0 = [], lab.run("time.process_time()").values_by_rank
            kernel_cpu = 0.0
            for _ in range(reps):
                time.sleep(idle)
                c0, k0 = time.thread_time(), time.monotonic()
                got = lab.run(STAMPED[what]).values_by_rank  # (began, ended) per rank
                k1 = time.monotonic()
                kernel_cpu += time.thread_time() - c0
                begins = sorted(v[0] for v in got.values())
                ends = [v[1] for v in got.values()]
                rows.append(
                    (begins[0] - k0, begins[-1] - k0, max(ends) - begins[-1], k1 - max(ends))
                )
            cpu1 = lab.run("time.process_time()").values_by_rank
            med = [statistics.median(r[i] for r in rows) for i in range(4)]
            rank_cpu = statistics.median((cpu1[r] - cpu0[r]) / (reps + 1) for r in cpu0)
            out[name] = {
                "first_begin_s": med[0],
                "last_begin_s": med[1],
                "op_after_last_s": med[2],
                "reply_s": med[3],
                "kernel_cpu_s": kernel_cpu / reps,
                "rank_cpu_s": rank_cpu,
                # the least wall time this CPU allows, all of it spread over every core: what
                # the cell itself cost (the ranks' CPU of the quiet before it taken out)
                "cpu_bound_s": (kernel_cpu / reps + n * max(0.0, rank_cpu - idle * quiet))
                / (os.cpu_count() or 1),
            }
        time.sleep(DROWSY_AFTER_S + 0.5)  # a lab left alone: its ranks poll less often
        left_alone = f"no cell for {DROWSY_AFTER_S:.0f} s or more"
        out[left_alone] = {"rank_cpu_s": idle_cpu(lab, 5.0) * IDLE_S}
    finally:
        lab.stop()
    return out


def cell_records(ranks: int = 4, per_rank: int = 2000, seed: int = 0) -> list[Any]:
    """A long cell's trace: per rank and step a forward and a backward span, an async
    all_reduce issued during the backward pass and a blocking one after it (4 records a step),
    each rank a little late now and then, as in a DDP step."""
    import random

    from labkit.wire.records import CommRecord, SpanRecord

    rng = random.Random(seed)
    group = tuple(range(ranks))
    out: list[Any] = []
    for step in range(per_rank // 4):
        t = step * 0.01
        for r in range(ranks):
            late = rng.uniform(0, 0.002)
            out.append(SpanRecord(rank=r, name="forward", start=t, end=t + 0.003 + late))
            out.append(SpanRecord(rank=r, name="backward", start=t + 0.004, end=t + 0.007))
            out.append(
                CommRecord(
                    rank=r,
                    op="all_reduce",
                    seq=2 * step + 1,
                    group=group,
                    start=t + 0.005 + late,
                    end=t + 0.008,
                    async_op=True,
                )
            )
            out.append(CommRecord(rank=r, op="all_reduce", seq=2 * step + 2, group=group,
                                  start=t + 0.008 + late / 2, end=t + 0.0095))  # fmt: skip
    return out


def breakdown_cost(ranks: int = 4, per_rank: int = 2000, reps: int = 5) -> dict[str, float]:
    """What `labkit.views.breakdown` (and its text) costs in the kernel for one cell of
    `ranks` x `per_rank` records: the median of `reps` runs, in seconds, wall and CPU (the
    CPU time of this process: on a loaded machine the wall time also holds waiting for a core)."""
    from labkit.views.breakdown_data import breakdown

    records = cell_records(ranks, per_rank)
    took, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        assert breakdown(records).text  # the table too, as the view shows it
        took.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {
        "breakdown_s": statistics.median(took),
        "breakdown_cpu_s": statistics.median(cpu),
        "records": len(records),
        "ranks": ranks,
    }
