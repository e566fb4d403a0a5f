"""The GPU check in one command, for a GPU machine lent for minutes (a developers' tool).

On a lent machine (torch with CUDA, 16 cores, no Jupyter packages; docs/gpu.md, "The GPU
check") it

1. installs the wheels carried in WHEELS (`.whl/`, the versions CI installs, downloaded for that
   machine's Python) into a folder of their own, with no index (on a torch older than 2.13 the
   ranks provide the two 2.13 collective names themselves: labkit.rank.torch_compat);
2. runs `pytest -m gpu tests/test_gpu.py` beside every notebook, JOBS notebooks at a time, each
   through `scripts/gpu_notebooks.py` with `LABKIT_DEVICE=DEVICE` (on one GPU every lab's ranks
   share it), none started after BUDGET seconds and each stopped at its limit or the budget's end;
3. before those, on the still quiet machine, times a DDP training step in a 1-rank lab against
   the same step under torchrun, alternating (`python -m labkit.bench --ddp`, once per model in
   DDP; target: lab / torchrun <= DDP_TARGET);
4. times the host-staging copies (`scripts/staging_cost.py`) on DEVICE;
5. prints one pass/fail table with each part's time, also written to OUT/summary.txt (the failed
   notebooks' tracebacks in OUT/nb_errors.txt), and exits 0 only when everything passed.

`--device cpu` runs the same on CPU ranks (what tests/test_gpu_check.py runs), `--dry-run`
prints what it would run and runs nothing.

    python3 scripts/gpu_check.py [--device cuda] [--jobs 5] [--budget 480] [--ddp issue,bench]
                                 [NOTEBOOK...]
"""

from __future__ import annotations

import argparse
import atexit
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DDP_TARGET = 1.01  # issue 32: a DDP step in a 1-GPU lab within 1 % of torchrun's


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("notebooks", nargs="*", help="default: every notebooks/*.ipynb")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--wheels", default=os.path.join(ROOT, ".whl"))
    p.add_argument("--no-install", action="store_true", help="use the installed packages")
    p.add_argument("--no-pytest", action="store_true", help="skip `pytest -m gpu`")
    p.add_argument("--jobs", type=int, default=5, help="notebooks at a time (default 5)")
    p.add_argument("--budget", type=float, default=480, help="seconds; none starts after")
    p.add_argument("--nb-timeout", type=float, default=300, help="seconds per notebook")
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-out")
    p.add_argument(
        "--ddp",
        default=None,
        help="models of the DDP lab/torchrun step, comma-separated (issue, bench); '' for none;"
        " default both on cuda, none on cpu",
    )
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs must be 1 or more, got {args.jobs}")
    if args.ddp is None:
        args.ddp = "issue,bench" if args.device == "cuda" else ""
    args.ddp = [m for m in args.ddp.split(",") if m]
    args.notebooks = args.notebooks or sorted(glob.glob(os.path.join(ROOT, "notebooks/*.ipynb")))
    return args


def install(args: argparse.Namespace, env: dict[str, str]) -> list[str] | None:
    """The install command (run unless dry); the site folder (removed when the check ends)
    goes first on PYTHONPATH."""
    wheels = sorted(glob.glob(os.path.join(args.wheels, "*.whl")))
    if args.no_install or not wheels:
        return None
    site = "SITE" if args.dry_run else tempfile.mkdtemp(prefix="labkit-gpu-site-")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
    cmd += ["--no-compile", "--no-cache-dir", "--target", site, *wheels]
    env["PYTHONPATH"] = os.pathsep.join([site, ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if not args.dry_run:
        atexit.register(shutil.rmtree, site, True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return cmd


def machine() -> str:
    """The date, the device and torch: what a recorded result needs beside it."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return f"{when}, {gpu}, torch {torch.__version__}, {os.cpu_count()} cores"


def run_one(
    cmd: list[str], env: dict[str, str], limit: float, log: str | None = None
) -> tuple[str, float, str]:
    """('pass' | 'FAIL' | 'timeout', seconds, its output's last line); the whole output goes
    to `log` if given."""
    start = time.monotonic()
    try:
        done = subprocess.run(
            cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=max(limit, 1)
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        if log:
            with open(log, "w") as f:
                f.write(out)
        return "timeout", time.monotonic() - start, (out.strip().splitlines() or [""])[-1]
    if log:
        with open(log, "w") as f:
            f.write(done.stdout + done.stderr)
    lines = (done.stdout + done.stderr).strip().splitlines()
    return ("pass" if done.returncode == 0 else "FAIL"), time.monotonic() - start, lines[-1:]


def ddp_row(model: str, args: argparse.Namespace, env: dict[str, str]) -> tuple:
    """One table row: the DDP step's lab / torchrun ratio for `model` ('pass' within target,
    'over' past it); its whole output goes to OUT/ddp_MODEL.log."""
    out = os.path.join(args.out, f"ddp_{model}.json")
    cmd = [sys.executable, "-m", "labkit.bench", "--ddp", "--device", args.device]
    cmd += ["--model", model, "--json", out]
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
        text, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        text, code = str(exc.stdout or "") + str(exc.stderr or ""), None
    with open(os.path.join(args.out, f"ddp_{model}.log"), "w") as f:
        f.write(text)
    lines = text.strip().splitlines()[-1:]
    verdict = "timeout" if code is None else "FAIL"
    if code == 0:
        import json

        with open(out) as f:
            ratio = json.load(f)["ratio"]
        verdict = "pass" if ratio <= DDP_TARGET else "over"
    return (f"DDP step lab/torchrun ({model})", verdict, time.monotonic() - start, lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    env = dict(os.environ, PYTHONUNBUFFERED="1", LABKIT_DEVICE=args.device)
    env.setdefault("PYTHONPATH", ROOT)
    os.makedirs(args.out, exist_ok=True)
    errors = os.path.join(args.out, "nb_errors.txt")
    py = sys.executable
    installed = install(args, env)
    pytest = [py, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-q", "-p", "no:cacheprovider"]
    staging = [py, "scripts/staging_cost.py", "--device", args.device, "--sizes-mb", "1", "64"]
    nb_cmd = {
        nb: [py, "scripts/gpu_notebooks.py", f"{errors}.{i}", nb]
        for i, nb in enumerate(args.notebooks)
    }
    if args.dry_run:
        print("install:", " ".join(installed) if installed else "(nothing: installed packages)")
        print(f"LABKIT_DEVICE={args.device}, {args.jobs} at a time, budget {args.budget:g} s")
        if not args.no_pytest:
            print("gpu tests:", " ".join(pytest))
        for cmd in nb_cmd.values():
            print(f"notebook: {' '.join(cmd)}  (limit {args.nb_timeout:g} s)")
        print("staging cost:", " ".join(staging))
        for model in args.ddp:
            print(f"ddp step: python -m labkit.bench --ddp --device {args.device} --model {model}")
        return 0
    t0 = time.monotonic()
    ddp_rows = [ddp_row(model, args, env) for model in args.ddp]  # on a quiet machine, first
    deadline = time.monotonic() + args.budget
    results: dict[str, tuple[str, float, object]] = {}

    def notebook(nb: str) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            results[nb] = ("not run", 0.0, "the budget was spent")
            return
        results[nb] = run_one(nb_cmd[nb], env, min(args.nb_timeout, left))

    with ThreadPoolExecutor(args.jobs + 1) as pool:
        tests = (
            None
            if args.no_pytest
            else pool.submit(
                run_one, pytest, env, args.budget, os.path.join(args.out, "pytest.log")
            )
        )
        list(pool.map(notebook, args.notebooks))  # JOBS at a time beside the tests
        rows = [("pytest -m gpu", *tests.result())] if tests else []
    rows += [(os.path.basename(nb), *results[nb]) for nb in args.notebooks] + ddp_rows
    with open(errors, "w") as out:
        for i, _ in enumerate(args.notebooks):
            part = f"{errors}.{i}"
            if os.path.exists(part):
                with open(part) as f:
                    out.write(f.read())
                os.remove(part)
    passed = sum(r[1] == "pass" for r in rows)
    table = [f"GPU check: LABKIT_DEVICE={args.device}, {args.jobs} notebooks at a time", machine()]
    table += [f"{'part':<42} {'result':<8} {'seconds':>8}  last line"]
    for name, verdict, seconds, last in rows:
        text = last[0] if isinstance(last, list) and last else (last or "")
        table.append(f"{name:<42} {verdict:<8} {seconds:>8.1f}  {str(text)[:90]}")
    table.append(f"{passed} of {len(rows)} passed in {time.monotonic() - t0:.0f} s")
    table += [last[0] for _, _, _, last in ddp_rows if last]  # each ratio's line in full
    cost = subprocess.run(staging, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    table += (cost.stdout + cost.stderr[-2000:]).strip().splitlines()
    print("\n".join(table), flush=True)
    with open(os.path.join(args.out, "summary.txt"), "w") as f:
        f.write("\n".join(table) + "\n")
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
