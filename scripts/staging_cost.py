"""What labkit's host staging adds to a point-to-point call per MB (a developers' tool).

A staged send copies its tensor to the host (`t.to("cpu", copy=True)`: D2H on a GPU), a staged
recv copies what arrived into the user's tensor (`t.copy_(host)`: H2D); labkit.rank.host_staging
makes exactly these two calls. This times them on DEVICE for several sizes (median of REPEAT,
synchronised on CUDA) and prints ms per MB for each direction and their sum. On a CPU both are
memory copies; on a GPU they are transfers over PCIe or NVLink-C2C, which only a lent GPU can
measure (scripts/gpu_check.py runs this with --device cuda).

    python scripts/staging_cost.py [--device cpu|cuda] [--sizes-mb 1 4 16 64] [--repeat 9]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _timed(fn, sync) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def measure(device: str, sizes_mb: list[float], repeat: int) -> list[dict]:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    rows = []
    for mb in sizes_mb:
        t = torch.randn(int(mb * 2**20) // 4, device=device)
        host = t.to("cpu", copy=True)
        d2h = statistics.median(
            _timed(lambda t=t: t.to("cpu", copy=True), sync) for _ in range(repeat)
        )
        h2d = statistics.median(
            _timed(lambda t=t, host=host: t.copy_(host), sync) for _ in range(repeat)
        )
        rows.append({"mb": mb, "d2h_ms_per_mb": d2h * 1e3 / mb, "h2d_ms_per_mb": h2d * 1e3 / mb})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args(argv)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"staging copies on {args.device} ({name}), torch {torch.__version__}, MiB = 2**20 B")
    print(
        f"{'MiB':>6}  {'D2H ms/MiB':>10}  {'H2D ms/MiB':>10}  {'both ms/MiB':>11}  {'GB/s both':>9}"
    )
    for row in measure(args.device, args.sizes_mb, args.repeat):
        both = row["d2h_ms_per_mb"] + row["h2d_ms_per_mb"]
        print(
            f"{row['mb']:>6g}  {row['d2h_ms_per_mb']:>10.4f}  {row['h2d_ms_per_mb']:>10.4f}  "
            f"{both:>11.4f}  {2**20 / (both / 1e3) / 1e9:>9.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
