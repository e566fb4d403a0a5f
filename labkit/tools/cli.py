"""The `labkit` command: `labkit lab`, `labkit check`, `labkit doctor` (runs in a shell)."""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any


def notebooks_dir() -> str | None:
    """The curriculum: ./notebooks if present, else the one beside the package source (a
    clone's, for an editable install); None when neither exists (labkit installed from a
    wheel, run outside a clone: the notebooks are not part of the package)."""
    here = os.path.join(os.getcwd(), "notebooks")
    if os.path.isdir(here):
        return here
    beside = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks")
    return beside if os.path.isdir(beside) else None


def lab_command(notebook_dir: str, extra: list[str], euid: int) -> tuple[list[str], list[str]]:
    """(the `jupyter lab` command, notes to print) for `labkit lab`.

    JupyterLab listens on loopback unless `extra` names another address (`--ip` or
    `--ServerApp.ip`, which come after ours and win). Run as root (a container, a rented GPU
    machine, a cloud notebook VM), Jupyter refuses to start without `--allow-root`: it is added,
    with a note, unless `extra` says otherwise. A leading `--` before Jupyter's own arguments is
    accepted and dropped."""
    if extra[:1] == ["--"]:
        extra = extra[1:]
    notes = []
    names = {arg.split("=", 1)[0] for arg in extra}
    if euid == 0 and not names & {"--allow-root", "--ServerApp.allow_root", "--no-allow-root"}:
        extra = ["--allow-root", *extra]
        notes.append(
            "running as root (as in a container): passing --allow-root to Jupyter; "
            "run as another user to avoid it"
        )
    if names & {"--ip", "--ServerApp.ip"}:
        notes.append(
            "listening beyond loopback: anyone who can reach this port and has the token (in "
            "the URL below) can run code as you; an SSH tunnel keeps it on loopback instead"
        )
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        f"--notebook-dir={notebook_dir}",
        "--ServerApp.ip=127.0.0.1",
        *extra,
    ]
    return cmd, notes


def cmd_lab(args: argparse.Namespace, extra: list[str]) -> int:
    where = args.dir or notebooks_dir()
    if where is None or not os.path.isdir(where):
        print(
            f"labkit lab: no notebooks folder {'at ' + where if where else 'here'}: pass "
            "--dir PATH, or run it in a clone of labkit (its notebooks/ folder is the "
            "curriculum; the installed package does not carry it)",
            file=sys.stderr,
        )
        return 2
    cmd, notes = lab_command(where, extra, os.geteuid())
    for note in notes:
        print(f"labkit lab: {note}", file=sys.stderr)
    sys.stderr.flush()
    return _exec(cmd)


def _exec(cmd: list[str]) -> int:
    """Become `cmd` (Jupyter), so a signal to this process (Ctrl-C, a container's stop) reaches
    the server itself instead of leaving it behind."""
    os.execv(cmd[0], cmd)
    return 1  # not reached


IOPUB_TIMEOUT = 120  # seconds a notebook run waits for a cell's outputs after its reply


def run_notebook(
    path: str, timeout: int = 600, save_dir: str | None = None
) -> tuple[bool, float, str]:
    """Execute a notebook top to bottom in a fresh kernel; (ok, seconds, error summary).

    With `save_dir`, a notebook that passed is written there under its own name with its
    outputs and its widgets' state (what the course site renders: `scripts/dev.py docs`)."""
    return execute_notebook(path, timeout, save_dir)[:3]


def execute_notebook(
    path: str, timeout: int = 600, save_dir: str | None = None
) -> tuple[bool, float, str, str]:
    """`run_notebook`, and the whole error besides its summary (a failed cell's traceback)."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    with _kernel_config() as config:
        return _execute(nb, config, path, timeout, save_dir)


SOCKET_DIR_MAX = 70  # a longer temporary directory is not used for a kernel's sockets


@contextlib.contextmanager
def _kernel_config() -> Iterator[Any]:
    """The kernel manager's configuration: the kernel talks over Unix sockets in a directory
    of its own, removed afterwards. Over TCP (jupyter_client's default) each kernel binds
    five ports the manager picked free a moment before, so kernels started together can take
    each other's (seen with 8 notebooks at a time on a 16-core machine), and each kernel warns
    that TCP is unencrypted. Windows has no Unix sockets for zmq: TCP there."""
    from traitlets.config import Config

    if os.name == "nt":
        yield Config()
        return
    base = tempfile.gettempdir()
    if len(base) > SOCKET_DIR_MAX and os.path.isdir("/tmp"):
        base = "/tmp"  # a Unix socket's path has room for about 107 bytes
    where = tempfile.mkdtemp(prefix="labkit-kernel-", dir=base)
    try:
        yield Config(
            KernelManager={
                "transport": "ipc",
                "connection_file": os.path.join(where, "kernel.json"),
                "ip": os.path.join(where, "k"),  # absolute: the kernel has another cwd
            }
        )
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _execute(
    nb: Any, config: Any, path: str, timeout: int, save_dir: str | None
) -> tuple[bool, float, str, str]:
    """Run `nb` (read from `path`) on a kernel configured by `config`: execute_notebook's
    answer."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    client = NotebookClient(
        nb,
        config=config,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": os.path.dirname(path)}},
        # after a cell's reply, wait for its last outputs (nbclient waits 4 s, then drops them
        # with a log line: on a busy 2-core machine notebook 12 lost three of its views, whose
        # widget messages came later); outputs still missing then fail the notebook
        iopub_timeout=IOPUB_TIMEOUT,
        raise_on_iopub_timeout=True,
    )
    t0 = time.perf_counter()
    try:
        client.execute()  # keeps the widgets' state in nb.metadata (store_widget_state)
        seconds = time.perf_counter() - t0
        if save_dir:
            os.makedirs(save_dir, exist_ok=True)
            out = os.path.join(save_dir, os.path.basename(path))
            _drop_widget_bundles(nb)
            nbformat.write(nb, out + ".part")
            os.replace(out + ".part", out)  # a reader never sees half a notebook
        return True, seconds, "", ""
    except CellExecutionError as exc:
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        summary = lines[-1] if lines else "cell failed"
        return False, time.perf_counter() - t0, summary, str(exc)
    except Exception as exc:  # noqa: BLE001 - a timeout or a dead kernel is a failed check
        error = f"{type(exc).__name__}: {exc}"
        return False, time.perf_counter() - t0, error, error


def _drop_widget_bundles(nb: Any) -> None:
    """Leave out the JavaScript that anywidget keeps in each widget's state (`_esm`, `_css`:
    about 5 MB of plotly.js per figure); the figure's data and layout stay, and the course site
    draws them with the one plotly.js it carries."""
    state = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
    for model in state.get("state", {}).values():
        for key in ("_esm", "_css"):
            model.get("state", {}).pop(key, None)


def gpu_problem(device: str) -> str | None:
    """Why `--device cuda` cannot run here (None when it can, or for another device)."""
    if device != "cuda":
        return None
    import torch

    if not torch.cuda.is_available():
        return (
            f"--device cuda: torch {torch.__version__} sees no GPU here "
            f"(CUDA build {torch.version.cuda or 'none'}); run it on a GPU machine"
        )
    return None


def cmd_check(args: argparse.Namespace) -> int:
    where = notebooks_dir()
    paths = args.notebooks or (sorted(glob.glob(os.path.join(where, "*.ipynb"))) if where else [])
    if not paths:
        print("no notebooks found", file=sys.stderr)
        return 2
    problem = gpu_problem(args.device)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    if args.device != "auto":
        os.environ["LABKIT_DEVICE"] = args.device  # every Lab(...) asking for "auto" gets it
        print(f"notebooks on device={args.device} (LABKIT_DEVICE)", flush=True)
    width = max(len(os.path.basename(p)) for p in paths)
    failed = 0
    for path in paths:
        ok, seconds, error = run_notebook(path, args.timeout, args.save)
        failed += not ok
        print(
            f"{os.path.basename(path):<{width}}  {'pass' if ok else 'FAIL'}  {seconds:6.1f} s"
            + (f"  {error}" if error else ""),
            flush=True,
        )
    print(f"{len(paths) - failed} passed, {failed} failed")
    return 1 if failed else 0


def doctor() -> dict[str, Any]:
    from labkit.kernel.launch import spawn
    from labkit.kernel.launch.policy import choose

    server = spawn.take()
    try:
        facts = server.wait_facts()
    finally:
        spawn.release(server)  # in a kernel, the spare for its next Lab
    facts = dict(facts)
    facts["Lab() would choose"] = choose(None, "auto", "auto", facts).reason
    facts.update(torch_support(facts["torch"]))
    return facts


def torch_support(version: str) -> dict[str, Any]:
    """Whether torch `version` (this process's torch: the fork server and the ranks run the
    same interpreter) lies in the tested range, the 2.13 names labkit provides on it, and the
    features it lacks (labkit.rank.torch_compat)."""
    from labkit.rank import torch_compat

    low, high = torch_compat.TESTED
    inside = torch_compat.in_range(version)
    renames = torch_compat.renames_needed()
    return {
        "tested range": f"torch {low} to {high}: {version} is "
        + ("inside" if inside else "OUTSIDE it (labkit may work; nothing checked it)"),
        "renamed by labkit": ", ".join(f"{n} (= {torch_compat.RENAMES[n]})" for n in renames)
        or "none (this torch has torch 2.13's names)",
        "unavailable": {
            name: f"{why}: no {torch_compat.FEATURES[name][0]}"
            for name, why in torch_compat.unavailable().items()
        },
    }


def cmd_doctor(args: argparse.Namespace) -> int:
    facts = doctor()
    for key in (
        "python",
        "torch",
        "cuda",
        "gpus",
        "cpus",
        "gloo",
        "nccl",
        "mpi",
        "Lab() would choose",
        "tested range",
        "renamed by labkit",
    ):
        print(f"{key:>20}: {facts.get(key)}")
    missing = facts.get("unavailable") or {}
    print(f"{'unavailable':>20}: {', '.join(missing) or 'none: every feature works'}")
    for name, why in missing.items():
        print(f"{'':>22}{name}: {why}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="labkit", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser(
        "lab",
        help="open JupyterLab on the notebooks",
        description="Open JupyterLab on the notebooks, on 127.0.0.1. Every other argument is "
        "passed on to `jupyter lab` (--no-browser, --port 9999, --allow-root, --ServerApp.*); "
        "as root, --allow-root is added for you.",
    )
    p.add_argument("--dir", help="the notebooks' folder (default: ./notebooks, else labkit's)")
    p.set_defaults(fn=cmd_lab)
    p = sub.add_parser("check", help="run every notebook headless and print a pass/fail table")
    p.add_argument("notebooks", nargs="*", help="the notebooks to run (default: all)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="the device of every Lab that asks for 'auto' (default: the policy's choice)",
    )
    p.add_argument(
        "--save",
        metavar="DIR",
        default=os.environ.get("LABKIT_EXECUTED_DIR") or None,
        help="write each notebook that passed to DIR with its outputs and widget state, for "
        "the course site (default: $LABKIT_EXECUTED_DIR, else nothing is written)",
    )
    p.set_defaults(fn=cmd_check)
    p = sub.add_parser(
        "doctor",
        help="torch (inside the tested range?), backends, GPUs, what Lab() would choose, and "
        "the features this torch lacks",
    )
    p.set_defaults(fn=cmd_doctor)
    args, unknown = parser.parse_known_args(argv)
    if args.fn is cmd_lab:  # Jupyter's own options go through
        return cmd_lab(args, unknown)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
