"""Write the benchmark's table into the README and docs/performance.md (runs in a shell).

    python scripts/bench_tables.py [--check]

Between the markers `<!-- bench-table: FILE.json -->` and `<!-- /bench-table -->` each file
gets `python -m labkit.tools.bench_report FILE.json`'s output, so no figure is typed by hand.
`--check` changes nothing and fails when a table differs from what its JSON gives
(tests/test_bench_report.py runs it).
"""

from __future__ import annotations

import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from labkit.tools.bench_report import markdown  # noqa: E402

FILES = ("README.md", os.path.join("docs", "performance.md"))
BLOCK = re.compile(r"(<!-- bench-table: (\S+) -->\n)(.*?)(<!-- /bench-table -->)", re.S)


def filled(text: str) -> str:
    def table(m: re.Match[str]) -> str:
        with open(os.path.join(ROOT, m.group(2))) as f:
            return f"{m.group(1)}\n{markdown(json.load(f))}\n{m.group(4)}"

    return BLOCK.sub(table, text)


def main(argv: list[str]) -> int:
    stale = []
    for name in FILES:
        path = os.path.join(ROOT, name)
        with open(path) as f:
            text = f.read()
        if not BLOCK.search(text):
            stale.append(f"{name}: no <!-- bench-table: FILE.json --> block")
            continue
        new = filled(text)
        if new != text:
            if "--check" in argv:
                stale.append(f"{name}: its table is not what its JSON gives")
            else:
                with open(path, "w") as f:
                    f.write(new)
    if stale:
        print("\n".join(stale) + "\n(python scripts/bench_tables.py writes them)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
