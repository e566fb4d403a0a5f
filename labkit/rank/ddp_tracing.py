"""Records of the collectives torch issues from C++, DDP's bucket all_reduces first (rank side).

DDP's reducer calls the process group from C++, past the wrapped `torch.distributed` functions;
so do DDP's start-up (the all_gather that checks the parameters' shapes, the broadcast of the
parameters), its bucket rebuild after the first step, and `Join`'s all_reduce of ones (which
`dist_tracing` lets through unwrapped: DDP's reducer takes torch's own Work only). labkit does not
touch DDP: no comm hook is registered, no Work is wrapped, so DDP runs its own C++ all_reduce,
with its own math and its own divisor under `Join`.

torch's Flight Recorder (turned on by `labkit.rank.flight_recorder.enable`) keeps an entry for
every collective a process group runs. At the end of a cell, `collect()` reads the entries made
since the cell began; an entry created while a traced call was being issued on its group is that
call's (`trace_state.issued`), and every other one becomes a record with
`recorded_by="flight_recorder"`: op, group, bytes (S as nccl-tests defines it: the buffer, the
gathered output of an all_gather), dtype and shape of the first tensor, as torch recorded them.
Those records carry:

- `start`: when torch created the entry, i.e. when the all_reduce was issued (the system clock,
  as `time.time()`): for a DDP bucket, the moment its last gradient was ready;
- `end` = `start`: gloo records no completion time (its entries' `time_discovered_*` are 0), and
  labkit does not wait on DDP's Work, so how long a bucket took is not known on CPU ranks;
- `device_time`: the entry's `duration_ms` when torch measured it (NCCL with
  `TORCH_NCCL_ENABLE_TIMING=1`), else None;
- `line` None: entries are read without their stacks (symbolising them took 24 s once);
- `seq`: numbers that follow the cell's traced calls on the same group, in the order torch
  issued them, the same on every rank; `trace.progress` leaves them out until the next cell so
  the watchdog compares traced calls with traced calls.

Limits: the recorder keeps the last `flight_recorder.BUFFER` entries of the process; when a cell
issues more, the oldest are gone by its end, and the rank prints a note saying how many.
Point-to-point entries are not turned into records (torch's C++ issues none, and gloo's entries
do not name the peer). Times are the rank's clock; the kernel shifts them like any record's.
"""

from __future__ import annotations

import bisect
import sys
import time
from typing import Any

from labkit.rank import flight_recorder, torch_compat
from labkit.rank.trace_state import STATE
from labkit.wire.records import CommRecord

BY = "flight_recorder"  # the records' `recorded_by`
TOLERANCE = 2e-6  # s: time.time() is a float (0.24 us steps today); torch's clock is the same
# names the Flight Recorder gives (after "gloo:" / "nccl:") -> the names labkit's records use
OPS = {
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce_coalesced",
    "allgather": "all_gather",
    "_allgather_base": "all_gather_single",
    "allgather_into_tensor_coalesced": "all_gather_single",
    "reducescatter": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter_single",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_single",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all_single",
}
DTYPES = {  # torch's ScalarType names -> torch dtype attribute names
    "Float": "float32",
    "Double": "float64",
    "Half": "float16",
    "BFloat16": "bfloat16",
    "Long": "int64",
    "Int": "int32",
    "Short": "int16",
    "Char": "int8",
    "Byte": "uint8",
    "Bool": "bool",
    "ComplexFloat": "complex64",
    "ComplexDouble": "complex128",
}


def begin() -> None:
    """A cell begins: note the time and the recorder's counts (cheap: no entries are read)."""
    STATE.cell_start = time.time()
    STATE.cell_traced = STATE.enabled
    STATE.switches = []
    STATE.windows = []
    STATE.fr_added = {}
    STATE.fr_enqueued = flight_recorder.enqueued() if STATE.enabled else None


def _op(entry: dict[str, Any]) -> str:
    name = str(entry.get("profiling_name", "?")).split(":", 1)[-1].split(" ", 1)[0]
    return OPS.get(name, name)


def _dtype(name: str) -> Any:
    import torch

    return getattr(torch, DTYPES.get(name, name.lower()), None)


def _nbytes(sizes: list[list[int]], dtypes: list[str]) -> int:
    total = 0
    for shape, name in zip(sizes or [], dtypes or [], strict=False):
        dtype = _dtype(name)
        numel = 1
        for n in shape:
            numel *= n
        total += numel * (dtype.itemsize if dtype is not None else 0)
    return total


def _group_ranks() -> dict[str, tuple[int, ...]] | None:
    """Process group name (as the Flight Recorder names it) -> the group's global ranks; None
    when this torch's group table is unavailable (torch_compat's `group_registry`)."""
    import torch.distributed as dist

    found = torch_compat.get("group_registry")
    if found is None:
        return None
    out = {}
    try:
        for pg, name in found[0].pg_names.items():
            out[name] = tuple(dist.get_process_group_ranks(pg))
    except Exception:  # noqa: BLE001 - torch's private registry: fall back to no group
        pass
    return out


def to_record(entry: dict[str, Any], ranks: tuple[int, ...], seq: int) -> CommRecord:
    """One Flight Recorder entry as a record (see the module's doc for what its times mean)."""
    op = _op(entry)
    gathered = "gather" in op  # S of an all_gather is its gathered output
    sizes = entry.get("output_sizes" if gathered else "input_sizes") or []
    dtypes = entry.get("output_dtypes" if gathered else "input_dtypes") or []
    first = _dtype(dtypes[0]) if dtypes else None
    start = entry.get("time_created_ns", 0) / 1e9
    took = entry.get("duration_ms")
    return CommRecord(
        rank=STATE.rank,
        op=op,
        seq=seq,
        group=ranks,
        bytes=_nbytes(sizes, dtypes),
        dtype=str(first).removeprefix("torch.") if first is not None else "",
        shape=tuple(sizes[0]) if sizes else (),
        start=start,
        end=start,
        cell=STATE.cell,
        async_op=True,
        device_time=took / 1e3 if took is not None else None,
        recorded_by=BY,
    )


def _seen(windows: list[tuple[float, float, tuple[int, ...]]], longest: float) -> Any:
    starts = [w[0] for w in windows]

    def seen(created: float, ranks: tuple[int, ...]) -> bool:
        i = bisect.bisect_right(starts, created + TOLERANCE) - 1
        while i >= 0 and starts[i] >= created - longest - TOLERANCE:
            _, issued, group = windows[i]
            if created <= issued + TOLERANCE and (not group or group == ranks):
                return True
            i -= 1
        return False

    return seen


def _tracing_at(when: float, switches: list[tuple[float, bool]]) -> bool:
    """Whether tracing was on at `when` in this cell (`trace.set_enabled` calls in it)."""
    on = STATE.cell_traced
    for at, state in switches:
        if at > when:
            break
        on = state
    return on


def collect() -> list[CommRecord]:
    """At the end of a cell: records of the collectives torch ran that no traced call issued,
    added to the cell's records in time order (see the module's doc)."""
    switches = sorted(STATE.switches)
    if not STATE.cell_traced and not any(on for _, on in switches):
        return []  # tracing was off all through the cell
    if STATE.fr_enqueued is not None and flight_recorder.enqueued() == STATE.fr_enqueued:
        return []  # no collective was enqueued in this cell
    raw = flight_recorder.raw_entries()
    groups = _group_ranks()
    if isinstance(raw, str) or groups is None:  # without groups, records would name none
        return []
    # record_id counts per recorder (gloo's, NCCL's: flight_recorder.RECORDER), so does the cursor
    recorder = flight_recorder.RECORDER
    last = dict(STATE.fr_last)
    fresh = [e for e in raw if e.get("record_id", -1) > last.get(e.get(recorder), -1)]
    if not fresh:
        return []
    lost = 0
    for name in {e.get(recorder) for e in fresh}:
        ids = [e.get("record_id", -1) for e in fresh if e.get(recorder) == name]
        before = last.get(name, -1)
        lost += min(ids) - before - 1 if before >= 0 else 0
        STATE.fr_last[name] = max(ids)
    windows = sorted(STATE.windows)
    seen = _seen(windows, max((b - a for a, b, _ in windows), default=0.0))
    out = []
    for entry in fresh:
        created = entry.get("time_created_ns", 0) / 1e9
        if entry.get("is_p2p") or created < STATE.cell_start:
            continue
        name = (entry.get("process_group") or ["?"])[0]
        ranks = groups.get(name, ())
        if seen(created, ranks) or not _tracing_at(created, switches):
            continue
        STATE.seq[ranks] = seq = STATE.seq.get(ranks, 0) + 1
        STATE.fr_added[ranks] = STATE.fr_added.get(ranks, 0) + 1
        out.append(to_record(entry, ranks, seq))
    if lost > 0 and out:
        print(
            f"labkit: torch's Flight Recorder keeps the last {flight_recorder.BUFFER} "
            f"collectives; {lost} older ones of this cell were gone by its end, so collectives "
            "torch issued from C++ among them (DDP's buckets) are missing from the trace",
            file=sys.stderr,
        )
    _insert(STATE.records.setdefault(STATE.cell, []), out)
    return out


def _insert(records: list[Any], new: list[CommRecord]) -> None:
    """Put each new record (in time order) before the first comm record that started after it."""
    i = 0
    for rec in new:
        while i < len(records) and not (
            isinstance(records[i], CommRecord) and records[i].start > rec.start
        ):
            i += 1
        records.insert(i, rec)
        i += 1
