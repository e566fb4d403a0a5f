"""Tensors made plottable (kernel side, pure data): kind by shape, shared scale, block means.

A value from a rank (tensor, ndarray or number) becomes a `TensorInfo`: a float64 array plus the
shape, dtype and device the panel header states. Nothing here draws; `tensors.py` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "Scale",
    "TensorInfo",
    "as_2d",
    "downsample",
    "fmt_value",
    "shared_scale",
    "summary_text",
    "to_info",
]

MAX_SIDE = 32  # heatmaps up to 32x32 are drawn cell by cell
MAX_NUMEL = 1024  # beyond this a tensor is summarised
TEXT_NUMEL = 100  # values are written in cells up to this many elements
HTML_SIDE = 16  # static HTML shows at most 16x16 values


@dataclass
class Scale:
    """One colour scale shared by every panel of a view."""

    zmin: float
    zmax: float
    colorscale: str


@dataclass
class TensorInfo:
    """A value made plottable: float64 array plus what the header says about the original."""

    array: np.ndarray
    shape: tuple[int, ...]
    dtype: str
    device: str

    @property
    def kind(self) -> str:
        """'empty', 'bars', 'heatmap' or 'summary'."""
        a = self.array
        if a.size == 0:
            return "empty"
        if a.size > MAX_NUMEL or (a.ndim == 2 and max(a.shape) > MAX_SIDE):
            return "summary"
        return "bars" if a.ndim <= 1 else "heatmap"

    def header(self, rank: int, label: str = "") -> str:
        shape = "scalar" if not self.shape else str(tuple(self.shape))
        prefix = f"{label} · " if label else ""
        return f"{prefix}rank {rank} · {shape} {self.dtype} · {self.device}"


def to_info(value: Any, device: str | None = None) -> TensorInfo:
    """Convert a tensor, ndarray or number; raises ValueError for non-numeric values."""
    dtype, dev = type(value).__name__, "cpu"
    if hasattr(value, "detach") and hasattr(
        value, "dtype"
    ):  # a torch.Tensor, without importing torch
        dtype, dev = str(value.dtype).removeprefix("torch."), str(value.device)
        value = value.detach().cpu()
        if value.is_complex():
            value = value.abs()
        value = value.double().numpy() if value.dtype.is_floating_point else value.numpy()
    elif isinstance(value, np.ndarray):
        dtype = str(value.dtype)
    arr = np.asarray(value)
    if arr.dtype.kind == "c":
        arr = np.abs(arr)
    if arr.dtype.kind not in "biuf":
        raise ValueError(f"cannot draw a value of type {type(value).__name__} ({arr.dtype})")
    return TensorInfo(arr.astype(np.float64), tuple(arr.shape), dtype, device or dev)


def shared_scale(infos: Sequence[TensorInfo]) -> Scale:
    """Min/max over every finite value of every panel; symmetric and diverging across zero."""
    finite = [a[np.isfinite(a)] for a in (i.array.ravel() for i in infos)]
    finite = [a for a in finite if a.size]
    if not finite:
        return Scale(0.0, 1.0, "Viridis")
    lo = float(min(a.min() for a in finite))
    hi = float(max(a.max() for a in finite))
    if lo < 0 < hi:
        m = max(-lo, hi)
        return Scale(-m, m, "RdBu_r")
    if lo == hi:
        return Scale(lo - 0.5, hi + 0.5, "Viridis")
    return Scale(lo, hi, "Viridis")


def fmt_value(v: float) -> str:
    return f"{v:.0f}" if float(v).is_integer() and abs(v) < 1e6 else f"{v:.3g}"


def as_2d(a: np.ndarray) -> np.ndarray:
    if a.ndim == 0:
        return a.reshape(1, 1)
    if a.ndim == 1:
        return a.reshape(1, -1)
    return a.reshape(-1, a.shape[-1])


def downsample(a: np.ndarray, side: int = MAX_SIDE) -> np.ndarray:
    """Block means of a 2-D array to at most side x side (blocks as even as np.array_split)."""
    rows, cols = a.shape
    r = np.array([c[0] for c in np.array_split(np.arange(rows), min(rows, side))])
    c = np.array([c[0] for c in np.array_split(np.arange(cols), min(cols, side))])
    sums = np.add.reduceat(np.add.reduceat(a, r, axis=0), c, axis=1)
    counts = np.outer(np.diff(np.append(r, rows)), np.diff(np.append(c, cols)))
    return sums / counts


def summary_text(info: TensorInfo) -> str:
    a = info.array
    return (
        f"min {fmt_value(a.min())}  max {fmt_value(a.max())}  mean {a.mean():.4g}  "
        f"norm {np.linalg.norm(a.ravel()):.4g}"
    )
