"""Set-up and entry points for people and CI: `python3 scripts/dev.py COMMAND` (below).

Creates `.venv` beside this repository (if missing), installs torch first and then labkit with
its test extras in editable mode, then runs the command (setup, lab, test, bench, check, docs,
range):

- setup: only the set-up (.venv, and what `test` installs from Debian)
- lab:   JupyterLab on notebooks/ (http://127.0.0.1:8888)
- test:  the test suite (installs Debian's chromium and Slurm for their tests when it can);
         a whole run (no test path given) runs the tests that mostly wait (`BESIDE_TESTS`) in
         a second pytest beside the others (LABKIT_TEST_BESIDE=0: one pytest)
- bench: the performance benchmark (python -m labkit.tools.bench)
- check: every notebook top to bottom (labkit check)
- docs:  the course site into build/site/ (scripts/build_site.py), from the notebooks that
         `test` and `check` executed and saved in build/executed/ ($LABKIT_EXECUTED_DIR); offline
- range: the torch-range subset (`RANGE_TESTS`) on the oldest and the newest torch of the tested
  range (`RANGE`), each installed alone in `.torch/VERSION` and put ahead of .venv's torch with
  PYTHONPATH; `range oldest` or `range newest` runs one end. Other arguments go to pytest.

Which torch: a torch the user already has is never replaced. When the Python running this
script has torch and .venv does not exist yet, .venv is made with --system-site-packages and
uses that torch (a GPU image's, a cluster's module); otherwise `LABKIT_TORCH` is installed
into .venv, default the pinned "torch==2.13.0" (reproducible: what CI runs the whole suite on).
Set LABKIT_TORCH to install another requirement ("torch==2.11.0", "torch" for the newest) or to
"pinned" to ignore the outer torch; once .venv has a torch it is kept (remove .venv to change it).
LABKIT_TORCH_INDEX adds a package index for torch (`range` and LABKIT_TORCH), e.g.
https://download.pytorch.org/whl/cpu for the CPU builds (~190 MB instead of ~3 GB with CUDA's
libraries).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(ROOT, ".venv")
PY = os.path.join(VENV, "bin", "python")


def sh(*cmd: str, **kw) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


PINNED = "torch==2.13.0"
# the tested range: pyproject's lower bound and the newest torch checked (labkit.rank.torch_compat)
RANGE = {"oldest": "2.11.0", "newest": "2.14.1"}
# what `range` runs on each end: the core, tracing (DDP's records and FSDP2's among it), Stop,
# torchrun code, the Flight Recorder, Join under DDP, every private torch hook made unavailable,
# the checker torch 2.14 broke, and three notebooks (the start, the 2.13 names and
# use_local_synchronization, every collective)
RANGE_TESTS = [
    "tests/test_torch_compat.py",
    "tests/test_core.py",
    "tests/test_trace.py",
    "tests/test_stop.py",
    "tests/test_torchrun_code.py",
    "tests/test_flight_recorder.py",
    "tests/test_ddp_observed.py::test_join_with_uneven_inputs_keeps_ddps_divisor",
    "tests/test_checkers_collectives.py::test_pair_sum",
    "tests/test_checkers_collectives.py::test_pair_sum_local_synchronization",
    "tests/test_notebooks.py::test_notebook_runs[00_start.ipynb]",
    "tests/test_notebooks.py::test_notebook_runs[10_process_groups.ipynb]",
    "tests/test_notebooks.py::test_notebook_runs[12_collectives.ipynb]",
]


# Tests that mostly wait (for a browser, a Jupyter server, torchrun's agents, Slurm, a terminal,
# a node's death, a straggler's sleep, a watchdog), and a few others to even the two parts
# out: a whole `test` run gives them a pytest of their own beside the others', so their waiting
# overlaps the others' computing (LABKIT_TEST_BESIDE=0: one pytest). docs/testing.md has the
# figures: since a stopped lab's fork server is reused, a run uses half the CPU it did and the
# second half of a one-queue run left the CPU mostly idle.
BESIDE_TESTS = [
    "tests/test_browser.py",
    "tests/test_browser_views.py",
    "tests/test_attach.py",
    "tests/test_cli_lab.py",
    "tests/test_multihost.py",
    "tests/test_slurm.py",
    "tests/test_terminal.py",
    "tests/test_faults.py",
    "tests/test_stragglers.py",
    "tests/test_debugger.py",
    "tests/test_progress.py",
    "tests/test_failures.py",
    "tests/test_checkpoint_scale.py",
    "tests/test_parallel_uneven.py",
    "tests/test_checkers_stubs.py",
]
# pytest options whose value is the next argument and may name a test path without selecting it
PATH_VALUED = {"--deselect", "--ignore", "--ignore-glob", "--rootdir", "-c", "--confcutdir"}


def selects_tests(args: list[str]) -> bool:
    """Whether pytest arguments name tests to run (a path or node id), so no split applies."""
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in PATH_VALUED:
            skip = True
        elif not arg.startswith("-") and os.path.exists(arg.split("::")[0]):
            return True
    return False


def run_tests(rest: list[str]) -> int:
    """pytest with `rest`; for a whole run, BESIDE_TESTS in a second pytest running alongside."""
    pytest = [PY, "-m", "pytest"]
    if os.environ.get("LABKIT_TEST_BESIDE") == "0" or selects_tests(rest):
        return subprocess.call([*pytest, *rest])
    log = os.path.join(ROOT, "build", "test-beside.log")
    os.makedirs(os.path.dirname(log), exist_ok=True)
    t0 = time.monotonic()
    with open(log, "w") as out:
        beside = subprocess.Popen(
            [*pytest, *BESIDE_TESTS, *rest], stdout=out, stderr=subprocess.STDOUT
        )
    ended: list[float] = []  # when the beside part ended: a thread waits for it

    def note_end() -> None:
        beside.wait()
        ended.append(time.monotonic())

    threading.Thread(target=note_end, daemon=True).start()
    ignores = [f"--ignore={path}" for path in BESIDE_TESTS]
    try:
        main_code = subprocess.call([*pytest, *rest, *ignores])
        main_s = time.monotonic() - t0
        beside_code = beside.wait()
    except KeyboardInterrupt:  # both pytests had the SIGINT too: let the beside one report
        beside.wait()
        raise
    while not ended:  # the thread notes the time just after wait() returns
        time.sleep(0.01)
    beside_s = ended[0] - t0
    with open(log) as f:
        report = f.read()
    print(f"\n== beside: {' '.join(BESIDE_TESTS)} ({log})\n{report}", end="", flush=True)
    print(
        f"== parts: the others {main_s:.0f} s (exit {main_code}), beside {beside_s:.0f} s "
        f"(exit {beside_code}), whole {time.monotonic() - t0:.0f} s",
        flush=True,
    )
    codes = [c for c in (main_code, beside_code) if c != 5]  # 5: that part selected no test
    return max(codes) if codes else 5


def torch_version(python: str) -> str | None:
    probe = subprocess.run(
        [python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True
    )
    return probe.stdout.strip() if probe.returncode == 0 else None


def index_args() -> list[str]:
    index = os.environ.get("LABKIT_TORCH_INDEX")
    return ["--extra-index-url", index] if index else []


def ensure_env() -> None:
    torch_req = os.environ.get("LABKIT_TORCH", "")
    if not os.path.exists(PY):
        outer = None if torch_req else torch_version(sys.executable)
        if outer is not None:
            print(
                f"using the torch {outer} that {sys.executable} has (.venv sees it: "
                f"--system-site-packages); LABKIT_TORCH=pinned installs {PINNED} instead",
                flush=True,
            )
            sh(sys.executable, "-m", "venv", "--system-site-packages", VENV)
        else:
            sh(sys.executable, "-m", "venv", VENV)
    pip = [PY, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    have = torch_version(PY)
    if have is None:
        sh(*pip, *index_args(), PINNED if torch_req in ("", "pinned") else torch_req)
    elif torch_req not in ("", "pinned"):
        print(f".venv keeps its torch {have} (LABKIT_TORCH applies to a new .venv)", flush=True)
    stamp = os.path.join(VENV, ".labkit-installed")
    pyproject = os.path.join(ROOT, "pyproject.toml")
    if not os.path.exists(stamp) or os.path.getmtime(stamp) < os.path.getmtime(pyproject):
        sh(*pip, "-e", f"{ROOT}[dev]")
        open(stamp, "w").close()


# Debian packages some tests use, by the command that shows one is there: chromium for the
# browser test, Slurm (slurm-wlm, munge: about 15 s to install) for tests/test_slurm.py.
TEST_PACKAGES = {
    "chromium": ["chromium"],
    "slurmctld": ["--no-install-recommends", "slurm-wlm", "munge"],
}


def ensure_test_packages() -> None:
    missing = [pkgs for tool, pkgs in TEST_PACKAGES.items() if not shutil.which(tool)]
    if not missing:
        return
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        sh("apt-get", "update", "-qq", env=env)
        for pkgs in missing:
            sh("apt-get", "install", "-y", "-qq", *pkgs, env=env)
    else:
        names = ", ".join(p for pkgs in missing for p in pkgs if not p.startswith("-"))
        print(
            f"{names} not found and cannot be installed here: the tests that need them (the "
            "browser test, the Slurm test) will skip",
            file=sys.stderr,
        )


def with_path(where: str) -> dict[str, str]:
    """The environment with `where` first on PYTHONPATH (its torch shadows .venv's)."""
    old = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=where + (os.pathsep + old if old else ""))


def ensure_torch(version: str) -> str:
    """`.torch/VERSION` holding torch==VERSION alone (plus, for a CUDA build, the nvidia-*
    packages it needs to import); returns the folder to put first on PYTHONPATH."""
    where = os.path.join(ROOT, ".torch", version)
    if torch_at(where) == version:
        return where
    shutil.rmtree(where, ignore_errors=True)
    # no cache: a CUDA build's ~3 GB would be kept twice, and .torch/VERSION is kept anyway
    pip = [PY, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-cache-dir"]
    pip += ["--target", where]
    sh(*pip, "--no-deps", *index_args(), f"torch=={version}")
    if torch_at(where) is None:  # a CUDA build does not import without its libraries
        sh(*pip, "--upgrade", *index_args(), f"torch=={version}")
    return where


def torch_at(where: str) -> str | None:
    """The version of the torch in `where` (without its local part), None when none imports
    from there."""
    probe = [PY, "-c", "import torch; print(torch.__version__.split('+')[0], torch.__file__)"]
    out = subprocess.run(probe, capture_output=True, text=True, env=with_path(where)).stdout.split()
    inside = len(out) == 2 and out[1].startswith(os.path.join(where, ""))
    return out[0] if inside else None


def run_range(rest: list[str]) -> int:
    """The range subset on each end asked for (both by default), one after the other; a line
    per end at the end: its exit status, install and test seconds."""
    ends = [a for a in rest if a in RANGE] or list(RANGE)
    args = [a for a in rest if a not in RANGE]
    worst, lines = 0, []
    for end in ends:
        t0 = time.monotonic()
        where = ensure_torch(RANGE[end])
        t1 = time.monotonic()
        print(f"== torch {RANGE[end]} ({end} of the tested range)", flush=True)
        env = with_path(where)
        # its notebooks are not the course's: the site renders the whole suite's (pinned torch)
        env.pop("LABKIT_EXECUTED_DIR", None)
        code = subprocess.call([PY, "-m", "pytest", *RANGE_TESTS, *args], env=env)
        worst = max(worst, code)
        lines.append(
            f"== range: torch {RANGE[end]} ({end}) exit {code}, install {t1 - t0:.0f} s, "
            f"tests {time.monotonic() - t1:.0f} s"
        )
    print("\n".join(lines), flush=True)
    return worst


def main() -> int:
    cmd = sys.argv[1] if len(sys.argv) > 1 else "test"
    rest = sys.argv[2:]
    ensure_env()
    os.chdir(ROOT)
    # the notebooks that `test` and `check` execute are saved here, for `docs` to render
    os.environ.setdefault("LABKIT_EXECUTED_DIR", os.path.join(ROOT, "build", "executed"))
    if cmd == "lab":  # become the lab, so Ctrl-C or a container's stop reaches Jupyter
        sys.stdout.flush()
        os.execv(PY, [PY, "-m", "labkit", "lab", *rest])
    if cmd == "setup":
        ensure_test_packages()
        return 0
    if cmd == "test":
        ensure_test_packages()
        return run_tests(rest)
    if cmd == "bench":
        return subprocess.call([PY, "-m", "labkit.tools.bench", *rest])
    if cmd == "check":
        return subprocess.call([PY, "-m", "labkit", "check", *rest])
    if cmd == "docs":
        return subprocess.call([PY, os.path.join(ROOT, "scripts", "build_site.py"), *rest])
    if cmd == "range":
        return run_range(rest)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
