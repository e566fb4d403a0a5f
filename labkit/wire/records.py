"""Plain records that cross from ranks to views (runs on both sides; imports nothing heavy).

A rank's tracer produces `CommRecord` and `SpanRecord` values; the kernel gathers them with
`Lab.trace()`; every view takes lists of them (or their `dict` forms), so a view can be built
from a saved trace without ranks or a browser. Times are seconds on the kernel's clock: the rank
subtracts the clock offset estimated at start-up, so timelines of different ranks line up.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# the point-to-point ops: a record of one of these has a `peer`
P2P_OPS = frozenset({"send", "recv", "isend", "irecv"})


@dataclass
class CommRecord:
    """One `torch.distributed` call made by one rank."""

    rank: int  # global rank that made the call
    op: str  # "all_reduce", "send", "irecv", "barrier", ...
    seq: int  # 1-based sequence number of this call on its group, per rank
    group: tuple[int, ...]  # global ranks of the group the call ran on
    peer: int | None = None  # p2p peer, or src/dst of a rooted collective (global rank)
    bytes: int = 0  # S as nccl-tests defines it: the buffer; all_gather: the gathered output
    dtype: str = ""
    shape: tuple[int, ...] = ()
    start: float = 0.0  # issue time (kernel clock, seconds)
    end: float = 0.0  # completion time: for async ops when wait() returned / work completed
    cell: int = 0  # id of the cell that made the call
    line: int | None = None  # line in the user's cell (or file) that made the call
    filename: str = ""
    async_op: bool = False
    reduce_op: str | None = None  # SUM, AVG, MAX, ... where it applies
    device_time: float | None = None  # seconds measured with CUDA events, when on CUDA
    # "" when labkit's wrapper saw the call; "flight_recorder" for a collective torch issued
    # from C++ (DDP's buckets), read from torch's Flight Recorder: start is when torch created
    # it (issued it), end = start (gloo records no completion), no line (labkit.rank.ddp_tracing)
    recorded_by: str = ""
    # how labkit moved the tensors for a device gloo cannot move them on (labkit.rank.
    # host_staging): "d2h" (copied to the host to send), "h2d" (received on the host, copied
    # into the user's tensor), "d2h+h2d"; stage_time: seconds spent in those copies
    staged: str = ""
    stage_time: float = 0.0
    kind: str = field(default="comm", repr=False)

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class SpanRecord:
    """A compute region a user marked with `labkit.span(name)` on a rank."""

    rank: int
    name: str
    start: float
    end: float
    cell: int = 0
    kind: str = field(default="span", repr=False)

    @property
    def duration(self) -> float:
        return self.end - self.start


def to_dict(record: CommRecord | SpanRecord) -> dict[str, Any]:
    return asdict(record)


def from_dict(data: dict[str, Any]) -> CommRecord | SpanRecord:
    """Rebuild a record from its dict form (for saved traces)."""
    data = dict(data)
    kind = data.pop("kind", "comm")
    if kind == "span":
        return SpanRecord(**data)
    for key in ("group", "shape"):
        if key in data and data[key] is not None:
            data[key] = tuple(data[key])
    return CommRecord(**data)
