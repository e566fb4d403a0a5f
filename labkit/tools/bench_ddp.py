"""A DDP training step in a lab against the same step under torchrun (kernel side, a benchmark).

labkit observes and never alters: a DDP model in a lab runs DDP's own C++ all_reduce, and its
buckets are recorded from torch's Flight Recorder (labkit.rank.ddp_tracing). What is left to
cost time is what a lab adds around the user's code (the wrapped `torch.distributed` calls, the
Flight Recorder, the rank's threads). This measures it: the same step code runs

- in a lab (`Lab(n, device=...)`, one cell per round), and
- under `torchrun --standalone --nproc-per-node=n` (a script written to a temporary folder),

each timing `STEPS` steps after `WARMUP` inside the ranks (synchronising the GPU around each
step), alternating lab, torchrun, lab, torchrun, ... for `rounds` rounds in one run, so both see
the same machine. The result is rank 0's median step in each round and the ratio of the medians
of the rounds (lab / torchrun). Both use the lab's backend and the same number of torch threads.

    python -m labkit.bench --ddp [--device cuda] [--ranks 1] [--model issue|bench] [--rounds 3]

Models: `issue` is 8 x (Linear(4096) + ReLU), batch 512, fp32 (issue 32's measurement on an
H200); `bench` is 4 x (Linear(512) + ReLU), batch 64 (small enough for CPU ranks).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

MODELS = {"issue": (4096, 8, 512), "bench": (512, 4, 64)}  # width, depth, batch

STEP = '''
def _labkit_ddp_step_median(dev, width, depth, batch, steps, warmup, threads):
    """Rank side: the median of `steps` DDP training steps (seconds) after `warmup`."""
    import statistics as _st
    import time as _time

    import torch as _torch
    from torch.nn.parallel import DistributedDataParallel as _DDP

    _torch.set_num_threads(threads)
    dev = _torch.device(dev)
    _torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [_torch.nn.Linear(width, width), _torch.nn.ReLU()]
    model = _torch.nn.Sequential(*layers).to(dev)
    ddp = _DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = _torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x = _torch.randn(batch, width, device=dev)
    y = _torch.randn(batch, width, device=dev)
    sync = (lambda: _torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    times = []
    for i in range(warmup + steps):
        sync()
        t = _time.perf_counter()
        opt.zero_grad(set_to_none=True)
        _torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        sync()
        if i >= warmup:
            times.append(_time.perf_counter() - t)
    del ddp, model, opt
    return _st.median(times)
'''

TORCHRUN_MAIN = """
import json, os, sys
import torch
import torch.distributed as dist

dist.init_process_group({backend!r})
local = int(os.environ["LOCAL_RANK"])
dev = {device!r}
if dev == "cuda":
    dev = f"cuda:{{local % torch.cuda.device_count()}}"
    torch.cuda.set_device(dev)
m = _labkit_ddp_step_median(dev, {width}, {depth}, {batch}, {steps}, {warmup}, {threads})
if dist.get_rank() == 0:
    print("LABKIT_DDP_MEDIAN", json.dumps(m), flush=True)
dist.destroy_process_group()
"""


def _threads(n: int) -> int:
    return max(1, (os.cpu_count() or 1) // n)


def torchrun_median(
    n: int,
    backend: str,
    device: str,
    model: tuple[int, int, int],
    steps: int,
    warmup: int,
    threads: int,
    folder: str,
    timeout: float = 600,
) -> float:
    """Rank 0's median step under `torchrun --standalone` (our own child, waited for)."""
    width, depth, batch = model
    script = os.path.join(folder, "ddp_step.py")
    with open(script, "w") as f:
        f.write(
            STEP
            + TORCHRUN_MAIN.format(
                backend=backend,
                device=device,
                width=width,
                depth=depth,
                batch=batch,
                steps=steps,
                warmup=warmup,
                threads=threads,
            )
        )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={n}",
        script,
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    for line in done.stdout.splitlines():
        if line.startswith("LABKIT_DDP_MEDIAN "):
            return float(json.loads(line.split(" ", 1)[1]))
    raise RuntimeError(
        f"torchrun's DDP step printed no median (exit {done.returncode}):\n"
        + (done.stdout + done.stderr)[-3000:]
    )


def lab_median(
    lab: Any, device: str, model: tuple[int, int, int], steps: int, warmup: int, threads: int
) -> float:
    """Rank 0's median step in a cell of `lab` (the same code as under torchrun)."""
    width, depth, batch = model
    dev = "device" if device == "cuda" else repr(device)
    code = STEP + (
        f"_labkit_ddp_step_median(str({dev}), {width}, {depth}, {batch}, {steps}, {warmup}, "
        f"{threads})"
    )
    res = lab.run(code, display=False)
    for r in sorted(res):
        if res[r].error:
            raise RuntimeError(f"rank {r}: the DDP step failed in the lab:\n{res[r].error}")
    return float(res[0].value)


def ddp_ratio(
    n: int = 1,
    device: str = "cpu",
    model: str = "bench",
    rounds: int = 3,
    steps: int = 60,
    warmup: int = 10,
    progress: Any = print,
) -> dict[str, Any]:
    """Alternate lab and torchrun `rounds` times; {lab_s, torchrun_s (per round), ratio, ...}."""
    if model not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {model!r}")
    if rounds < 1 or steps < 1 or warmup < 0:
        raise ValueError(
            f"rounds and steps must be 1 or more, warmup 0 or more; got "
            f"rounds={rounds}, steps={steps}, warmup={warmup}"
        )
    from labkit import Lab
    from labkit.tools.bench_labkit import settled

    shape = MODELS[model]
    threads = _threads(n)
    folder = tempfile.mkdtemp(prefix="labkit-bench-ddp-")
    lab = settled(Lab(n, device=device, threads=threads))
    try:
        backend = lab.choice.backend
        lab_s, run_s = [], []
        for i in range(rounds):
            lab_s.append(lab_median(lab, device, shape, steps, warmup, threads))
            run_s.append(torchrun_median(n, backend, device, shape, steps, warmup, threads, folder))
            progress(
                f"  round {i + 1}/{rounds}: lab {lab_s[-1] * 1e3:.3f} ms, "
                f"torchrun {run_s[-1] * 1e3:.3f} ms"
            )
    finally:
        lab.stop()
        shutil.rmtree(folder, ignore_errors=True)
    ratio = statistics.median(lab_s) / statistics.median(run_s)
    return {
        "ranks": n,
        "device": device,
        "backend": backend,
        "model": model,
        "width_depth_batch": shape,
        "steps": steps,
        "warmup": warmup,
        "threads": threads,
        "lab_s": lab_s,
        "torchrun_s": run_s,
        "ratio": ratio,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def line(res: dict[str, Any]) -> str:
    """One line for the report: the ratio and each side's medians."""
    ms = lambda xs: "/".join(f"{x * 1e3:.2f}" for x in xs)  # noqa: E731
    w, d, b = res["width_depth_batch"]
    return (
        f"DDP step, lab / torchrun = {res['ratio']:.3f} ({res['ranks']} rank(s), "
        f"{res['device']}, {res['backend']}, {d} x Linear({w}) batch {b}, median of "
        f"{res['steps']} steps; lab {ms(res['lab_s'])} ms, torchrun {ms(res['torchrun_s'])} ms, "
        f"{len(res['lab_s'])} alternating rounds)"
    )
