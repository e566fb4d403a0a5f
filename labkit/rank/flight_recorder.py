"""torch's Flight Recorder on a rank: its recent collectives, as plain dicts (rank side).

torch records each collective of a process group in a ring buffer (the Flight Recorder) when
`TORCH_FR_BUFFER_SIZE` is set before the group is made; `enable()` sets it (unless the user set
it: `TORCH_FR_BUFFER_SIZE=0` turns it off) before the lab's group is formed. `entries()` dumps
it through torch's private `torch._C._distributed_c10d._dump_fr_trace_json` (found by
`labkit.rank.torch_compat`, feature `flight_recorder`; checked on torch 2.11 to 2.14 with gloo);
where that is missing, it says why instead of failing. `tail_text()` is what a
rank adds to its stacks (labkit.rank.stacks), so `lab.stacks()` and a stuck cell's message show
the last collectives each rank entered, read by the heartbeat thread while the main thread
waits in one; `snapshot()` comes with them (every entry, and the rank's groups: `groups()`),
for the kernel's hang verdict (labkit.kernel.inspection.hang_verdict). `raw_entries()` and
`enqueued()` are what `labkit.rank.ddp_tracing` reads at the end of a cell to record the
collectives torch issued from C++ (DDP's buckets).

This module never imports IPython, ipywidgets or plotly.
"""

from __future__ import annotations

import json
import os
import pickle
import time
from typing import Any

from labkit.rank import torch_compat
from labkit.wire.flight_records import FrEntry, FrGroup, FrSnapshot

# entries torch keeps per process (a ring: the oldest go first); a dump of 200 takes ~2 ms,
# of 2000 ~50 ms (on the heartbeat thread, holding the GIL), so the ring stays small
BUFFER = "200"
ENV = "TORCH_FR_BUFFER_SIZE"
TAIL = 4  # entries a rank's stacks show
HEADER = (
    "Flight Recorder (torch)"  # the line the kernel finds them by (labkit.kernel.inspection.stacks)
)
# gloo retires an entry on its own thread a moment after `wait()` has returned (a dump read at
# once often still finds it open, even on an idle machine), so a dump between cells waits up to
# this long for the entries it shows to be retired; one that stays open is shown as it is
SETTLE_S = 0.25


def enable() -> None:
    """Ask torch to record collectives (call before the process group is made)."""
    os.environ.setdefault(ENV, BUFFER)


def _dumps() -> Any:
    """(torch's pickled dump, its JSON dump), or RuntimeError saying this torch has neither."""
    found = torch_compat.get("flight_recorder")
    if found is None:
        raise RuntimeError(torch_compat.missing("flight_recorder"))
    return found


# the recorders a rank reads, in torch_compat's order: gloo's (every torch), NCCL's (CUDA builds)
RECORDERS = ("gloo", "nccl")
RECORDER = "labkit_recorder"  # the key each merged entry carries: which recorder holds it


def _merged(dumps: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """One dump from the recorders' dumps ((recorder, dump): gloo's, then NCCL's where there is
    one): their entries oldest first by creation time, each tagged with its recorder (RECORDER),
    since `record_id` counts per recorder and a group with both backends (the default group of
    `cpu:gloo,cuda:nccl`) has the same name, and its own sequence numbers, in both; their groups'
    status side by side (NCCL's under "NAME@nccl", so one never hides the other's)."""
    entries: list[dict[str, Any]] = []
    status: dict[str, Any] = {}
    for recorder, d in dumps:
        for e in d.get("entries", []):
            entries.append({**e, RECORDER: recorder})
        for name, s in (d.get("pg_status") or {}).items():
            status[name if recorder == RECORDERS[0] else f"{name}@{recorder}"] = s
    entries.sort(key=lambda e: e.get("time_created_ns") or 0)
    return {**dumps[0][1], "entries": entries, "pg_status": status}


def _dump() -> dict[str, Any]:
    found = _dumps()
    return _merged(
        [(r, json.loads(f(True, False))) for r, f in zip(RECORDERS, found[1::2]) if f is not None]
    )


def _pickled(collectives: bool) -> dict[str, Any]:
    found = _dumps()
    return _merged(
        [
            (r, pickle.loads(f(collectives, False, False)))
            for r, f in zip(RECORDERS, found[0::2])
            if f is not None
        ]
    )


def enqueued() -> dict[str, Any] | None:
    """Per process group, the last collective (and p2p) sequence number torch enqueued, or None
    when the recorder cannot say; a cheap read (no entries): two equal answers mean that no
    collective was issued in between."""
    if os.environ.get(ENV, "0") in ("", "0"):
        return None
    try:
        status = _pickled(False).get("pg_status")
    except Exception:  # noqa: BLE001 - a private API: when it fails, the caller reads entries
        return None
    if not status:
        return None
    return {
        pg: {k: v for k, v in sorted(s.items()) if k.startswith("last_enqueued")}
        for pg, s in status.items()
    }


def raw_entries() -> list[dict[str, Any]] | str:
    """torch's entries as torch dumps them (no stacks: symbolising them took 24 s the first
    time), oldest first, or why there are none. The pickled dump is read: it is 2-4x cheaper
    than the JSON one for the same entries."""
    if os.environ.get(ENV, "0") in ("", "0"):
        return f"the Flight Recorder is off on this rank ({ENV} is not set, or 0)"
    try:
        return list(_pickled(True).get("entries", []))
    except Exception as exc:  # noqa: BLE001 - a private API: say what went wrong, never fail
        return f"the Flight Recorder could not be read: {type(exc).__name__}: {exc}"


def _entry(e: dict[str, Any]) -> FrEntry:
    started, done = e.get("time_discovered_started_ns"), e.get("time_discovered_completed_ns")
    group = e.get("process_group") or ["?", "?"]
    p2p = bool(e.get("is_p2p"))
    return FrEntry(
        seq=e.get("p2p_seq_id") if p2p else e.get("collective_seq_id"),
        p2p=p2p,
        op=str(e.get("profiling_name", "?")).split(":", 1)[-1],
        group=group[1],
        group_id=_group_id(e),
        record_id=e.get("record_id"),
        state="completed" if e.get("retired") else e.get("state", "?"),
        input_sizes=e.get("input_sizes"),
        output_sizes=e.get("output_sizes"),
        dtypes=e.get("input_dtypes"),
        duration_ms=e.get("duration_ms"),  # measured on GPUs (CUDA events), None with gloo
        created_ns=e.get("time_created_ns"),
        run_ms=(done - started) / 1e6 if started and done else None,
    )


def _group_id(e: dict[str, Any]) -> str:
    """The entry's group as the hang verdict keys it: torch's group name, "NAME@nccl" for
    NCCL's recorder (a group with both backends counts its collectives once per backend)."""
    name = str((e.get("process_group") or ["?"])[0])
    recorder = e.get(RECORDER, RECORDERS[0])
    return name if recorder == RECORDERS[0] else f"{name}@{recorder}"


def groups() -> dict[str, FrGroup]:
    """The process groups this rank belongs to, by torch's group name (an entry's `group_id`):
    description and global ranks, from torch's table of groups (`group_registry`). torch's own
    dump has a `pg_config` too, but gloo leaves it empty; {} where the table cannot be read."""
    found = torch_compat.get("group_registry")
    if found is None:
        return {}
    import torch.distributed as dist

    got = {}
    for pg, name in list(found[0].pg_names.items()):  # a copy: the main thread may add one
        try:
            ranks = sorted(dist.get_process_group_ranks(pg))
        except Exception:  # noqa: BLE001 - a group being destroyed: leave it out
            continue
        group = FrGroup(desc=str(getattr(pg, "group_desc", "") or ""), ranks=ranks)
        got[str(name)] = group
        for recorder in RECORDERS[1:]:  # the same group, as NCCL's recorder's entries name it
            got[f"{name}@{recorder}"] = group
    return got


def _capacity() -> int:
    try:
        return int(os.environ.get(ENV, "0"))
    except ValueError:
        return 0


def snapshot(settle: float = 0.0) -> FrSnapshot | None:
    """Every entry the recorder holds, whether its ring wrapped (the oldest are lost), and this
    rank's groups: what the kernel's hang verdict merges (None when the recorder is off)."""
    if os.environ.get(ENV, "0") in ("", "0"):
        return None
    got = entries(settle=settle)
    wrapped = False
    if not isinstance(got, str) and got:
        by_recorder: dict[bool, list[FrEntry]] = {}  # each recorder is its own ring
        for e in got:
            by_recorder.setdefault(str(e["group_id"]).endswith("@nccl"), []).append(e)
        wrapped = any(
            bool(ring[0].get("record_id")) or len(ring) >= _capacity() > 0
            for ring in by_recorder.values()
        )
    return FrSnapshot(entries=got, wrapped=wrapped, groups=groups())


def entries(last: int | None = None, settle: float = SETTLE_S) -> list[FrEntry] | str:
    """The recorded collectives, oldest first (the `last` ones), or why there are none.

    Entries not yet retired are read again for up to `settle` seconds (SETTLE_S); the heartbeat
    thread, which reads them while a collective may be stuck, passes 0.
    """
    if os.environ.get(ENV, "0") in ("", "0"):
        return f"the Flight Recorder is off on this rank ({ENV} is not set, or 0)"
    deadline = time.monotonic() + settle
    while True:
        try:
            raw = _dump().get("entries", [])
        except Exception as exc:  # noqa: BLE001 - a private API: say what went wrong, never fail
            return f"the Flight Recorder could not be read: {type(exc).__name__}: {exc}"
        got = [_entry(e) for e in raw]
        got = got[-last:] if last else got
        if all(e["state"] == "completed" for e in got) or time.monotonic() >= deadline:
            return got
        time.sleep(0.002)


def entry_text(e: dict[str, Any]) -> str:
    """One entry as a line: "#12 all_reduce on default_pg: scheduled, in [[4]] float"."""
    dtypes = ",".join(sorted(set(e.get("dtypes") or []))).lower() or "-"
    took = f", {e['duration_ms']:.3f} ms" if e.get("duration_ms") else ""
    state = f"{e['state']}, in {e['input_sizes']} {dtypes}{took}"
    return f"#{e['seq']} {e['op']} on {e['group']}: {state}"


def tail_text(last: int = TAIL, snap: FrSnapshot | None = None) -> str:
    """The last `last` collectives as lines for a rank's stacks, "" when the recorder is off.
    `snap`: a `snapshot()` already read (else the recorder is read now)."""
    # the main thread may be inside one of them: show it as it is (no settling)
    got = entries(last, settle=0) if snap is None else snap["entries"]
    if isinstance(got, str):
        return "" if "is off" in got else f"{HEADER}: {got}"
    got = got[-last:]
    if not got:
        return f"{HEADER}: no collective yet"
    lines = "\n".join(f"    {entry_text(e)}" for e in got)
    return f"{HEADER}, last {len(got)} collectives, oldest first:\n{lines}"
