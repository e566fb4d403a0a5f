#!/bin/bash
# The GPU check on a lent GPU machine (a developers' tool): now scripts/gpu_check.py, which
# installs the wheels carried in .whl/, runs `pytest -m gpu` beside every notebook on the GPU
# and prints one pass/fail table (docs/gpu.md, "The GPU check"). Kept so older notes still work.
cd "$(dirname "$0")/.." && exec python3 scripts/gpu_check.py "$@"
