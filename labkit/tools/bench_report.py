"""The benchmark's main table from its results (runs in a shell): what `python -m labkit.bench`
prints, and the same table in Markdown from a run saved with `--json F`:

    python -m labkit.tools.bench_report F.json

which is how docs/performance.md and the README get their table (never typed by hand:
tests/test_bench_report.py checks that the README's table is this command's output).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from labkit.tools.bench_kernel import INSIDE_LATER_S, gap_rows


def _table(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [head, tuple("-" * w for w in widths), *rows]
    return "\n".join("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in lines)


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def main_rows(res: dict[str, Any]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """(head, rows) of the main table, from the results `python -m labkit.bench` saves."""
    n, k, cells, ipp = res["ranks"], res["kernel"], res["cells"], res["ipyparallel"]
    main_n = {int(m): r for m, r in res["scaling"].items()}[n]
    echo, cold, torch_import = res["raw_roundtrip_s"], res["cold_start_s"], res["torch_import_s"]
    cell, raw, traced = res["allreduce_cell_s"], res["raw_allreduce_s"], res
    on, off = res["traced_s"], res["untraced_s"]

    def other(key: str) -> str:
        return _ms(ipp[key]) if ipp else "-"

    head = ("metric", "labkit", "floor (same run)", "vs floor", "ipyparallel", "target")
    extra = (k["ranks"] - k["own"]) * 1e3
    pull_x, push_x = main_n["pull_s"] / main_n["copy_s"], main_n["push_s"] / main_n["copy_s"]
    rows = [
        (
            "no-op %%ranks cell (kernel)",
            _ms(k["ranks"]),
            f"{_ms(k['own'])} kernel no-op",
            f"{extra:+.2f} ms",
            other("noop_s"),
            "+1 ms",
        ),
        *gap_rows(k, n),
        (
            "no-op lab.run after 20 ms idle",
            _ms(main_n["noop_idle_s"]),
            f"{_ms(echo)} echo, {n} idle procs",
            f"+{(main_n['noop_idle_s'] - echo) * 1e3:.2f} ms",
            "-",
            "-",
        ),
        (
            "no-op lab.run in a kernel cell",
            _ms(k["inside_at_once_s"]),
            f"{_ms(k['inside_later_s'])} {INSIDE_LATER_S * 1e3:.0f} ms into the cell",
            f"+{(k['inside_at_once_s'] - k['inside_later_s']) * 1e3:.2f} ms",
            "-",
            "-",
        ),
        (
            "CPU of a no-op cell, all threads",
            _ms(k["cpu_cell_s"] + k["cpu_ranks_s"]),
            f"{_ms(k['cpu_own_s'])} kernel no-op",
            f"+{(k['cpu_cell_s'] + k['cpu_ranks_s'] - k['cpu_own_s']) * 1e3:.2f} ms",
            "-",
            "-",
        ),
        (
            "no-op lab.run back to back",
            _ms(main_n["noop_s"]),
            "-",
            "-",
            "-",
            "-",
        ),
        (
            f"start {n} ranks, cold",
            _ms(cold),
            f"{_ms(torch_import)} import torch",
            f"x{cold / torch_import:.2f}",
            other("start_s"),
            "-",
        ),
        (f"start {n} ranks, fork server warm", _ms(main_n["start_s"]), "-", "-", "-", "-"),
        ("restart()", _ms(main_n["restart_s"]), "-", "-", "-", "-"),
        (
            "1M-float all_reduce cell",
            _ms(cell),
            f"{_ms(raw)} raw torch.distributed",
            f"x{cell / raw:.2f}",
            other("allreduce_s"),
            "x1.3, <= ipyparallel",
        ),
        (
            f"pull 16 MiB x {n}",
            _ms(main_n["pull_s"]),
            f"{_ms(main_n['copy_s'])} copy",
            f"x{pull_x:.2f}",
            other("pull_s"),
            "x2.5",
        ),
        (
            f"pull 16 MiB x {n}, results kept",
            _ms(main_n["pull_kept_s"]),
            f"{_ms(main_n['copy_s'])} copy",
            f"x{main_n['pull_kept_s'] / main_n['copy_s']:.2f}",
            "-",
            "-",
        ),
        (
            f"push 16 MiB to {n}",
            _ms(main_n["push_s"]),
            f"{_ms(main_n['copy_s'])} copy",
            f"x{push_x:.2f}",
            "-",
            "x2.5",
        ),
        (
            "1 MiB all_reduce traced",
            _ms(on),
            f"{_ms(off)} untraced",
            f"{(on / off - 1) * 100:+.1f} %",
            "-",
            "+5 %",
        ),
        (
            "tracing's own cost per call",
            f"{traced['wrapper_s'] * 1e6:.0f} us",
            f"{_ms(off)} untraced all_reduce",
            f"{traced['wrapper_s'] / off * 100:+.1f} %",
            "-",
            "+5 %",
        ),
        (f"kernel RSS over {cells} cells", f"{k['rss_growth']:+.1f} MB", "-", "-", "-", "20 MB"),
    ]
    return head, rows


def markdown(res: dict[str, Any]) -> str:
    """The main table in Markdown, and a line that says which run made it."""
    head, rows = main_rows(res)
    load = " / ".join(f"{x:.1f}" for x in res["load_before"])
    ipp = f", ipyparallel {res['ipyparallel']['version']}" if res.get("ipyparallel") else ""
    made = (
        f"{res['ranks']} CPU ranks on {res['cpus']} cores, torch {res['torch']}{ipp}; "
        f"{'a --quick run' if res.get('quick') else 'a full run'}"
        + (f" at {res['when']}" if res.get("when") else "")
        + f"; load average {load} when it began"
    )
    return _table(head, rows) + f"\n\n({made})\n"


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(markdown(json.load(f)), end="")
