#!/bin/bash
# The GPU check on a lent GPU machine that has torch but no Jupyter packages (a developers' tool):
# installs the wheels in .whl/ (the versions CI installs, downloaded for that machine's Python)
# into /tmp/site, records the machine, then runs `pytest -m gpu tests/test_gpu.py` beside the
# notebooks on cuda in three shards (scripts/gpu_notebooks.py), everything written under $OUT.
# Where torch is older than 2.13 the ranks provide its two collective names themselves
# (labkit.rank.torch_compat), so no shim is needed. NB_S: the notebooks' limit.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /tmp/install.log 2>&1 || { echo "install failed"; tail -20 /tmp/install.log; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc
  python3 -c "import sys, torch, torch.distributed as d; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(), torch.cuda.device_count(), torch.cuda.get_device_name(0), 'nccl', d.is_nccl_available())"
  timeout 60 python3 -m labkit doctor; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
ls notebooks/*.ipynb > /tmp/nbs
timeout 240 python3 -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider -rA > "$OUT/gpu_tests.txt" 2>&1 &
for i in 0 1 2; do
  timeout "${NB_S:-330}" python3 scripts/gpu_notebooks.py "$OUT/nb_errors$i.txt" $(awk "NR%3==$i" /tmp/nbs) > "$OUT/nb$i.txt" 2>&1 &
done
wait
echo "--- gpu tests"; tail -25 "$OUT/gpu_tests.txt"
echo "--- notebooks"; cat "$OUT"/nb[012].txt
