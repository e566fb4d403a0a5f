"""The notebooks as `labkit check --device cuda` runs them (the same nbclient call), keeping each
failure's traceback: python gpu_check.py LOG NOTEBOOK..."""

import os
import sys
import time

from labkit.tools import cli

os.environ["LABKIT_DEVICE"] = "cuda"
problem = cli.gpu_problem("cuda")
if problem:
    print(problem, flush=True)
    sys.exit(2)
import nbformat  # noqa: E402
from nbclient import NotebookClient  # noqa: E402

log = open(sys.argv[1], "w")
for path in sys.argv[2:]:
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=150,
        kernel_name="python3",
        resources={"metadata": {"path": os.path.dirname(path)}},
    )
    t0 = time.perf_counter()
    try:
        client.execute()
        ok, err = True, ""
    except Exception as exc:  # noqa: BLE001
        ok, err = False, f"{type(exc).__name__}: {exc}"
    dt = time.perf_counter() - t0
    lines = [ln for ln in err.splitlines() if ln.strip()]
    last = lines[-1][:200] if lines else ""
    print(f"{os.path.basename(path)}  {'pass' if ok else 'FAIL'}  {dt:6.1f} s  {last}", flush=True)
    if not ok:
        log.write(f"===== {path} ({dt:.1f} s)\n" + "\n".join(lines[-80:]) + "\n")
        log.flush()
