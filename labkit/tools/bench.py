"""Speed and memory of a lab, each beside a floor measured in the same run (runs in a shell).

    python -m labkit.bench [--ranks 4] [--scale 2,4,8,16] [--cells 1000] [--quick] [--json F]

The main table (4 ranks by default; targets in the last column):
- a no-op `%%ranks` cell through a real kernel, interleaved with the kernel's own no-op cell
  (the floor), median of 50 pairs back to back; target: within 1 ms of the floor. The same
  pairs with a 100 ms pause before every cell (as a person runs cells: the kernel and the ranks
  go idle), beside an echo cell paired so (below). Then, in one rotation, each after a kernel
  no-op: the `%%ranks` cell again (its ranks idle longer there), a cell magic that does nothing
  (IPython's own path for any `%%` cell: the cell turned into a call, compiled and made), a
  cell magic whose only work is an empty message to as many plain processes and back over the
  same sockets (the part of the gap that reaching the ranks costs on this machine, before any
  of labkit's work), and one that sends the same request to the ranks and reads their replies
  with none of the kernel's machinery (the part that is the ranks' work and the signing;
  `bench_kernel`): the rest is the kernel's machinery;
- where that time goes: the same `lab.run` timed inside a kernel cell (`bench_kernel`), at
  once, as `%%ranks` runs it, while the kernel's own start-of-cell messages still travel to the
  client through threads and processes that share the cores with the ranks, beside 3 ms into
  the cell, once they have gone; the CPU of a no-op `%%ranks` cell (all threads of the kernel
  process and of the ranks) beside the kernel process's for its own no-op cell: where the CPU
  a cell adds, over the cores that are left, comes to its gap, it is short of cores, not
  waiting; a no-op `lab.run` after 20 ms of quiet (as cells in a notebook come, so the ranks
  have gone idle) beside an empty message to as many idle plain processes and back over the
  same sockets (`bench_others.raw_roundtrip`), and `lab.run` back to back;
- start of the ranks, cold (a fresh process; floor: `import torch`) and with the fork server
  warm (after `%load_ext labkit`); `lab.restart()`;
- a cell with a 1M-float all_reduce, beside the same all_reduce in plain torch.distributed
  processes (the floor, `bench_others.RawAllreduce`), timed in alternating blocks so both see
  the same load (`bench_labkit.collective`); target: x1.3, and no slower than ipyparallel's;
- pull and push of 16 MiB per rank (large tensors go through /dev/shm, `labkit.wire.shm`),
  beside a copy of the same bytes in this process; target: x2.5. Pull twice: results dropped
  at once (the ranks reuse their segments) and results kept (each pull writes fresh pages);
  push after two pushes of the same size (the kernel reuses the segment the ranks let go of);
- a 1 MiB all_reduce with tracing on vs off, in an order drawn per pair of ops, beside how far
  two halves of the untraced ops alone come apart (the comparison's noise), and the time the
  traced call adds in one process alone (the wrapper's own cost); +5 %;
- the kernel's RSS growth over N `%%ranks` cells; 20 MB;
- what the time breakdown (`labkit.views.breakdown`, what `show_breakdown` shows) costs the
  kernel for a cell of 4 ranks x 2000 trace records (`--breakdown`: only that, in a second).

ipyparallel does the same (start, no-op cell, all_reduce cell, pull) in the same run when it is
installed (`pip install 'labkit[bench]'`); the output says so when it is not.

Where a cell's time goes (`bench_labkit.dispatch`): for a no-op cell back to back and after
20 ms idle, and the all_reduce cell after idle, when the first and last rank began it, the op
after the last began, the reply, the CPU per cell of the kernel's thread and of each rank, and
the least time that CPU allows when spread over every core (a no-op cell close to it is short
of cores, not waiting on anything); and what a rank spends with no cell, soon after one and
once the lab has been left alone for 2 s (its heartbeat thread then polls less often).

The scaling table: start, restart, a no-op cell (back to back, and after 20 ms idle) beside
its echo floor for as many plain processes, the all_reduce cell and pull for 2, 4, 8 and 16
ranks, with the growth from the smallest to the largest, and the floor's growth beside the
no-op cell's: on a machine with fewer cores than ranks, even processes that only echo do not
stay flat.

Every lab is timed once its fork server's one-off warm-up import is done (`settled`).
Timings on a shared machine are noisy: the load averages are printed before and after; read the
ratios, and run it twice. `--quick` (ranks 2 and 4, fewer repeats) takes about a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from labkit.tools import bench_others
from labkit.tools.bench_kernel import kernel_cells, split_text
from labkit.tools.bench_labkit import (
    IDLE_S,
    breakdown_cost,
    cold_start,
    collective,
    dispatch,
    scaling,
    trace_overhead,
)
from labkit.tools.bench_report import _ms, _table, main_rows


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.1f} {five:.1f} {fifteen:.1f} (1, 5, 15 min)"


def _breakdown_line(cost: dict[str, float]) -> str:
    return (
        f"show_breakdown's data for a cell of {cost['ranks']} ranks x "
        f"{cost['records'] // cost['ranks']} records: {_ms(cost['breakdown_s'])} in the kernel, "
        f"{_ms(cost['breakdown_cpu_s'])} of CPU (labkit.views.breakdown and its text; median of 5)"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m labkit.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--ranks", type=int, default=None, help="ranks of the main table (default 4; --ddp: 1)"
    )
    p.add_argument("--scale", default="2,4,8,16", help="rank counts of the scaling table")
    p.add_argument("--cells", type=int, default=1000, help="cells for the kernel's RSS growth")
    p.add_argument("--quick", action="store_true", help="fewer repeats, ranks 2 and 4 (~1 min)")
    p.add_argument(
        "--no-ipyparallel", action="store_true", help="skip ipyparallel even if installed"
    )
    p.add_argument(
        "--breakdown", action="store_true", help="only the time breakdown's cost (no ranks)"
    )
    p.add_argument(
        "--ddp",
        action="store_true",
        help="only a DDP step in a lab against torchrun (labkit.tools.bench_ddp)",
    )
    p.add_argument("--device", default="cpu", help="--ddp: cpu or cuda (default cpu)")
    p.add_argument("--model", default="bench", help="--ddp: bench or issue (default bench)")
    p.add_argument("--rounds", type=int, default=3, help="--ddp: alternating rounds (3)")
    p.add_argument("--steps", type=int, default=60, help="--ddp: timed steps a round (60)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.ddp:
        from labkit.tools import bench_ddp

        res = bench_ddp.ddp_ratio(args.ranks or 1, args.device, args.model, args.rounds, args.steps)
        print(bench_ddp.line(res), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        return 0
    args.ranks = args.ranks or 4
    if args.breakdown:
        print(_breakdown_line(breakdown_cost(args.ranks)))
        return 0
    n = args.ranks
    reps = 10 if args.quick else 30
    scale = [2, n] if args.quick else [int(k) for k in args.scale.split(",")]
    cells = min(args.cells, 200) if args.quick else args.cells
    t_start = time.perf_counter()
    import torch

    res: dict[str, Any] = {"ranks": n, "cpus": os.cpu_count(), "torch": torch.__version__}
    res.update(
        cells=cells, quick=args.quick, when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    )
    res["load_before"] = os.getloadavg()
    print(f"labkit benchmark: {n} CPU ranks on {os.cpu_count()} cores; {_load()}", flush=True)

    k = kernel_cells(n, cells, 20 if args.quick else 50, paced=10 if args.quick else 30)
    cold, torch_import = cold_start(n)
    rows_n = {m: scaling(m, reps) for m in sorted({*scale, n})}
    cell, raw = collective(n, 6, reps)
    echoes = {  # the no-op cell's floor for each size: back to back, and after idle
        m: (
            bench_others.raw_roundtrip(m, reps * 3, 0.0),
            bench_others.raw_roundtrip(m, reps * 3, IDLE_S),
        )
        for m in rows_n
    }
    echo = echoes[n][1]
    where = dispatch(n, reps * 3)
    ipp = None if args.no_ipyparallel else bench_others.ipyparallel_cells(n, reps, 16)
    traced = trace_overhead(n, 50 if args.quick else 200)
    res.update(kernel=k, cold_start_s=cold, torch_import_s=torch_import, scaling=rows_n)
    res.update(
        allreduce_cell_s=cell,
        raw_allreduce_s=raw,
        raw_roundtrip_s=echo,
        raw_roundtrip_by_ranks={
            m: {"back_to_back_s": e[0], "idle_s": e[1]} for m, e in echoes.items()
        },
        dispatch=where,
        ipyparallel=ipp,
    )
    res.update(traced)
    res["breakdown"] = breakdown_cost(n)
    res["load_after"] = os.getloadavg()

    head, rows = main_rows(res)
    print()
    print(_table(head, rows))
    print(
        f"traced against untraced on {n} ranks: half of the untraced ops against the other half "
        f"differ by {traced['noise'] * 100:+.1f} % in this run (the comparison's noise)"
    )
    print(split_text(k, n))
    print(_breakdown_line(res["breakdown"]))
    print(
        f"CPU per no-op cell, all threads: the kernel process {_ms(k['cpu_own_s'])} for its own, "
        f"{_ms(k['cpu_cell_s'])} for a %%ranks cell, and the {n} ranks together "
        f"{_ms(k['cpu_ranks_s'])}; {os.cpu_count()} cores"
    )
    print()
    shead = (
        "ranks",
        "start (warm)",
        "restart",
        "no-op cell",
        "echo",
        "after 20 ms idle",
        "echo after idle",
        "all_reduce cell",
        "pull 16 MiB each",
        "pull vs copy",
    )
    srows = [
        (
            str(m),
            _ms(r["start_s"]),
            _ms(r["restart_s"]),
            _ms(r["noop_s"]),
            _ms(echoes[m][0]),
            _ms(r["noop_idle_s"]),
            _ms(echoes[m][1]),
            _ms(r["allreduce_s"]),
            _ms(r["pull_s"]),
            f"x{r['pull_s'] / r['copy_s']:.2f}",
        )
        for m, r in sorted(rows_n.items())
    ]
    print(_table(shead, srows))
    print()
    dhead = (
        "cell",
        "first rank began",
        "last began",
        "op after last",
        "reply",
        "kernel CPU",
        "CPU per rank",
        f"all CPU / {os.cpu_count()} cores",
    )
    keys = (
        "first_begin_s",
        "last_begin_s",
        "op_after_last_s",
        "reply_s",
        "kernel_cpu_s",
        "rank_cpu_s",
        "cpu_bound_s",
    )
    drows = [
        (name, *(f"{d[k] * 1e3:.2f} ms" if k in d else "-" for k in keys))
        for name, d in where.items()
    ]
    print(f"where a cell's time goes ({n} ranks, lab.run; times after the kernel began lab.run):")
    print(_table(dhead, drows))
    lo, hi = min(rows_n), max(rows_n)
    floors = {"noop_s": 0, "noop_idle_s": 1}  # which echo is the floor of which no-op cell
    for key, what in (
        ("start_s", "start"),
        ("noop_s", "no-op cell"),
        ("noop_idle_s", "no-op cell after idle"),
        ("pull_s", "pull"),
    ):
        growth = rows_n[hi][key] / rows_n[lo][key]
        line = f"{what}: x{growth:.1f} from {lo} to {hi} ranks ({hi // lo}x the ranks)"
        if key in floors:
            i = floors[key]
            line += f"; its echo floor x{echoes[hi][i] / echoes[lo][i]:.1f}"
        print(line)
    print()
    print(
        "floors: `import torch` in a fresh process; the kernel's own no-op cell; the same "
        "all_reduce in plain torch.distributed processes (gloo, same threads per rank); a copy "
        "of the same bytes in this process; an empty message to as many idle plain processes "
        "and back (over the same Unix socket links). Medians; no-op cells through a real "
        "kernel are interleaved pairs, the scaling table's cells go through lab.run."
    )
    if ipp:
        print(f"ipyparallel {ipp['version']}: {n} engines started in this run.")
    else:
        why = "skipped" if args.no_ipyparallel else "not installed (pip install 'labkit[bench]')"
        print(f"ipyparallel: {why}.")
    print(
        f"torch {torch.__version__}, {os.cpu_count()} cores; {_load()} at the end; "
        f"took {time.perf_counter() - t_start:.0f} s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
