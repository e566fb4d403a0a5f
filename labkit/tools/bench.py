"""Speed and memory of a lab, each beside a floor measured in the same run (runs in a shell).

    python -m labkit.tools.bench [--ranks 4] [--cells 1000] [--json out.json]

- no-op `%%ranks` cell through a real kernel, interleaved with the kernel's own no-op cell
  (the floor), median of 50 pairs; target: within 1 ms of the floor;
- `Lab(n)` ready, cold (a fresh process, torch not yet imported; floor: `import torch`),
  target 1.6 s; and with the fork server already warm (after `%load_ext labkit`);
- `lab.restart()`, median of 5; target 0.4 s;
- `lab.pull` of 16 MB from each rank, aggregate, median of 15 (floor: a memcpy of the same
  bytes); 1.5 GB/s;
- a 1 MB all_reduce with tracing on vs off (raw torch.distributed), median of 200; +5 %;
- kernel RSS growth over N `%%ranks` cells; 20 MB.

Timings on a shared machine are noisy: read the ratios, and run it twice.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

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


def warm_start_and_restart(n: int) -> tuple[float, float]:
    import labkit
    from labkit.kernel import spawn

    spawn.prewarm()
    spawn._spare.wait_facts()  # type: ignore[union-attr]
    t0 = time.perf_counter()
    lab = labkit.Lab(n, device="cpu")
    warm = time.perf_counter() - t0
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        lab.restart()
        times.append(time.perf_counter() - t0)
    lab.stop()
    return warm, statistics.median(times)


def pull_bandwidth(n: int) -> tuple[float, float]:
    import torch

    import labkit

    lab = labkit.Lab(n, device="cpu")
    lab.run("big = torch.randn(4, 1024, 1024)")  # 16 MiB per rank
    lab.pull("big")
    times = []
    for _ in range(15):  # this VM's bandwidth swings between runs: take a median of many
        t0 = time.perf_counter()
        lab.pull("big")
        times.append(time.perf_counter() - t0)
    lab.stop()
    nbytes = n * 16 * 2**20
    src = torch.randn(n * 4, 1024, 1024)
    dst = torch.empty_like(src)
    copies = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9, nbytes / min(copies) / 1e9


TRACE_COST = """
import time, statistics
t = torch.randn(256 * 1024)  # 1 MiB
for _ in range(20):
    dist.all_reduce(t)
def timed():
    out = []
    for _ in range(200):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)
timed()
"""


def trace_overhead(n: int) -> tuple[float, float]:
    import labkit

    lab = labkit.Lab(n, device="cpu")
    on, off = [], []
    for _ in range(3):
        lab.trace(enabled=True)
        on.append(statistics.median(lab.run(TRACE_COST).values_by_rank.values()))
        lab.trace(enabled=False)
        off.append(statistics.median(lab.run(TRACE_COST).values_by_rank.values()))
    lab.stop()
    return min(on), min(off)


def kernel_cells(n: int, cells: int) -> dict[str, float]:
    """No-op cell latency and RSS growth, through a real IPython kernel."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    try:

        def run(code: str) -> float:
            t0 = time.perf_counter()
            reply = kc.execute_interactive(code, timeout=120, output_hook=lambda msg: None)
            if reply["content"]["status"] != "ok":
                raise RuntimeError(f"cell failed: {code!r}: {reply['content']}")
            return time.perf_counter() - t0

        run("%load_ext labkit")
        run(f"%lab start {n} --device cpu")
        for _ in range(20):
            run("pass")
            run("%%ranks\npass")
        pairs = [(run("pass"), run("%%ranks\npass")) for _ in range(50)]
        own = statistics.median(p[0] for p in pairs)
        ranks = statistics.median(p[1] for p in pairs)
        pid = km.provisioner.process.pid  # type: ignore[union-attr]
        rss0 = _rss(pid)
        for _ in range(cells):
            run("%%ranks\nx = rank")
        rss1 = _rss(pid)
        run("%lab stop")
        return {"own": own, "ranks": ranks, "rss_growth": rss1 - rss0}
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def _rss(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m labkit.tools.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--cells", type=int, default=1000)
    p.add_argument("--json")
    args = p.parse_args(argv)
    n = args.ranks
    rows: list[tuple[str, str, str, str, str]] = []
    res: dict[str, Any] = {"ranks": n, "cpus": os.cpu_count()}

    k = kernel_cells(n, args.cells)
    res.update(
        noop_kernel_ms=k["own"] * 1e3, noop_ranks_ms=k["ranks"] * 1e3, rss_growth_mb=k["rss_growth"]
    )
    extra = (k["ranks"] - k["own"]) * 1e3
    rows.append(
        (
            "no-op %%ranks cell",
            f"{k['ranks'] * 1e3:.2f} ms",
            f"{k['own'] * 1e3:.2f} ms (kernel no-op)",
            f"+{extra:.2f} ms",
            "+1 ms",
        )
    )
    cold, torch_import = cold_start(n)
    res.update(cold_start_s=cold, torch_import_s=torch_import)
    rows.append(
        (
            f"Lab({n}) cold",
            f"{cold:.2f} s",
            f"{torch_import:.2f} s (import torch)",
            f"x{cold / torch_import:.2f}",
            "1.6 s",
        )
    )
    warm, restart = warm_start_and_restart(n)
    res.update(warm_start_s=warm, restart_s=restart)
    rows.append((f"Lab({n}) fork server warm", f"{warm:.2f} s", "-", "-", "-"))
    rows.append(("restart()", f"{restart:.3f} s", "-", "-", "0.4 s"))
    gbps, memcpy = pull_bandwidth(n)
    res.update(pull_gbps=gbps, memcpy_gbps=memcpy)
    rows.append(
        (
            f"pull 16 MB x {n}",
            f"{gbps:.2f} GB/s",
            f"{memcpy:.2f} GB/s (memcpy)",
            f"x{gbps / memcpy:.2f}",
            "1.5 GB/s",
        )
    )
    on, off = trace_overhead(n)
    res.update(allreduce_traced_ms=on * 1e3, allreduce_raw_ms=off * 1e3)
    rows.append(
        (
            "1 MB all_reduce traced",
            f"{on * 1e3:.3f} ms",
            f"{off * 1e3:.3f} ms (raw)",
            f"{(on / off - 1) * 100:+.1f} %",
            "+5 %",
        )
    )
    rows.append(
        (f"kernel RSS over {args.cells} cells", f"{k['rss_growth']:+.1f} MB", "-", "-", "20 MB")
    )

    head = ("metric", "measured", "floor (same run)", "vs floor", "target")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(5)]
    for row in [head, tuple("-" * w for w in widths), *rows]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
    print(f"\n{n} CPU ranks on {os.cpu_count()} cores")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
