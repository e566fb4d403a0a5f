"""Which collectives gloo survives on CUDA tensors, with and without labkit (a developers' tool
for a lent GPU machine: `scripts/gpu_check.py --probe` runs it).

Each op runs on 4 ranks sharing GPU 0 over gloo, twice: in plain processes under
`torchrun --standalone` (one torchrun per op, 4 at a time, so a crash ends only that op's run),
and in one `labkit.Lab(4, device="cuda")` (one cell per op; a rank that dies is restarted by the
lab). Prints one row per op: plain torchrun's result and the lab's (ok, the error's last line,
or the signal that ended a rank), and whether the values were right.

    python3 scripts/gpu_probe_ops.py [--device cuda] [OP...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

# op -> code run on every rank (rank, world_size, dev, dist, torch in scope); it must leave
# `ok` True when the values are right
OPS = {
    "all_reduce": "t = torch.ones(4, device=dev); dist.all_reduce(t); ok = t.sum().item() == 16",
    "broadcast": "t = torch.full((4,), float(rank), device=dev); dist.broadcast(t, 0); "
    "ok = t.sum().item() == 0",
    "all_gather": "out = [torch.empty(2, device=dev) for _ in range(4)]; "
    "dist.all_gather(out, torch.full((2,), float(rank), device=dev)); "
    "ok = torch.cat(out).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]",
    "all_gather_into_tensor": "out = torch.empty(8, device=dev); "
    "dist.all_gather_into_tensor(out, torch.full((2,), float(rank), device=dev)); "
    "ok = out.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]",
    "all_gather_into_tensor_async": "out = torch.empty(8, device=dev); "
    "w = dist.all_gather_into_tensor(out, torch.full((2,), float(rank), device=dev), "
    "async_op=True); w.wait(); ok = out.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]",
    "reduce_scatter_tensor": "out = torch.empty(2, device=dev); "
    "dist.reduce_scatter_tensor(out, torch.arange(8., device=dev)); "
    "ok = out.tolist() == [8. * rank, 8. * rank + 4]",
    "reduce_scatter_tensor_async": "out = torch.empty(2, device=dev); "
    "w = dist.reduce_scatter_tensor(out, torch.arange(8., device=dev), async_op=True); "
    "w.wait(); ok = out.tolist() == [8. * rank, 8. * rank + 4]",
    "reduce_scatter_list": "out = torch.empty(2, device=dev); "
    "dist.reduce_scatter(out, [torch.ones(2, device=dev) for _ in range(4)]); "
    "ok = out.tolist() == [4., 4.]",
    "all_to_all_single": "out = torch.empty(4, device=dev); "
    "dist.all_to_all_single(out, torch.full((4,), float(rank), device=dev)); "
    "ok = out.tolist() == [0., 1., 2., 3.]",
    "gather": "g = [torch.empty(2, device=dev) for _ in range(4)] if rank == 0 else None; "
    "dist.gather(torch.full((2,), float(rank), device=dev), g, dst=0); "
    "ok = rank != 0 or torch.cat(g).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]",
    "scatter": "out = torch.empty(2, device=dev); "
    "dist.scatter(out, [torch.full((2,), float(r), device=dev) for r in range(4)] "
    "if rank == 0 else None, src=0); ok = out.tolist() == [rank, rank]",
    "reduce": "t = torch.ones(2, device=dev); dist.reduce(t, 0); "
    "ok = rank != 0 or t.tolist() == [4., 4.]",
    "funcol_all_gather": "import torch.distributed._functional_collectives as fc; "
    "out = fc.all_gather_tensor(torch.full((2,), float(rank), device=dev), 0, "
    "list(range(4))); ok = out.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]",
    "funcol_reduce_scatter": "import torch.distributed._functional_collectives as fc; "
    "out = fc.reduce_scatter_tensor(torch.arange(8., device=dev), 'sum', 0, list(range(4))); "
    "ok = out.tolist() == [8. * rank, 8. * rank + 4]",
    "funcol_all_reduce": "import torch.distributed._functional_collectives as fc; "
    "out = fc.all_reduce(torch.ones(4, device=dev), 'sum', list(range(4))); "
    "ok = out.sum().item() == 16",
    "funcol_all_to_all": "import torch.distributed._functional_collectives as fc; "
    "out = fc.all_to_all_single(torch.full((4,), float(rank), device=dev), None, None, "
    "list(range(4))); ok = out.tolist() == [0., 1., 2., 3.]",
    "dtensor_full_tensor": "from torch.distributed.device_mesh import init_device_mesh; "
    "from torch.distributed.tensor import distribute_tensor, Shard; "
    "mesh = init_device_mesh(dev.type, (4,)); "
    "d = distribute_tensor(torch.arange(8., device=dev), mesh, [Shard(0)]); "
    "ok = d.full_tensor().tolist() == list(range(8))",
    "fsdp2_step": "from torch.distributed.fsdp import fully_shard; "
    "torch.manual_seed(0); m = torch.nn.Linear(8, 8).to(dev); fully_shard(m); "
    "m(torch.ones(2, 8, device=dev)).sum().backward(); ok = m.weight.grad is not None",
    "send_recv": "t = torch.full((4,), float(rank), device=dev); "
    "(dist.send(t, rank + 1) if rank % 2 == 0 else dist.recv(t, rank - 1)); "
    "ok = t.tolist() == [float(rank - rank % 2)] * 4",
}

PLAIN = """
import os, sys, faulthandler
faulthandler.enable()
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
dev = torch.device("{device}", 0) if "{device}" == "cuda" else torch.device("cpu")
if dev.type == "cuda":
    torch.cuda.set_device(dev)
{code}
torch.cuda.synchronize() if dev.type == "cuda" else None
os.write(1, f"RESULT {{rank}} {{ok}}\\n".encode())  # one write: lines of 4 ranks stay whole
dist.barrier()
dist.destroy_process_group()
"""


def plain(op: str, device: str, folder: str) -> str:
    path = os.path.join(folder, f"{op}.py")
    with open(path, "w") as f:
        f.write(PLAIN.format(device=device, code=OPS[op]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    try:
        done = subprocess.run(cmd + [path], capture_output=True, text=True, timeout=45)
    except subprocess.TimeoutExpired:
        return "timeout (45 s)"
    results = [ln.split() for ln in done.stdout.splitlines() if ln.startswith("RESULT")]
    if done.returncode == 0 and len(results) == 4:
        return "ok" if all(r[2] == "True" for r in results) else "WRONG values"
    text = done.stdout + done.stderr
    for sig in ("SIGSEGV", "SIGABRT", "Segmentation fault", "Aborted"):
        if sig in text:
            return f"crash ({sig})"
    lines = [ln for ln in text.splitlines() if "Error" in ln and "***" not in ln]
    return ("error: " + (lines[-1] if lines else text.strip().splitlines()[-1]))[:110]


def in_lab(ops: list[str], device: str) -> dict[str, str]:
    import labkit

    out = {}
    lab = labkit.Lab(4, device=device)
    try:
        for op in ops:
            try:
                res = lab.run(f"dev = device\n{OPS[op]}\nok", timeout=30, display=False)
                errors = [res[r].error for r in res if res[r].error]
                if errors:
                    out[op] = ("error: " + str(errors[0]).strip().splitlines()[-1])[:110]
                else:
                    vals = [res[r].value for r in sorted(res)]
                    out[op] = "ok" if all(vals) else f"WRONG values {vals}"
            except Exception as err:  # noqa: BLE001 - a rank died: say so, go on
                first = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
                out[op] = f"lab: {type(err).__name__}: {first}"[:110]
    finally:
        lab.stop()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ops", nargs="*")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = p.parse_args()
    ops = args.ops or list(OPS)
    with tempfile.TemporaryDirectory(prefix="labkit-probe-") as folder:
        with ThreadPoolExecutor(4) as pool:
            plain_res = dict(zip(ops, pool.map(lambda o: plain(o, args.device, folder), ops)))
    lab_res = in_lab(ops, args.device)
    print(f"{'op (4 ranks on one ' + args.device + ', gloo)':<32} {'torchrun':<40} lab")
    for op in ops:
        print(f"{op:<32} {plain_res[op]:<40} {lab_res[op]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
