"""The notebooks as `labkit check --device cuda` runs them (`labkit.tools.cli.execute_notebook`,
150 s a cell; LABKIT_DEVICE, if set, instead of cuda), printing one line per notebook and keeping
each failure's traceback in LOG, exiting 1 if one failed (a developers' tool, for a GPU machine
lent for minutes: `scripts/gpu_check.py` runs several of these at once).

    python scripts/gpu_notebooks.py LOG NOTEBOOK...
"""

import os
import sys

from labkit.tools import cli

device = os.environ.setdefault("LABKIT_DEVICE", "cuda")  # scripts/gpu_check.py may say cpu
problem = cli.gpu_problem(device)
if problem:
    print(problem, flush=True)
    sys.exit(2)

failed = 0
with open(sys.argv[1], "w") as log:
    for path in sys.argv[2:]:
        ok, seconds, summary, details = cli.execute_notebook(path, timeout=150)
        verdict = "pass" if ok else "FAIL"
        print(f"{os.path.basename(path)}  {verdict}  {seconds:6.1f} s  {summary[:200]}", flush=True)
        if not ok:
            failed += 1
            lines = [ln for ln in details.splitlines() if ln.strip()]
            log.write(f"===== {path} ({seconds:.1f} s)\n" + "\n".join(lines[-80:]) + "\n")
            log.flush()
sys.exit(1 if failed else 0)
