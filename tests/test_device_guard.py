"""The curriculum follows the lab's `device`: no notebook or teaching module pins tensors, meshes,
pipeline stages, checkpoints or autocast to the CPU (a source scan; no ranks).

Every "cpu" string literal in a code cell of notebooks/*.ipynb and in labkit/parallel/*.py and
labkit/exercises/*.py is a finding, unless its line is in ALLOWED with the reason CPU is meant
there. An entry that no longer matches a line fails too, so the list stays reviewed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CPU_LITERAL = re.compile(r"""(?<![\w.])(["'])cpu\1""")

# (file relative to the repo, the line stripped) -> why the CPU is meant there
ALLOWED: dict[tuple[str, str], str] = {
    (
        "labkit/parallel/context_parallel.py",
        'DEVICE_TYPES = {"cpu": 0, "cuda": 1}',
    ): "live_peak: the profiler's numbers for device types, a table, not a placement",
    (
        "labkit/parallel/async_sgd.py",
        'HEADER_DEVICE = torch.device("cpu")',
    ): "the server receives headers from any source, which gloo does and NCCL does not",
    (
        "labkit/parallel/layer_split.py",
        'return first.device if first is not None else torch.device("cpu")',
    ): "module_device: a module without parameters has no device to follow",
    (
        "labkit/parallel/grad_clipping.py",
        'return grads[0].device if grads else torch.device("cpu")',
    ): "a rank that holds no gradient has no device to follow",
    (
        "labkit/parallel/collective_sweep.py",
        'device: Any = "cpu",',
    ): "a default for callers that pass none; notebook 14 passes the lab's device",
    (
        "notebooks/22_dp_vs_ddp.ipynb",
        'cpu = torch.device("cpu")',
    ): "shows, in the kernel, that DataParallel's scatter/replicate refuse CPU devices",
    (
        "notebooks/23_accumulation_clipping_syncbn.ipynb",
        'if kind == "cpu":',
    ): "branches on the rank's device type: SyncBatchNorm refuses CPU inputs",
    (
        "labkit/parallel/mixed_precision.py",
        'AUTOCAST_DEVICES = ("cpu", "cuda")',
    ): "the device types torch.autocast takes, each with its own rules (notebook 37)",
    (
        "labkit/parallel/mixed_precision.py",
        'device_type: str = "cpu",',
    ): "the autocast formula's default device type; callers pass the rank's",
    (
        "labkit/parallel/mixed_precision.py",
        'core = lo * 4 * th + (lo if device_type == "cpu" else 4 + lo) * probs',
    ): "CUDA autocast keeps softmax in fp32, CPU autocast does not: the formula branches on it",
    (
        "labkit/parallel/zero_redundancy.py",
        'def __init__(self, device_type: str = "cpu") -> None:',
    ): "AllocationPeak's default device type; notebooks 26 and 42 pass the rank's",
    (
        "notebooks/26_zero_fsdp.ipynb",
        'if p["device"] == "cpu":',
    ): "exact peak bounds are asserted on CPU ranks only; a GPU's streams free later",
    (
        "notebooks/35_expert_parallel.ipynb",
        'if device.type == "cpu" else None',
    ): "bytes are counted on sockets only on CPU ranks; NCCL passes no socket",
    (
        "notebooks/37_memory_of_a_step.ipynb",
        'dev = "cuda" if on_gpu else "cpu"',
    ): "the autocast device type follows the rank's device",
    (
        "notebooks/38_sequence_parallel.ipynb",
        'on_sockets = device.type == "cpu" or "nccl" not in dist.get_backend()',
    ): "bytes are counted on sockets only where gloo carries them",
    (
        "notebooks/39_two_d_parallelism.ipynb",
        'on_sockets = device.type == "cpu" or "nccl" not in dist.get_backend()',
    ): "bytes are counted on sockets only where gloo carries them",
    (
        "notebooks/42_finding_a_configuration.ipynb",
        'on_cpu = lab.pull("peak_device")[0] == "cpu"',
    ): "exact peak bounds are asserted on CPU ranks only; a GPU's streams free later",
    (
        "notebooks/42_finding_a_configuration.ipynb",
        'with AllocationPeak("cpu") as fwd:',
    ): "the loss's peak is measured on CPU tensors made for it, whatever the lab's device",
    (
        "notebooks/42_finding_a_configuration.ipynb",
        'with AllocationPeak("cpu") as bwd:',
    ): "the loss's peak is measured on CPU tensors made for it, whatever the lab's device",
    (
        "notebooks/36_context_parallel.ipynb",
        'seconds, cpu_ranks = lab.pull("seconds"), '
        'set(lab.pull("device.type").values()) == {"cpu"}',
    ): "compute times are asserted on CPU ranks only; GPU kernels this small follow launches",
}


def _code_lines() -> list[tuple[str, str]]:
    """(file, stripped line) for every code line of the curriculum, comments dropped."""
    out = []
    for path in sorted((ROOT / "labkit" / "parallel").glob("*.py")) + sorted(
        (ROOT / "labkit" / "exercises").glob("*.py")
    ):
        for line in path.read_text().splitlines():
            out.append((path.relative_to(ROOT).as_posix(), line))
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code":
                for line in "".join(cell["source"]).splitlines():
                    out.append((path.relative_to(ROOT).as_posix(), line))
    return [(f, line.split("#", 1)[0].strip()) for f, line in out]


def findings(lines: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(f, line) for f, line in lines if CPU_LITERAL.search(line) and (f, line) not in ALLOWED]


def test_no_cpu_literal_outside_the_allow_list() -> None:
    bad = findings(_code_lines())
    assert not bad, "code that pins the CPU instead of using the lab's `device`:\n" + "\n".join(
        f"  {f}: {line}" for f, line in bad
    )


def test_every_allowed_line_still_exists() -> None:
    lines = set(_code_lines())
    stale = [key for key in ALLOWED if key not in lines]
    assert not stale, f"allow-list entries that match no line any more: {stale}"


def test_the_scan_finds_what_it_guards_against() -> None:
    # the lines the curriculum had before it followed the device (issue 12)
    before = [
        ("labkit/parallel/tensor_parallel.py", 'mesh = init_device_mesh("cpu", (n,))'),
        ("labkit/parallel/pipeline_parallel.py", 'PipelineStage(m, 0, 2, torch.device("cpu"))'),
        ("notebooks/24_checkpoints.ipynb", 'torch.load(path, map_location="cpu")'),
        ("notebooks/34_x.ipynb", "with torch.autocast(device_type='cpu'):"),
    ]
    assert findings(before) == before
    fine = [("labkit/parallel/x.py", "t.cpu().tolist()"), ("x.py", 'f"{device}:cpu"')]
    assert findings(fine) == []


class _Reached(Exception):
    """Raised by a stand-in once it has seen the device it was given."""


def test_teaching_code_follows_a_device_that_is_not_the_cpu(monkeypatch) -> None:
    # torch's "meta" device: tensors with shapes and no data, so no GPU and no ranks are needed
    import torch
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh
    import torch.distributed.pipelining as pipelining
    from torch import nn

    from labkit.parallel.data_parallel import make_mlp
    from labkit.parallel.layer_split import module_device
    from labkit.parallel.pipeline_parallel import torch_pipeline_step
    from labkit.parallel.tensor_parallel import dtensor_mlp
    from labkit.parallel.zero_redundancy import fully_shard_model

    meta = torch.device("meta")
    assert {p.device for p in make_mlp(0, device=meta).parameters()} == {meta}
    assert module_device(nn.Linear(2, 2, device=meta)) == meta
    assert module_device(nn.ReLU()) == torch.device("cpu")  # no parameters: nothing to follow

    seen = {}

    def fake_mesh(device_type, shape, **kwargs):
        seen["mesh"] = device_type
        raise _Reached

    def fake_stage(module, stage, num_stages, device, **kwargs):
        seen["stage"] = device
        raise _Reached

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(device_mesh, "init_device_mesh", fake_mesh)
    monkeypatch.setattr(pipelining, "PipelineStage", fake_stage)
    fc1, fc2 = nn.Linear(4, 8, device=meta), nn.Linear(8, 4, device=meta)
    with pytest.raises(_Reached):
        dtensor_mlp(fc1, fc2)
    with pytest.raises(_Reached):
        torch_pipeline_step(nn.Linear(4, 4, device=meta), None, None, nn.MSELoss(), 2)
    assert seen == {"mesh": "meta", "stage": meta}
    # FSDP2's own default mesh is the machine's accelerator, whatever device the ranks use
    seen.clear()
    with pytest.raises(_Reached):
        fully_shard_model(nn.Sequential(nn.Linear(4, 4, device=meta)))
    assert seen == {"mesh": "meta"}
