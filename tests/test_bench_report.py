"""The benchmark's table in the README and docs/performance.md is generated from a saved run
(docs/bench/*.json) by labkit.tools.bench_report, never typed (scripts/bench_tables.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_tables_are_the_saved_runs_output() -> None:
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_tables.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def test_the_report_reads_a_run_saved_as_json() -> None:
    from labkit.tools.bench_report import main_rows, markdown

    with open(os.path.join(ROOT, "docs", "bench", "latest.json")) as f:
        res = json.load(f)
    head, rows = main_rows(res)
    assert head[0] == "metric" and all(len(r) == len(head) for r in rows)
    first = rows[0]
    assert first[0] == "no-op %%ranks cell (kernel)"
    # the gap is the two medians' difference, as the benchmark prints it
    want = (res["kernel"]["ranks"] - res["kernel"]["own"]) * 1e3
    assert first[3] == f"{want:+.2f} ms"
    text = markdown(res)
    assert f"{res['ranks']} CPU ranks on {res['cpus']} cores" in text
