"""torch's Flight Recorder entries as they cross from a rank to the kernel (runs on both sides;
imports only the standard library).

A rank reads its recorder (labkit.rank.flight_recorder) into `FrEntry` dicts: between cells as
the value of `labkit.flight_recorder(lab)`, and with its stacks (`Stacks.fr` in
labkit.wire.messages) as an `FrSnapshot`, which adds the groups the rank belongs to (torch's own
dump lists them only for NCCL). The kernel merges every rank's snapshot into the hang verdict
(labkit.kernel.inspection.hang_verdict).
"""

from __future__ import annotations

from typing import Any, TypedDict


class FrEntry(TypedDict):
    """One collective torch's Flight Recorder holds, as labkit.rank.flight_recorder gives it."""

    seq: int  # the group's collective sequence number, or its p2p one (`p2p`)
    p2p: bool  # a point-to-point op: numbered apart from the group's collectives
    op: str  # "all_reduce", "send", ...
    group: str  # the group's description ("default_pg", or what `new_group` was told)
    group_id: str  # the group's name in torch ("0", "1", ...): unique, unlike the description
    record_id: int | None  # the entry's place in the rank's recorder (grows by 1 per entry)
    state: str  # "completed", or "scheduled"/"started": entered, not finished
    input_sizes: Any
    output_sizes: Any
    dtypes: list[str] | None
    duration_ms: float | None  # measured on GPUs (CUDA events), None with gloo
    created_ns: int | None  # when the rank entered it (its wall clock, ns)
    run_ms: float | None


class FrGroup(TypedDict):
    """A process group a rank belongs to: its description and its members (global ranks)."""

    desc: str
    ranks: list[int]


class FrSnapshot(TypedDict):
    """A rank's Flight Recorder: its entries oldest first (or why it has none), whether the
    ring had wrapped (older entries lost), and the groups the rank belongs to by group_id."""

    entries: list[FrEntry] | str
    wrapped: bool
    groups: dict[str, FrGroup]
