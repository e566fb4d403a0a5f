"""The benchmark's cells through a real Jupyter kernel (runs in a shell, from
`labkit.tools.bench`): a no-op `%%ranks` cell beside the kernel's own no-op cell, where its time
goes, and the kernel's memory over many cells.

The target's figure: interleaved pairs of the kernel's own no-op cell and a no-op `%%ranks`
cell, back to back, nothing else between them (the ranks idle for the one plain cell between
two of theirs). The same pairs with a pause before every cell (`pause_s`, as a person runs
cells), beside an echo cell paired the same way: how the gap and its floor look once the
kernel and the ranks have gone idle.

Where the time goes: each of these cells after a kernel no-op, in one rotation with the
`%%ranks` cell (so the ranks idle longer between two of their cells than in the pairs above,
and the gap there is larger):
- a cell magic that does nothing (`NOTHING_SETUP`): what IPython's own path for a cell magic
  costs over a plain cell (turning the cell into a call, compiling and making it), which any
  `%%` cell pays before its magic runs;
- a cell magic that does nothing but send an empty message to as many plain processes and wait
  for their echoes, over the same sockets (`bench_others.EchoGroup`): what reaching the ranks
  and back from a cell costs on this machine before any of labkit's work; and one that sends
  the `%%ranks` cell's request to the ranks and reads their replies with none of the kernel's
  machinery around it (`BARE_SETUP`): between the four, the gap splits into IPython's
  cell-magic path, the transport, the ranks' work with the signing, and the kernel's machinery
  (each of these magics, as `%%ranks`, skips IPython's expansion of the magic's line:
  `no_var_expand`);
- `lab.run` timed inside a cell, at once (as `%%ranks` runs it, while the kernel's own
  start-of-cell messages, `status: busy` and `execute_input`, are still on their way to the
  client through threads and processes that share the cores with the ranks) and `later_s` into
  the cell, once they are gone;
- the CPU of each cell, all threads (Linux's /proc/<pid>/task/*/schedstat): the kernel
  process's for its own no-op cell and for a `%%ranks` no-op cell, and the ranks' together for
  the latter. Beside the cores, it says whether a cell waits or is short of them.
"""

from __future__ import annotations

import ast
import os
import statistics
import time
from typing import Any

INSIDE = (
    "_t0 = _bench_t.perf_counter(); lab.run('pass'); "
    "_bench['{key}'].append(_bench_t.perf_counter() - _t0)"
)
INSIDE_LATER_S = 0.003
PAUSE_S = 0.1  # before each cell of the paced pairs: long enough for every process to go idle
# the floor of a no-op cell on n processes from this kernel: a cell magic whose only work is a
# round trip to n idle echo processes over the ctrl links' sockets
ECHO_SETUP = """
from IPython.core.magic import no_var_expand as _bench_nve
from labkit.tools.bench_others import EchoGroup as _EchoGroup
_bench_echo = _EchoGroup({n})
@_bench_nve
def _bench_echo_magic(line, cell):
    _bench_echo.roundtrip()
get_ipython().register_magic_function(_bench_echo_magic, "cell", "bench_echo")
"""
# IPython's own cost of a cell magic: one that only counts its calls
NOTHING_SETUP = """
from IPython.core.magic import no_var_expand as _bench_nve
_bench_nothing_calls = [0]
@_bench_nve
def _bench_nothing(line, cell):
    _bench_nothing_calls[0] += 1
get_ipython().register_magic_function(_bench_nothing, "cell", "bench_nothing")
"""
# the same cell on labkit's ranks, signed both ways, with none of the kernel's machinery (no
# magic's parsing, Lab.run, CellRun, waiting loop or results): the request encoded once and
# written to each rank's direct link, then replies read until every rank's `done` came
BARE_SETUP = """
import time as _bench_bt
from IPython.core.magic import no_var_expand as _bench_nve
_bench_bare_trips = [0]
@_bench_nve
def _bench_bare(line, cell, lab=lab):
    channel, router = lab.channel, lab.channel.ctrl
    lab._cell += 1
    cell_id = lab._cell
    frames = channel.codec.encode({"type": "exec", "id": cell_id, "display": True, "code": cell})
    for r in range(lab.world_size):
        router.send_multipart([channel.routes[r], *frames])
    left, deadline = lab.world_size, _bench_bt.monotonic() + 60
    while left:
        if not router.poll(1000):
            if _bench_bt.monotonic() > deadline:
                raise RuntimeError("the ranks did not all answer a bare cell in 60 s")
            continue
        msg = channel.codec.decode(router.recv_multipart()[1:])
        if msg.get("type") == "done" and msg.get("id") == cell_id:
            left -= 1
    _bench_bare_trips[0] += 1
get_ipython().register_magic_function(_bench_bare, "cell", "bench_bare")
"""


def kernel_cells(
    n: int,
    cells: int,
    pairs: int,
    later_s: float = INSIDE_LATER_S,
    paced: int = 0,
    pause_s: float = PAUSE_S,
) -> dict[str, float]:
    """Medians of `pairs` interleaved pairs of the kernel's own no-op cell (`own`) and a no-op
    `%%ranks` cell (`ranks`), back to back: the target's figure. With a pause of `pause_s`
    before every cell, `paced` pairs of each of these, in turn: a kernel no-op and `%%ranks`
    (`paced_own`, `paced_ranks`), and a kernel no-op and `%%bench_echo` (`paced_echo_own`,
    `paced_echo`). In one rotation of `pairs` rounds, each after a kernel no-op (`rot_own`):
    `%%ranks` (`rot_ranks`), `%%bench_nothing` (`magic`: a cell magic that does nothing,
    `NOTHING_SETUP`), `%%bench_bare` (`bare`: the same request to the same ranks with none of
    the kernel's machinery, `BARE_SETUP`) and `%%bench_echo` (`echo`: a round trip to `n` plain
    echo processes, `bench_others.EchoGroup`). `bare_trips` and `echo_trips` count the round
    trips their magics made, `magic_calls` the calls of the one that does nothing; `lab.run`
    inside a cell (`_inside_cells`); CPU per cell (`_cpu_per_cell`); the kernel's RSS growth
    over `cells` `%%ranks` cells, in MB."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    try:

        def run(code: str) -> float:
            t0 = time.perf_counter()
            reply = kc.execute_interactive(code, timeout=120, output_hook=lambda msg: None)
            if reply["content"]["status"] != "ok":
                raise RuntimeError(f"cell failed: {code!r}: {reply['content']}")
            return time.perf_counter() - t0

        def after_pause(code: str) -> float:
            time.sleep(pause_s)
            return run(code)

        run("%load_ext labkit")
        run(f"%lab start {n} --device cpu")
        run("lab.server.wait_warm()")
        run(ECHO_SETUP.format(n=n))
        run(BARE_SETUP)
        run(NOTHING_SETUP)
        kinds = ("%%ranks", "%%bench_bare", "%%bench_echo", "%%bench_nothing")
        for _ in range(20):
            for kind in kinds:
                run("pass")
                run(f"{kind}\npass")
        timed = [(run("pass"), run("%%ranks\npass")) for _ in range(pairs)]
        own, ranks = (statistics.median(p[i] for p in timed) for i in range(2))
        rotation = [[(run("pass"), run(f"{kind}\npass")) for kind in kinds] for _ in range(pairs)]
        rot_own = statistics.median(p[0] for group in rotation for p in group)
        rot_ranks, bare, echo, magic = (
            statistics.median(g[i][1] for g in rotation) for i in range(4)
        )
        paced_out = {}
        if paced:
            slow = [
                [
                    (after_pause("pass"), after_pause(f"{kind}\npass"))
                    for kind in ("%%ranks", "%%bench_echo")
                ]
                for _ in range(paced)
            ]
            paced_out = {
                "paced_own": statistics.median(g[0][0] for g in slow),
                "paced_ranks": statistics.median(g[0][1] for g in slow),
                "paced_echo_own": statistics.median(g[1][0] for g in slow),
                "paced_echo": statistics.median(g[1][1] for g in slow),
            }
        trips = _ask(
            kc,
            echo="_bench_echo.trips",
            bare="_bench_bare_trips[0]",
            magic="_bench_nothing_calls[0]",
        )
        run("_bench_echo.close()")
        pid = km.provisioner.process.pid  # type: ignore[union-attr]
        inside = _inside_cells(run, kc, pairs, later_s)
        cpu = _cpu_per_cell(run, kc, pid, pairs)
        rss0 = _rss(pid)
        for _ in range(cells):
            run("%%ranks\nx = rank")
        rss1 = _rss(pid)
        run("%lab stop")
        return {
            "own": own,
            "ranks": ranks,
            "rot_own": rot_own,
            "rot_ranks": rot_ranks,
            **paced_out,
            "echo": echo,
            "bare": bare,
            "magic": magic,
            "echo_trips": trips["echo"],
            "bare_trips": trips["bare"],
            "magic_calls": trips["magic"],
            "rss_growth": rss1 - rss0,
            **inside,
            **cpu,
        }
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def gap_rows(k: dict[str, float], n: int) -> list[tuple[str, ...]]:
    """The benchmark's rows beside the target's, from `kernel_cells`' figures `k` on `n` ranks:
    the paced pairs, then the rotation (metric, labkit, floor, vs floor, -, -)."""
    rows = []
    for label, key, own in (
        (f"the same, {PAUSE_S * 1e3:.0f} ms pause before each cell", "paced_ranks", "paced_own"),
        (f"no-op cell on {n} echo procs, paced so", "paced_echo", "paced_echo_own"),
        ("no-op %%ranks cell, in the rotation:", "rot_ranks", "rot_own"),
        ("- cell magic that does nothing", "magic", "rot_own"),
        (f"- cell magic: echo from {n} plain procs", "echo", "rot_own"),
        ("- cell magic: bare loop to the ranks", "bare", "rot_own"),
    ):
        floor = f"{k[own] * 1e3:.1f} ms kernel no-op"
        rows.append((label, f"{k[key] * 1e3:.1f} ms", floor, _signed(k[key] - k[own]), "-", "-"))
    return rows


def split_text(k: dict[str, float], n: int) -> str:
    """Where the rotation's `%%ranks` gap goes, in words, from `kernel_cells`' figures `k`."""
    return (
        "in the rotation (5 other cells before each %%ranks cell there, against 1 in the pairs), "
        f"the no-op %%ranks cell's gap, {_signed(k['rot_ranks'] - k['rot_own'])}: IPython's path "
        f"for any cell magic {_signed(k['magic'] - k['rot_own'])} (the magic that does nothing), "
        f"reaching {n} processes and back {_signed(k['echo'] - k['magic'])} (the echo cell over "
        f"it), the ranks' work and the signing {_signed(k['bare'] - k['echo'])} (the bare cell "
        f"over the echo), the kernel's machinery {_signed(k['rot_ranks'] - k['bare'])} (%%ranks "
        "over the bare cell)"
    )


def _signed(seconds: float) -> str:
    return f"{seconds * 1e3:+.2f} ms"


def _ask(kc: Any, **expressions: str) -> dict[str, Any]:
    """The values of Python `expressions` in the kernel (each a literal)."""
    reply = kc.execute_interactive(
        "", timeout=120, output_hook=lambda msg: None, user_expressions=expressions
    )
    found = reply["content"]["user_expressions"]
    return {k: ast.literal_eval(found[k]["data"]["text/plain"]) for k in expressions}


def _inside_cells(run: Any, kc: Any, pairs: int, later_s: float) -> dict[str, float]:
    """Medians of a no-op `lab.run` timed inside a cell: `inside_at_once_s`, and
    `inside_later_s` (`later_s` into the cell); interleaved, after `pass` cells."""
    run("import time as _bench_t, statistics as _bench_s; _bench = {'at_once': [], 'later': []}")
    at_once = INSIDE.format(key="at_once")
    later = f"_bench_t.sleep({later_s}); " + INSIDE.format(key="later")
    for _ in range(pairs):
        run("pass")
        run(at_once)
        run("pass")
        run(later)
    found = _ask(kc, **{k: f"_bench_s.median(_bench[{k!r}])" for k in ("at_once", "later")})
    return {f"inside_{k}_s": float(v) for k, v in found.items()}


def process_cpu(pid: int) -> float:
    """CPU seconds of all of a process's threads so far (0.0 where there is no /proc)."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])  # nanoseconds on a CPU
        except OSError:  # the thread ended meanwhile
            pass
    return total / 1e9


def _cpu_per_cell(run: Any, kc: Any, kernel: int, pairs: int) -> dict[str, float]:
    """Medians over `pairs` interleaved cells of the CPU (all threads) the kernel process spends
    on its own no-op cell (`cpu_own_s`) and on a `%%ranks` no-op cell (`cpu_cell_s`), and the
    ranks together on the latter (`cpu_ranks_s`)."""
    ranks = _ask(kc, pids="sorted(lab.pids.values())")["pids"]
    own, cell, on_ranks = [], [], []
    for _ in range(pairs):
        k0 = process_cpu(kernel)
        run("pass")
        own.append(process_cpu(kernel) - k0)
        k0, r0 = process_cpu(kernel), sum(map(process_cpu, ranks))
        run("%%ranks\npass")
        cell.append(process_cpu(kernel) - k0)
        on_ranks.append(sum(map(process_cpu, ranks)) - r0)
    return {
        "cpu_own_s": statistics.median(own),
        "cpu_cell_s": statistics.median(cell),
        "cpu_ranks_s": statistics.median(on_ranks),
    }


def _rss(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")
