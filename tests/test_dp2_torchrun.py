"""examples/ddp_digits.py under a real torchrun (2 processes, one host) equals one process."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from labkit.parallel.data_parallel import make_mlp, train_reference
from labkit.parallel.datasets import load_digits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "ddp_digits.py")


def _torchrun(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    return subprocess.run(
        [*cmd, SCRIPT, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


@pytest.mark.timeout(180)
def test_ddp_digits_under_torchrun_equals_one_process(tmp_path):
    ckpt = tmp_path / "digits.pt"
    proc = _torchrun("--epochs", "2", "--checkpoint", str(ckpt))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = re.search(r"final loss (\d+\.\d+)", proc.stdout)
    assert m, proc.stdout
    assert "world_size 2 steps 28 identical True" in proc.stdout  # 2 epochs x (898 // 64 = 14)
    X, y = load_digits()
    ref = make_mlp(seed=0)
    history = train_reference(ref, X, y, 2, 128, 0.5, 0, world_size=2)
    assert abs(float(m.group(1)) - history[-1]["loss"]) < 1e-5
    import torch

    state = torch.load(ckpt, weights_only=True)  # rank 0's checkpoint: the reference weights
    assert state["extra"] == {"steps": 28}
    diff = max((state["model"][k] - v).abs().max().item() for k, v in ref.state_dict().items())
    assert diff < 1e-5


def _example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("ddp_digits", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "local_world_size,gpus,want",
    [
        (2, 1, ["cpu", "cpu"]),  # one GPU, two ranks: both on the CPU, never nccl beside gloo
        (2, 2, ["cuda:0", "cuda:1"]),
        (4, 8, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]),
        (2, 0, ["cpu", "cpu"]),
    ],
)
def test_every_rank_of_the_example_picks_the_same_backend(local_world_size, gpus, want):
    choose = _example().choose_device
    picks = [choose(r, local_world_size, gpus) for r in range(local_world_size)]
    assert [device for device, _ in picks] == want
    assert len({backend for _, backend in picks}) == 1  # the old rule gave nccl and gloo
