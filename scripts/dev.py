"""Set-up and entry points for people and CI: `python3 scripts/dev.py lab|test|bench|check|docs`.

Creates `.venv` beside this repository (if missing), installs torch==2.13.0 first and then
labkit with its test extras in editable mode, then runs the command:

- lab:   JupyterLab on notebooks/ (http://127.0.0.1:8888)
- test:  the test suite (installs Debian's chromium and Slurm for their tests when it can)
- bench: the performance benchmark (python -m labkit.tools.bench)
- check: every notebook top to bottom (labkit check)
- docs:  the course site into build/site/ (scripts/build_site.py), from the notebooks that
         `test` and `check` executed and saved in build/executed/ ($LABKIT_EXECUTED_DIR); offline

Set LABKIT_TORCH to install another torch requirement (e.g. "torch" for the newest).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(ROOT, ".venv")
PY = os.path.join(VENV, "bin", "python")


def sh(*cmd: str, **kw) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def ensure_env() -> None:
    if not os.path.exists(PY):
        sh(sys.executable, "-m", "venv", VENV)
    pip = [PY, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    torch_req = os.environ.get("LABKIT_TORCH", "torch==2.13.0")
    probe = subprocess.run([PY, "-c", "import torch"], capture_output=True)
    if probe.returncode != 0:
        sh(*pip, torch_req)
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
    if cmd == "test":
        ensure_test_packages()
        return subprocess.call([PY, "-m", "pytest", *rest])
    if cmd == "bench":
        return subprocess.call([PY, "-m", "labkit.tools.bench", *rest])
    if cmd == "check":
        return subprocess.call([PY, "-m", "labkit", "check", *rest])
    if cmd == "docs":
        return subprocess.call([PY, os.path.join(ROOT, "scripts", "build_site.py"), *rest])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
