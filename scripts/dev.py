"""Set-up and entry points for people and CI: `python3 scripts/dev.py lab|test|bench|check`.

Creates `.venv` beside this repository (if missing), installs torch==2.13.0 first and then
labkit with its test extras in editable mode, then runs the command:

- lab:   JupyterLab on notebooks/ (http://127.0.0.1:8888)
- test:  the test suite (installs Debian's chromium for the browser test when it can)
- bench: the performance benchmark (python -m labkit.tools.bench)
- check: every notebook top to bottom (labkit check)

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


def ensure_chromium() -> None:
    if shutil.which("chromium"):
        return
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        sh("apt-get", "update", "-qq", env=env)
        sh("apt-get", "install", "-y", "-qq", "chromium", env=env)
    else:
        print(
            "chromium not found and cannot install it here: the browser test will skip",
            file=sys.stderr,
        )


def main() -> int:
    cmd = sys.argv[1] if len(sys.argv) > 1 else "test"
    rest = sys.argv[2:]
    ensure_env()
    os.chdir(ROOT)
    if cmd == "lab":
        return subprocess.call([PY, "-m", "labkit", "lab", *rest])
    if cmd == "test":
        ensure_chromium()
        return subprocess.call([PY, "-m", "pytest", *rest])
    if cmd == "bench":
        return subprocess.call([PY, "-m", "labkit.tools.bench", *rest])
    if cmd == "check":
        return subprocess.call([PY, "-m", "labkit", "check", *rest])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
